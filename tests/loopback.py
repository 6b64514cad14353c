"""A tiny HTTP/1.1 server on 127.0.0.1 for adapter tests: replays streams, scripts failures.

``serve(handler)`` runs the server for the duration of an ``async with`` and yields a
:class:`Server` with its base URL and the requests it received. A handler gets the parsed
request and the connection's stream and writes whatever response it likes; the connection is
closed when the handler returns (every response says ``Connection: close``).

Two kinds of recorded stream are served: this project's own fixtures (``tests/fixtures/streams``,
always present) and third-party captures in ``../shared/streams`` beside the checkout, which
only some machines have; tests replaying a capture skip when it is absent.
"""

from __future__ import annotations

import contextlib
import functools
import http
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from agentloop import CallConfig, Message, ToolSpec
from agentloop._model import StreamPart
from agentloop.llm import LLMRequest

STREAMS = Path(__file__).resolve().parents[1].parent / "shared" / "streams"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "streams"

_NO_CAPTURES = f"{STREAMS} is absent (a fresh clone has no ../shared)"
# A skip raised inside a trio test loses its reason (pytest-trio re-raises it bare), so tests
# replaying captures carry this mark and skip before they start.
needs_captures = pytest.mark.skipif(
    not STREAMS.is_dir(), reason=f"replays third-party captures, but {_NO_CAPTURES}"
)


@attrs.frozen
class Request:
    """One request as the server read it (header names lower-cased)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Handler = Callable[[Request, trio.SocketStream], Awaitable[None]]


@attrs.define
class Server:
    url: str
    requests: list[Request]


class _NoRequest(Exception):
    pass


async def _read_request(stream: trio.SocketStream) -> Request:
    buffer = bytearray()
    while b"\r\n\r\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise _NoRequest
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _version = request_line.split(" ", 2)
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert "chunked" not in headers.get("transfer-encoding", ""), "chunked bodies unsupported"
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise _NoRequest
        body += chunk
    return Request(method, path, headers, bytes(body[:length]))


async def _connection(
    stream: trio.SocketStream, *, handler: Handler, requests: list[Request]
) -> None:
    async with stream:
        try:
            request = await _read_request(stream)
        except (_NoRequest, trio.BrokenResourceError):
            return
        requests.append(request)
        # Several scenarios end with the client hanging up first.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await handler(request, stream)


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    """Serve ``handler`` on 127.0.0.1 (a free port) while the block runs."""
    requests: list[Request] = []
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"),
            functools.partial(_connection, handler=handler, requests=requests),
            0,
        )
        port = listeners[0].socket.getsockname()[1]
        try:
            yield Server(f"http://127.0.0.1:{port}/v1", requests)
        finally:
            nursery.cancel_scope.cancel()


def _head(status: int, headers: Iterable[tuple[str, str]]) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def respond(
    stream: trio.SocketStream,
    status: int,
    body: bytes = b"",
    *,
    content_type: str = "application/json",
    headers: Iterable[tuple[str, str]] = (),
) -> None:
    """Send a complete response with a Content-Length."""
    all_headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers]
    await stream.send_all(_head(status, all_headers) + body)


async def start_stream(
    stream: trio.SocketStream,
    *,
    status: int = 200,
    content_type: str = "text/event-stream",
    content_length: int | None = None,
) -> None:
    """Send response headers only; without a length the body runs until the connection closes."""
    headers = [("Content-Type", content_type)]
    if content_length is not None:
        headers.append(("Content-Length", str(content_length)))
    await stream.send_all(_head(status, headers))


def capture(name: str) -> bytes:
    """The bytes of a third-party capture in ``STREAMS``; skips the test when that is absent."""
    if not STREAMS.is_dir():
        pytest.skip(f"replays the capture {name}, but {_NO_CAPTURES}")
    return (STREAMS / name).read_bytes()


def fixture(name: str) -> bytes:
    """The bytes of one of the project's own stream fixtures."""
    return (FIXTURES / name).read_bytes()


def sse_body(body: bytes | str, *, chunk_size: int | None = None) -> Handler:
    """A 200 ``text/event-stream`` response carrying exactly ``body``, then a close.

    With ``chunk_size`` the body goes out in writes of that many bytes, so events and UTF-8
    sequences straddle reads.
    """
    data = body.encode() if isinstance(body, str) else body

    async def handler(request: Request, stream: trio.SocketStream) -> None:
        await start_stream(stream)
        step = chunk_size or len(data) or 1
        for start in range(0, len(data), step):
            await stream.send_all(data[start : start + step])

    return handler


def replay(name: str, *, chunk_size: int | None = None) -> Handler:
    """Replay the capture ``name`` byte for byte as an event stream."""
    return sse_body(capture(name), chunk_size=chunk_size)


def replay_fixture(name: str, *, chunk_size: int | None = None) -> Handler:
    """Replay the project's fixture ``name`` byte for byte as an event stream."""
    return sse_body(fixture(name), chunk_size=chunk_size)


def json_error(status: int, payload: object, *, headers: Iterable[tuple[str, str]] = ()) -> Handler:
    """An error status with a JSON body (and extra headers such as ``Retry-After``)."""
    body = json.dumps(payload).encode()
    extra = tuple(headers)

    async def handler(request: Request, stream: trio.SocketStream) -> None:
        await respond(stream, status, body, headers=extra)

    return handler


def plain_error(status: int, text: str) -> Handler:
    """An error status with a plain-text body."""

    async def handler(request: Request, stream: trio.SocketStream) -> None:
        await respond(stream, status, text.encode(), content_type="text/plain")

    return handler


def echo_headers(status: int) -> Handler:
    """An error status whose JSON body quotes every request header back, as some proxies do."""

    async def handler(request: Request, stream: trio.SocketStream) -> None:
        echoed = "; ".join(f"{name}: {value}" for name, value in request.headers.items())
        payload = {"error": {"message": f"rejected request with headers {echoed}"}}
        await respond(stream, status, json.dumps(payload).encode())

    return handler


def echo_headers_in_status_line() -> Handler:
    """A broken status line quoting the request's headers, so the client's protocol error does."""

    async def handler(request: Request, stream: trio.SocketStream) -> None:
        echoed = "; ".join(f"{name}: {value}" for name, value in request.headers.items())
        await stream.send_all(f"HTTP/1.1 4x1 {echoed}\r\n\r\n".encode("latin-1"))

    return handler


def json_document(payload: object) -> Handler:
    """A 200 ``application/json`` body where an event stream was expected."""
    body = json.dumps(payload).encode()

    async def handler(request: Request, stream: trio.SocketStream) -> None:
        await respond(stream, 200, body)

    return handler


def drop_mid_stream(body: bytes, *, after: int) -> Handler:
    """Announce ``len(body)`` bytes, send the first ``after`` of them, then close."""

    async def handler(request: Request, stream: trio.SocketStream) -> None:
        await start_stream(stream, content_length=len(body))
        await stream.send_all(body[:after])

    return handler


@attrs.define
class Hang:
    """Send ``prefix`` as an event stream, then never finish until the client hangs up.

    ``disconnected`` is set when the server sees the client close the connection.
    """

    prefix: bytes
    disconnected: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, request: Request, stream: trio.SocketStream) -> None:
        try:
            await start_stream(stream)
            await stream.send_all(self.prefix)
            while await stream.receive_some(65536):
                pass
        finally:
            self.disconnected.set()


async def unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listeners[0].socket.getsockname()[1]
    for listener in listeners:
        await listener.aclose()
    return port


def sse(*events: object, done: bool = False) -> bytes:
    """An event stream of ``data:`` lines (objects JSON-encoded), optionally ending in [DONE]."""
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def named_sse(*events: tuple[str, object]) -> bytes:
    """An event stream of ``event:``/``data:`` pairs, as Anthropic sends them."""
    return "".join(
        f"event: {name}\ndata: {d if isinstance(d, str) else json.dumps(d)}\n\n"
        for name, d in events
    ).encode()


# --- shared by the adapter tests --------------------------------------------------------------


def make_request(
    messages: tuple[Message, ...] = (Message("user", "hi"),),
    *,
    system: str = "",
    tools: tuple[ToolSpec, ...] = (),
    **config: Any,
) -> LLMRequest:
    """A request for the adapters under test (``model`` defaults to ``"test-model"``)."""
    config.setdefault("model", "test-model")
    return LLMRequest(system=system, messages=messages, tools=tools, config=CallConfig(**config))


async def collect(adapter: Any, request: LLMRequest) -> list[StreamPart]:
    """Every part of one adapter stream, closing it properly."""
    async with contextlib.aclosing(adapter.stream(request)) as parts:
        return [part async for part in parts]


async def fold_reply(adapter: Any, request: LLMRequest | None = None) -> Message:
    """The assistant message one adapter stream folds into (a fresh session, real fold).

    This is the path a reply takes in the runtime: parts, log, anchor, derived history.
    """
    from agentloop import FrozenDict
    from agentloop._bus import EventBus
    from agentloop._log import USER_MESSAGE, claimed_message
    from agentloop._reply import fold_stream
    from agentloop._session import Session

    session = Session("s", FrozenDict(), EventBus())
    session.append(USER_MESSAGE, claimed_message("m1", "hi", None), 1)
    await fold_stream(session, 1, 1, adapter.stream(request or make_request()))
    history = session.messages()
    assert len(history) == 2, history
    return history[-1]


async def sent_body(make_adapter: Callable[[str], Any], messages: tuple[Message, ...],
                    **config: Any) -> Any:
    """The JSON body an adapter sends for ``messages`` (the server answers 400)."""
    from agentloop import ProviderError

    async with serve(json_error(400, {"error": {"message": "seen"}})) as server:
        with pytest.raises(ProviderError):
            await collect(make_adapter(server.url), make_request(messages, **config))
    return server.requests[-1].json()
