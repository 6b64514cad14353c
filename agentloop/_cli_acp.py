"""``agentloop acp``: an agent served to an editor over the Agent Client Protocol on stdio
(needs the ``acp`` extra).

The editor starts ``agentloop acp --config FILE`` and speaks JSON-RPC 2.0 to it, one JSON
object a line: ``initialize``, ``session/new``, ``session/load`` (a stored session: its
history is replayed as ``session/update`` notifications), ``session/prompt`` (the turn streams
as ``session/update`` notifications: message chunks, thought chunks, tool calls and their
updates; the answer's ``stopReason`` comes from the turn's reason) and the notification
``session/cancel`` (cancels the running turn). A tool call parked for approval becomes a
``session/request_permission`` request to the editor; its answer approves or denies the call.
``[acp] ask = ["pattern", ...]`` (shell-style patterns of tool names) parks every matching
call for approval.

The JSON-RPC is spoken here over trio streams; the ``agent-client-protocol`` package supplies
only its schema models, which validate every message in both directions (its connection class
needs asyncio).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal, TextIO

import attrs
import trio

from agentloop import (
    Agent,
    AgentHandle,
    AgentLoopError,
    Ask,
    Context,
    SessionEvent,
    TurnFailed,
    __version__,
    content_text,
    load_config,
    thaw,
)
from agentloop.events import SessionEventAppended, ToolPreExecute

from ._cli import EXIT_OK, EXIT_USAGE, PROG, CliError, Plan, cli_runtime
from ._cli_agents import Offered, offered_agents

__all__ = ["serve_acp", "JsonRpc", "RpcError", "stop_reason", "updates_for"]

log = logging.getLogger("agentloop.acp")

PROTOCOL_VERSION = 1
StopReason = Literal["end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled"]
_MAX_LINE = 16 * 1024 * 1024

# JSON-RPC error codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603


class RpcError(Exception):
    """An error answer: raised by a handler, or received for a request we sent."""

    def __init__(self, code: int, message: str, data: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


class JsonRpc:
    """JSON-RPC 2.0 peers over newline-delimited JSON on a pair of trio streams."""

    def __init__(self, receive: trio.abc.ReceiveStream, send: trio.abc.SendStream) -> None:
        self._receive = receive
        self._send = send
        self._lock = trio.Lock()
        self._next_id = 0
        self._waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}

    async def _write(self, message: Mapping[str, Any]) -> None:
        line = json.dumps({"jsonrpc": "2.0", **message}, ensure_ascii=False) + "\n"
        async with self._lock:
            await self._send.send_all(line.encode())

    async def notify(self, method: str, params: object) -> None:
        await self._write({"method": method, "params": params})

    async def respond(self, request_id: object, result: object) -> None:
        await self._write({"id": request_id, "result": result})

    async def respond_error(self, request_id: object, error: RpcError) -> None:
        body: dict[str, Any] = {"code": error.code, "message": error.message}
        if error.data is not None:
            body["data"] = error.data
        await self._write({"id": request_id, "error": body})

    async def request(self, method: str, params: object) -> Any:
        """Send a request and wait for its answer; an error answer raises :class:`RpcError`."""
        self._next_id += 1
        request_id = self._next_id
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._waiting[request_id] = send
        try:
            await self._write({"id": request_id, "method": method, "params": params})
            async with receive:
                answer = await receive.receive()
        finally:
            self._waiting.pop(request_id, None)
        if "error" in answer:
            error = answer["error"] or {}
            raise RpcError(error.get("code", INTERNAL_ERROR), error.get("message", ""),
                           error.get("data"))
        return answer.get("result")

    async def incoming(self) -> AsyncIterator[dict[str, Any]]:
        """Requests and notifications from the peer, until it closes its end. Answers to our
        own requests are routed to their waiting callers; a line that is not JSON is answered
        with a parse error."""
        buffer = b""
        while True:
            chunk = await self._receive.receive_some()
            if not chunk:
                return
            buffer += chunk
            if len(buffer) > _MAX_LINE:
                raise CliError(f"a line from the editor exceeds {_MAX_LINE} bytes", 1)
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                if not raw.strip():
                    continue
                try:
                    message = json.loads(raw)
                except ValueError as exc:
                    await self.respond_error(None, RpcError(PARSE_ERROR, f"not JSON: {exc}"))
                    continue
                if not isinstance(message, dict):
                    await self.respond_error(None, RpcError(INVALID_REQUEST, "not an object"))
                    continue
                if "method" in message:
                    yield message
                    continue
                waiter = self._waiting.pop(message.get("id"), None)  # type: ignore[arg-type]
                if waiter is not None:
                    waiter.send_nowait(message)


def _dump(model: Any) -> Any:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def _text_block(text: str) -> Any:
    from acp.schema import TextContentBlock

    return TextContentBlock(type="text", text=text)


def updates_for(event: SessionEvent, *, replay: bool = False) -> list[Any]:
    """The ACP session updates (schema models) that show one log event; ``replay`` adds the
    user's own messages, which an editor shows itself while the turn is live."""
    from acp.schema import (
        AgentMessageChunk,
        AgentThoughtChunk,
        ContentToolCallContent,
        ToolCallProgress,
        ToolCallStart,
        UserMessageChunk,
    )

    data = event.data
    if event.type == "user/message" and replay:
        return [UserMessageChunk(session_update="user_message_chunk",
                                 content=_text_block(content_text(thaw(data["content"]))))]
    if event.type == "assistant/chunk" and data.get("delta"):
        if data.get("kind") == "text":
            return [AgentMessageChunk(session_update="agent_message_chunk",
                                      content=_text_block(data["delta"]))]
        if data.get("kind") == "reasoning":
            return [AgentThoughtChunk(session_update="agent_thought_chunk",
                                      content=_text_block(data["delta"]))]
    if event.type == "tool/call":
        return [ToolCallStart(
            session_update="tool_call", tool_call_id=data["call_id"], title=data["name"],
            kind="other", status="pending", raw_input=thaw(data["arguments"]),
        )]
    if event.type == "tool/result":
        content = data.get("content")
        text = content if isinstance(content, str) else content_text(thaw(content))
        return [ToolCallProgress(
            session_update="tool_call_update", tool_call_id=data["call_id"],
            status="failed" if data.get("is_error") else "completed",
            content=[ContentToolCallContent(type="content", content=_text_block(text))],
        )]
    return []


def stop_reason(reason: str, cause: object = None) -> StopReason:
    """The ACP ``stopReason`` of a turn that ended with ``reason`` (and ``cause``)."""
    if reason == "completed":
        return "end_turn"
    if reason == "max-tokens":
        return "max_tokens"
    if reason == "rejected":
        return "refusal"
    if reason == "aborted" and cause in ("step_limit", "budget"):
        return "max_turn_requests"
    return "cancelled"


def _prompt_text(blocks: list[Any]) -> str:
    """One user message from the prompt's content blocks."""
    parts: list[str] = []
    for block in blocks:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        elif kind == "resource":
            inner = block.resource
            text = getattr(inner, "text", None)
            parts.append(f"[resource: {inner.uri}]" + (f"\n{text}" if text is not None else ""))
        else:
            parts.append(f"[{kind} content]")
    return "\n".join(parts)


@attrs.define
class _Session:
    handle: AgentHandle
    always: set[str] = attrs.field(factory=set)
    running: bool = False

    @property
    def agent(self) -> Agent:
        return self.handle.agent


class _AcpAgent:
    """Answers one editor's requests for the agent it serves."""

    def __init__(self, rt: Context, offered: Offered, rpc: JsonRpc, nursery: trio.Nursery,
                 err: TextIO) -> None:
        self.rt = rt
        self.offered = offered
        self.rpc = rpc
        self.nursery = nursery
        self.err = err
        self.sessions: dict[str, _Session] = {}
        self.handlers: dict[str, Callable[[Any], Any]] = {
            "initialize": self.initialize,
            "session/new": self.new_session,
            "session/load": self.load_session,
            "session/prompt": self.prompt,
        }

    async def serve(self) -> None:
        async for message in self.rpc.incoming():
            method = message["method"]
            if "id" not in message:
                await self.notification(method, message.get("params"))
            else:
                self.nursery.start_soon(self.answer, message)

    async def notification(self, method: str, params: Any) -> None:
        from acp.schema import CancelNotification
        from pydantic import ValidationError

        await trio.lowlevel.checkpoint()
        if method != "session/cancel":
            return  # unknown notifications are ignored, as JSON-RPC asks
        try:
            cancel = CancelNotification.model_validate(params)
        except ValidationError:
            return
        session = self.sessions.get(cancel.session_id)
        if session is not None:
            session.agent.cancel("user")

    async def answer(self, message: dict[str, Any]) -> None:
        from pydantic import ValidationError

        request_id, method = message["id"], message["method"]
        handler = self.handlers.get(method)
        try:
            if handler is None:
                raise RpcError(METHOD_NOT_FOUND, f"unknown method {method!r}")
            result = await handler(message.get("params") or {})
        except RpcError as exc:
            await self.rpc.respond_error(request_id, exc)
        except ValidationError as exc:
            details = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]
            )
            await self.rpc.respond_error(
                request_id, RpcError(INVALID_PARAMS, f"invalid {method} params: {details}")
            )
        except AgentLoopError as exc:
            await self.rpc.respond_error(request_id, RpcError(INTERNAL_ERROR, str(exc)))
        except Exception as exc:  # one bad request must not end the editor's session
            log.exception("acp: %s failed", method)
            await self.rpc.respond_error(
                request_id, RpcError(INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
            )
        else:
            await self.rpc.respond(request_id, result)

    async def initialize(self, params: Any) -> Any:
        from acp.schema import (
            AgentCapabilities,
            Implementation,
            InitializeRequest,
            InitializeResponse,
            PromptCapabilities,
        )

        await trio.lowlevel.checkpoint()
        request = InitializeRequest.model_validate(params)
        return _dump(InitializeResponse(
            protocol_version=min(request.protocol_version, PROTOCOL_VERSION),
            agent_capabilities=AgentCapabilities(
                load_session=True,
                prompt_capabilities=PromptCapabilities(embedded_context=True),
            ),
            agent_info=Implementation(name="agentloop", version=__version__),
            auth_methods=[],
        ))

    async def new_session(self, params: Any) -> Any:
        from acp.schema import NewSessionRequest, NewSessionResponse

        request = NewSessionRequest.model_validate(params)
        session_id = self.offered.fresh_session_id()
        handle = await self.rt.agents.create(
            session_id=session_id,
            meta={"cwd": request.cwd, "label": f"{PROG} acp ({self.offered.id})"},
            agent_options=self.offered.options,
        )
        self.sessions[session_id] = _Session(handle)
        return _dump(NewSessionResponse(session_id=session_id))

    async def load_session(self, params: Any) -> Any:
        from acp.schema import LoadSessionRequest, LoadSessionResponse, SessionNotification

        request = LoadSessionRequest.model_validate(params)
        session_id = request.session_id
        session = self.sessions.get(session_id)
        if session is None:
            backend = self.rt.session_persistence
            if backend is None or not await backend.exists(session_id):
                raise RpcError(INVALID_PARAMS, f"no stored session {session_id!r}")
            handle = await self.rt.agents.resume(
                resume_session_id=session_id, agent_options=self.offered.options
            )
            session = self.sessions[session_id] = _Session(handle)
        for event in session.agent.session.events:
            for update in updates_for(event, replay=True):
                await self.rpc.notify("session/update", _dump(
                    SessionNotification(session_id=session_id, update=update)
                ))
        if session.agent.pending_approvals and not session.running:
            self.nursery.start_soon(self.resume_pending, session_id, session)
        return _dump(LoadSessionResponse())

    async def resume_pending(self, session_id: str, session: _Session) -> None:
        """Ask again for the calls a stored turn left awaiting approval, and stream the turn
        that answering them continues, as a prompt's would be."""
        from acp.schema import SessionNotification

        agent = session.agent
        session.running = True
        try:
            async with self.rt.events.subscribe(SessionEventAppended) as log:
                for pending in agent.pending_approvals:
                    self.nursery.start_soon(self.permission, session_id, session,
                                            pending.call_id, pending.name,
                                            thaw(pending.arguments))
                async for appended in log:
                    if appended.session_id != session_id:
                        continue
                    event = appended.event
                    for update in updates_for(event):
                        await self.rpc.notify("session/update", _dump(
                            SessionNotification(session_id=session_id, update=update)
                        ))
                    if event.type == "tool/approval-requested":
                        data = event.data
                        self.nursery.start_soon(self.permission, session_id, session,
                                                data["call_id"], data["name"],
                                                thaw(data["arguments"]))
                    elif event.type == "turn/end":
                        return
        finally:
            session.running = False

    async def prompt(self, params: Any) -> Any:
        from acp.schema import PromptRequest, PromptResponse, SessionNotification

        request = PromptRequest.model_validate(params)
        session = self.sessions.get(request.session_id)
        if session is None:
            raise RpcError(INVALID_PARAMS, f"no session {request.session_id!r}: "
                           "create it with session/new or load it with session/load")
        if session.running:
            raise RpcError(INVALID_REQUEST, f"session {request.session_id!r} is already "
                           "answering a prompt")
        session.running = True
        cause: object = None
        try:
            async with session.agent.run(_prompt_text(request.prompt)) as run:
                async for event in run.events():
                    for update in updates_for(event):
                        await self.rpc.notify("session/update", _dump(
                            SessionNotification(session_id=request.session_id, update=update)
                        ))
                    if event.type == "tool/approval-requested":
                        data = event.data
                        self.nursery.start_soon(
                            self.permission, request.session_id, session, data["call_id"],
                            data["name"], thaw(data["arguments"]),
                        )
                    elif event.type == "turn/end":
                        cause = event.data.get("cause")
                try:
                    result = await run.result()
                except TurnFailed as exc:
                    raise RpcError(INTERNAL_ERROR, f"the turn failed: {exc}") from None
        finally:
            session.running = False
        return _dump(PromptResponse(stop_reason=stop_reason(result.reason, cause)))

    async def permission(self, session_id: str, session: _Session, call_id: str, name: str,
                         arguments: object) -> None:
        from acp.schema import (
            PermissionOption,
            RequestPermissionRequest,
            RequestPermissionResponse,
            ToolCallUpdate,
        )

        agent = session.agent
        if name in session.always:
            agent.approve(call_id)
            await trio.lowlevel.checkpoint()
            return
        request = RequestPermissionRequest(
            session_id=session_id,
            tool_call=ToolCallUpdate(tool_call_id=call_id, title=name, kind="other",
                                     status="pending", raw_input=arguments),
            options=[
                PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                PermissionOption(option_id="allow-always", name=f"Always allow {name}",
                                 kind="allow_always"),
                PermissionOption(option_id="reject", name="Reject", kind="reject_once"),
            ],
        )
        try:
            raw = await self.rpc.request("session/request_permission", _dump(request))
            outcome = RequestPermissionResponse.model_validate(raw).outcome
        except Exception as exc:  # noqa: BLE001 - an editor's bad answer refuses the call
            agent.deny(call_id, f"the editor's answer could not be read: {exc}")
            return
        chosen = getattr(outcome, "option_id", None)
        if outcome.outcome == "selected" and chosen in ("allow", "allow-always"):
            if chosen == "allow-always":
                session.always.add(name)
            agent.approve(call_id)
        elif outcome.outcome == "selected":
            agent.deny(call_id, "the user rejected the call")
        else:
            agent.deny(call_id, "the permission request was cancelled")

    async def aclose(self) -> None:
        for session in list(self.sessions.values()):
            await session.handle.aclose()


def _ask_patterns(args: argparse.Namespace) -> tuple[str, ...]:
    if not args.config:
        return ()
    table = load_config(args.config).section("acp")
    unknown = sorted(set(table) - {"ask"})
    if unknown:
        raise CliError(f"acp.{unknown[0]}: unknown key (known: ask)", EXIT_USAGE)
    patterns = thaw(table.get("ask", []))
    if not (isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
        raise CliError(f"acp.ask: must be a list of tool-name patterns, got {patterns!r}",
                       EXIT_USAGE)
    return tuple(patterns)


async def serve_acp(args: argparse.Namespace, plan: Plan, out: TextIO, err: TextIO) -> int:
    try:
        import acp.schema  # noqa: F401 - checked here to fail with one clear line
    except ImportError:
        raise CliError(
            f"{PROG} acp needs the acp extra: pip install 'agentloop[acp]'", EXIT_USAGE
        ) from None
    offered = offered_agents(args, plan)[0]
    patterns = _ask_patterns(args)
    # FdStream makes the descriptions non-blocking, which they share with whoever started us
    # (a terminal, when run by hand): put that back on the way out.
    blocking = {fd: os.get_blocking(fd) for fd in (0, 1)}
    try:
        await _serve_stdio(plan, err, offered, patterns)
    finally:
        for fd, was in blocking.items():
            os.set_blocking(fd, was)
    return EXIT_OK


async def _serve_stdio(
    plan: Plan, err: TextIO, offered: Offered, patterns: tuple[str, ...]
) -> None:
    receive = trio.lowlevel.FdStream(os.dup(0))
    send = trio.lowlevel.FdStream(os.dup(1))
    async with cli_runtime(plan, os.environ, err) as rt, receive, send:
        if patterns:

            def ask(event: ToolPreExecute) -> Ask | None:
                name = event.call.name
                if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    return Ask(f"run {name}?")
                return None

            rt.events.on(ToolPreExecute, ask)
        if not plan.quiet:
            err.write(f"{PROG}: acp: agent {offered.id} "
                      f"({offered.options.provider}/{offered.options.model}) on stdio\n")
            err.flush()
        async with trio.open_nursery() as nursery:
            server = _AcpAgent(rt, offered, JsonRpc(receive, send), nursery, err)
            try:
                await server.serve()
            finally:
                # The editor closed its end: nothing more can be asked or answered.
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await server.aclose()
