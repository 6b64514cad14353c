"""OpenTelemetry traces and metrics of every turn, model call and tool call.

Load it from the config (``plugins = ["otel"]``, with an optional ``[otel]`` table) or in code
with ``open_runtime(plugins=[agentloop_otel.otel(capture_content=True)])``. It needs the
``otel`` extra (``opentelemetry-api``); spans and metrics go to the global tracer and meter
providers, so whatever SDK and exporter the application configured receives them (without an
SDK the API's no-op providers would drop them, so until a provider is set, checked at load and
at each new session, the plugin does not even read the log).

Spans follow the OpenTelemetry GenAI semantic conventions:

- ``invoke_agent {agent_id}`` per turn (``gen_ai.operation.name = "invoke_agent"``,
  ``gen_ai.agent.id``, ``gen_ai.conversation.id`` = the session id, the turn's summed usage and
  its ``agentloop.turn.reason``); a sub-agent's turn is a child of the ``execute_tool`` span of
  the call that started it (or of its parent's turn);
- ``chat {model}`` per model call (``gen_ai.provider.name``, ``gen_ai.request.model``,
  ``gen_ai.response.finish_reasons``, ``gen_ai.usage.input_tokens`` / ``output_tokens``); a call
  that failed and was retried ends with an error status, and the retry is a span of its own;
- ``execute_tool {tool}`` per tool call (``gen_ai.tool.name``, ``gen_ai.tool.call.id``), with
  ``agentloop.approval.requested`` / ``agentloop.approval.answered`` span events for calls
  parked for approval.

Errors (a failed turn, call or tool) set the span status and ``error.type``. A turn links to
the span context a claimed message carries in its ``source`` (``traceparent``, see
:func:`traced_source`), which is how a message routed to another runtime joins its sender's
trace; a turn that resumes a suspended one (approvals answered, or a resumed session) links to
that turn's span and to the ``traceparent`` its messages stored in the log.

Metrics: ``gen_ai.client.token.usage`` (histogram of tokens per call, by ``gen_ai.token.type``)
and ``gen_ai.client.operation.duration`` (seconds per model call).

Prompt and completion content (``gen_ai.input.messages``, ``gen_ai.output.messages``, tool
arguments and results) is recorded only with ``capture_content = true``. Nothing the plugin
records comes from provider configuration, so API keys and headers never reach a span.

``[otel]`` settings::

    [otel]
    capture_content = false
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, Final

import attrs
import trio
from opentelemetry import metrics, trace
from opentelemetry.context import Context as OtelContext
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import agentloop
from agentloop import Context, Plugin, SessionEvent
from agentloop.events import SessionCreated, SessionDisposed, SessionEventAppended

__all__ = ["OtelConfig", "install", "plugin", "otel", "traced_source", "Tracing"]

_SCOPE: Final = "agentloop"
_ENDED_CALLS: Final = 64
_PROPAGATOR: Final = TraceContextTextMapPropagator()
# The bucket boundaries the GenAI conventions advise for these two histograms.
_TOKEN_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216,
    67108864,
)
_DURATION_BUCKETS: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)


@attrs.frozen(slots=True, kw_only=True)
class OtelConfig:
    """The ``[otel]`` table.

    Attributes:
        capture_content: record prompts, completions, tool arguments and results on spans
            (off by default: they may hold personal data).
    """

    capture_content: bool = False


def traced_source(source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``source`` (a message's JSON source) with the current span context as ``traceparent``.

    Send it with the message (``ctx.sessions.send(sid, text, source=traced_source())``): the
    source is stored in the log with the message, so the turn that claims it links to the
    sender's span in whichever runtime drives the session, now or after a restart.
    """
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    out = dict(source or {})
    out.update(carrier)
    return out


def _link_of(source: object) -> SpanContext | None:
    if isinstance(source, Mapping) and isinstance(source.get("sender"), Mapping):
        # Routed between runtimes, the sender's source is kept under "sender".
        source = source["sender"]
    if not isinstance(source, Mapping) or not isinstance(source.get("traceparent"), str):
        return None
    carrier = {"traceparent": source["traceparent"]}
    if isinstance(source.get("tracestate"), str):
        carrier["tracestate"] = source["tracestate"]
    context = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return context if context.is_valid else None


def _json(value: object) -> str:
    return json.dumps(agentloop.thaw(value), ensure_ascii=False, default=str)


def _error_type(error: object, fallback: str) -> str:
    if isinstance(error, Mapping):
        for key in ("code", "status", "type"):
            value = error.get(key)
            if value is not None and value != "":
                return str(value)
    return fallback


def _error_message(error: object) -> str | None:
    if isinstance(error, Mapping) and isinstance(error.get("message"), str):
        return str(error["message"])
    return None


@attrs.define(slots=True, eq=False)
class _Chat:
    span: Span
    started: float
    attributes: dict[str, Any]


@attrs.define(slots=True, eq=False)
class _Session:
    """What is open in one session: its turn, its model call, its tool calls."""

    parent_id: str | None = None
    parent_call_id: str | None = None
    resumed: bool = False
    turn: Span | None = None
    turn_context: OtelContext | None = None
    chat: _Chat | None = None
    tools: dict[str, Span] = attrs.field(factory=dict)
    # Span contexts of the calls a suspended turn left parked, for the turn that answers them.
    parked: dict[str, SpanContext] = attrs.field(factory=dict)
    suspended: SpanContext | None = None
    # The latest ended calls' span contexts: a background job started by a call opens its
    # turn after the call returned, and still belongs under it.
    ended: dict[str, SpanContext] = attrs.field(factory=dict)
    turns: int = 0


class Tracing:
    """Folds the durable log of every session into spans and metrics, as it is appended.

    It runs as a plain ``session/event`` handler, at the moment of each append: one dictionary
    lookup per event, and nothing else for the streamed chunks (the only events of high rate),
    so the step's hot path stays cheap with no exporter configured.
    """

    def __init__(
        self,
        ctx: Context,
        config: OtelConfig,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self._ctx = ctx
        self._capture = config.capture_content
        self._tracer = trace.get_tracer(
            _SCOPE, agentloop.__version__, tracer_provider=tracer_provider
        )
        meter = metrics.get_meter(_SCOPE, agentloop.__version__, meter_provider=meter_provider)
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Number of input and output tokens used",
            explicit_bucket_boundaries_advisory=list(_TOKEN_BUCKETS),
        )
        self._duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s",
            description="GenAI operation duration",
            explicit_bucket_boundaries_advisory=list(_DURATION_BUCKETS),
        )
        self._sessions: dict[str, _Session] = {}
        self._dispatch = {
            "turn/start": self._turn_start,
            "user/message": self._claimed,
            "steering/message": self._claimed,
            "request/header": self._request,
            "assistant/message": self._reply,
            "tool/call": self._tool_call,
            "tool/approval-requested": self._approval_requested,
            "tool/approval-answered": self._approval_answered,
            "tool/result": self._tool_result,
            "turn/end": self._turn_end,
        }

    # --- the handlers the bus calls ------------------------------------------------------------

    def on_session(self, event: SessionCreated) -> None:
        state = self._state(event.session_id)
        parent = event.meta.get("parent_session_id")
        call = event.meta.get("parent_call_id")
        state.parent_id = parent if isinstance(parent, str) else None
        state.parent_call_id = call if isinstance(call, str) else None
        state.resumed = event.resumed

    def on_disposed(self, event: SessionDisposed) -> None:
        state = self._sessions.get(event.session_id)
        if state is None:
            return
        self._close_turn(state, "disposed")
        if state.suspended is None and not state.parked:
            del self._sessions[event.session_id]
        # else kept: a resume in this process links its first turn to the suspended one.

    def on_event(self, appended: SessionEventAppended) -> None:
        event = appended.event
        handle = self._dispatch.get(event.type)
        if handle is not None:
            handle(appended.session_id, event)

    def close(self) -> None:
        """End whatever is still open (the plugin is unloading)."""
        for state in self._sessions.values():
            self._close_turn(state, "unloaded")
        self._sessions.clear()

    # --- turns ---------------------------------------------------------------------------------

    def _state(self, session_id: str) -> _Session:
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _Session()
        return state

    def _parent_context(self, state: _Session) -> OtelContext | None:
        if state.parent_id is None:
            return None
        parent = self._sessions.get(state.parent_id)
        if parent is None:
            return None
        if state.parent_call_id is not None:
            tool = parent.tools.get(state.parent_call_id)
            if tool is not None:
                return trace.set_span_in_context(tool)
            ended = parent.ended.get(state.parent_call_id)
            if ended is not None and state.turns == 0:
                return trace.set_span_in_context(NonRecordingSpan(ended))
        return parent.turn_context

    def _turn_start(self, session_id: str, event: SessionEvent) -> None:
        state = self._state(session_id)
        if state.turn is not None:  # a turn/start without its turn/end: never leak the span
            self._close_turn(state, "unknown")
        links: list[Link] = []
        if state.suspended is not None:
            links.append(Link(state.suspended, {"agentloop.link": "resumes"}))
            state.suspended = None
        elif state.resumed:
            links.extend(self._stored_links(session_id))
        state.resumed = False
        span = self._tracer.start_span(
            f"invoke_agent {session_id}",
            context=self._parent_context(state),
            kind=SpanKind.INTERNAL,
            links=links,
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.id": session_id,
                "gen_ai.conversation.id": session_id,
                "agentloop.turn": event.turn or 0,
            },
        )
        state.turn = span
        state.turn_context = trace.set_span_in_context(span)
        state.turns += 1

    def _stored_links(self, session_id: str) -> list[Link]:
        """Links to what the log of a resumed session stored: the ``traceparent`` of the
        messages its last turn claimed, if that turn was suspended or cut by a crash."""
        session = self._ctx.sessions.get(session_id)
        if session is None:
            return []
        links: list[Link] = []
        events = session.events
        # The appended turn/start is last; walk back over the previous turn only.
        for index in range(len(events) - 2, -1, -1):
            previous = events[index]
            if previous.type == "turn/start":
                break
            if previous.type in ("user/message", "steering/message"):
                context = _link_of(previous.data.get("source"))
                if context is not None:
                    links.append(Link(context, {"agentloop.link": "resumes"}))
        return links

    def _claimed(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None or state.turn is None:
            return
        context = _link_of(event.data.get("source"))
        if context is not None:
            state.turn.add_link(context, {"agentloop.link": "message"})

    def _turn_end(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None or state.turn is None:
            return
        data = event.data
        reason = str(data.get("reason", "unknown"))
        turn = state.turn
        usage = data.get("usage")
        if isinstance(usage, Mapping):
            for key, name in (("input_tokens", "gen_ai.usage.input_tokens"),
                              ("output_tokens", "gen_ai.usage.output_tokens")):
                if isinstance(usage.get(key), int):
                    turn.set_attribute(name, usage[key])
        if isinstance(data.get("cause"), str):
            turn.set_attribute("agentloop.turn.cause", data["cause"])
        if reason == "error":
            error = data.get("error")
            turn.set_attribute("error.type", _error_type(error, "error"))
            turn.set_status(Status(StatusCode.ERROR, _error_message(error)))
            if state.chat is not None:
                self._end_chat(state, error=error)
        if reason == "suspended":
            state.suspended = turn.get_span_context()
        self._close_turn(state, reason)

    def _close_turn(self, state: _Session, reason: str) -> None:
        if state.chat is not None:
            self._end_chat(state, error={"code": reason})
        for call_id, span in state.tools.items():
            if reason == "suspended":
                state.parked[call_id] = span.get_span_context()
                span.set_attribute("agentloop.tool.suspended", True)
            span.end()
        state.tools.clear()
        if state.turn is not None:
            state.turn.set_attribute("agentloop.turn.reason", reason)
            state.turn.end()
        state.turn = None
        state.turn_context = None

    # --- model calls ---------------------------------------------------------------------------

    def _request(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None or state.turn is None:
            return
        data = event.data
        after = data.get("after_error")
        if state.chat is not None:
            # The call this header retries failed: its span ends with that error.
            failed = after.get("error") if isinstance(after, Mapping) else None
            self._end_chat(state, error=failed or {"code": "failed"})
        provider = data.get("provider")
        model = data.get("model")
        # Also the metrics' attributes: only low-cardinality ones (no session id).
        attributes: dict[str, Any] = {"gen_ai.operation.name": "chat"}
        if isinstance(provider, str):
            attributes["gen_ai.provider.name"] = provider
        if isinstance(model, str):
            attributes["gen_ai.request.model"] = model
        config = data.get("config")
        if isinstance(config, Mapping) and isinstance(config.get("max_tokens"), int):
            attributes["gen_ai.request.max_tokens"] = config["max_tokens"]
        span_attributes = {**attributes, "gen_ai.conversation.id": session_id}
        if isinstance(after, Mapping) and isinstance(after.get("attempt"), int):
            span_attributes["agentloop.retry.attempt"] = after["attempt"] + 1
        if isinstance(data.get("step"), int):
            span_attributes["agentloop.step"] = data["step"]
        if self._capture:
            span_attributes.update(self._input_messages(session_id))
        span = self._tracer.start_span(
            f"chat {model}" if model else "chat",
            context=state.turn_context,
            kind=SpanKind.CLIENT,
            attributes=span_attributes,
        )
        state.chat = _Chat(span, time.perf_counter(), attributes)

    def _input_messages(self, session_id: str) -> dict[str, str]:
        session = self._ctx.sessions.get(session_id)
        if session is None:
            return {}
        messages = [
            {
                "role": m.role,
                "parts": [{"type": "text", "content": m.text}]
                + [{"type": "tool_call", "id": c.id, "name": c.name,
                    "arguments": agentloop.thaw(c.arguments)} for c in m.tool_calls],
                **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
            }
            for m in session.messages()
        ]
        return {"gen_ai.input.messages": _json(messages)}

    def _reply(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None or state.chat is None:
            return
        data = event.data
        chat = state.chat
        span = chat.span
        finish = data.get("finish_reason")
        if isinstance(finish, str):
            span.set_attribute("gen_ai.response.finish_reasons", (finish,))
        if data.get("interrupted"):
            span.set_attribute("agentloop.interrupted", True)
        usage = data.get("usage")
        if isinstance(usage, Mapping):
            for key, kind in (("input_tokens", "input"), ("output_tokens", "output")):
                count = usage.get(key)
                if isinstance(count, int):
                    span.set_attribute(f"gen_ai.usage.{key}", count)
                    self._tokens.record(count, {**chat.attributes, "gen_ai.token.type": kind})
        if self._capture:
            parts: list[dict[str, Any]] = []
            if data.get("reasoning"):
                parts.append({"type": "reasoning", "content": data["reasoning"]})
            if data.get("content"):
                parts.append({"type": "text", "content": data["content"]})
            parts.extend(
                {"type": "tool_call", "id": call.get("id"), "name": call.get("name"),
                 "arguments": call.get("arguments")}
                for call in data.get("tool_calls") or () if isinstance(call, Mapping)
            )
            span.set_attribute("gen_ai.output.messages", _json(
                [{"role": "assistant", "parts": parts, "finish_reason": finish}]
            ))
        self._end_chat(state, error=None)

    def _end_chat(self, state: _Session, *, error: object) -> None:
        chat = state.chat
        if chat is None:
            return
        state.chat = None
        attributes = chat.attributes
        if error is not None:
            kind = _error_type(error, "error")
            chat.span.set_attribute("error.type", kind)
            chat.span.set_status(Status(StatusCode.ERROR, _error_message(error)))
            attributes = {**attributes, "error.type": kind}
        self._duration.record(time.perf_counter() - chat.started, attributes)
        chat.span.end()

    # --- tool calls ----------------------------------------------------------------------------

    def _start_tool(self, state: _Session, call_id: str, name: str,
                    arguments: object) -> Span:
        links = []
        parked = state.parked.pop(call_id, None)
        if parked is not None:
            links.append(Link(parked, {"agentloop.link": "parked"}))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.type": "function",
        }
        if self._capture and arguments is not None:
            attributes["gen_ai.tool.call.arguments"] = _json(arguments)
        span = self._tracer.start_span(
            f"execute_tool {name}", context=state.turn_context, kind=SpanKind.INTERNAL,
            links=links, attributes=attributes,
        )
        state.tools[call_id] = span
        return span

    def _tool_call(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None or state.turn is None:
            return
        data = event.data
        self._start_tool(state, str(data["call_id"]), str(data["name"]), data.get("arguments"))

    def _approval_requested(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None:
            return
        span = state.tools.get(str(event.data["call_id"]))
        if span is not None:
            span.add_event("agentloop.approval.requested")

    def _approval_answered(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None or state.turn is None:
            return
        data = event.data
        call_id = str(data["call_id"])
        span = state.tools.get(call_id)
        if span is None:
            # Answered in a later turn (or process) than the one that parked it.
            span = self._start_tool(state, call_id, self._tool_name(session_id, call_id), None)
        span.add_event("agentloop.approval.answered", {"approved": bool(data.get("approved"))})

    def _tool_name(self, session_id: str, call_id: str) -> str:
        session = self._ctx.sessions.get(session_id)
        if session is not None:
            for pending in reversed(session.events):
                if pending.type == "tool/call" and pending.data.get("call_id") == call_id:
                    return str(pending.data["name"])
        return "unknown"

    def _tool_result(self, session_id: str, event: SessionEvent) -> None:
        state = self._sessions.get(session_id)
        if state is None or state.turn is None:
            return
        data = event.data
        call_id = str(data["call_id"])
        span = state.tools.pop(call_id, None)
        if span is None:
            span = self._start_tool(state, call_id, str(data["name"]), None)
            state.tools.pop(call_id, None)
        if data.get("is_error"):
            code = data.get("error_code")
            span.set_attribute("error.type", str(code) if code else "tool_error")
            span.set_status(Status(StatusCode.ERROR, str(code) if code else None))
        if self._capture:
            span.set_attribute("gen_ai.tool.call.result", _json(data.get("content")))
        span.end()
        state.ended[call_id] = span.get_span_context()
        if len(state.ended) > _ENDED_CALLS:
            del state.ended[next(iter(state.ended))]


def install(
    ctx: Context,
    config: OtelConfig,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> Tracing:
    """Register the handlers on ``ctx`` (undone with its scope); returns the fold."""
    tracing = Tracing(
        ctx, config, tracer_provider=tracer_provider, meter_provider=meter_provider
    )
    explicit = tracer_provider is not None or meter_provider is not None
    folding = False

    def fold_if_configured() -> None:
        # Until an SDK provider is set, every span and measurement would be dropped: the log
        # is not even looked at, so loading the plugin before configuring costs nothing per
        # step. Checked at load and at each new session (rare), not per event.
        nonlocal folding
        if not folding and (explicit or _configured()):
            folding = True
            # A plain function: it runs at the moment of each append (exact span times) and
            # costs a lookup per event; a subscription would add a channel hop per chunk.
            ctx.events.on(SessionEventAppended, tracing.on_event)

    def on_session(event: SessionCreated) -> None:
        fold_if_configured()
        tracing.on_session(event)

    ctx.events.on(SessionCreated, on_session)
    ctx.events.on(SessionDisposed, tracing.on_disposed)
    fold_if_configured()
    return tracing


def _configured() -> bool:
    """Whether the application set a global tracer or meter provider (an SDK's): the API's
    own defaults (proxies and no-ops) live in its ``opentelemetry.trace`` / ``.metrics``
    modules."""
    return any(
        not type(provider).__module__.startswith(("opentelemetry.trace", "opentelemetry.metrics"))
        for provider in (trace.get_tracer_provider(), metrics.get_meter_provider())
    )


def otel(
    *,
    capture_content: bool = False,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> Plugin:
    """The plugin, with explicit providers if given (the global ones otherwise)."""
    config = OtelConfig(capture_content=capture_content)

    async def otel(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await _run(ctx, config, task_status, tracer_provider, meter_provider)

    return otel


async def _run(
    ctx: Context,
    config: OtelConfig,
    task_status: trio.TaskStatus[None],
    tracer_provider: trace.TracerProvider | None,
    meter_provider: metrics.MeterProvider | None,
) -> None:
    tracing = install(ctx, config, tracer_provider=tracer_provider, meter_provider=meter_provider)
    task_status.started()
    try:
        await trio.sleep_forever()
    finally:
        tracing.close()


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["otel"]``): reads the ``[otel]`` table.

    Raises:
        ConfigError: an unknown key or an invalid value (named ``otel.<key>``).
    """
    await _run(ctx, ctx.config.section("otel", OtelConfig), task_status, None, None)

