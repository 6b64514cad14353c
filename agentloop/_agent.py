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
import logging
import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Literal, final

import attrs
import trio

from . import _log
from ._approvals import Answer, Approvals
from ._errors import (
    AgentDisposed,
    AgentNotPublished,
    InvalidContent,
    PersistenceUnavailable,
    ProviderError,
)
from ._events import (
    AgentHibernated,
    AgentPreStep,
    AgentStatus,
    AgentTurnContinuation,
    AgentTurnEnd,
    AgentTurnStopping,
    AgentWoken,
    InboxClaimed,
    Reject,
    Replace,
    SessionFlush,
    Stop,
)
from ._inbox import TARGETS, Inbox, InboxState, Target
from ._inputs import check_prompt
from ._json import FrozenDict, freeze, freeze_repaired, repair_text, text_problem
from ._lifecycle import Lifecycle
from ._model import (
    AgentOptions,
    CallConfig,
    Content,
    InboxMessage,
    Message,
    MessageId,
    PendingApproval,
    ToolCall,
    ToolResult,
    new_message_id,
)
from ._output import FINAL_RESULT, OutputSpec, Verdict, correction
from ._request import Requests
from ._run import RunControls, take_output
from ._scheduler import (
    ToolRunner,
    ToolTasks,
    TurnCancel,
    close_unanswered,
    result_data,
    run_suspended_calls,
    run_tool_calls,
    with_tool_tasks,
)
from ._session import Continuation, Session, continue_crashed_turn, interrupted_by_crash
from ._settings import APPROVAL_TIMEOUT, HIBERNATE_AFTER, MAX_STEPS_PER_TURN
from ._util import NoPublicConstructor

if TYPE_CHECKING:
    from ._services import Services

__all__ = ["Agent", "current_agent", "life_of", "Status"]

log = logging.getLogger("agentloop")

Status = Literal["idle", "running", "hibernated", "disposed"]

# Closing a turn (turn/end + flush) and a disposal flush run shielded, bounded by this.
CLOSE_GRACE: Final = 30.0

# Wakes an idle actor without input (an answer to a suspended approval); never claimed,
# since claims take content from the inbox lists, not from the channel.
_WAKE: Final = InboxMessage(MessageId(""), "")
# A hibernated agent's call settings when they are those its options give.
_CONFIGURED: Final = object()
# The settings the options last asked for give: agents made alike share one options value,
# and so one (immutable) config, built once. Weakly: the options (and the classes and prompt
# they name) are the caller's, freed with its agents.
_last_configured: tuple[weakref.ref[AgentOptions] | None, CallConfig] = (None, CallConfig())


def _forget_configured(ref: weakref.ref[AgentOptions]) -> None:
    # The config goes with its options: it holds what they named (the extra settings too).
    global _last_configured
    if _last_configured[0] is ref:
        _last_configured = (None, CallConfig())


# How many calls of wait_idle() that find their agent settled return before one passes a
# schedule point (counted across agents and runtimes: a pace, not a state of any of them).
IDLE_RETURNS_PER_YIELD: Final = 64
_idle_returns = 0


_current: contextvars.ContextVar[Agent | None] = contextvars.ContextVar(
    "agentloop_current_agent", default=None
)


def current_agent() -> Agent | None:
    """The agent on whose behalf this task runs (its driver, tools and hooks), if any."""
    return _current.get()


def life_of(agent: Agent) -> Lifecycle:
    """The agent's lifecycle (for the supervisor, which keeps no table of its own)."""
    return agent._life


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
        "_cancel_cause", "_inbox", "_life", "_model_calls", "_services", "_session", "_status",
        "_tool_runner", "_turn_cancel", "_wake_flag", "cwd", "id", "options", "resumed",
    )

    def __init__(
        self,
        services: Services,
        session: Session,
        options: AgentOptions,
        life: Lifecycle,
        *,
        cwd: str | None = None,
        resumed: bool = False,
        proposal: CallConfig | None = None,
    ) -> None:
        RunControls.__init__(self, services.bus)
        self._services = services
        self.id: Final = session.id
        self.options: Final = options
        self.cwd = cwd
        self.resumed = resumed
        self._life = life
        life.bind(self, Agent._stop, Agent._actor)
        self._status: Status = "idle"
        self._wake_flag = False
        self._turn_cancel: TurnCancel | None = None
        self._cancel_cause: str | None = None
        self._build(session, proposal)

    def _configured(self) -> CallConfig:
        """The call settings its options give (what it starts with unless resumed)."""
        global _last_configured
        options = self.options
        last_options, config = _last_configured
        if last_options is None or last_options() is not options:
            config = CallConfig(
                provider=options.provider,
                model=options.model,
                reasoning_effort=options.reasoning_effort,
                max_tokens=options.max_tokens,
            )
            _last_configured = (weakref.ref(options, _forget_configured), config)
        return config

    def _dormant_config(self) -> CallConfig | None:
        """The call settings a hibernated agent goes on with when it wakes (None: those
        its options give)."""
        proposal = self._life.dormant
        if proposal is _CONFIGURED:
            return None
        assert isinstance(proposal, CallConfig)
        return proposal

    def _build(self, session: Session, proposal: CallConfig | None) -> None:
        """The state an awake agent holds (what hibernation releases and a wake rebuilds);
        ``proposal`` None: the call settings its options give."""
        self._session = session
        self._inbox = InboxState(session.id, self._services.bus)
        # Its model calls are set up by the first step: until then only the call settings
        # they will propose are kept (nothing, when they are those the options give).
        self._model_calls: Requests | CallConfig | None = proposal
        # Made by the first turn or approval that needs it: an idle agent that never ran
        # here (one of many resumed or created with a history) keeps none.
        self._tool_runner: ToolRunner | None = None

    @property
    def _requests(self) -> Requests:
        made = self._model_calls
        if not isinstance(made, Requests):
            made = self._model_calls = Requests(
                self._services, self._session, made or self._configured(),
                system_prompt=self.options.system_prompt, cwd=self.cwd,
            )
        return made

    @property
    def _runner(self) -> ToolRunner:
        runner = self._tool_runner
        if runner is None:
            session = self._session
            runner = self._tool_runner = ToolRunner(
                self._services, session, session.id, Approvals(), self._life, ToolTasks(),
            )
        return runner

    def __repr__(self) -> str:
        return f"<Agent {self.id!r} {self._status}>"

    # --- observable state ----------------------------------------------------------------

    @property
    def status(self) -> Status:
        """``"idle"``, ``"running"``, ``"hibernated"`` or ``"disposed"``."""
        return self._status

    @property
    def session(self) -> Session:
        """The agent's session: its log, history and metadata.

        Reading it wakes a hibernated agent: the session is reloaded from the store at once,
        synchronously (the store's ``load_now``), and the actor starts again. A hibernated
        agent that was disposed is not woken: its stored session is loaded for reading only.
        """
        life = self._life
        if life.dormant is not None:
            if life.stopping:
                # Rebuilt for reading: no actor starts, and input is refused as disposed.
                self._build(self._load(), self._dormant_config())
                life.dormant = None
            else:
                self._wake("session")
        return self._session

    @property
    def inbox(self) -> Inbox:
        """The pending messages of both lists (a hibernated agent has none)."""
        if self._life.dormant is not None:
            return Inbox((), ())
        return self._inbox.snapshot()

    def _set_status(self, status: Status) -> None:
        if self._status == "disposed":
            return  # disposal is final: a converging driver does not bring the agent back
        previous, self._status = self._status, status
        if status != "running" and self._tool_runner is not None:
            self._tool_runner.approvals.wake_waiters()
        bus = self._services.bus
        if previous != status and bus.has_listeners(AgentStatus):
            bus.emit_nowait(AgentStatus(self.id, status, previous))

    async def wait_idle(self) -> None:
        """Return once the agent is idle with no waking input pending (or disposed), or once
        its running turn waits for nothing but answers to approval requests
        (:attr:`pending_approvals`): it cannot go on without them.

        Every call checks for cancellation. A call that finds the agent settled already
        returns without a trip through the scheduler, passing one every
        :data:`IDLE_RETURNS_PER_YIELD` such returns, so that a loop of them still lets other
        tasks run: waiting on each of many agents that are done costs no scheduler pass each.
        """
        waited = False
        while self._status == "running" and not self._runner.approvals.blocked:
            # Woken when the status changes, or when the run waits only for answers.
            await self._runner.approvals.wait_for_change()
            waited = True
        if waited:
            return  # it parked: that was this call's schedule point
        global _idle_returns
        _idle_returns += 1
        if _idle_returns < IDLE_RETURNS_PER_YIELD:
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            _idle_returns = 0
            await trio.lowlevel.checkpoint()

    # --- approvals -----------------------------------------------------------------------

    @property
    def pending_approvals(self) -> tuple[PendingApproval, ...]:
        """Tool calls parked by ``Ask(prompt)`` and not answered yet, in the order they were
        parked. Rebuilt from the log, so a resumed session lists what was pending before."""
        awaiting = self.session.awaiting_approval
        if not awaiting or self._tool_runner is None:
            return awaiting  # nothing answered yet
        approvals = self._tool_runner.approvals
        if not approvals.has_answers():
            return awaiting
        return tuple(p for p in awaiting if not approvals.answered(p.call_id))

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
        self._check_open("approval")
        if self._status == "running" and self._turn_cancel is not None \
                and self._turn_cancel.cancel_called:
            return False  # the cancelled turn answers its parked calls ABORTED_BEFORE_DISPATCH
        approvals = self._runner.approvals
        if approvals.answered(call_id) or all(
            p.call_id != call_id for p in self.session.awaiting_approval
        ):
            return False
        approvals.give(call_id, answer)
        self._answered()
        return True

    def _answered(self) -> None:
        approvals = self._runner.approvals
        run = approvals.waiter
        if run is not None:
            approvals.blocked = False  # the run has work again: wait_idle() waits for it
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
        timeout = self._services.settings.get(APPROVAL_TIMEOUT)
        pending = self.pending_approvals
        return bool(pending) and self._runner.approvals.expire(
            timeout, [p.call_id for p in pending]
        )

    def _approval_deadline(self) -> float:
        timeout: float | None = self._services.settings.get(APPROVAL_TIMEOUT)
        pending = self.pending_approvals
        if timeout is None or not pending:
            return math.inf
        return self._runner.approvals.deadline(timeout, [p.call_id for p in pending])

    # --- input ---------------------------------------------------------------------------

    def _check_open(self, wake: str | None = "send") -> None:
        """Refuse input to an agent not published or disposed; wake a hibernated one (with
        ``wake`` as the cause), as any input does."""
        if not self._life.published:
            raise AgentNotPublished(
                f"agent {self.id!r} is still being set up; it can be driven once create() returns"
            )
        if self._life.stopping:
            raise AgentDisposed(f"agent {self.id!r} is disposed")
        if wake is not None and self._life.dormant is not None:
            self._wake(wake)

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
            new_message_id(),
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
        self._check_open(None)
        content = _freeze_content(content)
        if self._life.dormant is not None:
            return False  # nothing is pending in a hibernated agent
        return self._inbox.edit(message_id, content)

    def remove(self, message_id: str) -> bool:
        """Discard a pending message; False when it is no longer pending."""
        if self._life.dormant is not None:
            return False
        return self._inbox.remove(message_id)

    def _request_wake(self) -> None:
        if self._status == "idle" and not self._suspended():
            self._admit()
        else:
            # Latched: replayed when the current activity converges.
            self._wake_flag = True

    def _admit(self) -> None:
        # Synchronous, so a cancel() right after the send hits the turn it admitted.
        self._turn_cancel = TurnCancel()
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
        if self._life.stopping:
            return False
        if self._life.dormant is not None:
            # Calls a closed turn left awaiting approval are in the stored log only.
            self._wake("cancel")
        approvals = self._runner.approvals
        if self._suspended():
            # Answer every suspended call ABORTED_BEFORE_DISPATCH, in a turn of their own.
            for p in self.pending_approvals:
                approvals.give(p.call_id, Answer(False, abort=True))
            if not keep_inbox:
                self._inbox.discard_all("canceled")
            self._answered()
            assert self._turn_cancel is not None
            self._cancel_cause = cause
            self._turn_cancel.cancel()
            self._cancel_children()
            return True
        if self._status != "running" or self._turn_cancel is None:
            return False
        approvals.blocked = False
        effective = not self._turn_cancel.cancel_called
        if not keep_inbox and self._inbox.discard_all("canceled"):
            effective = True
        # A kept waking steer still needs a turn: it is the wake this cancel must not lose.
        self._wake_flag = keep_inbox and bool(self._inbox.waking)
        if not self._turn_cancel.cancel_called:
            self._cancel_cause = cause
            self._turn_cancel.cancel()
        self._cancel_children()
        return effective

    def _cancel_children(self) -> None:
        # In the same synchronous step as the parent's own cancel, so a child running on its
        # own (a kept handle, a job) ends with cause ``parent`` however long the parent's turn
        # takes to unwind; each child's cancel reaches its own children the same way.
        self._life.cancel_children()

    def _running(self) -> bool:
        # A call, like _stopping(): the status changes across awaits.
        return self._status == "running"

    def _stopping(self) -> bool:
        # A call, not an attribute read, so type narrowing does not survive an await.
        return self._life.stopping

    def _stop(self) -> None:
        """Begin disposal: no more input, the running turn ends ``disposed``.

        Synchronous, so disposal is an input barrier: from this call on ``status`` reads
        ``"disposed"`` and ``send`` raises :class:`AgentDisposed`. Closing the inbox channels
        ends an idle actor's wait; a busy one gets :data:`CLOSE_GRACE` to converge before its
        scope is cancelled.
        """
        life = self._life
        if life.stopping:
            return
        if life.dormant is not None:
            self._stop_dormant()
            return
        life.stopping = True
        self._set_status("disposed")
        self._inbox.discard_all("disposed")
        if self._turn_cancel is not None and not self._turn_cancel.cancel_called:
            self._cancel_cause = "disposed"
            self._turn_cancel.cancel()
        self._inbox.close()
        if life.nursery is not None:
            self._set_grace(life.nursery)

    @staticmethod
    def _set_grace(nursery: trio.Nursery) -> None:
        # A deadline rather than a timer task: nothing to allocate per agent, nothing to stop.
        scope = nursery.cancel_scope
        scope.deadline = min(scope.deadline, trio.current_time() + CLOSE_GRACE)

    # --- the actor -----------------------------------------------------------------------

    async def _actor(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                     ) -> None:
        """The agent's task (``agentloop.agent:<id>``), from publication to quiescence.

        It owns a nursery under which its turns' tool tasks (and child actors) run. Idle, it
        waits on its next-turn channel. When it returns, the closing events are flushed, its
        scope is closed, its lease released and the supervisor has been asked to detach it.

        An agent whose ``setup`` runs is started before publication (``task_status`` reports
        its nursery open), so the children its setup spawns run under it too; it waits there
        until it is published, or leaves no trace if the creation rolls back.
        """
        _current.set(self)
        life = self._life
        awaiting = self.session.awaiting_approval
        if awaiting:
            self._runner.approvals.note_pending(
                (p.call_id for p in awaiting), trio.current_time()
            )
        rested = False
        try:
            # The actor's nursery: its cancel scope is the agent's, cancelled when disposal
            # outlasts CLOSE_GRACE; tool tasks (and child actors) run under it.
            async with trio.open_nursery() as nursery:
                life.nursery = nursery
                task_status.started()
                # False when the creation rolled back: nothing was published, nothing to do.
                # Driven here rather than in a function of its own: an idle actor keeps
                # every frame of its stack, one per agent.
                if await life.wait_settled():
                    try:
                        if life.stopping:
                            self._set_grace(nursery)
                        if not life.attached:
                            life.attached = True
                            await self._services.attach_persistence(
                                self.session, acquire=life.needs_lease
                            )
                        rested = await self._drive()  # True when it hibernated
                    finally:
                        if not rested:
                            # Inside the nursery, so what the agent owns (the child actors
                            # that run here) is disposed to quiescence before the nursery
                            # waits for them.
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
            # A hibernated agent's life goes on without this task (a wake starts another).
            if not rested:
                life.nursery = None
                if life.published:
                    with trio.move_on_after(2 * CLOSE_GRACE, shield=True):
                        # Memoized: a no-op unless the nursery never opened.
                        await self._close_scope()
                        await self._services.release_persistence(self.id, life.lease)
                    life.detach()

    async def _close_scope(self) -> None:
        self._stop()
        with trio.move_on_after(CLOSE_GRACE, shield=True):
            pending = self._services.flush(self.id, self.session.last_seq)
            if pending is not None:
                await pending
            await self._life.close_scope()

    async def _drive(self) -> bool:
        """Run turns until disposal (False) or hibernation (True)."""
        inbox = self._inbox
        turns = inbox.turn_rx
        while not self._stopping():
            if self._status != "running":
                rest_at = self._rest_at()
                try:
                    # Suspended approvals with an approval_timeout: wake when the first
                    # runs out, to answer it, or at the rest time, to hibernate. Without
                    # either, an idle actor holds no scope.
                    deadline = min(self._approval_deadline(), rest_at)
                    if deadline == math.inf:
                        await turns.receive()
                    else:
                        with trio.move_on_at(deadline):
                            await turns.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return False  # disposal closed the inbox
                if not self._running() and self._expire_approvals():
                    self._answered()
                elif (inbox.take_rest() or trio.current_time() >= rest_at) \
                        and await self._hibernate():
                    return True
                # Admission already happened in send(), synchronously; a stale record (its
                # message removed, or claimed by the turn before) finds the agent idle.
                continue
            # Everything that arrived so far is seen by this turn's claims; only input sent
            # from here on replays the latch.
            inbox.drain_turns()
            cancel = self._turn_cancel
            assert cancel is not None
            self._wake_flag = False
            await self._turn(cancel)
            # An idle actor keeps nothing of its last turn: its cancel held the turn's scope.
            del cancel
            if self._stopping():
                return False
            # A waking steer still pending needs a turn too: a keep-inbox cancel between its
            # admission and this turn's start ended that turn before it began.
            if self._wake_flag or inbox.next_turn or inbox.waking:
                self._turn_cancel = TurnCancel()
                self._cancel_cause = None
                continue
            self._turn_cancel = None
            self._runner.approvals.blocked = False
            # Load-bearing: an agent/status handler may send while the agent turns idle.
            # That send admits a new turn synchronously (status back to running), and the
            # loop's next pass runs it instead of waiting on the channel.
            self._set_status("idle")
        return False

    # --- hibernation ---------------------------------------------------------------------

    def hibernate(self) -> bool:
        """Ask the idle agent to hibernate now instead of after
        ``agent-loop.hibernate_after_seconds``.

        Returns True when asked: the actor stores what is not stored yet, then hibernates
        unless input arrived meanwhile (``agent/hibernated`` says it did). False when it
        cannot: it is running, has pending input or live sub-agents, is hibernated or
        disposed already, or its store cannot reload it synchronously (``load_now``).
        """
        if not self._restable(started=False):
            return False
        self._inbox.ask_rest()
        return True

    def wake(self) -> bool:
        """Reload a hibernated agent now (any input does it too); False when it is not
        hibernated.

        Raises:
            PersistenceError: the store cannot load the session (it stays hibernated).
        """
        if self._life.dormant is None or self._life.stopping:
            return False
        self._wake("wake")
        return True

    def _restable(self, *, started: bool = True) -> bool:
        """Idle, nothing pending, nothing running under it, and reloadable from its store
        (``started=False``: the actor may still be about to start, it checks again)."""
        life = self._life
        if self._status != "idle" or life.stopping or life.dormant is not None:
            return False
        inbox, nursery = self._inbox, life.nursery
        return (
            life.attached
            and (not started or (nursery is not None and not nursery.child_tasks))
            and not (inbox.next_turn or inbox.next_step or self._wake_flag)
            and not life.has_children()
            and (self._tool_runner is None or not self._tool_runner.approvals.has_answers())
            and self._approval_deadline() == math.inf
            and self._reloadable()
        )

    def _reloadable(self) -> bool:
        """Whether the store can load the session synchronously (a wake's ``load_now``)."""
        return callable(getattr(self._services.persistence, "load_now", None))

    def _rest_at(self) -> float:
        after: float | None = self._services.settings.get(HIBERNATE_AFTER)
        if after is None or not self._reloadable():
            return math.inf  # a session without (reloadable) persistence never hibernates
        return trio.current_time() + after

    async def _hibernate(self) -> bool:
        if not self._restable():
            return False
        # Everything stored first: the wake reloads the log from the store.
        bus, seq = self._services.bus, self._session.last_seq
        try:
            await bus.emit(SessionFlush(self.id, seq))
        except Exception:
            log.exception("agent %s: storing up to seq %d failed; it stays awake", self.id, seq)
            return False
        if not self._restable() or self._session.last_seq != seq:
            return False  # input (or a disposal) came while the store caught up
        life = self._life
        # The nursery closes with this task; a wake opens another.
        life.nursery = None
        made = self._model_calls
        proposal = made.proposal if isinstance(made, Requests) else made
        # Most agents go on with what their options give: nothing to keep for them.
        life.rest(
            _CONFIGURED if proposal is None or proposal == self._configured() else proposal
        )
        del self._session, self._inbox, self._model_calls
        self._tool_runner = None  # read by a status change: there is none to tell now
        # Announced before the status: an agent/status handler that sends wakes the agent on
        # the spot, and agent/woken must not come before agent/hibernated.
        self._services.emit(AgentHibernated(self.id, seq))
        if life.dormant is not None:  # a handler's input may have woken it already
            self._set_status("hibernated")
        return True

    def _load(self) -> Session:
        services = self._services
        load_now = getattr(services.persistence, "load_now", None)
        if load_now is None:
            raise PersistenceUnavailable(
                f"agent {self.id!r} is hibernated and no store that can reload it "
                "synchronously (load_now) is installed any more"
            )
        stored = load_now(self.id)
        session = Session(self.id, stored.meta, services.bus)
        session.load(stored.events)
        return session

    def _wake(self, cause: str) -> None:
        """Reload the session and start the actor again, synchronously, so the input that
        woke the agent lands in its live inbox in the order it was sent."""
        life = self._life
        proposal = self._dormant_config()
        session = self._load()  # raises before anything changes
        self._build(session, proposal)
        life.wake(session)
        self._set_status("idle")
        self._services.emit(AgentWoken(self.id, session.last_seq, cause))

    def _stop_dormant(self) -> None:
        # Disposal needs no wake: nothing is pending and the log is stored.
        life = self._life
        life.stopping = True
        self._set_status("disposed")
        life.retire(self._retire)

    async def _retire(self) -> None:
        life = self._life
        try:
            with trio.move_on_after(2 * CLOSE_GRACE, shield=True):
                await life.close_scope()
                await self._services.release_persistence(self.id, life.lease)
        finally:
            life.detach()

    def _claim(self, turn: int, *, boundary: bool) -> tuple[InboxMessage, ...]:
        """Atomically take the next-step input, plus one queued prompt at a turn boundary."""
        batch = self._inbox.claim(boundary=boundary)
        if not batch:
            return ()
        bus, append = self._services.bus, self._session.append_claimed
        for is_prompt, m in batch:
            append(
                _log.USER_MESSAGE if is_prompt else _log.STEERING_MESSAGE,
                m.id, m.content, m.source, turn,
            )
            if bus.has_listeners(InboxClaimed):
                bus.emit_nowait(InboxClaimed(self.id, m, turn))
        if len(batch) == 1:
            return (batch[0][1],)  # the usual claim: no generator for it
        return tuple(m for _, m in batch)

    async def _turn(self, cancel: TurnCancel) -> None:
        # Answers to calls a closed turn left awaiting approval open a turn of their own,
        # even a cancelled one: cancel() answers them ABORTED_BEFORE_DISPATCH there.
        # No closure over a local here: its cell would live as long as the turn does.
        awaiting = self._session.awaiting_approval
        resuming = bool(awaiting) and any(
            map(self._runner.approvals.answered, [p.call_id for p in awaiting])
        )
        crashed = None if resuming else self._session.open_turn()
        if crashed is None and not resuming and (
            cancel.cancel_called or not (self._inbox.next_turn or self._inbox.waking)
        ):
            # Cancelled before it began, or its input was removed: no durable turn.
            await trio.lowlevel.checkpoint()
            return
        going_on = None
        if crashed is not None:
            # Resumed with crashed_turn="continue": the open turn goes on where it stopped.
            turn = _Turn(crashed, started=trio.current_time())
            going_on = continue_crashed_turn(self._session, self._idempotent)
        else:
            turn = _Turn(self._session.turns + 1, started=trio.current_time())
            self._session.append_turn_start(turn.number)
        # A resuming turn claims no prompt: queued input waits for the turn after it.
        claimed = () if resuming or going_on else self._claim(turn.number, boundary=True)
        if resuming:
            turn.output = self._suspended_output()
        else:
            for m in claimed:
                spec = take_output(self, m.id)
                if spec is not None:
                    turn.output = spec
        try:
            # The turn's cancel scope is its tool nursery's: None when its cancel ended it.
            turn.reason = await with_tool_tasks(
                self._runner, cancel, self._run_turn, turn, claimed, resuming, going_on
            )
        except Exception as exc:  # noqa: BLE001 - a failing hook ends the turn, not the loop
            turn.reason, turn.error = "error", exc
            log.warning("agent %s: turn %d failed: %r", self.id, turn.number, exc)
        except BaseException:
            # The agent's own scope ran out of disposal grace (work ignored the cancel): the
            # turn still ends, durably, before the actor unwinds.
            turn.reason = "suspended" if self._session.awaiting_approval else "disposed"
            with trio.CancelScope(shield=True):
                await self._close_turn(turn)
            raise
        if _cancel_called(cancel) and turn.reason != "error":
            # Cancellation takes precedence even when the work finished before noticing it.
            turn.reason = "disposed" if self._life.stopping else "aborted"
        if turn.reason == "disposed" and self._session.awaiting_approval:
            # Calls wait for a person: they stay pending, and a resume picks them up.
            turn.reason = "suspended"
        await self._close_turn(turn)

    def _suspended_output(self) -> OutputSpec | None:
        """The structured output the suspended turn being resumed asked for, from its
        ``turn/end`` (so a resume in another process asks for it too)."""
        for event in reversed(self._session.events):
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
        close_unanswered(self._session, turn.number, keep_awaiting=self._life.stopping)
        self._runner.approvals.prune({p.call_id for p in self._session.awaiting_approval})
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
        end_seq = self._session.append_turn_end(
            turn.number, reason, cause, error, self._session.turn_usage or None, turn.detail,
            (turn.output.schema, turn.output.name)
            if reason == "suspended" and turn.output is not None else None,
        )
        bus = self._services.bus
        if not (bus.has_handlers(SessionFlush) or bus.has_listeners(AgentTurnEnd)):
            return  # nothing to wait for: no store to flush, nobody told of the end
        with trio.move_on_after(CLOSE_GRACE, shield=True):
            pending = self._services.flush(self.id, end_seq)
            if pending is not None:
                await pending
            if bus.has_listeners(AgentTurnEnd):
                try:
                    await bus.emit(AgentTurnEnd(self.id, turn.number, turn.reason or ""))
                except Exception:
                    log.exception("agent %s: an agent/turn-end handler failed", self.id)

    async def _run_turn(
        self, turn: _Turn, claimed: tuple[InboxMessage, ...], resuming: bool,
        going_on: Continuation | None,
    ) -> str:
        bus, runner = self._services.bus, self._runner
        # Asked about four hook classes a step: a live set, tested without a call each.
        handled = bus.handled()
        step = 0
        entering = claimed
        if resuming or going_on is not None:
            step, done = await self._take_up(turn, going_on)
            if done:
                return "completed"
            entering = self._claim(turn.number, boundary=False)
        requests = self._requests
        while True:
            step += 1
            # Most steps have neither a stopping policy nor a step limit in reach: no
            # coroutine for them.
            if AgentTurnStopping in handled or self._at_step_limit(turn):
                stop = await self._stopping_point(turn, step, "pre-step")
                if stop is not None:
                    return stop
            if AgentPreStep in handled:
                decision = await bus.emit(AgentPreStep(self.id, turn.number, step, entering))
                if isinstance(decision, Reject):
                    return "rejected"
                if isinstance(decision, Replace):
                    self._replace_all(decision.messages)
            outcome = await requests.step(turn.number, step, turn.output)
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
                        await run_tool_calls(runner, turn.number, calls)
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
                await run_tool_calls(runner, turn.number, calls)
                turn.tool_calls += len(calls)
                # After the tools only a policy can stop the turn: no call without one.
                if AgentTurnStopping in handled:
                    stop = await self._stopping_point(turn, step, "post-tools")
                    if stop is not None:
                        return stop
            proceed = bool(outcome.tool_calls) or correct or bool(self._inbox.waking)
            if AgentTurnContinuation in handled:
                proceed = bool(
                    await bus.emit(AgentTurnContinuation(self.id, turn.number, step, proceed))
                )
            if not proceed:
                return "max-tokens" if turn.max_tokens else "completed"
            # Steering is rare between steps: no claim (and no batch list) without any.
            entering = self._claim(turn.number, boundary=False) if self._inbox.next_step else ()

    async def _take_up(self, turn: _Turn, going_on: Continuation | None) -> tuple[int, bool]:
        """Before the step loop of a turn that goes on: a suspended turn's answered calls,
        or a crashed turn's idempotent calls run again. Returns the last step taken, and
        whether the crashed turn's answer was already complete."""
        runner = self._runner
        if going_on is None:
            # First the results of the calls a suspended turn left, then the step loop
            # goes on as after any tool step.
            await run_suspended_calls(runner, turn.number)
            await trio.lowlevel.checkpoint_if_cancelled()
            return 0, False
        calls = [c for c, _ in going_on.calls]
        if calls:
            logged = {c.id for c, was_logged in going_on.calls if was_logged}
            lost = {c.id: interrupted_by_crash(c) for c in calls if c.id in going_on.interrupted}
            await run_tool_calls(runner, turn.number, calls, logged=logged, answered=lost)
            turn.tool_calls += len(calls)
            await trio.lowlevel.checkpoint_if_cancelled()
        return going_on.step, going_on.answered and not calls

    def _idempotent(self, name: str) -> bool:
        tool = self._services.tools.lookup(name, self.id)
        return tool is not None and tool.idempotent

    def continue_crashed_turn(self) -> None:
        """Take up the turn the resumed log left open (``crashed_turn="continue"``): the
        agent runs it at once, as if input had arrived."""
        if self._status == "idle":
            self._admit()
            self._inbox.turn_tx.send_nowait(_WAKE)

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
            self._session.append(_log.TOOL_CALL, _log.tool_call(call), turn)
            self._session.append(
                _log.TOOL_RESULT, result_data(call, result), turn
            )

    def _correct(self, turn: int, text: str) -> None:
        """Tell the model, as a steering message of this turn, what to fix in its output."""
        mid = new_message_id()
        self._session.append(
            _log.STEERING_MESSAGE,
            _log.claimed_message(mid, text, FrozenDict(kind="output-correction")),
            turn,
        )

    async def _stopping_point(
        self, turn: _Turn, step: int, point: Literal["pre-step", "post-tools"]
    ) -> str | None:
        """``agent/turn-stopping``: ``"aborted"`` when a policy ends the turn here; then the
        runtime's own ``agent-loop.max_steps_per_turn`` before a step."""
        bus = self._services.bus
        decision = None
        if bus.has_handlers(AgentTurnStopping):
            decision = await bus.emit(
                AgentTurnStopping(
                    self.id, turn.number, step, point, turn.steps, turn.tool_calls,
                    self._session.turn_usage, trio.current_time() - turn.started,
                )
            )
        if not isinstance(decision, Stop) and point == "pre-step" and self._at_step_limit(turn):
            limit = self._services.settings.get(MAX_STEPS_PER_TURN)
            decision = Stop("step_limit", f"{MAX_STEPS_PER_TURN} ({limit}) reached")
        if not isinstance(decision, Stop):
            return None
        self._cancel_cause = decision.cause
        turn.detail = decision.reason or None
        log.warning(
            "agent %s: turn %d stopped (%s): %s", self.id, turn.number, decision.cause,
            decision.reason or "no reason given",
        )
        return "aborted"

    def _at_step_limit(self, turn: _Turn) -> bool:
        limit = self._services.settings.get(MAX_STEPS_PER_TURN)
        return bool(limit) and turn.steps >= limit

    def _replace_all(self, messages: Sequence[Message]) -> None:
        """A pre-step ``Replace``: the whole history, durably (refused if unpaired)."""
        session = self._session
        current = session.messages()
        if len(current) == len(messages) and session.common_prefix(
            current, messages
        ) == len(messages):
            return  # the same history: nothing to record
        session.replace_history(1, session.last_seq, messages, reason="pre-step")


def _cancel_called(cancel: TurnCancel) -> bool:
    return cancel.cancel_called
