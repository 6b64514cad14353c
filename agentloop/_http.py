"""The runtime's one pooled HTTP client, shared by every HTTP adapter in a trio run.

Every adapter request goes through :func:`client_for`, which is also where
``agentloop.testing.block_network`` refuses requests.
"""

from __future__ import annotations

import contextlib
import functools
import os
import ssl
from collections.abc import AsyncIterator, Iterator

import httpx
import trio

from ._errors import ProviderError

__all__ = ["open_shared_client", "client_for", "blocking_requests", "verifying_context"]

_CLIENT: trio.lowlevel.RunVar[httpx.AsyncClient | None] = trio.lowlevel.RunVar(
    "agentloop_http_client", default=None
)

# Model calls stream for minutes; only connecting and the gap between chunks are bounded.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=30.0)


@functools.lru_cache(maxsize=4)
def _verifying_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    # Loading the CA bundle takes tens of milliseconds, far more than opening a runtime
    # otherwise does; the context is the same for every client with the same trust roots.
    del cafile, capath  # the cache key: httpx reads the same variables itself
    return httpx.create_ssl_context()


def verifying_context() -> ssl.SSLContext:
    """The process's verifying TLS context, as httpx builds it by default (certifi's roots,
    or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set), built once per trust setting."""
    return _verifying_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@contextlib.asynccontextmanager
async def open_shared_client() -> AsyncIterator[httpx.AsyncClient]:
    """Open the run's pooled client (the runtime does this once) and close it on exit."""
    previous = _CLIENT.get()
    async with httpx.AsyncClient(timeout=DEFAULT_TIMEOUT, verify=verifying_context()) as client:
        _CLIENT.set(client)
        try:
            yield client
        finally:
            _CLIENT.set(previous)


# The open ``blocking_requests`` blocks, innermost last: each is the set of hosts it allows.
# Process-wide on purpose: agent actors run in tasks spawned long before a test enters the
# block, so neither a context variable nor the caller's task would reach them.
_BLOCKS: list[frozenset[str]] = []


class _Refusing(httpx.AsyncBaseTransport):
    """Refuses every request except to the allowed hosts, which go out on a fresh transport."""

    def __init__(self, allow: frozenset[str]) -> None:
        self._allow = allow
        self._real: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host not in self._allow:
            allowed = f" (allowed: {', '.join(sorted(self._allow))})" if self._allow else ""
            raise ProviderError(
                f"network access is blocked: a request to {request.url.scheme}://{host}"
                f"{request.url.path} was refused inside agentloop.testing.block_network()"
                f"{allowed}; register a test double (ScriptedModel, FunctionModel, TestModel)"
                " for this provider or replay a recorded stream",
                code="network_blocked",
            )
        if self._real is None:
            self._real = httpx.AsyncHTTPTransport(verify=verifying_context())
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        if self._real is not None:
            await self._real.aclose()


@contextlib.contextmanager
def blocking_requests(allow: frozenset[str] = frozenset()) -> Iterator[None]:
    """While open, every adapter request to a host not in ``allow`` raises ``ProviderError``."""
    _BLOCKS.append(allow)
    try:
        yield
    finally:
        _BLOCKS.remove(allow)


@contextlib.asynccontextmanager
async def client_for(explicit: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """The client to use for one call: explicit, else the runtime's, else a private one."""
    if _BLOCKS:
        allow = frozenset.intersection(*_BLOCKS)
        async with httpx.AsyncClient(transport=_Refusing(allow), timeout=DEFAULT_TIMEOUT) as c:
            yield c
        return
    client = explicit or _CLIENT.get()
    if client is not None:
        yield client
        return
    async with httpx.AsyncClient(timeout=DEFAULT_TIMEOUT, verify=verifying_context()) as private:
        yield private
