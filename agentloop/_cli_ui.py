"""``agentloop ui``: a local web inspector of the sessions, served on trio.

A small ASGI application (no framework: a handful of routes) served by Hypercorn's trio
worker. It reads the runtime's session store and its live agents; it drives a stored session
(resumes it in this runtime) when a person sends it a follow-up or answers an approval. The
page is built on a JSON API that scripts may use too:

- ``GET /api/sessions``: the sessions, each with its ``parent`` (sub-agents) and whether it is
  live here;
- ``GET /api/sessions/{id}``: its log, messages with their markdown rendered to safe HTML;
- ``GET /api/sessions/{id}/stream``: the log as server-sent events (``log``), then live, with
  the progress of its running tools (``progress``: ``call_id``, ``message``, ``fraction``);
- ``POST /api/sessions/{id}/messages`` ``{"content": ...}``: a follow-up;
- ``POST /api/sessions/{id}/approvals/{call_id}`` ``{"approve": true}`` or
  ``{"approve": false, "reason": ...}``;
- ``POST /agui``: an AG-UI ``RunAgentInput``, answered with the AG-UI event stream of the turn
  it starts in the session whose id is the input's ``threadId``.

Every request needs the random token printed in the URL (``?token=...``, then a cookie the
first page load sets, or ``Authorization: Bearer ...``): anything else is answered 403.
"""

from __future__ import annotations

import functools
import hmac
import json
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, TextIO

import trio

import agentloop
from agentloop import AgentHandle, AgentOptions, Context, SessionEvent
from agentloop.events import SessionEventAppended, ToolProgress

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

COOKIE = "agentloop_ui"
_RENDERED = ("user/message", "steering/message", "assistant/message")
_MAX_BODY = 1 << 20


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def shown_store(location: str | None) -> str:
    """A store's location for the page: a DSN without its password (or any query string,
    where a password may also be given)."""
    if not location:
        return "no session store"
    if "://" not in location:
        return location
    parts = urllib.parse.urlsplit(location)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}@" if parts.username else ""
    return urllib.parse.urlunsplit((parts.scheme, user + host, parts.path, "", ""))


def _markdown() -> Callable[[str], str]:
    from markdown_it import MarkdownIt

    # html=False: raw HTML in a message is shown as text, never parsed by the browser.
    md = MarkdownIt("commonmark", {"html": False})
    return md.render


class Inspector:
    """The ASGI application: ``await inspector(scope, receive, send)``."""

    def __init__(
        self,
        ctx: Context,
        *,
        token: str,
        store: str | None = None,
        agent_options: AgentOptions | None = None,
    ) -> None:
        self._ctx = ctx
        self._token = token
        self._store = shown_store(store)
        self._options = agent_options
        self._render = _markdown()
        self._handles: dict[str, AgentHandle] = {}
        self._opening = trio.Lock()

    async def aclose(self) -> None:
        """Dispose the agents this inspector resumed or created."""
        handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            await handle.aclose()

    # --- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method = scope["method"]
        path = scope["path"]
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        by_query = self._allowed(query.get("token", [""])[0])
        if not (by_query or self._allowed(_cookie(headers.get("cookie", ""), COOKIE))
                or self._allowed(_bearer(headers.get("authorization", "")))):
            await _respond(send, 403, "text/plain", b"403: this inspector needs its token "
                           b"(the ?token=... of the URL it printed)\n")
            return
        try:
            if method == "GET" and path == "/":
                extra = [(b"set-cookie", f"{COOKIE}={self._token}; HttpOnly; SameSite=Strict; "
                          "Path=/".encode())] if by_query else []
                nonce = secrets.token_urlsafe(16)
                page = PAGE.replace("{{STORE}}", _escape(self._store)).replace(
                    "{{NONCE}}", nonce)
                # Only the page's own script runs: no inline handler, nothing injected.
                csp = (f"default-src 'self'; script-src 'nonce-{nonce}'; "
                       "style-src 'unsafe-inline'; img-src 'self' data:")
                await _respond(send, 200, "text/html; charset=utf-8", page.encode(),
                               [*extra, (b"content-security-policy", csp.encode())])
                return
            if method == "POST":
                if not headers.get("content-type", "").startswith("application/json"):
                    # A form from another site cannot send JSON without a preflight.
                    raise HTTPError(415, "POST bodies must be application/json")
                body = await _body(receive)
            else:
                body = None
            await self._route(method, path, query, headers, body, receive, send)
        except HTTPError as exc:
            await _json_response(send, exc.status, {"error": exc.message})
        except agentloop.AgentLoopError as exc:
            # The runtime refused (a session driven elsewhere, a store that failed, ...):
            # its message names what, and never a secret.
            await _json_response(send, 409, {"error": str(exc)})

    def _allowed(self, candidate: str) -> bool:
        return bool(candidate) and hmac.compare_digest(candidate.encode(), self._token.encode())

    async def _route(
        self, method: str, path: str, query: Mapping[str, list[str]], headers: Mapping[str, str],
        body: Any, receive: Receive, send: Send,
    ) -> None:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if method == "GET" and parts == ["api", "sessions"]:
            await _json_response(send, 200, {"sessions": await self.sessions()})
        elif method == "GET" and len(parts) == 3 and parts[:2] == ["api", "sessions"]:
            await _json_response(send, 200, await self.session(parts[2]))
        elif method == "GET" and len(parts) == 4 and parts[:2] == ["api", "sessions"] \
                and parts[3] == "stream":
            after = query.get("after", [headers.get("last-event-id", "0")])[0]
            await self._stream(parts[2], _int(after), receive, send)
        elif method == "POST" and len(parts) == 4 and parts[:2] == ["api", "sessions"] \
                and parts[3] == "messages":
            if not isinstance(body, Mapping) or "content" not in body:
                raise HTTPError(400, 'the body must be {"content": ...}')
            agent = await self._agent(parts[2])
            try:
                message_id = agent.followup(body["content"])
            except agentloop.InvalidContent as exc:
                raise HTTPError(400, str(exc)) from None
            await _json_response(send, 200, {"message_id": message_id})
        elif method == "POST" and len(parts) == 5 and parts[:2] == ["api", "sessions"] \
                and parts[3] == "approvals":
            await self._answer(parts[2], parts[4], body, send)
        elif method == "POST" and parts == ["agui"]:
            await self._agui(body, receive, send)
        else:
            raise HTTPError(404, f"no such page: {method} {path}")

    # --- reading -----------------------------------------------------------------------------

    async def sessions(self) -> list[dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        store = self._ctx.session_persistence
        if store is not None:
            for info in await store.list():
                out[info.id] = {
                    "id": info.id, "parent": info.parent_session_id, "turns": info.turns,
                    "updated_at": info.updated_at, "live": False, "status": "stored",
                }
        for agent in self._ctx.agents.list():
            if agent.status == "hibernated" and agent.id in out:
                # Listed from the store: reading its session would wake every sleeper.
                out[agent.id].update(live=True, status="hibernated")
                continue
            parent = agent.session.meta.get("parent_session_id")
            row = out.setdefault(agent.id, {"id": agent.id, "updated_at": None})
            row.update(
                parent=parent if isinstance(parent, str) else None,
                turns=agent.session.turns, live=True, status=agent.status,
                pending=len(agent.pending_approvals),
            )
        return sorted(out.values(), key=lambda r: (r["updated_at"] is None, r["id"]))

    async def _events(self, session_id: str) -> tuple[list[SessionEvent], bool]:
        """The session's log and whether a live agent drives it here."""
        try:
            agentloop.validate_session_id(session_id)
        except agentloop.AgentLoopError as exc:
            raise HTTPError(404, str(exc)) from None
        agent = self._ctx.agents.get(session_id)
        if agent is not None:
            return list(agent.session.events), True
        store = self._ctx.session_persistence
        if store is not None and await store.exists(session_id):
            return list((await store.load(session_id)).events), False
        raise HTTPError(404, f"no session {session_id!r}")

    async def session(self, session_id: str) -> dict[str, Any]:
        events, live = await self._events(session_id)
        agent = self._ctx.agents.get(session_id)
        return {
            "id": session_id,
            "live": live,
            "status": agent.status if agent is not None else "stored",
            "events": [self.event_json(e) for e in events],
        }

    def event_json(self, event: SessionEvent) -> dict[str, Any]:
        data: dict[str, Any] = agentloop.thaw(event.data)
        if event.type in _RENDERED:
            text = agentloop.content_text(event.data.get("content"))
            data["html"] = self._render(text) if text else ""
        return {"seq": event.seq, "type": event.type, "turn": event.turn, "data": data}

    async def _stream(self, session_id: str, after: int, receive: Receive, send: Send) -> None:
        async with self._ctx.events.subscribe(SessionEventAppended, ToolProgress) as rx:
            # Subscribed first: whatever is appended after this read is in the channel, and
            # the seqs keep each event to one delivery.
            events, _ = await self._events(session_id)
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-store"),
            ]})
            last = after

            async def write(batch: list[SessionEvent]) -> None:
                nonlocal last
                fresh = [e for e in batch if e.seq > last]
                if fresh:
                    last = fresh[-1].seq
                    await send({"type": "http.response.body", "more_body": True, "body": "".join(
                        f"id: {e.seq}\nevent: log\ndata: {json.dumps(self.event_json(e))}\n\n"
                        for e in fresh
                    ).encode()})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                await write(events)
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"event: ready\ndata: {}\n\n"})
                async for first in rx:
                    # Everything already queued goes out in one write: one wake-up per batch,
                    # not per streamed chunk.
                    batch = [first]
                    while True:
                        try:
                            batch.append(rx.receive_nowait())
                        except trio.WouldBlock:
                            break
                    await write([a.event for a in batch if isinstance(a, SessionEventAppended)
                                 and a.session_id == session_id])
                    await send_progress(send, [p for p in batch if isinstance(p, ToolProgress)
                                               and p.agent_id == session_id])

    # --- driving -----------------------------------------------------------------------------

    async def _agent(self, session_id: str, *, create: bool = False) -> agentloop.Agent:
        """The live agent of ``session_id``, resumed here from the store if nobody drives it."""
        async with self._opening:
            agent = self._ctx.agents.get(session_id)
            if agent is not None:
                return agent
            store = self._ctx.session_persistence
            if store is not None and await store.exists(session_id):
                handle = await self._ctx.agents.resume(
                    resume_session_id=session_id, agent_options=self._options
                )
            elif create and self._options is not None:
                try:
                    handle = await self._ctx.agents.create(
                        session_id=session_id, agent_options=self._options,
                        meta={"label": "agentloop ui"},
                    )
                except agentloop.AgentLoopError as exc:
                    raise HTTPError(400, str(exc)) from None
            elif create:
                raise HTTPError(400, "no model is configured for new sessions here")
            else:
                raise HTTPError(404, f"no session {session_id!r}")
            self._handles[session_id] = handle
            return handle.agent

    async def _answer(self, session_id: str, call_id: str, body: Any, send: Send) -> None:
        if not isinstance(body, Mapping) or not isinstance(body.get("approve"), bool):
            raise HTTPError(400, 'the body must be {"approve": true} or {"approve": false, '
                                 '"reason": "..."}')
        agent = await self._agent(session_id)
        if body["approve"]:
            done = agent.approve(call_id)
        else:
            done = agent.deny(call_id, reason=str(body.get("reason") or "denied"))
        if not done:
            raise HTTPError(409, f"no call {call_id!r} awaits approval in {session_id!r}")
        await _json_response(send, 200, {"call_id": call_id, "approved": body["approve"]})

    async def _agui(self, body: Any, receive: Receive, send: Send) -> None:
        from ag_ui.core import RunAgentInput
        from ag_ui.encoder import EventEncoder
        from pydantic import ValidationError

        try:
            run_input = RunAgentInput.model_validate(body)
        except ValidationError as exc:
            raise HTTPError(400, f"not an AG-UI RunAgentInput: {exc.error_count()} errors, "
                                 f"first: {exc.errors()[0]['msg']}") from None
        prompt = next(
            (m.content for m in reversed(run_input.messages) if m.role == "user"), None
        )
        if prompt is None:
            raise HTTPError(400, "the input has no user message to answer")
        content: Any = prompt if isinstance(prompt, str) else [
            p.model_dump(mode="json", exclude_none=True) for p in prompt
        ]
        agent = await self._agent(run_input.thread_id, create=True)
        encoder = EventEncoder()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", encoder.get_content_type().encode()),
            (b"cache-control", b"no-store"),
        ]})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)

            async def emit(event: Any) -> None:
                await send({"type": "http.response.body", "more_body": True,
                            "body": encoder.encode(event).encode()})

            await agui_run(agent, content, run_input.thread_id, run_input.run_id, emit)
            await send({"type": "http.response.body", "body": b""})
            nursery.cancel_scope.cancel()


async def agui_run(
    agent: agentloop.Agent, content: Any, thread_id: str, run_id: str,
    emit: Callable[[Any], Awaitable[None]],
) -> None:
    """Run the turn that answers ``content``; ``emit`` each AG-UI event of it, from its log."""
    from ag_ui.core import (
        RunErrorEvent,
        RunFinishedEvent,
        RunStartedEvent,
        TextMessageContentEvent,
        TextMessageEndEvent,
        TextMessageStartEvent,
        ToolCallArgsEvent,
        ToolCallEndEvent,
        ToolCallResultEvent,
        ToolCallStartEvent,
    )

    await emit(RunStartedEvent(thread_id=thread_id, run_id=run_id))
    message_id: str | None = None
    last_message: str | None = None
    async with agent.run(content) as run:
        async for event in run.events():
            data = event.data
            if event.type == "assistant/chunk" and data.get("kind") == "text":
                if message_id is None:
                    message_id = f"{run_id}-{event.seq}"
                    await emit(TextMessageStartEvent(message_id=message_id, role="assistant"))
                if data.get("delta"):
                    await emit(TextMessageContentEvent(message_id=message_id,
                                                       delta=data["delta"]))
            elif event.type == "assistant/message":
                if message_id is not None:
                    await emit(TextMessageEndEvent(message_id=message_id))
                    last_message, message_id = message_id, None
            elif event.type == "tool/call":
                await emit(ToolCallStartEvent(tool_call_id=data["call_id"],
                                              tool_call_name=data["name"],
                                              parent_message_id=last_message))
                await emit(ToolCallArgsEvent(tool_call_id=data["call_id"],
                                             delta=json.dumps(agentloop.thaw(data["arguments"]))))
                await emit(ToolCallEndEvent(tool_call_id=data["call_id"]))
            elif event.type == "tool/result":
                result = data.get("content")
                await emit(ToolCallResultEvent(
                    message_id=f"{run_id}-result-{data['call_id']}",
                    tool_call_id=data["call_id"], role="tool",
                    content=result if isinstance(result, str)
                    else json.dumps(agentloop.thaw(result)),
                ))
            elif event.type == "turn/end":
                if data.get("reason") == "error":
                    error = data.get("error") or {}
                    await emit(RunErrorEvent(
                        message=str(error.get("message") or "the turn failed"),
                        code=str(error["code"]) if error.get("code") else None,
                    ))
                else:
                    await emit(RunFinishedEvent(thread_id=thread_id, run_id=run_id,
                                                result={"reason": data.get("reason")}))


# --- ASGI helpers ------------------------------------------------------------------------------


async def send_progress(send: Send, batch: list[ToolProgress]) -> None:
    """A tool's progress as ``progress`` server-sent events: the latest of each call in the
    batch (progress is never logged, so it carries no seq and is not replayed)."""
    latest = {p.call_id: p for p in batch}
    if latest:
        await send({"type": "http.response.body", "more_body": True, "body": "".join(
            "event: progress\ndata: " + json.dumps(
                {"call_id": p.call_id, "message": p.message, "fraction": p.fraction}
            ) + "\n\n"
            for p in latest.values()
        ).encode()})


async def _until_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _body(receive: Receive) -> Any:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(400, "the client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            raise HTTPError(413, f"the body is over {_MAX_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        return json.loads(b"".join(chunks) or b"null")
    except ValueError as exc:
        raise HTTPError(400, f"the body is not JSON: {exc}") from None


async def _respond(
    send: Send, status: int, content_type: str, body: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        *(extra or [(b"content-security-policy", b"default-src 'none'")]),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _json_response(send: Send, status: int, value: object) -> None:
    await _respond(send, status, "application/json", json.dumps(value).encode())


def _cookie(header: str, name: str) -> str:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""


def _bearer(header: str) -> str:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _int(text: str) -> int:
    try:
        return max(0, int(text))
    except ValueError:
        raise HTTPError(400, f"not a seq: {text!r}") from None


def _escape(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


# --- serving -----------------------------------------------------------------------------------


def new_token() -> str:
    return secrets.token_urlsafe(24)


async def serve(
    inspector: Inspector, *, host: str = "127.0.0.1", port: int = 8765,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``inspector`` until cancelled; ``task_status.started`` gets its base URL."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    # Server-sent events stay open; a shutdown must not wait for their clients.
    config.graceful_timeout = 0.5
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            # An ASGI 3 callable; hypercorn's type names its own scope classes.
            functools.partial(hypercorn_serve, inspector, config, mode="asgi")  # type: ignore[arg-type]
        )
        task_status.started(binds[0])


def check_host(host: str, public: bool) -> None:
    """Refuse to serve beyond loopback unless asked to in so many words."""
    if host not in ("127.0.0.1", "localhost", "::1") and not public:
        raise ValueError(
            f"--host {host} would serve the inspector beyond this machine; add --public to "
            "mean it (the token still guards every request)"
        )


async def run_inspector(
    ctx: Context, *, host: str, port: int, store: str | None,
    agent_options: AgentOptions | None, out: TextIO,
) -> int:
    """``agentloop ui`` on an open runtime: serve the inspector until interrupted."""
    token = new_token()
    inspector = Inspector(ctx, token=token, store=store, agent_options=agent_options)
    try:
        async with trio.open_nursery() as nursery:
            base = await nursery.start(
                functools.partial(serve, inspector, host=host, port=port)
            )
            out.write(f"agentloop ui: {base}/?token={token}\n")
            out.flush()
    finally:
        with trio.CancelScope(shield=True):
            await inspector.aclose()
    return 0


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>agentloop inspector</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
:root { --fg:#1d2330; --dim:#6b7385; --line:#e2e5ec; --bg:#f6f7fa; --accent:#3b5bdb;
        --err:#c92a2a; --ok:#2b8a3e; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui, sans-serif; color:var(--fg); background:var(--bg);
       display:grid; grid-template-columns: 260px 1fr; height:100vh; }
aside { border-right:1px solid var(--line); background:#fff; overflow:auto; padding:12px; }
aside h1 { font-size:15px; margin:0 0 4px; }
aside .store { color:var(--dim); font-size:12px; margin-bottom:12px; word-break:break-all; }
#sessions ul { list-style:none; margin:0; padding-left:14px; }
#sessions > ul { padding-left:0; }
#sessions a { display:block; padding:3px 6px; border-radius:4px; color:var(--fg);
              text-decoration:none; }
#sessions a.selected { background:#e7ecff; }
#sessions .badge { color:var(--dim); font-size:11px; margin-left:4px; }
main { display:flex; flex-direction:column; height:100vh; overflow:hidden; }
header { padding:10px 16px; border-bottom:1px solid var(--line); background:#fff;
         display:flex; gap:12px; align-items:baseline; }
header h2 { margin:0; font-size:15px; }
header .status { color:var(--dim); }
header a { margin-left:auto; color:var(--dim); font-size:12px; }
#log { flex:1; overflow:auto; padding:16px; }
.msg { background:#fff; border:1px solid var(--line); border-radius:8px; padding:8px 12px;
       margin:8px 0; max-width:900px; }
.msg.user { background:#eef2ff; margin-left:60px; }
.msg .who { font-size:11px; color:var(--dim); text-transform:uppercase; letter-spacing:.04em; }
.msg .body p { margin:.3em 0; }
.msg pre, .tool pre { background:#f1f3f5; padding:6px 8px; border-radius:4px; overflow:auto;
                      margin:4px 0; white-space:pre-wrap; }
details.reasoning { color:var(--dim); margin:4px 0; }
.tool { border-left:3px solid var(--accent); padding:4px 10px; margin:6px 0 6px 12px;
        background:#fff; max-width:880px; }
.tool.error { border-left-color:var(--err); }
.tool .name { font-weight:600; }
.tool .result.error { color:var(--err); }
.tool .progress { display:flex; gap:8px; align-items:center; font-size:90%; }
.approval { border:1px solid #f08c00; background:#fff9db; padding:6px 10px; border-radius:6px;
            margin:6px 0; }
.approval button { margin-left:8px; }
.turn { color:var(--dim); font-size:12px; margin:10px 0; border-top:1px dashed var(--line);
        padding-top:4px; }
.turn .reason.error { color:var(--err); }
.turn .reason.completed { color:var(--ok); }
form { display:flex; gap:8px; padding:10px 16px; border-top:1px solid var(--line);
       background:#fff; }
form textarea { flex:1; height:48px; font:inherit; padding:6px; }
.empty { color:var(--dim); padding:24px; }
</style></head>
<body>
<aside><h1>agentloop</h1><div class="store">{{STORE}}</div>
<div id="sessions"><div class="empty">loading…</div></div></aside>
<main>
<header><h2 id="title">no session selected</h2><span class="status" id="status"></span>
<a href="/api/sessions" id="api-link">JSON API</a></header>
<div id="log"><div class="empty">Pick a session on the left.</div></div>
<form id="followup"><textarea id="followup-text" placeholder="Send a follow-up…"></textarea>
<button type="submit" id="followup-send">Send</button></form>
</main>
<script nonce="{{NONCE}}">
"use strict";
let current = null, source = null, view = null;
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
function show(value) {
  return typeof value === "string" ? value : JSON.stringify(value, null, 2);
}
async function api(method, path, body) {
  const init = {method, headers: {}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  const data = await r.json();
  if (!r.ok) throw new Error(data.error || r.statusText);
  return data;
}
async function loadSessions() {
  const {sessions} = await api("GET", "/api/sessions");
  const children = {};
  const ids = new Set(sessions.map((s) => s.id));
  for (const s of sessions) {
    const parent = s.parent && ids.has(s.parent) ? s.parent : "";
    (children[parent] = children[parent] || []).push(s);
  }
  function tree(parent) {
    const ul = el("ul");
    for (const s of children[parent] || []) {
      const li = el("li"), a = el("a", s.id === current ? "selected" : "", s.id);
      a.href = "#" + encodeURIComponent(s.id);
      a.dataset.session = s.id;
      a.append(el("span", "badge", s.status + (s.pending ? " · approval" : "")));
      a.onclick = (ev) => { ev.preventDefault(); open(s.id); };
      li.append(a);
      if (children[s.id]) li.append(tree(s.id));
      ul.append(li);
    }
    return ul;
  }
  const box = $("sessions");
  box.replaceChildren(sessions.length ? tree("") : el("div", "empty", "no sessions"));
}
function newView() {
  return {log: $("log"), text: null, reasoning: null, tools: {}, approvals: {}, running: false};
}
function bubble(role, html, text) {
  const m = el("div", "msg " + role);
  m.append(el("div", "who", role));
  const b = el("div", "body");
  if (html !== undefined) b.innerHTML = html; else b.textContent = text || "";
  m.append(b);
  view.log.append(m);
  return m;
}
function assistantBubble() {
  if (!view.text) {
    view.text = bubble("assistant", undefined, "");
    view.text.classList.add("streaming");
  }
  return view.text;
}
function apply(e) {
  const d = e.data;
  if (e.type === "turn/start") {
    view.running = true;
    view.log.append(el("div", "turn", "turn " + d.turn));
  } else if (e.type === "user/message" || e.type === "steering/message") {
    bubble(e.type === "user/message" ? "user" : "user steer", d.html);
  } else if (e.type === "assistant/chunk") {
    const m = assistantBubble();
    if (d.kind === "text") {
      m.querySelector(".body").append(document.createTextNode(d.delta));
    } else if (d.kind === "reasoning") {
      if (!view.reasoning) {
        view.reasoning = el("details", "reasoning");
        view.reasoning.append(el("summary", "", "reasoning"), el("pre"));
        m.insertBefore(view.reasoning, m.querySelector(".body"));
      }
      view.reasoning.querySelector("pre").append(document.createTextNode(d.delta));
    }
  } else if (e.type === "assistant/message") {
    const m = assistantBubble();
    m.classList.remove("streaming");
    m.querySelector(".body").innerHTML = d.html;
    if (d.reasoning && !view.reasoning) {
      const r = el("details", "reasoning");
      r.append(el("summary", "", "reasoning"), el("pre", "", d.reasoning));
      m.insertBefore(r, m.querySelector(".body"));
    }
    if (d.usage) {
      m.append(el("div", "who usage", "tokens in " + (d.usage.input_tokens ?? "?") +
                  " · out " + (d.usage.output_tokens ?? "?")));
    }
    view.text = null; view.reasoning = null;
  } else if (e.type === "tool/call") {
    const t = el("div", "tool");
    t.id = "tool-" + d.call_id;
    t.append(el("span", "name", d.name), el("pre", "args", show(d.arguments)));
    view.log.append(t);
    view.tools[d.call_id] = t;
  } else if (e.type === "tool/approval-requested") {
    const a = el("div", "approval");
    a.id = "approval-" + d.call_id;
    a.append(el("span", "", d.prompt));
    const yes = el("button", "approve", "Approve"), no = el("button", "deny", "Deny");
    yes.onclick = () => answer(d.call_id, true, a);
    no.onclick = () => answer(d.call_id, false, a);
    a.append(yes, no);
    (view.tools[d.call_id] || view.log).append(a);
    view.approvals[d.call_id] = a;
  } else if (e.type === "tool/approval-answered") {
    const a = view.approvals[d.call_id];
    const said = d.approved ? "approved" : "denied: " + (d.reason || "");
    if (a) a.replaceChildren(el("span", "", said));
  } else if (e.type === "tool/result") {
    const t = view.tools[d.call_id] || view.log;
    const p = t.querySelector && t.querySelector(".progress");
    if (p) p.remove();
    const r = el("pre", "result" + (d.is_error ? " error" : ""), show(d.content));
    t.append(r);
    if (d.is_error && t.classList) t.classList.add("error");
  } else if (e.type === "turn/end") {
    view.running = false;
    const line = el("div", "turn end");
    line.append(el("span", "reason " + d.reason, "turn " + d.turn + " " + d.reason));
    if (d.cause) line.append(el("span", "", " (" + d.cause + ")"));
    if (d.error && d.error.message) line.append(el("span", "", ": " + d.error.message));
    if (d.usage) {
      line.append(el("span", "usage", " · tokens in " + (d.usage.input_tokens ?? 0) +
                     " out " + (d.usage.output_tokens ?? 0)));
    }
    view.log.append(line);
    view.text = null; view.reasoning = null;
  }
  $("status").textContent = view.running ? "running" : "idle";
  view.log.scrollTop = view.log.scrollHeight;
}
function progress(p) {
  // A running tool's latest progress, in place under its call; gone once its result is in.
  const t = view.tools[p.call_id];
  if (!t || t.querySelector(".result")) return;
  let box = t.querySelector(".progress");
  if (!box) {
    box = el("div", "progress");
    box.append(el("progress"), el("span", "message"));
    t.append(box);
  }
  const bar = box.querySelector("progress");
  if (p.fraction === null) bar.removeAttribute("value"); else bar.value = p.fraction;
  box.querySelector(".message").textContent = p.message +
    (p.fraction === null ? "" : " (" + Math.round(p.fraction * 100) + "%)");
}
async function answer(callId, approve, box) {
  try {
    await api("POST", "/api/sessions/" + encodeURIComponent(current) + "/approvals/" +
              encodeURIComponent(callId), approve ? {approve: true}
              : {approve: false, reason: "denied in the inspector"});
    box.querySelectorAll("button").forEach((b) => b.disabled = true);
  } catch (err) { box.append(el("span", "error", " " + err.message)); }
}
function open(id) {
  current = id;
  if (source) source.close();
  $("title").textContent = id;
  $("log").replaceChildren();
  view = newView();
  loadSessions();
  source = new EventSource("/api/sessions/" + encodeURIComponent(id) + "/stream");
  source.addEventListener("log", (m) => apply(JSON.parse(m.data)));
  source.addEventListener("progress", (m) => progress(JSON.parse(m.data)));
  source.addEventListener("ready", () => { document.body.dataset.ready = id; loadSessions(); });
  history.replaceState(null, "", location.pathname + "#" + encodeURIComponent(id));
}
$("followup").onsubmit = async (ev) => {
  ev.preventDefault();
  const text = $("followup-text").value.trim();
  if (!current || !text) return;
  try {
    await api("POST", "/api/sessions/" + encodeURIComponent(current) + "/messages",
              {content: text});
    $("followup-text").value = "";
    loadSessions();
  } catch (err) { $("status").textContent = err.message; }
};
// The token lives on in the cookie; keep it out of the address bar and the history.
history.replaceState(null, "", location.pathname + location.hash);
loadSessions().then(() => {
  if (location.hash.length > 1) open(decodeURIComponent(location.hash.slice(1)));
});
setInterval(loadSessions, 5000);
</script></body></html>
"""
