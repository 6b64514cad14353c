"""The agent actor: admission, run controls and the turn/step driver.

One task (``agentloop.agent:<id>``) owns an agent from publication to quiescence; its pending
input lives in :mod:`._inbox`, one model reply is folded by :mod:`._reply`, one step's tool
calls are run by :mod:`._scheduler`. A waking send to an idle agent *admits* a turn
synchronously: the status flips to ``running`` and a fresh cancel scope becomes the target of
:meth:`Agent.cancel`, so a cancel issued right after a send is never lost and never leaks onto
a later prompt.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Literal, final

import attrs
import trio

from . import _log
from ._errors import AgentDisposed, AgentNotPublished, InvalidContent, ProviderError
from ._events import (
    AgentPreStep,
    AgentRequest,
    AgentRequestError,
    AgentStatus,
    AgentStepResult,
    AgentTurnContinuation,
    AgentTurnEnd,
    AgentTurnStopping,
    InboxClaimed,
    Reject,
    Replace,
    Retry,
    SessionFlush,
    Stop,
    _Outcome,
)
from ._inbox import TARGETS, Inbox, InboxState, Target
from ._inputs import check_prompt
from ._json import FrozenDict, freeze, freeze_repaired, repair_text, text_problem
from ._model import (
    AgentOptions,
    CallConfig,
    Content,
    InboxMessage,
    LLMRequest,
    Message,
    MessageId,
    PendingApproval,
    ToolCall,
    ToolResult,
    ToolSpec,
)
from ._output import FINAL_RESULT, OutputSpec, Verdict, correction
from ._output import check as check_output
from ._reply import StepOutcome, fold_stream
from ._run import RunControls
from ._scheduler import (
    Answer,
    close_unanswered,
    result_data,
    run_suspended_calls,
    run_tool_calls,
)
from ._session import Session
from ._settings import APPROVAL_TIMEOUT
from ._util import NoPublicConstructor

if TYPE_CHECKING:
    from ._agents import LeaseClaim
    from ._context import Context
    from ._runtime import Runtime
    from ._scheduler import _Run

__all__ = ["Agent", "current_agent", "Status"]

log = logging.getLogger("agentloop")

Status = Literal["idle", "running", "disposed"]

# Closing a turn (turn/end + flush) and a disposal flush run shielded, bounded by this.
CLOSE_GRACE: Final = 30.0

# Wakes an idle actor without input (an answer to a suspended approval); never claimed,
# since claims take content from the inbox lists, not from the channel.
_WAKE: Final = InboxMessage(MessageId(""), "")

_current: contextvars.ContextVar[Agent | None] = contextvars.ContextVar(
    "agentloop_current_agent", default=None
)


def current_agent() -> Agent | None:
    """The agent on whose behalf this task runs (its driver, tools and hooks), if any."""
    return _current.get()


def _freeze_content(content: object) -> Content:
    if isinstance(content, str):
        problem = text_problem(content)
        if problem is not None:
            raise InvalidContent(f"content: {problem}")
        check_prompt(content)
        return content
    if isinstance(content, (list, tuple)):
        frozen = freeze(content, path="content")
        assert isinstance(frozen, tuple)
        check_prompt(frozen)
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


@attrs.define(slots=True, eq=False)
class _Turn:
    number: int
    reason: str | None = None
    max_tokens: bool = False
    error: BaseException | None = None
    detail: str | None = None
    started: float = 0.0
    steps: int = 0
    tool_calls: int = 0
    output: OutputSpec | None = None  # the structured output the claimed message asks for
    output_failures: int = 0


@final
class Agent(RunControls, metaclass=NoPublicConstructor):
    """A live agent. Obtain one from ``ctx.agents.create`` / ``ctx.agent_loop.create``.

    ``id`` equals its session's id. Everything it does is recorded in ``session.events`` and
    reported through ``agent/*`` events.
    """

    __slots__ = (
        "_announced", "_answers", "_attached", "_blocked", "_cancel_cause", "_disposing",
        "_idle", "_inbox", "_lease", "_needs_lease", "_nursery", "_outputs", "_parked_run",
        "_parked_since",
        "_proposal", "_published", "_quiescent", "_rt", "_sent", "_specs", "_specs_version",
        "_status",
        "_teardown_requested", "_turn_scope", "_wake_flag", "ctx", "cwd", "id", "options",
        "resumed", "session",
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
        self._inbox = InboxState(session.id, rt.bus)
        self._attached = False
        self._wake_flag = False
        self._turn_scope: trio.CancelScope | None = None
        self._cancel_cause: str | None = None
        self._idle: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._announced = Latch()
        self._teardown_requested = False
        self._quiescent = Latch()
        self._proposal = proposal or CallConfig(
            provider=options.provider,
            model=options.model,
            reasoning_effort=options.reasoning_effort,
            max_tokens=options.max_tokens,
        )
        self._specs_version = -1
        self._specs: tuple[ToolSpec, ...] = ()
        # The messages of the latest request sent on each route, for request/header's
        # cache_prefix (a snapshot: O(1) to keep and, unless replaced, to compare).
        self._sent: dict[tuple[str | None, str | None], Sequence[Message]] = {}
        self._needs_lease = False
        self._lease: LeaseClaim | None = None  # its claim on the session's persistence lease
        # Approvals: answers not yet applied by the driver, the tool run that holds parked
        # calls (None while the agent is idle or between steps), when each parked call
        # started waiting in this process (its approval_timeout counts from there), and
        # whether the running turn waits for nothing but answers.
        self._answers: dict[str, Answer] = {}
        self._parked_run: _Run | None = None
        self._parked_since: dict[str, float] = {}
        self._blocked = False
        # The output spec of each pending run's message (set as the run queues it), taken
        # by the turn that claims that message: the driver learns a run's output type there.
        self._outputs: dict[str, OutputSpec] = {}

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
        return self._inbox.snapshot()

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
        """Return once the agent is idle with no waking input pending (or disposed), or once
        its running turn waits for nothing but answers to approval requests
        (:attr:`pending_approvals`): it cannot go on without them."""
        while self._status == "running" and not self._blocked:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    def _set_blocked(self, blocked: bool) -> None:
        self._blocked = blocked
        if blocked and self._idle is not None:
            self._idle.set()
            self._idle = None

    # --- approvals -----------------------------------------------------------------------

    @property
    def pending_approvals(self) -> tuple[PendingApproval, ...]:
        """Tool calls parked by ``Ask(prompt)`` and not answered yet, in the order they were
        parked. Rebuilt from the log, so a resumed session lists what was pending before."""
        awaiting = self.session.awaiting_approval
        if not self._answers:
            return awaiting
        return tuple(p for p in awaiting if p.call_id not in self._answers)

    def approve(self, call_id: str) -> bool:
        """Run the parked call ``call_id``; False when it is not awaiting approval.

        Raises:
            AgentDisposed: the agent is disposed (the call stays pending for a resume).
        """
        return self._answer(call_id, Answer(True))

    def deny(self, call_id: str, reason: str = "denied") -> bool:
        """Refuse the parked call ``call_id``: its result is an error with ``error_code``
        ``"DENIED"`` and ``reason``; False when it is not awaiting approval.

        Raises:
            AgentDisposed: the agent is disposed (the call stays pending for a resume).
        """
        if not isinstance(reason, str):
            raise InvalidContent(f"reason: must be a string, got {type(reason).__name__}")
        return self._answer(call_id, Answer(False, repair_text(reason)))

    def _answer(self, call_id: str, answer: Answer) -> bool:
        self._check_open()
        if call_id in self._answers or all(
            p.call_id != call_id for p in self.session.awaiting_approval
        ):
            return False
        self._answers[call_id] = answer
        self._answered()
        return True

    def _answered(self) -> None:
        run = self._parked_run
        if run is not None:
            self._blocked = False  # the run has work again: wait_idle() waits for it
            run.notify()
        elif self._status == "idle":
            # A suspended turn's calls: answering opens the turn that records their results
            # and continues the step loop.
            self._admit()
            self._inbox.turn_tx.send_nowait(_WAKE)
        # Otherwise a turn was admitted and takes the answer when its tool run starts.

    def _suspended(self) -> bool:
        """Calls of a closed turn await approval: new input waits until they are answered."""
        return self._status == "idle" and bool(self.pending_approvals)

    def _expire_approvals(self) -> bool:
        """Deny the suspended calls whose approval_timeout ran out; True when any did."""
        timeout = self._rt.settings.get(APPROVAL_TIMEOUT)
        if timeout is None:
            return False
        now = trio.current_time()
        expired = [
            p.call_id for p in self.pending_approvals
            if now >= self._parked_since.get(p.call_id, now) + timeout
        ]
        for call_id in expired:
            self._answers[call_id] = Answer(
                False, f"no answer to the approval request within {timeout} s"
            )
        return bool(expired)

    def _approval_deadline(self) -> float:
        timeout: float | None = self._rt.settings.get(APPROVAL_TIMEOUT)
        pending = self.pending_approvals
        if timeout is None or not pending:
            return math.inf
        now = trio.current_time()
        return min(self._parked_since.setdefault(p.call_id, now) + timeout for p in pending)

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
        if target not in TARGETS:
            raise InvalidContent(f"target: must be 'next-turn' or 'next-step', got {target!r}")
        message = InboxMessage(
            MessageId(f"msg_{uuid.uuid4().hex[:20]}"),
            _freeze_content(content),
            freeze(source, path="source"),
        )
        self._inbox.accept(message, target, wakeup=wakeup)
        if wakeup:
            self._request_wake()
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

    def edit(self, message_id: str, content: object) -> bool:
        """Replace the content of a pending message; False when it is no longer pending."""
        self._check_open()
        return self._inbox.edit(message_id, _freeze_content(content))

    def remove(self, message_id: str) -> bool:
        """Discard a pending message; False when it is no longer pending."""
        return self._inbox.remove(message_id)

    def _request_wake(self) -> None:
        if self._status == "idle" and not self._suspended():
            self._admit()
        else:
            # Latched: replayed when the current activity converges.
            self._wake_flag = True

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
        Calls awaiting approval are answered ``ABORTED_BEFORE_DISPATCH`` (those of a suspended
        turn in a turn of their own, which ends ``aborted``); otherwise idle cancellation is a
        no-op. Waking input sent after the cancel is latched and runs once the agent has
        converged, without another send.
        """
        if self._disposing:
            return False
        if self._suspended():
            # Answer every suspended call ABORTED_BEFORE_DISPATCH, in a turn of their own.
            for p in self.pending_approvals:
                self._answers[p.call_id] = Answer(False, abort=True)
            if not keep_inbox:
                self._inbox.discard_all("canceled")
            self._answered()
            assert self._turn_scope is not None
            self._cancel_cause = cause
            self._turn_scope.cancel()
            self._cancel_children()
            return True
        if self._status != "running" or self._turn_scope is None:
            return False
        self._blocked = False
        effective = not self._turn_scope.cancel_called
        if not keep_inbox and self._inbox.discard_all("canceled"):
            effective = True
        self._wake_flag = False
        if not self._turn_scope.cancel_called:
            self._cancel_cause = cause
            self._turn_scope.cancel()
        self._cancel_children()
        return effective

    def _cancel_children(self) -> None:
        # In the same synchronous step as the parent's own cancel, so a child running on its
        # own (a kept handle, a job) ends with cause ``parent`` however long the parent's turn
        # takes to unwind; each child's cancel reaches its own children the same way.
        for child in list(self._rt.supervisor.children.get(self.id, {}).values()):
            if child._status == "running":
                child.cancel("parent")

    def _running(self) -> bool:
        # A call, like _stopping(): the status changes across awaits.
        return self._status == "running"

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
        self._inbox.discard_all("disposed")
        if self._turn_scope is not None and not self._turn_scope.cancel_called:
            self._cancel_cause = "disposed"
            self._turn_scope.cancel()
        self._inbox.close()
        if self._nursery is not None:
            self._set_grace(self._nursery)

    @staticmethod
    def _set_grace(nursery: trio.Nursery) -> None:
        # A deadline rather than a timer task: nothing to allocate per agent, nothing to stop.
        scope = nursery.cancel_scope
        scope.deadline = min(scope.deadline, trio.current_time() + CLOSE_GRACE)

    # --- the actor -----------------------------------------------------------------------

    async def _actor(self) -> None:
        """The agent's task (``agentloop.agent:<id>``), from publication to quiescence.

        It owns a nursery under which its turns' tool tasks (and child actors) run. Idle, it
        waits on its next-turn channel. When it returns, the closing events are flushed, its
        scope is closed, its lease released and the supervisor has been asked to detach it.
        """
        _current.set(self)
        rt = self._rt
        now = trio.current_time()
        for pending in self.session.awaiting_approval:
            self._parked_since.setdefault(pending.call_id, now)
        try:
            # The actor's nursery: its cancel scope is the agent's, cancelled when disposal
            # outlasts CLOSE_GRACE; tool tasks (and child actors) run under it.
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    if self._disposing:
                        self._set_grace(nursery)
                    if not self._attached:
                        self._attached = True
                        await rt.attach_persistence(self)
                    await self._drive()
                finally:
                    # Inside the nursery, so what the agent owns (the child actors that run
                    # here) is disposed to quiescence before the nursery waits for them.
                    with trio.move_on_after(2 * CLOSE_GRACE, shield=True):
                        await self._close_scope()
            if nursery.cancel_scope.cancelled_caught:
                log.warning("agent %s ignored disposal for %ss; its scope was cancelled",
                            self.id, CLOSE_GRACE)
        except Exception as exc:
            # A failing agent is disposed and reported; the supervisor and every other agent
            # keep running.
            log.error("agent %s failed and is disposed: %r", self.id, exc, exc_info=exc)
        finally:
            self._nursery = None
            with trio.move_on_after(2 * CLOSE_GRACE, shield=True):
                # Memoized: a no-op unless the nursery never opened.
                await self._close_scope()
                await rt.release_persistence(self)
            rt.supervisor.detach(self)

    async def _close_scope(self) -> None:
        self._stop()
        with trio.move_on_after(CLOSE_GRACE, shield=True):
            await self._flush(self.session.last_seq)
            if self.ctx is not None:
                await self.ctx.aclose()

    async def _drive(self) -> None:
        inbox = self._inbox
        turns = inbox.turn_rx
        while not self._stopping():
            if self._status != "running":
                try:
                    # Suspended approvals with an approval_timeout: wake when the first
                    # runs out, to answer it.
                    with trio.move_on_at(self._approval_deadline()):
                        await turns.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return  # disposal closed the inbox
                if not self._running() and self._expire_approvals():
                    self._answered()
                # Admission already happened in send(), synchronously; a stale record (its
                # message removed, or claimed by the turn before) finds the agent idle.
                continue
            # Everything that arrived so far is seen by this turn's claims; only input sent
            # from here on replays the latch.
            inbox.drain_turns()
            scope = self._turn_scope
            assert scope is not None
            self._wake_flag = False
            await self._turn(scope)
            if self._stopping():
                return
            if self._wake_flag or inbox.next_turn:
                self._turn_scope = trio.CancelScope()
                self._cancel_cause = None
                continue
            self._turn_scope = None
            self._blocked = False
            # Load-bearing: an agent/status handler may send while the agent turns idle.
            # That send admits a new turn synchronously (status back to running), and the
            # loop's next pass runs it instead of waiting on the channel.
            self._set_status("idle")

    def _claim(self, turn: int, *, boundary: bool) -> tuple[InboxMessage, ...]:
        """Atomically take the next-step input, plus one queued prompt at a turn boundary."""
        batch = self._inbox.claim(boundary=boundary)
        bus, append = self._rt.bus, self.session.append
        for is_prompt, m in batch:
            append(
                _log.USER_MESSAGE if is_prompt else _log.STEERING_MESSAGE,
                _log.claimed_message(m.id, m.content, m.source),
                turn,
            )
            if bus.has_listeners(InboxClaimed):
                bus.emit_nowait(InboxClaimed(self.id, m, turn))
        return tuple(m for _, m in batch)

    async def _turn(self, scope: trio.CancelScope) -> None:
        # Answers to calls a closed turn left awaiting approval open a turn of their own,
        # even a cancelled one: cancel() answers them ABORTED_BEFORE_DISPATCH there.
        resuming = any(p.call_id in self._answers for p in self.session.awaiting_approval)
        if not resuming and (
            scope.cancel_called or not (self._inbox.next_turn or self._inbox.waking)
        ):
            # Cancelled before it began, or its input was removed: no durable turn.
            await trio.lowlevel.checkpoint()
            return
        turn = _Turn(self.session.turns + 1, started=trio.current_time())
        self.session.append(_log.TURN_START, _log.turn_start(turn.number), turn.number)
        # A resuming turn claims no prompt: queued input waits for the turn after it.
        claimed = () if resuming else self._claim(turn.number, boundary=True)
        if resuming:
            turn.output = self._suspended_output()
        elif self._outputs:
            for m in claimed:
                spec = self._outputs.pop(m.id, None)
                if spec is not None:
                    turn.output = spec
        try:
            with scope:
                turn.reason = await self._run_turn(turn, claimed, resuming=resuming)
        except Exception as exc:  # noqa: BLE001 - a failing hook ends the turn, not the loop
            turn.reason, turn.error = "error", exc
            log.warning("agent %s: turn %d failed: %r", self.id, turn.number, exc)
        if _cancel_called(scope) and turn.reason != "error":
            # Cancellation takes precedence even when the work finished before noticing it.
            turn.reason = "disposed" if self._disposing else "aborted"
        if turn.reason == "disposed" and self.session.awaiting_approval:
            # Calls wait for a person: they stay pending, and a resume picks them up.
            turn.reason = "suspended"
        await self._close_turn(turn)

    def _suspended_output(self) -> OutputSpec | None:
        """The structured output the suspended turn being resumed asked for, from its
        ``turn/end`` (so a resume in another process asks for it too)."""
        for event in reversed(self.session.events):
            if event.type == _log.TURN_END:
                schema, name = event.data.get("output_schema"), event.data.get("output_name")
                if isinstance(schema, FrozenDict) and isinstance(name, str):
                    return OutputSpec(schema, name)
                return None
        return None

    async def _close_turn(self, turn: _Turn) -> None:
        # Whatever ended the turn (a failing or cancelled hook between the anchor and the
        # tools, an internal error), every call the model made gets its answer, so the next
        # request is valid for every provider; at a disposal, calls awaiting approval keep
        # waiting instead (the turn is suspended).
        close_unanswered(self.session, turn.number, keep_awaiting=self._disposing)
        if self._answers or self._parked_since:
            awaiting = {p.call_id for p in self.session.awaiting_approval}
            self._answers = {k: v for k, v in self._answers.items() if k in awaiting}
            self._parked_since = {
                k: v for k, v in self._parked_since.items() if k in awaiting
            }
        error: FrozenDict | None = None
        if turn.error is not None:
            err = turn.error
            frozen = (
                freeze_repaired(err.to_json())[0] if isinstance(err, ProviderError)
                else FrozenDict(type=type(err).__name__, message=repair_text(str(err)))
            )
            assert isinstance(frozen, FrozenDict)
            error = frozen
        reason = turn.reason or "error"
        cause = (self._cancel_cause or "user") if reason == "aborted" else None
        end = self.session.append(
            _log.TURN_END,
            _log.turn_end(
                turn.number, reason, cause=cause, error=error,
                usage=self.session.turn_usage or None, detail=turn.detail,
                output=(
                    (turn.output.schema, turn.output.name)
                    if reason == "suspended" and turn.output is not None else None
                ),
            ),
            turn.number,
        )
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

    async def _run_turn(
        self, turn: _Turn, claimed: tuple[InboxMessage, ...], *, resuming: bool = False
    ) -> str:
        bus = self._rt.bus
        step = 0
        entering = claimed
        if resuming:
            # First the results of the calls a suspended turn left, then the step loop
            # goes on as after any tool step.
            await run_suspended_calls(self, turn.number)
            await trio.lowlevel.checkpoint_if_cancelled()
            entering = self._claim(turn.number, boundary=False)
        while True:
            step += 1
            stop = await self._stopping_point(turn, step, "pre-step")
            if stop is not None:
                return stop
            if bus.has_handlers(AgentPreStep):
                decision = await bus.emit(AgentPreStep(self.id, turn.number, step, entering))
                if isinstance(decision, Reject):
                    return "rejected"
                if isinstance(decision, Replace):
                    self._replace_all(decision.messages)
            outcome = await self._step(turn, step)
            turn.steps += 1
            if outcome.finish_reason == "max_tokens":
                turn.max_tokens = True
            calls = outcome.tool_calls
            verdict = outcome.verdict
            correct = False
            if turn.output is not None and verdict is not None:
                calls = tuple(c for c in calls if c.name != FINAL_RESULT)
                if verdict.valid:
                    self._answer_final(turn.number, verdict, outcome.tool_calls, None)
                    if calls:
                        # The model asked for these beside its answer (a note to save, a
                        # file to write): they run, then the turn ends on the answer.
                        await run_tool_calls(self, turn.number, calls)
                        turn.tool_calls += len(calls)
                    return "max-tokens" if turn.max_tokens else "completed"
                # Invalid output, or a reply with neither output nor tool calls: corrected.
                correct = verdict.found or not calls
                if correct:
                    turn.output_failures += 1
                    if turn.output_failures > self.options.output_retries:
                        self._answer_final(
                            turn.number, verdict, outcome.tool_calls, correction(verdict)
                        )
                        raise ProviderError(
                            f"the structured output is still invalid after "
                            f"{self.options.output_retries} corrections: "
                            + "; ".join(verdict.problems or ("no output was given",)),
                            code="OUTPUT_INVALID",
                        )
                self._answer_final(turn.number, verdict, outcome.tool_calls, correction(verdict))
                if correct and verdict.call is None:
                    self._correct(turn.number, correction(verdict))
            if calls:
                await run_tool_calls(self, turn.number, calls)
                turn.tool_calls += len(calls)
                stop = await self._stopping_point(turn, step, "post-tools")
                if stop is not None:
                    return stop
            proceed = bool(outcome.tool_calls) or correct or bool(self._inbox.waking)
            if bus.has_handlers(AgentTurnContinuation):
                proceed = bool(
                    await bus.emit(AgentTurnContinuation(self.id, turn.number, step, proceed))
                )
            if not proceed:
                return "max-tokens" if turn.max_tokens else "completed"
            entering = self._claim(turn.number, boundary=False)

    def _answer_final(
        self, turn: int, verdict: Verdict, calls: tuple[ToolCall, ...], problem: str | None
    ) -> None:
        """Answer every ``final_result`` call of a step: the one judged gets ``problem``
        (or success); extra ones are refused, so the next request stays well formed."""
        for call in calls:
            if call.name != FINAL_RESULT:
                continue
            if call is verdict.call and problem is None:
                result = ToolResult("The answer was accepted.")
            elif call is verdict.call:
                assert problem is not None
                result = ToolResult.error("OUTPUT_INVALID", problem)
            else:
                result = ToolResult.error("OUTPUT_INVALID", f"call {FINAL_RESULT} only once")
            self.session.append(_log.TOOL_CALL, _log.tool_call(call), turn)
            self.session.append(
                _log.TOOL_RESULT, result_data(call, result), turn
            )

    def _correct(self, turn: int, text: str) -> None:
        """Tell the model, as a steering message of this turn, what to fix in its output."""
        mid = MessageId(f"msg_{uuid.uuid4().hex[:20]}")
        self.session.append(
            _log.STEERING_MESSAGE,
            _log.claimed_message(mid, text, FrozenDict(kind="output-correction")),
            turn,
        )

    async def _stopping_point(
        self, turn: _Turn, step: int, point: Literal["pre-step", "post-tools"]
    ) -> str | None:
        """``agent/turn-stopping``: ``"aborted"`` when a policy ends the turn here."""
        bus = self._rt.bus
        if not bus.has_handlers(AgentTurnStopping):
            return None
        decision = await bus.emit(
            AgentTurnStopping(
                self.id, turn.number, step, point, turn.steps, turn.tool_calls,
                self.session.turn_usage, trio.current_time() - turn.started,
            )
        )
        if not isinstance(decision, Stop):
            return None
        self._cancel_cause = decision.cause
        turn.detail = decision.reason or None
        log.warning(
            "agent %s: turn %d stopped (%s): %s", self.id, turn.number, decision.cause,
            decision.reason or "no reason given",
        )
        return "aborted"

    def _replace_all(self, messages: Sequence[Message]) -> None:
        """A pre-step ``Replace``: the whole history, durably (refused if unpaired)."""
        session = self.session
        current = session.messages()
        if len(current) == len(messages) and session.common_prefix(
            current, messages
        ) == len(messages):
            return  # the same history: nothing to record
        session.replace_history(1, session.last_seq, messages, reason="pre-step")

    def _visible_specs(self) -> tuple[ToolSpec, ...]:
        registry = self._rt.tools
        if registry.version != self._specs_version:
            self._specs = tuple(t.spec for t in registry.visible(self.id))
            self._specs_version = registry.version
        return self._specs

    async def _step(self, turn: _Turn, step: int) -> StepOutcome:
        rt = self._rt
        bus = rt.bus
        config = self._proposal
        specs = self._visible_specs()
        spec = turn.output
        template = rt.prompt.template_for(self.id, self.options.system_prompt)
        system = rt.prompt.render(
            template, provider=config.provider, model=config.model, cwd=self.cwd
        )
        history = self.session.messages()
        messages: Sequence[Message] = history
        # Whether the system prompt follows the route: a fallback to another provider renders
        # it again, unless an agent/request handler wrote its own.
        templated = "{" in template
        if bus.has_handlers(AgentRequest):
            outcome_of = _Outcome()
            proposed = AgentRequest(
                self.id, turn.number, step, config, system, specs, history, outcome_of
            )
            config = await bus.emit(proposed)
            final = outcome_of.event
            if final is None or final.config is not config:
                # Only the waterfall's own last copy says what the handlers left.
                final = attrs.evolve(proposed, config=config)
            messages, specs = final.messages, final.tools
            if final.system != system:
                system = final.system
                templated = False
            elif templated:
                system = rt.prompt.render(
                    template, provider=config.provider, model=config.model, cwd=self.cwd
                )
        planned = config
        # Per route (provider, model): a call moved to another route counts from 1 there.
        tries: dict[tuple[str | None, str | None], int] = {}
        routes: list[str] = []
        after: FrozenDict | None = None
        while True:
            key = (config.provider, config.model)
            if templated and config is not planned:
                system = rt.prompt.render(
                    template, provider=config.provider, model=config.model, cwd=self.cwd
                )
            attempt = tries[key] = tries.get(key, 0) + 1
            if f"{key[0]}:{key[1]}" not in routes:
                routes.append(f"{key[0]}:{key[1]}")
            policy = None
            failure: ProviderError | None = None
            try:
                if not config.provider or not config.model:
                    raise ProviderError(
                        f"a model call needs a provider and a model; got provider="
                        f"{config.provider!r}, model={config.model!r}",
                        code="INVALID_CONFIG",
                    )
                prepared = await rt.llm.prepare_call(config)
                policy = prepared.retry
                effective = prepared.config
                route = (effective.provider, effective.model)
                before = self._sent.get(route)
                self.session.append(
                    _log.REQUEST_HEADER,
                    _log.request_header(
                        step, effective.to_json(), prepared.adapter_defaults,
                        messages=len(messages),
                        cache_prefix=0 if before is None
                        else self.session.common_prefix(before, messages),
                        rewritten=messages is not history,
                        after_error=after,
                    ),
                    turn.number,
                )
                self._sent[route] = messages
                native = spec is not None and (
                    prepared.registration is not None
                    and prepared.registration.adapter.supports_json_schema
                )
                request = LLMRequest(
                    system=system,
                    messages=messages,
                    tools=specs if spec is None or native else (*specs, spec.tool()),
                    config=effective,
                    session_id=self.id,
                    turn=turn.number,
                    step=step,
                    output_schema=spec.schema if spec is not None and native else None,
                    output_name=spec.name if spec is not None else "output",
                )
                stream, guard = await prepared.serve(request, agent_id=self.id)
                judge = None if spec is None else functools.partial(check_output, spec, native)
                outcome = await fold_stream(
                    self.session, turn.number, step, stream, judge, failure=guard
                )
                break
            except ProviderError as err:
                failure = err
            # Recovery runs outside the except block: a retry wait must not chain onto (or,
            # when cancelled, discard) the provider error.
            decision = None
            if bus.has_handlers(AgentRequestError):
                decision = await bus.emit(
                    AgentRequestError(
                        self.id, turn.number, step, attempt, config, failure, policy,
                        tuple(routes),
                    )
                )
            if not isinstance(decision, Retry):
                raise failure
            # The next header records the failed call, so the log keeps every attempt.
            error = freeze_repaired(failure.to_json())[0]
            assert isinstance(error, FrozenDict)
            after = _log.failed_call(config.provider, config.model, attempt, error)
            if decision.config is not None:
                config = decision.config
            # A handler that retries at once must still let other tasks (and cancel()) in.
            await trio.lowlevel.checkpoint()
        if config is not planned:
            # A call moved to another route (a fallback) serves this step only.
            self._proposal = planned
        # Adapter-filled fields are dropped, so the next step's route fills its own.
        elif prepared.adapter_defaults:
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


def _cancel_called(scope: trio.CancelScope) -> bool:
    return scope.cancel_called
