"""One actor per MCP server: start it, register its tools, watch it, stop it."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, Protocol, TextIO, TypeVar

import anyio
import httpx2
import mcp.types as mt
import trio
from mcp import Client, MCPError, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

import agentloop
from agentloop import Context, Disposer, Tool, ToolResult, thaw
from agentloop.events import McpServerFailed

from ._config import ServerConfig

__all__ = ["ServerError", "start_servers", "render_result"]

log = logging.getLogger("agentloop.mcp")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

_STDERR_TAIL = 20
_STDERR_LINE_LIMIT = 64 * 1024
_STDERR_GRACE = 1.0
_LIST_PAGE_LIMIT = 100


class ServerError(agentloop.AgentLoopError):
    """An MCP server failed to start, stopped, or could not be restarted.

    Attributes:
        server: the server's configured name.
        stderr: the last lines the server wrote to its stderr.
    """

    def __init__(self, message: str, *, server: str, stderr: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.server = server
        self.stderr = tuple(stderr)

    def __str__(self) -> str:
        text = super().__str__()
        if not self.stderr:
            return text
        return text + "\nlast lines of its stderr:\n" + "\n".join(self.stderr)


class _ConnectionClosedError(ConnectionError):
    """The server's stdout ended: it exited or closed the connection."""


class _Receive(Protocol[T_co]):
    async def receive(self) -> T_co: ...

    async def aclose(self) -> None: ...


class _WatchedReceive(Generic[T]):
    """The transport's read stream, setting ``closed`` when the connection ends.

    The session reads this stream until the server's stdout closes, so the end of reading is
    the earliest sign that the server exited.
    """

    def __init__(self, inner: _Receive[T], closed: trio.Event) -> None:
        self._inner = inner
        self._closed = closed

    async def receive(self) -> T:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._closed.set()
            raise

    def __aiter__(self) -> _WatchedReceive[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self._closed.set()
        await self._inner.aclose()

    async def __aenter__(self) -> _WatchedReceive[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@asynccontextmanager
async def _stdio(
    params: StdioServerParameters, errlog: TextIO, closed: trio.Event
) -> AsyncIterator[Any]:
    try:
        async with stdio_client(params, errlog=errlog) as (read, write):
            # The child holds its own copy now; ours would keep its stderr from ever ending.
            errlog.close()
            yield _WatchedReceive(read, closed), write
    finally:
        errlog.close()


def _block_text(block: object) -> str:
    if isinstance(block, mt.TextContent):
        return str(block.text)
    if isinstance(block, mt.ImageContent | mt.AudioContent):
        kind = "image" if isinstance(block, mt.ImageContent) else "audio"
        return f"[{kind}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]"
    if isinstance(block, mt.ResourceLink):
        return f"[resource link: {block.uri} ({block.name})]"
    if isinstance(block, mt.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, mt.TextResourceContents):
            return f"[resource: {resource.uri}]\n{resource.text}"
        size = len(resource.blob) * 3 // 4
        return f"[resource: {resource.uri}, {resource.mime_type or 'binary'}, {size} bytes]"
    return f"[{getattr(block, 'type', 'unknown')} content]"


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text_is_serialization(blocks: Sequence[object], structured: object) -> bool:
    if not all(isinstance(b, mt.TextContent) for b in blocks):
        return False
    text = "".join(b.text for b in blocks if isinstance(b, mt.TextContent))
    if not text.strip():
        return True
    try:
        return bool(json.loads(text) == structured)
    except ValueError:
        return False


def render_result(result: mt.CallToolResult) -> ToolResult:
    """The agentloop result of an MCP ``CallToolResult``.

    Content blocks are rendered as text, one per line (non-text blocks as a bracketed
    placeholder naming their kind). Structured content is used instead, as compact JSON, only
    when the text blocks are empty or merely its serialization (what the spec asks servers to
    send for older clients): then both say the same and the compact form costs fewer tokens.
    When the text says something else (a summary, or a bare value that a server framework
    wrapped as ``{"result": ...}``), the text is what the server meant the model to read.
    ``isError`` gives ``is_error=True`` with ``error_code="MCP_ERROR"``.
    """
    blocks = list(result.content)
    structured = result.structured_content
    if structured is not None and _text_is_serialization(blocks, structured):
        body = _compact(structured)
    else:
        body = "\n".join(_block_text(b) for b in blocks)
    if not result.is_error:
        return ToolResult(body)
    if not body:
        body = "the tool reported an error"
    if not body.lower().startswith("error"):
        body = f"Error: {body}"
    return ToolResult(body, is_error=True, error_code="MCP_ERROR")


def _leaf(exc: BaseException) -> BaseException:
    """The cause inside (nested) exception groups: the first leaf that is not a cancellation."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def _describe(exc: BaseException) -> str:
    leaf = _leaf(exc)
    if isinstance(leaf, _ConnectionClosedError):
        return str(leaf)
    if isinstance(leaf, MCPError):
        if leaf.code == mt.CONNECTION_CLOSED:
            return "it closed the connection"
        return f"MCP error {leaf.code}: {leaf.message}"
    return f"{type(leaf).__name__}: {leaf}"


_MAX_RESTART_DELAY = 30.0
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _header_values(cfg: ServerConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """``headers`` with ``headers_env`` resolved; a missing variable is named, never a value."""
    headers = dict(cfg.headers)
    for header, spec in cfg.headers_env.items():
        names = _ENV_REF.findall(spec) if "$" in spec else [spec]
        missing = [n for n in names if not environ.get(n)]
        if missing:
            raise ServerError(
                f"MCP server {cfg.name!r}: header {header!r} needs the environment variable "
                f"{missing[0]}, which is not set",
                server=cfg.name,
            )
        if "$" in spec:
            headers[header] = _ENV_REF.sub(lambda m: environ[m.group(1)], spec)
        else:
            headers[header] = environ[spec]
    return headers


class _ServerActor:
    """Runs one server for as long as the plugin lives: starts it, registers its tools, and
    restarts it (stdio) or reconnects (HTTP) with backoff when it goes away."""

    def __init__(self, ctx: Context, config: ServerConfig, separator: str) -> None:
        self.ctx = ctx
        self.config = config
        self.separator = separator
        self.client: Client | None = None
        self.started = False  # this connection listed its tools
        self.ever_started = False
        self.restarting = False
        self.lost: trio.Event | None = None
        self.calls: set[trio.CancelScope] = set()
        self.disposers: list[Disposer] = []
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL)
        self.http_refusal = ""

    @property
    def name(self) -> str:
        return self.config.name

    async def run(self, ready: Callable[[], None]) -> None:
        """Serve until cancelled; failures are reported, never raised."""
        try:
            await self._supervise(ready)
        finally:
            self._drop_tools()
            ready()

    async def _supervise(self, ready: Callable[[], None]) -> None:
        cfg = self.config
        delay = cfg.restart_delay
        failed_attempts = 0
        while True:
            self.started = False
            try:
                await self._run(ready)
            except Exception as exc:  # noqa: BLE001 - one server's failure must not stop the rest
                error = exc
            if not self.ever_started:
                self._report(error, restarting=False)
                return
            if self.started:
                failed_attempts, delay = 0, cfg.restart_delay
            else:
                failed_attempts += 1
            again = failed_attempts < cfg.max_restarts
            self.restarting = again
            self._report(error, restarting=again)
            if not again:
                return
            await trio.sleep(delay)
            delay = min(delay * 2, _MAX_RESTART_DELAY)

    async def _run(self, ready: Callable[[], None]) -> None:
        if self.config.url is not None:
            failure: Exception | None = None
            try:
                await self._serve(self._http_transport(), ready)
            except Exception as exc:  # noqa: BLE001 - reported below
                failure = exc
            self._lose_calls()
            raise self._error(failure)
        errlog, stderr = _stderr_pipe()
        drained = trio.Event()
        failure = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump_stderr, stderr, drained)
            try:
                await self._serve(self._stdio_transport(errlog), ready)
            except Exception as exc:  # noqa: BLE001 - reported below, with the stderr tail
                failure = exc
            finally:
                errlog.close()
            self._lose_calls()
            # The server is gone, so its stderr ends soon; its last lines usually say why.
            with trio.move_on_after(_STDERR_GRACE):
                await drained.wait()
            nursery.cancel_scope.cancel()
        raise self._error(failure)

    def _error(self, failure: Exception | None) -> ServerError:
        if isinstance(failure, ServerError):
            return failure
        if failure is None:
            failure = _ConnectionClosedError("it closed the connection")
        if self.started:
            phase = "stopped"
        elif self.ever_started:
            phase = "could not be restarted" if self.config.url is None else (
                "could not be reconnected"
            )
        else:
            phase = "failed to start"
        said = f" ({self.http_refusal})" if self.http_refusal and not self.started else ""
        error = ServerError(
            f"MCP server {self.name!r} {phase}: {_describe(failure)}{said}",
            server=self.name,
            stderr=self.stderr_tail if self.config.url is None else (),
        )
        error.__cause__ = failure
        return error

    def _stdio_transport(self, errlog: TextIO) -> Callable[[trio.Event], Any]:
        cfg = self.config
        assert cfg.command is not None
        params = StdioServerParameters(
            command=cfg.command, args=list(cfg.args), env=dict(cfg.env) or None, cwd=cfg.cwd
        )
        self.stderr_tail.clear()
        return lambda lost: _stdio(params, errlog, lost)

    def _http_transport(self) -> Callable[[trio.Event], Any]:
        cfg = self.config
        assert cfg.url is not None
        url = cfg.url
        self.http_refusal = ""
        headers = _header_values(cfg, os.environ)

        @asynccontextmanager
        async def transport(lost: trio.Event) -> AsyncIterator[Any]:
            http = httpx2.AsyncClient(
                headers=headers,
                timeout=httpx2.Timeout(30.0, read=300.0),
                event_hooks={"response": [self._saw_response]},
            )
            async with http, streamable_http_client(url, http_client=http) as (read, write):
                yield _WatchedReceive(read, lost), write

        return transport

    async def _saw_response(self, response: httpx2.Response) -> None:
        # The SDK turns a refusal into a generic JSON-RPC error; the status says why.
        await trio.lowlevel.checkpoint()
        if response.status_code >= 400:
            self.http_refusal = f"HTTP {response.status_code} {response.reason_phrase}".strip()

    async def _serve(
        self, transport: Callable[[trio.Event], Any], ready: Callable[[], None]
    ) -> None:
        """Returns when the server's connection ends; raises when it cannot start."""
        cfg = self.config
        lost = trio.Event()
        client = Client(
            transport(lost),
            client_info=mt.Implementation(name="agentloop", version=agentloop.__version__),
        )
        # Not trio.fail_after: the client's task groups outlive the startup phase, so the
        # deadline has to live on the scope that encloses them and be lifted once started.
        with trio.CancelScope(deadline=trio.current_time() + cfg.startup_timeout) as startup:
            async with client:
                tools = await _list_tools(client)
                startup.deadline = math.inf
                # An unload may have begun meanwhile; its scope closes before registering.
                await trio.lowlevel.checkpoint_if_cancelled()
                self.client, self.lost = client, lost
                try:
                    self._register(tools)
                    if self.ever_started:
                        log.info("MCP server %r is back", self.name)
                    self.started = self.ever_started = True
                    self.restarting = False
                    ready()
                    await lost.wait()
                finally:
                    self.client = None
                    self._lose_calls()
        if startup.cancelled_caught:
            raise TimeoutError(f"no answer within {cfg.startup_timeout} s")

    def _lose_calls(self) -> None:
        for scope in self.calls:
            scope.cancel()

    async def _pump_stderr(self, stream: trio.lowlevel.FdStream, drained: trio.Event) -> None:
        buffer = b""
        try:
            async with stream:
                while chunk := await stream.receive_some():
                    lines = (buffer + chunk).split(b"\n")
                    buffer = lines.pop()
                    if len(buffer) > _STDERR_LINE_LIMIT:
                        lines.append(buffer)
                        buffer = b""
                    for line in lines:
                        self._stderr_line(line)
                if buffer:
                    self._stderr_line(buffer)
        finally:
            drained.set()

    def _stderr_line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        self.stderr_tail.append(line)
        log.debug("MCP server %r: %s", self.name, line)

    def _register(self, tools: Sequence[mt.Tool]) -> None:
        # A restarted server may list other tools than before: the new list replaces the old.
        self._drop_tools()
        seen: set[str] = set()
        for spec in tools:
            name = f"{self.name}{self.separator}{spec.name}"
            if name in seen:
                log.warning("MCP server %r lists tool %r twice; using the first", self.name,
                            spec.name)
                continue
            read_only = spec.annotations is not None and spec.annotations.read_only_hint is True
            try:
                tool = Tool(
                    name,
                    spec.description or spec.title or "",
                    spec.input_schema,
                    self._caller(spec.name),
                    concurrency="parallel" if read_only else "exclusive",
                )
            except (agentloop.AgentLoopError, TypeError, ValueError) as exc:
                log.warning("MCP server %r: tool %r is left out: %s", self.name, spec.name, exc)
                continue
            seen.add(name)
            self.disposers.append(self.ctx.tools.register(tool))
        if self.config.resources:
            for tool in self._resource_tools():
                self.disposers.append(self.ctx.tools.register(tool))

    def _resource_tools(self) -> list[Tool]:
        async def list_resources() -> ToolResult:
            return await self._request("list_resources", _render_resources)

        async def read_resource(uri: str) -> ToolResult:
            return await self._request(
                "read_resource", _render_contents, uri, what=f"read_resource {uri}"
            )

        return [
            Tool(
                f"{self.name}_list_resources",
                f"List the resources of the MCP server {self.name!r}: URI, name, type.",
                {"type": "object", "properties": {}},
                list_resources,
                concurrency="parallel",
            ),
            Tool(
                f"{self.name}_read_resource",
                f"Read one resource of the MCP server {self.name!r} by its URI.",
                {
                    "type": "object",
                    "properties": {"uri": {"type": "string", "description": "its URI"}},
                    "required": ["uri"],
                },
                read_resource,
                concurrency="parallel",
            ),
        ]

    def _drop_tools(self) -> None:
        while self.disposers:
            self.disposers.pop()()

    def _caller(self, tool_name: str) -> Callable[..., Any]:
        async def run(**arguments: Any) -> ToolResult:
            return await self._request(
                "call_tool", render_result, tool_name, thaw(arguments), what=tool_name
            )

        return run

    def _unavailable(self, why: str) -> ToolResult:
        return ToolResult.error("MCP_UNAVAILABLE", f"MCP server {self.name!r} {why}")

    async def _request(
        self, method: str, render: Callable[[Any], ToolResult], *args: Any, what: str = ""
    ) -> ToolResult:
        client, lost = self.client, self.lost
        # A lost connection is known here before the actor has woken to restart it.
        if client is None or lost is None or lost.is_set():
            coming_back = self.restarting or (
                lost is not None and lost.is_set() and self.config.max_restarts > 0
            )
            why = "is restarting; try again shortly" if coming_back else "is not running"
            return self._unavailable(why)
        timeout = self.config.tool_timeout
        with trio.CancelScope() as scope:
            if timeout is not None:
                scope.deadline = trio.current_time() + timeout
            self.calls.add(scope)
            try:
                result = await getattr(client, method)(*args)
            except MCPError as exc:
                if exc.code == mt.CONNECTION_CLOSED:
                    lost.set()
                    return self._unavailable("closed the connection during the call")
                return ToolResult.error("MCP_ERROR", exc.message)
            except Exception as exc:  # noqa: BLE001 - a transport failure: reconnect
                lost.set()
                return self._unavailable(f"failed during the call: {_describe(exc)}")
            finally:
                self.calls.discard(scope)
        if scope.cancelled_caught:
            if lost.is_set():
                return self._unavailable("went away during the call")
            return ToolResult.error(
                "TIMEOUT",
                f"MCP server {self.name!r} did not answer {what or method} within {timeout} s",
            )
        return render(result)

    def _report(self, exc: Exception, *, restarting: bool) -> None:
        cause = _leaf(exc.__cause__ or exc)
        # A missing command or a server that quit is explained by the message; a traceback
        # only helps with the unexpected.
        expected = isinstance(cause, OSError | MCPError | TimeoutError | ServerError) or (
            _is_transport_error(cause)
        )
        message = str(exc).split("\n", 1)[0]
        said = [line for line in getattr(exc, "stderr", ()) if line.strip()]
        if said:
            message += f" (last line of its stderr: {said[-1].strip()})"
        if restarting:
            message += "; trying again"
        log.error("%s", exc, exc_info=None if expected else exc)
        try:
            self.ctx.events.emit_nowait(
                McpServerFailed(self.name, message, restarting, exc)
            )
        except Exception:
            log.exception("an mcp/server-failed observer failed on MCP server %r", self.name)


def _is_transport_error(exc: BaseException) -> bool:
    return isinstance(exc, httpx2.HTTPError | _ConnectionClosedError)


def _render_resources(result: mt.ListResourcesResult) -> ToolResult:
    lines = []
    for r in result.resources:
        line = f"{r.uri}  {r.name}"
        if r.mime_type:
            line += f" ({r.mime_type})"
        if r.description:
            line += f": {r.description}"
        lines.append(line)
    return ToolResult("\n".join(lines) or "no resources")


def _render_contents(result: mt.ReadResourceResult) -> ToolResult:
    parts = []
    for c in result.contents:
        if isinstance(c, mt.TextResourceContents):
            parts.append(c.text)
        else:
            size = len(c.blob) * 3 // 4
            parts.append(f"[resource: {c.uri}, {c.mime_type or 'binary'}, {size} bytes]")
    return ToolResult("\n".join(parts))


def _stderr_pipe() -> tuple[TextIO, trio.lowlevel.FdStream]:
    """A pipe for a server's stderr: the end to hand to the child, and ours to read."""
    read_fd, write_fd = os.pipe()
    return os.fdopen(write_fd, "w"), trio.lowlevel.FdStream(read_fd)


async def _list_tools(client: Client) -> list[mt.Tool]:
    tools: list[mt.Tool] = []
    cursor: str | None = None
    for _ in range(_LIST_PAGE_LIMIT):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


async def start_servers(
    nursery: trio.Nursery, ctx: Context, servers: Sequence[ServerConfig], separator: str
) -> None:
    """Start one actor per server in ``nursery``; returns once each registered or failed."""
    waiting = {s.name for s in servers}
    all_ready = trio.Event()

    def ready_for(name: str) -> Callable[[], None]:
        def ready() -> None:
            waiting.discard(name)
            if not waiting:
                all_ready.set()

        return ready

    for server in servers:
        nursery.start_soon(_ServerActor(ctx, server, separator).run, ready_for(server.name))
    if waiting:
        await all_ready.wait()
