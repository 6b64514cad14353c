"""The agent actor: inboxes, run controls, and the turn/step driver.

One driver task owns an agent for its lifetime. Input arrives through ``send`` (synchronous,
validated and frozen once); every inbox change is published as a splice before the pending
lists change. A waking send to an idle agent *admits* a turn synchronously: the status flips to
``running`` and a fresh cancel scope becomes the target of :meth:`Agent.cancel`, so a cancel
issued right after a send is never lost and never leaks onto a later prompt.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, final

import attrs
import trio

from ._errors import AgentDisposed, AgentNotPublished, InvalidContent, ProviderError
from ._events import (
    AgentPreStep,
    AgentRequest,
    AgentRequestError,
    AgentStatus,
    AgentStepResult,
    AgentTurnContinuation,
    AgentTurnEnd,
    InboxClaimed,
    InboxDiscarded,
    InboxInserted,
    InboxSpliced,
    Reject,
    Retry,
    SessionFlush,
)
from ._json import FrozenDict, freeze, freeze_repaired, repair_text, text_problem
from ._model import (
    AgentOptions,
    CallConfig,
    Content,
    Finish,
    InboxMessage,
    LLMRequest,
    MessageId,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
)
from ._scheduler import close_unanswered, run_tool_calls
from ._session import Session, data
from ._util import NoPublicConstructor

if TYPE_CHECKING:
    from ._agents import LeaseClaim
    from ._context import Context
    from ._runtime import Runtime

__all__ = ["Agent", "Inbox", "current_agent", "Status"]

log = logging.getLogger("agentloop")

Status = Literal["idle", "running", "disposed"]
Target = Literal["next-turn", "next-step"]
_TARGETS: Final = ("next-turn", "next-step")

# Closing a turn (turn/end + flush) and a disposal flush run shielded, bounded by this.
CLOSE_GRACE: Final = 30.0

_current: contextvars.ContextVar[Agent | None] = contextvars.ContextVar(
    "agentloop_current_agent", default=None
)


def current_agent() -> Agent | None:
    """The agent on whose behalf this task runs (its driver, tools and hooks), if any."""
    return _current.get()


_FINISH = {
    "stop": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "length": "max_tokens",
    "max_tokens": "max_tokens",
    "tool_calls": "tool_calls",
    "tool_use": "tool_calls",
    "function_call": "tool_calls",
}


def _freeze_content(content: object) -> Content:
    if isinstance(content, str):
        problem = text_problem(content)
        if problem is not None:
            raise InvalidContent(f"content: {problem}")
        return content
    if isinstance(content, (list, tuple)):
        frozen = freeze(content, path="content")
        assert isinstance(frozen, tuple)
        return frozen
    raise InvalidContent(
        f"content: must be a string or a list of JSON parts, got {type(content).__name__}"
    )


class Latch:
    """A one-shot event that allocates a ``trio.Event`` only if someone has to wait.

    Idle agents are numerous; most latches are set before anyone waits on them.
    """

    __slots__ = ("_done", "_event")

    def __init__(self) -> None:
        self._done = False
        self._event: trio.Event | None = None

    def set(self) -> None:
        self._done = True
        if self._event is not None:
            self._event.set()

    def is_set(self) -> bool:
        return self._done

    async def wait(self) -> None:
        if self._done:
            await trio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()


@attrs.frozen(slots=True)
class Inbox:
    """A snapshot of an agent's pending input."""

    next_turn: tuple[InboxMessage, ...]
    next_step: tuple[InboxMessage, ...]


@attrs.define(slots=True, eq=False)
class _Turn:
    number: int
    reason: str | None = None
    max_tokens: bool = False
    error: BaseException | None = None


@attrs.define(slots=True, eq=False)
class _StepOutcome:
    finish_reason: str
    text: str
    tool_calls: tuple[ToolCall, ...]


@final
class Agent(metaclass=NoPublicConstructor):
    """A live agent. Obtain one from ``ctx.agents.create`` / ``ctx.agent_loop.create``.

    ``id`` equals its session's id. Everything it does is recorded in ``session.events`` and
    reported through ``agent/*`` events.
    """

    __slots__ = (
        "_announced", "_attached", "_cancel_cause", "_disposing", "_idle", "_lease",
        "_needs_lease", "_next_step", "_next_turn", "_nursery", "_proposal", "_published",
        "_quiescent", "_rt", "_scope", "_specs", "_specs_version", "_status", "_step_rx",
        "_step_tx", "_teardown_requested", "_turn_rx", "_turn_scope", "_turn_tx", "_wake_flag",
        "_waking",
        "ctx",
        "cwd", "id", "options", "resumed", "session",
    )

    def __init__(
        self,
        rt: Runtime,
        session: Session,
        options: AgentOptions,
        *,
        cwd: str | None = None,
        resumed: bool = False,
        proposal: CallConfig | None = None,
    ) -> None:
        self._rt = rt
        self.session: Final = session
        self.id: Final = session.id
        self.options: Final = options
        self.cwd = cwd
        self.resumed = resumed
        self.ctx: Context | None = None
        self._status: Status = "idle"
        self._published = False
        self._disposing = False
        self._next_turn: list[InboxMessage] = []
        self._next_step: list[InboxMessage] = []
        # Ids of pending next-step messages that were sent to wake (steer): only those
        # continue a turn; an injection waits for the next step something else causes.
        self._waking: set[str] = set()
        self._attached = False
        self._wake_flag = False
        self._turn_scope: trio.CancelScope | None = None
        self._cancel_cause: str | None = None
        self._idle: trio.Event | None = None
        self._scope = trio.CancelScope()  # the actor's: cancelled when disposal times out
        self._nursery: trio.Nursery | None = None
        self._announced = Latch()
        self._teardown_requested = False
        self._quiescent = Latch()
        # The inboxes' channels (unbounded: send() never blocks). Next-turn carries every
        # waking record, which is what an idle actor waits for; next-step carries
        # non-waking next-step records. The pending lists stay the projection that edits,
        # removals and claims act on.
        self._turn_tx, self._turn_rx = trio.open_memory_channel[InboxMessage](math.inf)
        self._step_tx, self._step_rx = trio.open_memory_channel[InboxMessage](math.inf)
        self._proposal = proposal or CallConfig(
            provider=options.provider,
            model=options.model,
            reasoning_effort=options.reasoning_effort,
            max_tokens=options.max_tokens,
        )
        self._specs_version = -1
        self._specs: tuple[ToolSpec, ...] = ()
        self._needs_lease = False
        self._lease: LeaseClaim | None = None  # its claim on the session's persistence lease

    def __repr__(self) -> str:
        return f"<Agent {self.id!r} {self._status}>"

    # --- observable state ----------------------------------------------------------------

    @property
    def status(self) -> Status:
        """``"idle"``, ``"running"`` or ``"disposed"``."""
        return self._status

    @property
    def inbox(self) -> Inbox:
        """The pending messages of both lists."""
        return Inbox(tuple(self._next_turn), tuple(self._next_step))

    def _set_status(self, status: Status) -> None:
        if self._status == "disposed":
            return  # disposal is final: a converging driver does not bring the agent back
        previous, self._status = self._status, status
        if status != "running" and self._idle is not None:
            self._idle.set()
            self._idle = None
        bus = self._rt.bus
        if previous != status and bus.has_listeners(AgentStatus):
            bus.emit_nowait(AgentStatus(self.id, status, previous))

    async def wait_idle(self) -> None:
        """Return once the agent is idle with no waking input pending (or disposed)."""
        while self._status == "running":
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    # --- input ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._published:
            raise AgentNotPublished(
                f"agent {self.id!r} is still being set up; it can be driven once create() returns"
            )
        if self._disposing:
            raise AgentDisposed(f"agent {self.id!r} is disposed")

    def send(
        self,
        content: object,
        *,
        source: object = None,
        target: Target = "next-turn",
        wakeup: bool = True,
    ) -> MessageId:
        """Accept ``content`` into the ``target`` inbox; wake the driver when ``wakeup``.

        Raises:
            InvalidContent: content or source is not JSON-representable (nothing changes).
        """
        self._check_open()
        if target not in _TARGETS:
            raise InvalidContent(f"target: must be 'next-turn' or 'next-step', got {target!r}")
        message = InboxMessage(
            MessageId(f"msg_{uuid.uuid4().hex[:20]}"),
            _freeze_content(content),
            freeze(source, path="source"),
        )
        pending = self._next_turn if target == "next-turn" else self._next_step
        if wakeup and target == "next-step":
            self._waking.add(message.id)
        self._splice(target, len(pending), 0, (message,), None)
        bus = self._rt.bus
        if bus.has_listeners(InboxInserted):
            bus.emit_nowait(InboxInserted(self.id, target, message))
        if wakeup:
            self._request_wake(message)
        elif target == "next-step":
            self._step_tx.send_nowait(message)
        return message.id

    def followup(self, content: object, *, source: object = None) -> MessageId:
        """Queue a prompt for a later turn (next-turn FIFO) and wake the agent."""
        return self.send(content, source=source, target="next-turn", wakeup=True)

    def steer(self, content: object, *, source: object = None) -> MessageId:
        """Add input for the next step of the running turn (or a new turn) and wake the agent."""
        return self.send(content, source=source, target="next-step", wakeup=True)

    def inject(self, content: object, *, source: object = None) -> MessageId:
        """Add input for the next step without waking an idle agent."""
        return self.send(content, source=source, target="next-step", wakeup=False)

    def _find(self, message_id: str) -> tuple[Target, int] | None:
        for target, pending in (("next-turn", self._next_turn), ("next-step", self._next_step)):
            for i, m in enumerate(pending):
                if m.id == message_id:
                    return target, i  # type: ignore[return-value]
        return None

    def edit(self, message_id: str, content: object) -> bool:
        """Replace the content of a pending message; False when it is no longer pending."""
        self._check_open()
        frozen = _freeze_content(content)
        found = self._find(message_id)
        if found is None:
            return False
        target, index = found
        old = (self._next_turn if target == "next-turn" else self._next_step)[index]
        self._splice(target, index, 1, (attrs.evolve(old, content=frozen),), None)
        return True

    def remove(self, message_id: str) -> bool:
        """Discard a pending message; False when it is no longer pending."""
        found = self._find(message_id)
        if found is None:
            return False
        self._discard(*found, outcome="canceled")
        return True

    def _discard(self, target: Target, index: int, *, outcome: str) -> None:
        pending = self._next_turn if target == "next-turn" else self._next_step
        message = pending[index]
        self._splice(target, index, 1, (), outcome)
        bus = self._rt.bus
        if bus.has_listeners(InboxDiscarded):
            bus.emit_nowait(InboxDiscarded(self.id, target, message, outcome))

    def _discard_all(self, outcome: str) -> bool:
        discarded = False
        target: Target
        for target in ("next-turn", "next-step"):
            pending = self._next_turn if target == "next-turn" else self._next_step
            while pending:
                self._discard(target, len(pending) - 1, outcome=outcome)
                discarded = True
        return discarded

    def _splice(
        self,
        target: Target,
        index: int,
        delete_count: int,
        inserted: tuple[InboxMessage, ...],
        outcome: str | None,
    ) -> None:
        bus = self._rt.bus
        if bus.has_listeners(InboxSpliced):
            # Published before the change, so an observer can still read what is removed.
            bus.emit_nowait(InboxSpliced(self.id, target, index, delete_count, inserted, outcome))
        pending = self._next_turn if target == "next-turn" else self._next_step
        if delete_count and target == "next-step" and self._waking:
            kept = {m.id for m in inserted}  # an edit replaces a message under the same id
            for gone in pending[index : index + delete_count]:
                if gone.id not in kept:
                    self._waking.discard(gone.id)
        pending[index : index + delete_count] = inserted

    def _request_wake(self, record: InboxMessage) -> None:
        if self._status == "idle":
            self._admit()
        else:
            # Latched: replayed when the current activity converges.
            self._wake_flag = True
        # The record reaches the actor through its next-turn channel: an idle actor waits
        # there, a running one drains it at its next turn boundary.
        self._turn_tx.send_nowait(record)

    def _admit(self) -> None:
        # Synchronous, so a cancel() right after the send hits the turn it admitted.
        self._turn_scope = trio.CancelScope()
        self._cancel_cause = None
        self._wake_flag = True
        self._set_status("running")

    # --- run controls --------------------------------------------------------------------

    def cancel(self, cause: str = "user", *, keep_inbox: bool = False) -> bool:
        """Abort the current turn (or admission); returns True when it had an effect.

        Unless ``keep_inbox``, every pending message of both lists is discarded (with events).
        Idle cancellation is a no-op. Waking input sent after the cancel is latched and runs
        once the agent has converged, without another send.
        """
        if self._status != "running" or self._turn_scope is None or self._disposing:
            return False
        effective = not self._turn_scope.cancel_called
        if not keep_inbox and self._discard_all("canceled"):
            effective = True
        self._wake_flag = False
        if not self._turn_scope.cancel_called:
            self._cancel_cause = cause
            self._turn_scope.cancel()
        return effective

    def _stopping(self) -> bool:
        # A call, not an attribute read, so type narrowing does not survive an await.
        return self._disposing

    def _stop(self) -> None:
        """Begin disposal: no more input, the running turn ends ``disposed``.

        Synchronous, so disposal is an input barrier: from this call on ``status`` reads
        ``"disposed"`` and ``send`` raises :class:`AgentDisposed`. Closing the inbox channels
        ends an idle actor's wait; a busy one gets :data:`CLOSE_GRACE` to converge before its
        scope is cancelled.
        """
        if self._disposing:
            return
        self._disposing = True
        self._set_status("disposed")
        self._discard_all("disposed")
        if self._turn_scope is not None and not self._turn_scope.cancel_called:
            self._cancel_cause = "disposed"
            self._turn_scope.cancel()
        self._turn_tx.close()
        self._step_tx.close()
        if self._nursery is not None:
            self._nursery.start_soon(self._grace)

    async def _grace(self) -> None:
        await trio.sleep(CLOSE_GRACE)
        log.warning("agent %s ignored disposal for %ss; cancelling its scope", self.id, CLOSE_GRACE)
        self._scope.cancel()

    # --- the actor -----------------------------------------------------------------------

    async def _actor(self) -> None:
        """The agent's task (``agentloop.agent:<id>``), from publication to quiescence.

        It owns a nursery under which its turns' tool tasks (and child actors) run. Idle, it
        waits on its next-turn channel. When it returns, the closing events are flushed, its
        scope is closed, its lease released and the supervisor has been asked to detach it.
        """
        _current.set(self)
        rt = self._rt
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._disposing:
                    nursery.start_soon(self._grace)
                try:
                    with self._scope:
                        if not self._attached:
                            self._attached = True
                            await rt.attach_persistence(self)
                        await self._drive()
                finally:
                    # Ends the grace timer; children were disposed by the scope's close.
                    nursery.cancel_scope.cancel()
        except Exception as exc:
            # A failing agent is disposed and reported; the supervisor and every other agent
            # keep running.
            log.error("agent %s failed and is disposed: %r", self.id, exc, exc_info=exc)
        finally:
            self._nursery = None
            self._stop()
            with trio.move_on_after(CLOSE_GRACE, shield=True):
                await self._flush(self.session.last_seq)
                if self.ctx is not None:
                    await self.ctx.aclose()
                await rt.release_persistence(self)
            rt.supervisor.detach(self)

    async def _drive(self) -> None:
        turns = self._turn_rx
        while not self._stopping():
            if self._status != "running":
                try:
                    await turns.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return  # disposal closed the inbox
                # Admission already happened in send(), synchronously; a stale record (its
                # message removed, or claimed by the turn before) finds the agent idle.
                continue
            # Everything that arrived so far is seen by this turn's claims; only input sent
            # from here on replays the latch.
            _drain(turns)
            scope = self._turn_scope
            assert scope is not None
            self._wake_flag = False
            await self._turn(scope)
            if self._stopping():
                return
            if self._wake_flag or self._next_turn:
                self._turn_scope = trio.CancelScope()
                self._cancel_cause = None
                continue
            self._turn_scope = None
            # Load-bearing: an agent/status handler may send while the agent turns idle.
            # That send admits a new turn synchronously (status back to running), and the
            # loop's next pass runs it instead of waiting on the channel.
            self._set_status("idle")

    def _claim(self, turn: int, *, boundary: bool) -> tuple[InboxMessage, ...]:
        """Atomically take the next-step input, plus one queued prompt at a turn boundary."""
        batch: list[tuple[str, InboxMessage]] = []
        _drain(self._step_rx)  # the projection is the truth for order, edits and removals
        if self._next_step:
            steps = tuple(self._next_step)
            self._splice("next-step", 0, len(steps), (), None)
            batch.extend(("steering/message", m) for m in steps)
        if boundary and self._next_turn:
            prompt = self._next_turn[0]
            self._splice("next-turn", 0, 1, (), None)
            batch.append(("user/message", prompt))
        bus, append = self._rt.bus, self.session.append
        for type_, m in batch:
            append(type_, data(message_id=m.id, content=m.content, source=m.source), turn)
            if bus.has_listeners(InboxClaimed):
                bus.emit_nowait(InboxClaimed(self.id, m, turn))
        return tuple(m for _, m in batch)

    async def _turn(self, scope: trio.CancelScope) -> None:
        if scope.cancel_called or not (self._next_turn or self._waking):
            # Cancelled before it began, or its input was removed: no durable turn.
            await trio.lowlevel.checkpoint()
            return
        turn = _Turn(self.session.turns + 1)
        self.session.append("turn/start", data(turn=turn.number), turn.number)
        claimed = self._claim(turn.number, boundary=True)
        try:
            with scope:
                turn.reason = await self._run_turn(turn, claimed)
        except Exception as exc:  # noqa: BLE001 - a failing hook ends the turn, not the loop
            turn.reason, turn.error = "error", exc
            log.warning("agent %s: turn %d failed: %r", self.id, turn.number, exc)
        if _cancel_called(scope) and turn.reason != "error":
            # Cancellation takes precedence even when the work finished before noticing it.
            turn.reason = "disposed" if self._disposing else "aborted"
        await self._close_turn(turn)

    async def _close_turn(self, turn: _Turn) -> None:
        # Whatever ended the turn (a failing or cancelled hook between the anchor and the
        # tools, an internal error), every call the model made gets its answer, so the next
        # request is valid for every provider.
        close_unanswered(self.session, turn.number)
        fields: dict[str, Any] = {"turn": turn.number, "reason": turn.reason}
        if turn.reason == "aborted":
            fields["cause"] = self._cancel_cause or "user"
        if turn.error is not None:
            err = turn.error
            fields["error"] = (
                freeze(err.to_json()) if isinstance(err, ProviderError)
                else FrozenDict(type=type(err).__name__, message=str(err))
            )
        end = self.session.append("turn/end", FrozenDict(fields), turn.number)
        with trio.move_on_after(CLOSE_GRACE, shield=True):
            await self._flush(end.seq)
            bus = self._rt.bus
            if bus.has_listeners(AgentTurnEnd):
                try:
                    await bus.emit(AgentTurnEnd(self.id, turn.number, turn.reason or ""))
                except Exception:
                    log.exception("agent %s: an agent/turn-end handler failed", self.id)

    async def _flush(self, seq: int) -> None:
        bus = self._rt.bus
        if bus.has_handlers(SessionFlush):
            try:
                await bus.emit(SessionFlush(self.id, seq))
            except Exception:
                log.exception("agent %s: flushing up to seq %d failed", self.id, seq)

    async def _run_turn(self, turn: _Turn, claimed: tuple[InboxMessage, ...]) -> str:
        bus = self._rt.bus
        step = 0
        entering = claimed
        while True:
            step += 1
            if bus.has_handlers(AgentPreStep):
                decision = await bus.emit(AgentPreStep(self.id, turn.number, step, entering))
                if isinstance(decision, Reject):
                    return "rejected"
            outcome = await self._step(turn, step)
            if outcome.finish_reason == "max_tokens":
                turn.max_tokens = True
            if outcome.tool_calls:
                await run_tool_calls(self, turn.number, outcome.tool_calls)
            proceed = bool(outcome.tool_calls) or bool(self._waking)
            if bus.has_handlers(AgentTurnContinuation):
                proceed = bool(
                    await bus.emit(AgentTurnContinuation(self.id, turn.number, step, proceed))
                )
            if not proceed:
                return "max-tokens" if turn.max_tokens else "completed"
            entering = self._claim(turn.number, boundary=False)

    def _visible_specs(self) -> tuple[ToolSpec, ...]:
        registry = self._rt.tools
        if registry.version != self._specs_version:
            self._specs = tuple(t.spec for t in registry.visible(self.id))
            self._specs_version = registry.version
        return self._specs

    async def _step(self, turn: _Turn, step: int) -> _StepOutcome:
        rt = self._rt
        bus = rt.bus
        config = self._proposal
        specs = self._visible_specs()
        template = rt.prompt.template_for(self.id, self.options.system_prompt)
        system = rt.prompt.render(
            template, provider=config.provider, model=config.model, cwd=self.cwd
        )
        messages = self.session.messages()
        if bus.has_handlers(AgentRequest):
            config = await bus.emit(
                AgentRequest(self.id, turn.number, step, config, system, specs, messages)
            )
            if not isinstance(config, CallConfig):
                raise TypeError(f"an agent/request handler returned {config!r}, not a CallConfig")
            if "{" in template:
                system = rt.prompt.render(
                    template, provider=config.provider, model=config.model, cwd=self.cwd
                )
        attempt = 0
        while True:
            attempt += 1
            failure: ProviderError | None = None
            try:
                if not config.provider or not config.model:
                    raise ProviderError(
                        f"a model call needs a provider and a model; got provider="
                        f"{config.provider!r}, model={config.model!r}",
                        code="INVALID_CONFIG",
                    )
                prepared = await rt.llm.prepare_call(config)
                effective = prepared.config
                self.session.append(
                    "request/header",
                    data(
                        step=step,
                        provider=effective.provider,
                        model=effective.model,
                        config=effective.to_json(),
                        adapter_defaults=prepared.adapter_defaults,
                    ),
                    turn.number,
                )
                request = LLMRequest(
                    system=system,
                    messages=messages,
                    tools=specs,
                    config=effective,
                    session_id=self.id,
                    turn=turn.number,
                    step=step,
                )
                outcome = await self._stream(turn, step, rt.llm.open_stream(
                    prepared, request, self.id))
                break
            except ProviderError as err:
                failure = err
            # Recovery runs outside the except block: a retry wait must not chain onto (or,
            # when cancelled, discard) the provider error.
            decision = None
            if bus.has_handlers(AgentRequestError):
                decision = await bus.emit(
                    AgentRequestError(self.id, turn.number, step, attempt, config, failure)
                )
            if not isinstance(decision, Retry):
                raise failure
            # A handler that retries at once must still let other tasks (and cancel()) in.
            await trio.lowlevel.checkpoint()
        # Adapter-filled fields are dropped, so the next step's route fills its own.
        if prepared.adapter_defaults:
            self._proposal = attrs.evolve(
                effective, **dict.fromkeys(prepared.adapter_defaults)
            )
        else:
            self._proposal = effective
        if bus.has_listeners(AgentStepResult):
            await bus.emit(
                AgentStepResult(
                    self.id, turn.number, step, outcome.finish_reason, outcome.text,
                    outcome.tool_calls,
                )
            )
        return outcome

    def _unique_ids(
        self, calls: tuple[ToolCall, ...], renamed: list[FrozenDict]
    ) -> tuple[ToolCall, ...]:
        """Calls with ids no earlier call of the session (or this step) has: providers refuse
        a history that repeats one. Renames keep the model's id on record."""
        taken: set[str] = set()
        out: list[ToolCall] = []
        for call in calls:
            unique = self.session.unique_call_id(call.id, taken)
            if unique != call.id:
                renamed.append(FrozenDict(id=unique, original_id=call.id))
                call = attrs.evolve(call, id=unique)
            taken.add(unique)
            out.append(call)
        return tuple(out)

    async def _stream(self, turn: _Turn, step: int, opening: Any) -> _StepOutcome:
        append, number = self.session.append, turn.number
        text: list[str] = []
        reasoning: list[str] = []
        signature: str | None = None
        seqs: list[int] = []
        visible: list[int] = []
        calls: dict[int, list[Any]] = {}
        finish: Finish | None = None
        try:
            stream: AsyncIterator[Any] = await opening
            closing = (
                contextlib.aclosing(stream) if hasattr(stream, "aclose")  # type: ignore[type-var]
                else contextlib.nullcontext(stream)
            )
            async with closing:
                async for part in stream:
                    cls = type(part)
                    if cls is TextDelta or cls is ReasoningDelta:
                        is_text = cls is TextDelta
                        if not is_text and part.signature:
                            signature = part.signature
                        delta_text = part.text
                        if not delta_text:
                            continue
                        if delta_text.isascii() or text_problem(delta_text) is None:
                            chunk = FrozenDict(
                                step=step, kind="text" if is_text else "reasoning",
                                delta=delta_text,
                            )
                        else:
                            # A provider's lone surrogate (a JSON "\ud83d" escape) could
                            # never be stored or sent again: repaired, and the repair noted.
                            delta_text = repair_text(delta_text)
                            chunk = FrozenDict(
                                step=step, kind="text" if is_text else "reasoning",
                                delta=delta_text, repaired=True,
                            )
                        seq = append("assistant/chunk", chunk, number).seq
                        seqs.append(seq)
                        visible.append(seq)
                        (text if is_text else reasoning).append(delta_text)
                    elif cls is ToolCallDelta:
                        call_id, name, fragment = part.id, part.name, part.arguments
                        repaired = False
                        if not (fragment.isascii() and (name is None or name.isascii())
                                and (call_id is None or call_id.isascii())):
                            fixed = tuple(
                                None if v is None else repair_text(v)
                                for v in (call_id, name, fragment)
                            )
                            repaired = fixed != (call_id, name, fragment)
                            call_id, name = fixed[0], fixed[1]
                            fragment = fixed[2] or ""
                        acc = calls.get(part.index)
                        if acc is None:
                            acc = calls[part.index] = [call_id, name, []]
                        else:
                            acc[0] = acc[0] or call_id
                            acc[1] = acc[1] or name
                        acc[2].append(fragment)
                        delta = FrozenDict(
                            index=part.index, id=call_id, name=name, arguments=fragment
                        )
                        if repaired:
                            delta = FrozenDict(delta, repaired=True)
                        seqs.append(
                            append(
                                "assistant/chunk",
                                FrozenDict(step=step, kind="tool_call", delta=delta),
                                number,
                            ).seq
                        )
                    elif cls is Finish:
                        finish = part
                        break
                    else:
                        raise ProviderError(
                            f"the adapter yielded {part!r}, which is not a stream part",
                            code="invalid_stream",
                        )
        except trio.Cancelled:
            if visible:
                # What the user already saw stays: an interrupted anchor cites exactly it.
                append(
                    "assistant/message",
                    data(
                        step=step,
                        content="".join(text),
                        reasoning="".join(reasoning) or None,
                        reasoning_signature=signature,
                        tool_calls=(),
                        source_event_seqs=tuple(visible),
                        finish_reason=None,
                        usage=None,
                        interrupted=True,
                    ),
                    number,
                )
            raise
        if finish is None:
            raise ProviderError(
                "the model stream ended without a finish", code="incomplete_stream"
            )
        tool_calls = tuple(_tool_call(acc) for _, acc in sorted(calls.items()))
        renamed: list[FrozenDict] = []
        if tool_calls:
            tool_calls = self._unique_ids(tool_calls, renamed)
        reason = _FINISH.get(finish.reason, finish.reason)
        content = "".join(text)
        fields = data(
            step=step,
            content=content,
            reasoning="".join(reasoning) or None,
            reasoning_signature=signature,
            tool_calls=tuple(c.to_json() for c in tool_calls),
            source_event_seqs=tuple(seqs),
            finish_reason=reason,
            usage=freeze(dict(finish.usage)) if finish.usage else None,
            interrupted=False,
        )
        if renamed:
            fields = FrozenDict(fields, renamed_tool_call_ids=tuple(renamed))
        append("assistant/message", fields, number)
        return _StepOutcome(reason, content, tool_calls)


def _drain(channel: trio.MemoryReceiveChannel[InboxMessage]) -> None:
    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        while True:
            channel.receive_nowait()


def _cancel_called(scope: trio.CancelScope) -> bool:
    return scope.cancel_called


def _tool_call(acc: Sequence[Any]) -> ToolCall:
    call_id, name, fragments = acc
    raw = "".join(fragments)
    arguments: FrozenDict | str = raw
    if not raw.strip():
        arguments = FrozenDict()
    else:
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            pass  # kept as text; the scheduler answers it with INVALID_ARGUMENTS
        else:
            if isinstance(parsed, dict):
                # A lone surrogate from a JSON escape is repaired like provider text; what
                # cannot be stored at all (1e400, too deep) stays text for INVALID_ARGUMENTS.
                with contextlib.suppress(InvalidContent):
                    arguments = freeze_repaired(parsed)[0]  # type: ignore[assignment]
    return ToolCall(call_id or f"call_{uuid.uuid4().hex[:24]}", name or "", arguments)
