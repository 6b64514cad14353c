"""The event catalog: every event class, its seed name and its dispatch mode.

Three kinds of events travel on the bus:

- **durable** events mirror the session log (``session/event``); its flush barrier
  (``session/flush``) is an awaited hook that persistence answers;
- **control** events report what happened (``agent/status``, ``agent/created``, inbox splices,
  ``llm/retry``, ...). They are dispatched synchronously, at the moment they happen, to plain
  handlers; an async handler given to ``ctx.events.on`` runs as an ordered observer task, and
  ``ctx.events.subscribe`` gives any task a typed memory channel of them;
- **hooks** are awaited at the loop's checkpoints. Their mode says what a handler's return
  value means: ``notify`` (ignored), ``waterfall`` (a replacement for one field, passed on to
  the next handler) or ``decision`` (the first non-``None`` value wins and ends dispatch).

``docs/events.md`` is generated from this module (``python -m agentloop._catalog``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs

from ._errors import ProviderError
from ._json import FrozenDict
from ._model import (
    CallConfig,
    InboxMessage,
    LLMRequest,
    Message,
    SessionEvent,
    ToolCall,
    ToolResult,
    ToolSpec,
)
from ._util import quick_init
from .llm._retry import RetryPolicy

__all__ = [
    "Event",
    "Kind",
    "Mode",
    # decisions
    "Reject",
    "Replace",
    "Stop",
    "Retry",
    "Deny",
    "Ask",
    "Allow",
    # durable
    "SessionEventAppended",
    "SessionFlush",
    # control
    "SessionCreated",
    "SessionDisposed",
    "AgentCreated",
    "AgentSessionStart",
    "AgentDisposed",
    "AgentStatus",
    "AgentHibernated",
    "AgentWoken",
    "InboxSpliced",
    "InboxInserted",
    "InboxDiscarded",
    "InboxClaimed",
    "LlmRetry",
    "PluginFailed",
    "SettingChanged",
    "InvariantViolated",
    "McpServerFailed",
    # hooks
    "AgentPreStep",
    "AgentRequest",
    "AgentRequestError",
    "AgentStepResult",
    "AgentTurnContinuation",
    "AgentTurnStopping",
    "AgentTurnEnd",
    "LlmStream",
    "ToolPreExecute",
    "ToolApproval",
    "ToolExecute",
    "ToolPostExecute",
    "ToolResultEvent",
    "HistoryCompacting",
    "HistoryCompacted",
    "ToolProgress",
    "ALL_EVENTS",
]

Kind = Literal["durable", "control", "hook"]
Mode = Literal["notify", "waterfall", "decision"]


class Event:
    """Base of every event class. Subclasses are frozen attrs classes."""

    name: ClassVar[str]
    kind: ClassVar[Kind]
    mode: ClassVar[Mode] = "notify"
    waterfall_field: ClassVar[str | None] = None
    """For waterfall hooks: the field a handler's return value replaces."""
    __slots__ = ()


# --- decisions ------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Reject:
    """``agent/pre-step`` decision: end the turn with reason ``rejected`` and make no call."""

    reason: str = ""


@attrs.frozen(slots=True)
class Replace:
    """``agent/pre-step`` decision: ``messages`` are the complete history entering the step;
    ``history/compacting`` decision: ``messages`` replace the range being compacted.

    The replacement is durable: it is logged as ``history/replaced`` over everything the
    history held, so the step sends exactly ``messages``, later steps build on them and a
    resumed session sees the same. A replacement that leaves a tool call unanswered (or a
    result without its call) is refused and the turn ends ``error``.
    """

    messages: tuple[Message, ...] = attrs.field(converter=tuple)


@attrs.frozen(slots=True)
class Stop:
    """``agent/turn-stopping`` decision: end the turn ``aborted`` with ``cause``.

    ``reason`` says which limit was reached; it is recorded in ``turn/end`` as ``detail``.
    """

    cause: str
    reason: str = ""


@attrs.frozen(slots=True)
class Retry:
    """``agent/request-error`` decision: make the failed model call again.

    With ``config`` the call is made with that config instead (another route: the fallback
    plugin's answer); the step after it goes back to the config the step proposed.
    """

    config: CallConfig | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(CallConfig))
    )


@attrs.frozen(slots=True)
class Deny:
    """``tools/pre-execute`` / ``tools/approval`` decision: do not run the call."""

    reason: str = "denied"


@attrs.frozen(slots=True)
class Ask:
    """``tools/pre-execute`` decision: ask ``tools/approval`` handlers before running."""

    prompt: str


@attrs.frozen(slots=True)
class Allow:
    """``tools/approval`` decision: run the call."""


# --- durable, and the flush barrier ---------------------------------------------------------


@quick_init
@attrs.frozen(slots=True, weakref_slot=False)
class SessionEventAppended(Event):
    """An event was appended to a session's durable log (delivered in seq order)."""

    name: ClassVar[str] = "session/event"
    kind: ClassVar[Kind] = "durable"
    session_id: str
    event: SessionEvent


@attrs.frozen(slots=True)
class SessionFlush(Event):
    """Durability barrier: handlers return once every event up to ``seq`` is stored.

    Awaited at every ``turn/end`` and at disposal, before the session is detached.
    """

    name: ClassVar[str] = "session/flush"
    kind: ClassVar[Kind] = "hook"
    session_id: str
    seq: int


# --- control --------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class SessionCreated(Event):
    """A session entered the registry."""

    name: ClassVar[str] = "session/created"
    kind: ClassVar[Kind] = "control"
    session_id: str
    meta: FrozenDict
    resumed: bool = False


@attrs.frozen(slots=True)
class SessionDisposed(Event):
    """A session left the registry (after its closing events were flushed)."""

    name: ClassVar[str] = "session/disposed"
    kind: ClassVar[Kind] = "control"
    session_id: str


@attrs.frozen(slots=True)
class SessionPersistenceFailed(Event):
    """A flush of the session's log failed: events up to that point may not be stored yet
    (the store is unreachable, or refused them). ``message`` is the store's error, naming
    the session; the driver keeps running."""

    name: ClassVar[str] = "session/persistence-failed"
    kind: ClassVar[Kind] = "control"
    session_id: str
    seq: int
    message: str


@attrs.frozen(slots=True)
class AgentCreated(Event):
    """An agent was published. Always paired with exactly one later ``agent/disposed``."""

    name: ClassVar[str] = "agent/created"
    kind: ClassVar[Kind] = "control"
    agent_id: str


@attrs.frozen(slots=True)
class AgentSessionStart(Event):
    """A published agent is about to start driving its session."""

    name: ClassVar[str] = "agent/session-start"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    resumed: bool = False


@attrs.frozen(slots=True)
class AgentDisposed(Event):
    """An agent reached quiescence and left the registry."""

    name: ClassVar[str] = "agent/disposed"
    kind: ClassVar[Kind] = "control"
    agent_id: str


@attrs.frozen(slots=True)
class AgentStatus(Event):
    """The agent's status changed (``idle``, ``running``, ``hibernated``, ``disposed``)."""

    name: ClassVar[str] = "agent/status"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    status: str
    previous: str


@attrs.frozen(slots=True)
class AgentHibernated(Event):
    """An idle agent of a persisted session released its actor task, channels and in-memory
    log (``agent-loop.hibernate_after_seconds``); its handle stays valid and any input wakes
    it. ``last_seq`` is the last event stored before the log was released."""

    name: ClassVar[str] = "agent/hibernated"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    last_seq: int


@attrs.frozen(slots=True)
class AgentWoken(Event):
    """A hibernated agent was reloaded from the store (its session's ``last_seq`` events) and
    its actor started again; ``cause`` says what woke it (``send``, ``approval``,
    ``session``, ``cancel``, ``wake``)."""

    name: ClassVar[str] = "agent/woken"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    last_seq: int
    cause: str


@attrs.frozen(slots=True)
class InboxSpliced(Event):
    """One inbox mutation, published before the live projection changes.

    Replaying every splice of a list onto an empty list reproduces that list at every point.
    ``outcome`` is ``"canceled"`` for removals, ``None`` for inserts, edits and claims.
    """

    name: ClassVar[str] = "agent/inbox/spliced"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    list: Literal["next-turn", "next-step"]
    index: int
    delete_count: int
    inserted: tuple[InboxMessage, ...]
    outcome: str | None = None


@attrs.frozen(slots=True)
class InboxInserted(Event):
    """A message was accepted into an inbox list."""

    name: ClassVar[str] = "agent/inbox/inserted"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    list: Literal["next-turn", "next-step"]
    message: InboxMessage


@attrs.frozen(slots=True)
class InboxDiscarded(Event):
    """A pending message was removed without being delivered (``remove``, ``cancel``)."""

    name: ClassVar[str] = "agent/inbox/discarded"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    list: Literal["next-turn", "next-step"]
    message: InboxMessage
    outcome: str = "canceled"


@attrs.frozen(slots=True)
class InboxClaimed(Event):
    """A pending message was claimed by the driver for ``turn``."""

    name: ClassVar[str] = "agent/inbox/claimed"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    message: InboxMessage
    turn: int


@attrs.frozen(slots=True)
class LlmRetry(Event):
    """A failed model call will be retried after ``delay`` seconds.

    ``route`` is the ``"provider:model"`` the call moves to (the fallback plugin's), ``None``
    when it is made again on the same route.
    """

    name: ClassVar[str] = "llm/retry"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    attempt: int
    delay: float
    error: ProviderError = attrs.field(eq=False)
    route: str | None = None


@attrs.frozen(slots=True)
class PluginFailed(Event):
    """A plugin raised; it was unloaded and the runtime kept running."""

    name: ClassVar[str] = "plugin/failed"
    kind: ClassVar[Kind] = "control"
    plugin: str
    error: BaseException = attrs.field(eq=False)


@attrs.frozen(slots=True)
class SettingChanged(Event):
    """A setting was written."""

    name: ClassVar[str] = "settings/changed"
    kind: ClassVar[Kind] = "control"
    key: str
    value: Any


@attrs.frozen(slots=True)
class InvariantViolated(Event):
    """The invariants companion rebuilt a request from the log and it differs from the
    request the loop sent; ``diff`` says how. Also logged as an error."""

    name: ClassVar[str] = "invariant/violated"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    seq: int
    """The seq of the ``request/header`` of the request."""
    diff: str


@attrs.frozen(slots=True)
class McpServerFailed(Event):
    """An MCP server of the ``mcp`` plugin failed to start, to list its tools, or stopped.

    ``message`` is one line naming the server and the cause (never a header value);
    ``restarting`` is True when the plugin will try again (a restart of a stdio server, a
    reconnection to an HTTP one), False when it gave up and the server's tools are gone.
    """

    name: ClassVar[str] = "mcp/server-failed"
    kind: ClassVar[Kind] = "control"
    server: str
    message: str
    restarting: bool
    error: BaseException = attrs.field(eq=False)


# --- hooks ----------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class AgentPreStep(Event):
    """Before a step: ``messages`` are the claimed messages entering it.

    Return :class:`Reject` to end the turn with reason ``rejected`` and no model call, or
    :class:`Replace` to replace the whole history the step sends (durably).
    """

    name: ClassVar[str] = "agent/pre-step"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "decision"
    agent_id: str
    turn: int
    step: int
    messages: tuple[InboxMessage, ...]


@attrs.define(slots=True, eq=False)
class _Outcome:
    """Where the final request of an ``agent/request`` waterfall is left for its emitter."""

    event: AgentRequest | None = None


@attrs.frozen(slots=True)
class AgentRequest(Event):
    """Before a model call: ``request`` is the whole proposal (``system``, ``tools``,
    ``messages``, ``config``).

    Return a new ``config`` (``attrs.evolve(event.config, ...)``), a new request
    (``attrs.evolve(event.request, messages=...)``), or ``None``. What the last handler leaves
    is what is sent and what ``request/header`` describes; messages replaced here are for this
    call only (the history is unchanged) and the header marks them ``rewritten``.
    """

    name: ClassVar[str] = "agent/request"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "waterfall"
    waterfall_field: ClassVar[str | None] = "config"
    agent_id: str
    turn: int
    step: int
    config: CallConfig
    system: str
    tools: tuple[ToolSpec, ...]
    messages: Sequence[Message]
    _outcome: _Outcome | None = attrs.field(
        default=None, eq=False, repr=False, alias="outcome", metadata={"internal": True}
    )

    def __attrs_post_init__(self) -> None:
        value: object = self.config
        if isinstance(value, LLMRequest):
            # A handler returned a whole request: the waterfall carries its parts on.
            object.__setattr__(self, "config", value.config)
            object.__setattr__(self, "system", value.system)
            object.__setattr__(self, "tools", tuple(value.tools))
            object.__setattr__(self, "messages", value.messages)
        elif not isinstance(value, CallConfig):
            raise TypeError(
                f"an agent/request handler returned {value!r}, not a CallConfig or an LLMRequest"
            )
        if self._outcome is not None:
            self._outcome.event = self

    @property
    def request(self) -> LLMRequest:
        """The proposal as one value; return ``attrs.evolve(event.request, ...)`` to replace it."""
        return LLMRequest(
            system=self.system, messages=self.messages, tools=self.tools, config=self.config,
            session_id=self.agent_id, turn=self.turn, step=self.step,
        )


@attrs.frozen(slots=True)
class AgentRequestError(Event):
    """A model call failed. Return :class:`Retry` to make it again; otherwise the turn ends.

    ``config`` is the config the call was made with (before the adapter's defaults) and
    ``error`` the failure: every adapter failure arrives as a :class:`ProviderError`.
    ``attempt`` numbers the calls on this route (``config``'s provider and model) from 1; a
    :class:`Retry` that moves the call to another route counts from 1 there. ``routes`` lists
    the routes (``"provider:model"``) the call has been made on, in order, this one last, so
    a fallback can try each route once. ``retry_policy`` is the retry policy captured by the
    registration that served the call (:class:`agentloop.llm.RetryPolicy`), ``None`` when
    the route had no registration or it carries none.
    """

    name: ClassVar[str] = "agent/request-error"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "decision"
    agent_id: str
    turn: int
    step: int
    attempt: int
    config: CallConfig
    error: ProviderError = attrs.field(eq=False)
    retry_policy: RetryPolicy | None = attrs.field(default=None, eq=False)
    routes: tuple[str, ...] = ()


@attrs.frozen(slots=True)
class AgentStepResult(Event):
    """A model call finished (its anchor is in the log); tools have not run yet."""

    name: ClassVar[str] = "agent/step-result"
    kind: ClassVar[Kind] = "hook"
    agent_id: str
    turn: int
    step: int
    finish_reason: str
    text: str
    tool_calls: tuple[ToolCall, ...]


@attrs.frozen(slots=True)
class AgentTurnContinuation(Event):
    """After a step: whether the turn goes on. Return a bool to override the proposal."""

    name: ClassVar[str] = "agent/turn-continuation"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "waterfall"
    waterfall_field: ClassVar[str | None] = "proceed"
    agent_id: str
    turn: int
    step: int
    proceed: bool


@attrs.frozen(slots=True)
class AgentTurnStopping(Event):
    """Where a policy may end the turn: before each step and after a step's tools.

    ``point`` is ``"pre-step"`` or ``"post-tools"``; ``steps`` counts the model calls the turn
    made so far, ``tool_calls`` its tool calls, ``usage`` sums their token counts and
    ``elapsed`` is the seconds since the turn opened (trio's clock). Return :class:`Stop` to
    end the turn ``aborted`` with its ``cause``; ``None`` lets it go on.
    """

    name: ClassVar[str] = "agent/turn-stopping"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "decision"
    agent_id: str
    turn: int
    step: int
    point: Literal["pre-step", "post-tools"]
    steps: int
    tool_calls: int
    usage: FrozenDict
    elapsed: float


@attrs.frozen(slots=True)
class AgentTurnEnd(Event):
    """A turn closed (``turn/end`` is in the log and flushed)."""

    name: ClassVar[str] = "agent/turn-end"
    kind: ClassVar[Kind] = "hook"
    agent_id: str
    turn: int
    reason: str


@attrs.frozen(slots=True)
class LlmStream(Event):
    """Before dispatch: a handler may serve the call itself by returning a stream of parts.

    Useful for caching and tests; it also serves routes that have no registered adapter.
    """

    name: ClassVar[str] = "llm/stream"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "decision"
    agent_id: str
    request: LLMRequest
    has_adapter: bool


@attrs.frozen(slots=True)
class ToolPreExecute(Event):
    """Before a call runs: return :class:`Deny`, :class:`Ask` or ``None``."""

    name: ClassVar[str] = "tools/pre-execute"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "decision"
    agent_id: str
    call: ToolCall
    tool: ToolSpec


@attrs.frozen(slots=True)
class ToolApproval(Event):
    """A pre-execute handler asked: return :class:`Allow` or :class:`Deny`."""

    name: ClassVar[str] = "tools/approval"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "decision"
    agent_id: str
    call: ToolCall
    prompt: str


@attrs.frozen(slots=True)
class ToolExecute(Event):
    """Dispatch: a handler may run the call itself (a sandbox, a cache) by returning a result."""

    name: ClassVar[str] = "tools/execute"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "decision"
    agent_id: str
    call: ToolCall
    arguments: FrozenDict


@attrs.frozen(slots=True)
class ToolPostExecute(Event):
    """After a call: return a replacement :class:`ToolResult` or ``None``."""

    name: ClassVar[str] = "tools/post-execute"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "waterfall"
    waterfall_field: ClassVar[str | None] = "result"
    agent_id: str
    call: ToolCall
    result: ToolResult


@attrs.frozen(slots=True)
class ToolResultEvent(Event):
    """A call's final result (after finalization), in the model's order."""

    name: ClassVar[str] = "tools/result"
    kind: ClassVar[Kind] = "hook"
    agent_id: str
    call: ToolCall
    result: ToolResult


@attrs.frozen(slots=True)
class HistoryCompacting(Event):
    """Before a compaction replaces what seqs ``first_seq`` to ``last_seq`` produced
    (``messages``, about ``tokens_before`` tokens of request in all).

    A waterfall over ``decision``: return :class:`Reject` to veto this compaction, or
    :class:`Replace` to supply the replacement messages yourself (no summary call is made);
    ``None`` keeps the decision the handlers before left. Each handler sees that decision in
    ``event.decision``, so a later one may overrule it; what the last leaves is done. The
    replacement must keep every tool call paired with its result, or it is refused (logged,
    history untouched).
    """

    name: ClassVar[str] = "history/compacting"
    kind: ClassVar[Kind] = "hook"
    mode: ClassVar[Mode] = "waterfall"
    waterfall_field: ClassVar[str | None] = "decision"
    agent_id: str
    first_seq: int
    last_seq: int
    messages: tuple[Message, ...]
    tokens_before: int
    decision: Reject | Replace | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        if self.decision is not None and not isinstance(self.decision, (Reject, Replace)):
            raise TypeError(
                f"a history/compacting handler returned {self.decision!r}, not a Reject, a "
                f"Replace or None"
            )


@attrs.frozen(slots=True)
class HistoryCompacted(Event):
    """A compaction replaced what seqs ``first_seq`` to ``last_seq`` produced with
    ``summary`` (the replacement's text; the ``history/replaced`` event in the log holds its
    messages). ``tokens_before`` and ``tokens_after`` estimate the next request's size."""

    name: ClassVar[str] = "history/compacted"
    kind: ClassVar[Kind] = "hook"
    agent_id: str
    first_seq: int
    last_seq: int
    summary: str
    tokens_before: int
    tokens_after: int


@attrs.frozen(slots=True)
class ToolProgress(Event):
    """A running tool reported progress (``agentloop.report_progress``): ``message``, and
    ``fraction`` done (0 to 1) when it knows. Never logged, never shown to the model. A tool
    that reports faster than readers take them is coalesced: the latest is always delivered."""

    name: ClassVar[str] = "tools/progress"
    kind: ClassVar[Kind] = "control"
    agent_id: str
    call_id: str
    message: str
    fraction: float | None = None


# Every event class, in definition order (the order of the generated catalog). attrs builds a
# new class for slotted classes, so the undecorated originals are filtered out.
ALL_EVENTS: tuple[type[Event], ...] = tuple(
    c for c in Event.__subclasses__() if "__attrs_attrs__" in c.__dict__
)
