"""The runtime's one pooled HTTP client, shared by every HTTP adapter in a trio run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import trio

__all__ = ["open_shared_client", "client_for"]

_CLIENT: trio.lowlevel.RunVar[httpx.AsyncClient | None] = trio.lowlevel.RunVar(
    "agentloop_http_client", default=None
)

# Model calls stream for minutes; only connecting and the gap between chunks are bounded.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=30.0)


@contextlib.asynccontextmanager
async def open_shared_client() -> AsyncIterator[httpx.AsyncClient]:
    """Open the run's pooled client (the runtime does this once) and close it on exit."""
    previous = _CLIENT.get()
    async with httpx.AsyncClient(timeout=DEFAULT_TIMEOUT) as client:
        _CLIENT.set(client)
        try:
            yield client
        finally:
            _CLIENT.set(previous)


@contextlib.asynccontextmanager
async def client_for(explicit: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """The client to use for one call: explicit, else the runtime's, else a private one."""
    client = explicit or _CLIENT.get()
    if client is not None:
        yield client
        return
    async with httpx.AsyncClient(timeout=DEFAULT_TIMEOUT) as private:
        yield private
