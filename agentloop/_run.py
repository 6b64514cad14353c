"""Run handles: reading one turn of an agent back, losslessly, from its durable log.

A :class:`Run` queues one follow-up and follows the turn that claims it (the turn whose
``user/message`` carries the id ``followup`` returned). It copies no events: its readers index
``agent.session.events`` by seq. Bus handlers shared by every run of a runtime note when a
message is claimed (and by which turn), dropped, or answered by a closed turn, and wake parked
readers; they are installed before a message is sent, so its claim cannot be missed, and only
while some run needs them. The log keeps every event, so a reader that starts late or falls
behind still sees the whole turn.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, final

import attrs
import trio

from . import _log
from ._bus import Disposer, EventBus
from ._errors import ProviderError, TurnFailed
from ._events import AgentDisposed as AgentGone
from ._events import AgentStatus, AgentTurnEnd, InboxClaimed, InboxDiscarded, ToolProgress
from ._json import FrozenDict, freeze
from ._model import AgentOptions, MessageId, SessionEvent
from ._output import OutputSpec, output_spec, rebuild_output
from ._util import NoPublicConstructor, construct

if TYPE_CHECKING:
    from types import TracebackType

    from ._inbox import Inbox
    from ._session import Session

__all__ = ["RunControls", "Run", "RunResult", "take_output"]

# The turn/end cause recorded when a run's block is left before its turn ended.
RUN_EXIT_CAUSE: Final = "run"

Kind = Literal["text", "reasoning"]


@attrs.frozen(slots=True)
class RunResult:
    """How the turn that claimed a run's message ended.

    Attributes:
        text: the content of the turn's last ``assistant/message`` (for an aborted turn, the
            text the reader saw before the cancel); ``""`` when there was none.
        output: the validated structured output, an instance of the run's ``output_type``
            (a dict for a JSON-schema dict), rebuilt from the ``output`` its turn recorded on
            the final ``assistant/message``; ``None`` without an ``output_type``.
        reason: the ``turn/end`` reason: ``completed``, ``max-tokens``, ``aborted``,
            ``disposed``, ``rejected`` or ``suspended`` (``error`` raises
            :class:`~agentloop.TurnFailed` instead). A message removed before any turn
            claimed it reads ``aborted``, one dropped by disposal ``disposed``; both with
            ``turn`` ``None``.
        turn: the turn's number, or ``None`` when no turn claimed the message.
        usage: the token counters of the turn's model calls, summed key by key (nested
            counters too, and ``cost`` with a ``[prices]`` table), or ``None`` when no call
            reported any.
    """

    text: str
    output: object | None
    reason: str
    turn: int | None
    usage: FrozenDict | None


class Driven(Protocol):
    """What a run needs of the agent it drives (:class:`agentloop.Agent`, a layer above)."""

    _run_bus: EventBus
    _run_outputs: dict[str, OutputSpec] | None

    @property
    def id(self) -> str: ...
    @property
    def session(self) -> Session: ...
    @property
    def status(self) -> str: ...
    @property
    def inbox(self) -> Inbox: ...
    @property
    def options(self) -> AgentOptions: ...
    def followup(self, content: object, *, source: object = None) -> MessageId: ...
    def remove(self, message_id: str) -> bool: ...
    def cancel(self, cause: str = "user", *, keep_inbox: bool = False) -> bool: ...


def take_output(agent: RunControls, message_id: str) -> OutputSpec | None:
    """The output spec a run left for the turn that claims ``message_id`` (taken once)."""
    outputs = agent._run_outputs
    return None if outputs is None else outputs.pop(message_id, None)


class RunControls:
    """The run-handle methods of :class:`agentloop.Agent` (``run``, ``ask``)."""

    __slots__ = ("_run_bus", "_run_outputs")

    def __init__(self, bus: EventBus) -> None:
        # What a run needs of its agent: the bus its dispatcher listens on, and where a run
        # leaves its message's output spec for the turn that claims the message (made by
        # the first run that asks for structured output: most agents never do).
        self._run_bus = bus
        self._run_outputs: dict[str, OutputSpec] | None = None

    def run(
        self, content: object, *, source: object = None, output_type: object = None
    ) -> Run:
        """A handle on the turn that will answer ``content``; use it as ``async with``.

        Entering the block queues ``content`` as a follow-up (exactly as
        :meth:`~agentloop.Agent.followup`, so ``InvalidContent`` and ``AgentDisposed`` are
        raised there). Leaving it before that turn ended cancels that turn (cause ``"run"``,
        the inbox kept), or removes the message if no turn claimed it yet, and nothing else.

        ``output_type`` (an attrs class, a dataclass, a ``TypedDict``, a pydantic
        ``BaseModel`` or a JSON-schema dict) asks the turn for structured output:
        ``RunResult.output`` is then an instance of it (a dict for a schema). Without one,
        the agent's ``AgentOptions.output_type`` (if set) is asked for.

        Raises:
            ToolDefinitionError: ``output_type`` has no JSON schema.
            TypeError: ``output_type`` does not describe a JSON object.
        """
        agent: Driven = self  # type: ignore[assignment]  # only Agent mixes this in
        if output_type is None:
            output_type = agent.options.output_type
        spec = None if output_type is None else output_spec(output_type)
        return construct(Run, agent, content, source, output_type, spec)

    async def ask(
        self, content: object, *, source: object = None, output_type: object = None
    ) -> RunResult:
        """Queue ``content``, wait for the turn that answers it and return its result.

        Raises:
            TurnFailed: that turn ended with reason ``error``.
        """
        async with self.run(content, source=source, output_type=output_type) as run:
            return await run.result()


class _Dispatch:
    """The bus handlers every run of one runtime shares, installed while any run needs them.

    One handler per event class, indexed by message id, ``(agent, turn)`` and agent, so an
    event costs one dict lookup whatever the number of runs, and a runtime with no live run
    pays nothing. Readers are woken by the session itself (its ``_wake`` hook, set only while
    a reader of it waits), not through the bus.
    """

    __slots__ = ("_bus", "_disposers", "claimed", "pending", "readers")

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self.pending: dict[str, Run] = {}  # by message id, until claimed or dropped
        self.claimed: dict[str, dict[int, Run]] = {}  # agent id -> turn -> run, until it ends
        # session id -> the runs whose readers may park, and the session hook that wakes them
        self.readers: dict[str, tuple[set[Run], Callable[[], None]]] = {}
        self._disposers: tuple[Disposer, ...] = ()

    def hold(self) -> None:
        if self._disposers:
            return
        bus = self._bus
        # First among agent/turn-end handlers: one that raises stops the ones after it.
        self._disposers = (
            bus.on(InboxClaimed, self._on_claimed),
            bus.on(InboxDiscarded, self._on_discarded),
            bus.on(AgentTurnEnd, self._on_turn_end, priority=1 << 30),
            bus.on(AgentStatus, self._on_status),
            bus.on(AgentGone, self._on_gone),
        )

    def release(self) -> None:
        if not self.pending and not self.claimed and self._disposers:
            disposers, self._disposers = self._disposers, ()
            for dispose in disposers:
                dispose()

    def watch(self, run: Run) -> Callable[[], None]:
        """Register ``run`` as one whose readers may park; the session hook that wakes them.

        A reader installs the hook as it parks and the hook removes itself as it fires, so
        the appends made while every reader is busy cost the session nothing.
        """
        session = run._agent.session
        found = self.readers.get(session.id)
        if found is None:
            watching: set[Run] = set()
            found = self.readers[session.id] = (
                watching, functools.partial(_wake_readers, watching)
            )
        found[0].add(run)
        return found[1]

    def forget(self, run: Run) -> None:
        agent_id = run._agent.id
        if run._message_id is not None and self.pending.get(run._message_id) is run:
            del self.pending[run._message_id]
        turns = self.claimed.get(agent_id)
        if turns is not None and run._turn is not None and turns.get(run._turn) is run:
            del turns[run._turn]
            if not turns:
                del self.claimed[agent_id]
        run._hook = None
        session = run._agent.session
        found = self.readers.get(session.id)
        if found is not None:
            watching, hook = found
            watching.discard(run)
            if not watching:
                del self.readers[session.id]
                session.forget_wake(hook)
        self.release()

    # --- handlers --------------------------------------------------------------------------

    def _on_claimed(self, e: InboxClaimed) -> None:
        run = self.pending.pop(e.message.id, None)
        if run is not None:
            run._claimed(e.turn)
            self.claimed.setdefault(e.agent_id, {})[e.turn] = run
        self._ended_before(e.agent_id, e.turn)

    def _on_discarded(self, e: InboxDiscarded) -> None:
        run = self.pending.get(e.message.id)
        if run is not None:
            run._finish("disposed" if e.outcome == "disposed" else "aborted")

    def _on_turn_end(self, e: AgentTurnEnd) -> None:
        turns = self.claimed.get(e.agent_id)
        if turns is not None:
            run = turns.get(e.turn)
            if run is not None:
                run._finish(None)
            self._ended_before(e.agent_id, e.turn)

    def _ended_before(self, agent_id: str, turn: int) -> None:
        # A later turn means every earlier one is closed, even one whose agent/turn-end was
        # lost to a flush that outlasted its grace.
        turns = self.claimed.get(agent_id)
        if turns is not None:
            for earlier in [r for t, r in turns.items() if t < turn]:
                earlier._finish(None)

    def _on_status(self, e: AgentStatus) -> None:
        # Idle means every turn is closed. Not "disposed": that is announced as disposal
        # begins, before the running turn has written its last events.
        if e.status == "idle":
            turns = self.claimed.get(e.agent_id)
            if turns is not None:
                for run in list(turns.values()):
                    run._finish(None)

    def _on_gone(self, e: AgentGone) -> None:
        for run in [r for r in self.pending.values() if r._agent.id == e.agent_id]:
            run._finish("disposed")
        for run in list(self.claimed.get(e.agent_id, {}).values()):
            run._finish(None)



def _wake_readers(watching: set[Run]) -> None:
    # The session dropped this hook as it called it: until a reader parks again.
    reschedule = trio.lowlevel.reschedule
    for run in watching:
        readers = run._readers
        if readers:
            # A fresh list: each parked task is rescheduled exactly once (Run._wake inline:
            # this runs about once per streamed chunk).
            run._readers = []
            for task in readers:
                reschedule(task)


@final
class Run(metaclass=NoPublicConstructor):
    """One follow-up and the turn that claims it (from :meth:`Agent.run <RunControls.run>`).

    ``events()``, ``text()`` and ``reasoning()`` may each be iterated any number of times, also
    concurrently and after the block; every iteration starts at the turn's ``turn/start``.
    """

    __slots__ = (
        "_agent",
        "_content",
        "_dispatch",
        "_done_lot",
        "_dropped",
        "_entered",
        "_hook",
        "_message_id",
        "_output_spec",
        "_output_type",
        "_progress",
        "_readers",
        "_source",
        "_start",
        "_terminal",
        "_turn",
    )

    def __init__(
        self, agent: Driven, content: object, source: object, output_type: object = None,
        output_spec: OutputSpec | None = None,
    ) -> None:
        self._agent = agent
        self._output_type = output_type
        self._output_spec = output_spec
        self._content = content
        self._source = source
        self._dispatch = agent._run_bus.companion(_Dispatch)
        self._message_id: MessageId | None = None
        self._entered = False
        self._turn: int | None = None
        self._start = 0  # index of the turn's turn/start in the log
        self._dropped: str | None = None  # the reason when no turn will ever claim the message
        self._terminal = False
        # Reader tasks parked until the session's next append. Not a ParkingLot: a reader is
        # woken about once per streamed chunk, and the bare reschedule costs a third less.
        self._readers: list[trio.lowlevel.Task] = []
        # The session hook that wakes this run's readers, once registered with the dispatcher
        # (until forgotten).
        self._hook: Callable[[], None] | None = None
        self._done_lot = trio.lowlevel.ParkingLot()  # result() waiters, woken once at the end
        self._progress: list[_Progress] = []  # open progress() iterations, ended with the run

    def __repr__(self) -> str:
        return f"<Run {self._message_id!r} turn={self._turn!r} done={self._terminal}>"

    @property
    def message_id(self) -> MessageId | None:
        """The id of the queued follow-up (``None`` until the block is entered)."""
        return self._message_id

    @property
    def turn(self) -> int | None:
        """The number of the turn that claimed the message, once one has."""
        return self._turn

    @property
    def done(self) -> bool:
        """Whether the outcome is known: the turn is closed (its ``turn/end`` logged and
        flushed), or no turn will claim the message."""
        return self._terminal

    # --- the block -----------------------------------------------------------------------

    async def __aenter__(self) -> Run:
        if self._entered:
            raise RuntimeError("a Run can be entered only once")
        self._entered = True
        # The only checkpoint is before the send: once queued, the block is always entered,
        # so the message cannot outlive its handle.
        await trio.lowlevel.checkpoint()
        agent = self._agent
        dispatch = self._dispatch
        dispatch.hold()  # before the send, so that nothing about the message is missed
        try:
            mid = self._message_id = agent.followup(self._content, source=self._source)
        except BaseException:
            dispatch.release()
            raise
        if self._output_spec is not None:
            # Set before any checkpoint, so the turn that claims the message sees it.
            if agent._run_outputs is None:
                agent._run_outputs = {}
            agent._run_outputs[mid] = self._output_spec
        if any(m.id == mid for m in agent.inbox.next_turn):
            dispatch.pending[mid] = self
        else:
            # A handler of the send's own events discarded it before its id was known here.
            self._finish("disposed" if agent.status == "disposed" else "aborted")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._terminal or self._message_id is None:
            return
        agent = self._agent
        if self._turn is None:
            agent.remove(self._message_id)
            if not self._terminal:
                self._finish("aborted")
            return
        # Its turn is not closed yet; when it is still the agent's current one, cancel it,
        # keeping the inbox, so that later input is untouched.
        # Nothing is awaited: leaving never holds up the caller (nor an exception on its way
        # out); result() waits for the cancelled turn to close.
        if agent.session.turns == self._turn and agent.status == "running":
            agent.cancel(RUN_EXIT_CAUSE, keep_inbox=True)

    # --- state changes (from the dispatcher's handlers, synchronous) ---------------------

    def _claimed(self, turn: int) -> None:
        log = self._agent.session.events
        # The claim was just appended, right after its turn/start (steering claimed with it
        # in between); its user/message is the one that names this run's message.
        i = len(log)
        while i > 0:
            i -= 1
            e = log[i]
            if e.type == _log.USER_MESSAGE and e.data["message_id"] == self._message_id:
                turn = e.turn if e.turn is not None else turn
            elif e.type == _log.TURN_START and e.turn == turn:
                break
        self._turn = turn
        self._start = i

    def _finish(self, dropped: str | None) -> None:
        if self._terminal:
            return
        self._terminal = True
        outputs = self._agent._run_outputs
        if self._message_id is not None and outputs is not None:
            outputs.pop(self._message_id, None)
        if self._turn is None:
            self._dropped = dropped or "aborted"
        self._dispatch.forget(self)
        self._wake()
        self._done_lot.unpark_all()
        progress, self._progress = self._progress, []
        for iteration in progress:
            iteration.end()

    async def _wait_terminal(self) -> None:
        self._check_entered()
        while not self._terminal:
            await self._done_lot.park()
        await trio.lowlevel.checkpoint()

    def _wake(self) -> None:
        readers = self._readers
        if readers:
            # A fresh list: each parked task is rescheduled exactly once.
            self._readers = []
            for task in readers:
                trio.lowlevel.reschedule(task)

    def _check_entered(self) -> None:
        if not self._entered:
            raise RuntimeError("enter the run (async with agent.run(...) as run) first")

    # --- reading -------------------------------------------------------------------------

    def events(self) -> AsyncIterator[SessionEvent]:
        """The turn's ``SessionEvent``\\ s, from its ``turn/start`` to its ``turn/end``.

        Only events of that turn are yielded; none if no turn claimed the message.
        """
        self._check_entered()
        return _Events(self)

    def text(self) -> AsyncIterator[str]:
        """The text deltas (``assistant/chunk`` of kind ``text``) of the turn, in order.

        Every step's deltas are included, also those of a model call that failed and was
        retried; read :meth:`events` to tell them apart by ``request/header``.
        """
        self._check_entered()
        return _Events(self, "text")

    def progress(self) -> AsyncIterator[ToolProgress]:
        """The progress its tool calls report (``agentloop.report_progress``), from now until
        the turn closes; nothing if no turn claimed the message.

        Progress is not logged: what was reported before this call is not replayed. A reader
        slower than the reports gets the latest of each call (coalesced, in the order the
        calls last reported).
        """
        self._check_entered()
        return _Progress(self)

    def reasoning(self) -> AsyncIterator[str]:
        """The reasoning deltas (``assistant/chunk`` of kind ``reasoning``) of the turn."""
        self._check_entered()
        return _Events(self, "reasoning")

    async def result(self) -> RunResult:
        """Wait for the turn to close (its ``turn/end`` logged and flushed); how it ended.

        Only ``error`` is raised: the other reasons are outcomes the caller chose (a cancel,
        a disposal, leaving the block) or configured (a ``Reject`` hook, ``max_tokens``), and
        the text produced so far is still worth having.

        Raises:
            TurnFailed: the turn ended with reason ``error``.
        """
        await self._wait_terminal()
        if self._turn is None:
            return RunResult("", None, self._dropped or "aborted", None, None)
        turn = self._turn
        text, output, usage, end = self._agent.session.turn_close(turn, self._start)
        reason = "disposed"  # cut by the end of the agent's scope, with no turn/end
        error: FrozenDict | None = None
        if end is not None:
            reason = end.data["reason"]
            error = end.data.get("error")
        if reason == "error":
            raise TurnFailed(turn, _rebuild(error), error)
        summed: FrozenDict | None = None
        if usage is not None:
            frozen = freeze(usage)
            assert isinstance(frozen, FrozenDict)
            summed = frozen
        if output is not None and self._output_type is not None:
            return RunResult(
                text, rebuild_output(self._output_type, output), reason, turn, summed
            )
        return RunResult(text, output, reason, turn, summed)


_TURN_END: Final = _log.TURN_END
_CHUNK: Final = _log.ASSISTANT_CHUNK


@final
class _Events:
    """An iteration over one run's turn: its events, or (with ``kind``) the deltas of its
    ``assistant/chunk`` events of that kind. A class rather than an async generator, so that
    leaving an ``async for`` early leaves nothing to finalize; one class for both, so that a
    delta costs one ``__anext__``, not one per layer.

    A reader is woken about once per streamed chunk, so the park is written out here rather
    than behind a helper or a ParkingLot: each layer would be resumed at every wake.
    """

    __slots__ = ("_abort", "_done", "_i", "_kind", "_run", "_session", "_task")

    def __init__(self, run: Run, kind: Kind | None = None) -> None:
        self._run = run
        self._kind = kind
        # Its log is append-only, so an index into it stays valid.
        self._session = run._agent.session
        self._i = -1  # the turn's first event once a turn claimed the message
        self._done = False
        # The task that parks here and how a cancel unparks it: made at the first park, and
        # again only if another task takes over the iteration.
        self._task: trio.lowlevel.Task | None = None
        self._abort: Callable[[object], trio.lowlevel.Abort] | None = None

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> Any:
        run = self._run
        kind = self._kind
        session = self._session
        event_at = session.event_at
        # A text reader takes a chunk kept as its delta as it is: no event made for it.
        text_at = session.text_at if kind == "text" else None
        parked = False
        while not self._done:
            turn = run._turn
            if turn is not None:
                i = self._i
                if i < 0:
                    i = run._start
                if text_at is not None:
                    while (delta := text_at(i, turn)) is not None:
                        i += 1
                        if delta:
                            self._i = i
                            if not parked:
                                await trio.lowlevel.checkpoint_if_cancelled()
                            return delta
                    if event_at(i) is not None:  # the turn's turn/end
                        i += 1
                        self._done = True
                else:
                    while (event := event_at(i)) is not None:
                        i += 1
                        if event.turn != turn:
                            continue
                        self._i = i
                        if event.type == _TURN_END:
                            self._done = True
                            if kind is not None:
                                break
                        elif kind is not None and (
                            event.type != _CHUNK or event.data["kind"] != kind
                        ):
                            continue
                        if not parked:
                            # A reader with a backlog takes it without yielding, but still
                            # honours a cancel (a call that parked was a cancellation point).
                            await trio.lowlevel.checkpoint_if_cancelled()
                        return event if kind is None else event.data["delta"]
                self._i = i
            if run._terminal or self._done:
                break
            hook = run._hook
            if hook is None:
                hook = run._hook = run._dispatch.watch(run)
            task = trio.lowlevel.current_task()
            abort = self._abort
            if task is not self._task or abort is None:
                self._task = task
                abort = self._abort = functools.partial(_unpark, run, task)
            run._readers.append(task)
            self._session.wake_at_next_append(hook)
            await trio.lowlevel.wait_task_rescheduled(abort)
            parked = True
        self._done = True
        raise StopAsyncIteration


class _Progress:
    """One iteration of a run's tool progress: the latest report of each call, until the
    run ends. A bus handler fills it (progress is a control event, already paced by the
    reporter); the reader takes the oldest pending call's latest report."""

    __slots__ = ("_dispose", "_ended", "_latest", "_run", "_wake")

    def __init__(self, run: Run) -> None:
        self._run = run
        self._latest: dict[str, ToolProgress] = {}
        self._wake = trio.Event()
        self._ended = run._terminal
        self._dispose: Disposer | None = None
        if not self._ended:
            agent = run._agent
            self._dispose = agent._run_bus.on(ToolProgress, self._on, agent_id=agent.id)
            run._progress.append(self)

    def _on(self, event: ToolProgress) -> None:
        run = self._run
        if run._turn is None or run._terminal:
            return  # another turn's calls: this run's message is not claimed yet
        latest = self._latest
        latest.pop(event.call_id, None)
        latest[event.call_id] = event
        self._wake.set()

    def end(self) -> None:
        self._ended = True
        if self._dispose is not None:
            self._dispose()
        self._wake.set()

    def __aiter__(self) -> _Progress:
        return self

    async def __anext__(self) -> ToolProgress:
        while True:
            latest = self._latest
            if latest:
                await trio.lowlevel.checkpoint()
                if latest:
                    return latest.pop(next(iter(latest)))
            elif self._ended:
                raise StopAsyncIteration
            else:
                await self._wake.wait()
                self._wake = trio.Event()


def _unpark(run: Run, task: trio.lowlevel.Task, _: object) -> trio.lowlevel.Abort:
    # Still parked: a woken task is never aborted, and a wake takes the whole list.
    run._readers.remove(task)
    return trio.lowlevel.Abort.SUCCEEDED




def _rebuild(error: FrozenDict | None) -> ProviderError | FrozenDict | None:
    """The provider error a ``turn/end`` records, as the exception it was; other errors (a
    failing hook, ...) stay the ``{"type", "message"}`` data they were logged as."""
    if error is None or "type" in error:
        return error
    retry_after = error.get("retry_after")
    return ProviderError(
        error.get("message") or "",
        status=error.get("status"),
        code=error.get("code"),
        retry_after=float(retry_after) if isinstance(retry_after, (int, float)) else None,
    )
