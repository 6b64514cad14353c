"""What a race acts on (:class:`Race`) and the operations it applies.

Most operations are *instant*: ``now(race)`` acts synchronously, so they can also run from a
synchronous handler at an extension point (:class:`When`) or several in one tick
(:class:`Together`). The rest let time pass or wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import trio
import trio.testing

from .._bus import Lagged
from .._errors import (
    AgentDisposed,
    AgentLoopError,
    PersistenceUnavailable,
    RuntimeClosed,
    SessionIdInUse,
    SessionNotFound,
    SettingsError,
)
from .._events import AgentStatus, InboxClaimed, InboxDiscarded, InboxInserted
from ._racemodel import OPTIONS, Probe

if TYPE_CHECKING:
    from .._agent import Agent
    from .._agents import AgentHandle
    from .._context import Context
    from .._session import Session

__all__ = [
    "Race", "Operation", "Instant",
    "Followup", "Steer", "Inject", "Edit", "Remove", "Cancel", "Close", "CreateSameId",
    "WriteSetting", "Advance", "Settle", "Spawn", "Exit", "Approve", "Deny", "Together",
    "When", "Resume", "Subscribe", "Crash", "Hold", "Hibernate", "Wake", "POINTS", "HOOK_POINTS",
    "open_turn",
]

POINTS = (
    "tool-start", "stream", "pre-step", "request", "step-result", "pre-execute", "approval",
    "continuation", "turn-end", "status",
)
"""Where :class:`When` can fire: a kit tool's body starting, a model reply half streamed, and
the synchronous handlers of ``agent/pre-step``, ``agent/request``, ``agent/step-result``,
``tools/pre-execute``, ``tools/approval``, ``agent/turn-continuation``, ``agent/turn-end``
and ``agent/status``."""
HOOK_POINTS = POINTS[2:-1]
"""Where :class:`Hold` can make a handler wait: the hooks among :data:`POINTS`."""


@runtime_checkable
class Operation(Protocol):
    """One thing a race does: ``await op.apply(race)``.

    Write your own as a frozen attrs class (its ``repr`` is what a failure report prints) and
    mix its strategy into ``strategies.operations(extra=[...])``. ``apply`` runs between
    scheduling points; start anything that must overlap later operations in
    ``race.nursery``. Raise only for a real failure: expected refusals (a disposed agent, a
    live duplicate id) are part of the race.
    """

    async def apply(self, race: Race) -> None: ...


@attrs.define(eq=False)
class Race:
    """What operations act on: the runtime, the agents, and a nursery for overlapping work."""

    ctx: Context
    handles: list[AgentHandle]
    nursery: trio.Nursery
    events: list[Any]
    """Inbox events recorded from the start (what :func:`check_inbox` reads)."""
    sessions: dict[str, Session] = attrs.field(factory=dict)
    """Every session the race saw, sub-agents' included, once each by session id: a session
    resumed after its agent's disposal is its resumed agent's (whose log continues the
    first)."""
    disposed_at: dict[int, int] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    """Free text for the failure report (``race.note(...)``)."""
    state: dict[str, Any] = attrs.field(factory=dict)
    """Scratch space for your own operations (empty when the race starts)."""
    probe: Probe = attrs.field(factory=Probe)
    agents: list[Agent] = attrs.field(factory=list)
    """Every agent the race saw (sub-agents, resumed and same-id ones included)."""
    woken: dict[str, set[str]] = attrs.field(factory=dict)
    """Ids of the waking messages (follow-ups, steers) the race sent, by agent id."""
    cancelled: list[tuple[Session, int]] = attrs.field(factory=list)
    """(session, turn) of each turn open when a cancel of it took effect."""
    feeds: list[Feed] = attrs.field(factory=list)
    background: trio.Nursery | Any = None
    """A nursery for work that lasts the whole race (slow subscribers), cancelled at its end."""

    def handle(self, index: int) -> AgentHandle | None:
        """The handle ``index`` modulo the number of handles (``None`` when there are none)."""
        if not self.handles:
            return None
        return self.handles[index % len(self.handles)]

    def note(self, text: str) -> None:
        self.notes.append(text)

    def violation(self, text: str) -> None:
        self.probe.violation(text)


def open_turn(session: Session) -> int | None:
    """The number of the turn the log has open, if any."""
    for e in reversed(session.events):
        if e.type == "turn/end":
            return None
        if e.type == "turn/start":
            return e.turn
    return None


class Instant:
    """An operation that acts synchronously (``now``), so it can run inside a handler."""

    def now(self, race: Race) -> None:
        raise NotImplementedError

    async def apply(self, race: Race) -> None:
        self.now(race)


def _tolerated(race: Race, h: AgentHandle, fn: Callable[[], object]) -> object:
    # Acting on an agent that is already disposed is refused, and that is part of the race;
    # the refusal and the status must tell the same story.
    try:
        return fn()
    except AgentDisposed:
        if h.agent.status != "disposed":
            race.violation(f"agent {h.agent.id!r} refused input as disposed while its status "
                           f"reads {h.agent.status!r}; expected 'disposed' from the barrier on")
        return None


def _send(race: Race, agent: int, fn: Callable[[AgentHandle], str]) -> None:
    h = race.handle(agent)
    if h is None:
        return
    mid = _tolerated(race, h, lambda: fn(h))
    if isinstance(mid, str):
        race.woken.setdefault(h.agent.id, set()).add(mid)


@attrs.frozen
class Followup(Instant):
    agent: int
    text: str = "hello"

    def now(self, race: Race) -> None:
        _send(race, self.agent, lambda h: h.agent.followup(self.text))


@attrs.frozen
class Steer(Instant):
    agent: int
    text: str = "steer"

    def now(self, race: Race) -> None:
        _send(race, self.agent, lambda h: h.agent.steer(self.text))


@attrs.frozen
class Inject(Instant):
    agent: int
    text: str = "note"

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            _tolerated(race, h, lambda: h.agent.inject(self.text))


def _pending(h: AgentHandle, pick: int) -> str | None:
    inbox = h.agent.inbox
    pending = [*inbox.next_turn, *inbox.next_step]
    return pending[pick % len(pending)].id if pending else None


@attrs.frozen
class Edit(Instant):
    """Edit the ``pick``-th pending message (modulo), if there is one."""

    agent: int
    pick: int = 0
    text: str = "edited"

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        mid = _pending(h, self.pick) if h is not None else None
        if h is not None and mid is not None:
            _tolerated(race, h, lambda: h.agent.edit(mid, self.text))


@attrs.frozen
class Remove(Instant):
    """Remove the ``pick``-th pending message (modulo), if there is one."""

    agent: int
    pick: int = 0

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        mid = _pending(h, self.pick) if h is not None else None
        if h is not None and mid is not None:
            h.agent.remove(mid)


@attrs.frozen
class Cancel(Instant):
    agent: int
    keep_inbox: bool = False

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is None:
            return
        agent = h.agent
        running = agent.status == "running"
        turn = open_turn(agent.session)
        effective = agent.cancel(keep_inbox=self.keep_inbox)
        if effective and running and turn is not None:
            race.cancelled.append((agent.session, turn))
        inbox = agent.inbox
        if running and not self.keep_inbox and agent.status != "disposed" and (
            inbox.next_turn or inbox.next_step
        ):
            race.violation(f"cancel() of running agent {agent.id!r} left {len(inbox.next_turn)} + "
                           f"{len(inbox.next_step)} messages pending; expected the inbox "
                           "emptied unless keep_inbox")


def _answer(race: Race, agent: int, pick: int, approve: bool) -> None:
    h = race.handle(agent)
    if h is None:
        return
    pending = h.agent.pending_approvals
    if not pending:
        return
    call_id = pending[pick % len(pending)].call_id
    if approve:
        _tolerated(race, h, lambda: h.agent.approve(call_id))
    else:
        _tolerated(race, h, lambda: h.agent.deny(call_id, "no"))


@attrs.frozen
class Approve(Instant):
    """Approve the ``pick``-th call awaiting approval (modulo), if there is one."""

    agent: int
    pick: int = 0

    def now(self, race: Race) -> None:
        _answer(race, self.agent, self.pick, True)


@attrs.frozen
class Deny(Instant):
    """Deny the ``pick``-th call awaiting approval (modulo), if there is one."""

    agent: int
    pick: int = 0

    def now(self, race: Race) -> None:
        _answer(race, self.agent, self.pick, False)


@attrs.frozen
class Close(Instant):
    """Start closing the agent's handle; it reaches quiescence while later operations run."""

    agent: int

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            race.nursery.start_soon(h.aclose)


@attrs.frozen
class Hibernate(Instant):
    """Ask the agent to hibernate now (``Agent.hibernate``): its actor stores its log and
    releases it unless input comes first. A no-op for an agent that cannot (busy, pending
    input, no store that reloads synchronously)."""

    agent: int

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            h.agent.hibernate()


@attrs.frozen
class Wake(Instant):
    """Wake a hibernated agent without input (``Agent.wake``); a no-op for any other."""

    agent: int

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            h.agent.wake()


@attrs.frozen
class CreateSameId(Instant):
    """Start creating an agent with the same session id: refused while it lives, else new."""

    agent: int

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is None:
            return
        sid, options = h.agent.id, h.agent.options

        async def create() -> None:
            try:
                new = await race.ctx.agents.create(session_id=sid, agent_options=options)
            except (SessionIdInUse, RuntimeClosed):
                return
            race.handles.append(new)

        race.nursery.start_soon(create)


@attrs.frozen
class Resume(Instant):
    """Start resuming the agent's session from the store once it is disposed (a suspended
    turn's calls can then be answered); refused while it lives."""

    agent: int

    def now(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is None or h.agent.status != "disposed":
            return
        sid = h.agent.id

        async def resume() -> None:
            try:
                new = await race.ctx.agents.resume(resume_session_id=sid, agent_options=OPTIONS)
            except (SessionIdInUse, RuntimeClosed, PersistenceUnavailable, SessionNotFound):
                return
            race.handles.append(new)

        race.nursery.start_soon(resume)


@attrs.frozen
class Spawn(Instant):
    """Spawn a sub-agent with ``ctx.subagents.spawn``; does nothing where that is absent."""

    text: str = "sub task"

    def now(self, race: Race) -> None:
        subagents = getattr(race.ctx, "subagents", None)
        if subagents is None:
            return

        async def spawn() -> None:
            try:
                new = await subagents.spawn(self.text, agent_options=OPTIONS)
            except (SessionIdInUse, RuntimeClosed):
                return
            except AgentDisposed as exc:
                # The parent was closed before (or while) the child was made: a refusal
                # that is part of the race.
                race.note(f"{self!r} was refused: {exc}")
                return
            race.handles.append(new)

        race.nursery.start_soon(spawn)


@attrs.frozen
class Together(Instant):
    """Several instant operations in one tick, with no scheduling point between them
    (``Together((Approve(0), Cancel(0)))``)."""

    ops: tuple[Instant, ...]

    def now(self, race: Race) -> None:
        for op in self.ops:
            op.now(race)


@attrs.frozen
class When(Instant):
    """Arm ``op`` to run synchronously the next time the race reaches ``point`` (one of
    :data:`POINTS`): mid-stream, mid-tool, or inside a handler at an extension point."""

    point: str
    op: Instant

    def now(self, race: Race) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown point {self.point!r}; known: {', '.join(POINTS)}")

        def fire() -> None:
            try:
                self.op.now(race)
            except AgentLoopError as exc:
                race.note(f"{self!r} was refused: {exc!r}")

        race.probe.arm(self.point, fire)


@attrs.frozen
class Hold(Instant):
    """The next time the race reaches the extension point ``point`` (a hook: not
    ``tool-start``, ``stream`` or ``status``), its handler awaits ``seconds`` of virtual time,
    as a plugin's slow hook would, so that later operations land inside it."""

    point: str
    seconds: float = 1.0

    def now(self, race: Race) -> None:
        if self.point not in HOOK_POINTS:
            raise ValueError(f"{self.point!r} is not a hook point; known: {', '.join(HOOK_POINTS)}")
        race.probe.holds[self.point] = self.seconds


@attrs.frozen
class WriteSetting:
    key: str = "agent-loop.max_parallel_tool_calls"
    value: object = 1

    async def apply(self, race: Race) -> None:
        # An invalid value is refused at the write and must change nothing.
        with contextlib.suppress(SettingsError):
            race.ctx.settings.set(self.key, self.value)


@attrs.frozen
class Advance:
    """Let ``seconds`` of virtual time pass."""

    seconds: float

    async def apply(self, race: Race) -> None:
        await trio.sleep(self.seconds)


@attrs.frozen
class Settle:
    """Wait until every task is blocked."""

    async def apply(self, race: Race) -> None:
        await trio.testing.wait_all_tasks_blocked()


@attrs.frozen
class Exit:
    """Leave the runtime now: later operations are skipped and nothing waits for quiescence,
    so running turns are disposed mid-flight (the closed-log checks still apply)."""

    async def apply(self, race: Race) -> None:
        race.state["exit"] = True
        await trio.lowlevel.checkpoint()


@attrs.frozen
class Crash:
    """The process dies after ``appends`` more log events (0: now): nothing later reaches
    the store, and a fresh runtime resumes every stored session and runs the rest."""

    appends: int = 0

    async def apply(self, race: Race) -> None:
        store = race.state.get("store")
        if store is None:
            race.note(f"{self!r} skipped: the race has no store of its own (config's persistence)")
            return
        store.crash_at = store.appends + self.appends
        if self.appends == 0:
            store.crash()
        await trio.lowlevel.checkpoint()


_FEED_CLASSES = (InboxInserted, InboxClaimed, InboxDiscarded, AgentStatus)


@attrs.define(eq=False)
class Feed:
    """A slow subscriber: what it was sent, what it received, what it was told it missed."""

    rx: Any = None
    emitted: int = 0
    received: int = 0
    missed: int = 0

    def drain(self) -> None:
        if self.rx is None:
            return
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            while True:
                self.take(self.rx.receive_nowait())

    def take(self, item: object) -> None:
        if isinstance(item, Lagged):
            self.missed += item.missed
        else:
            self.received += 1


@attrs.frozen
class Subscribe(Instant):
    """Subscribe to inbox and status events with a queue of ``capacity``, read one item
    every ``every`` seconds: what it misses must be told with ``Lagged`` markers."""

    capacity: int = 1
    every: float = 1.0

    def now(self, race: Race) -> None:
        feed = Feed()
        race.feeds.append(feed)
        race.background.start_soon(self._read, race, feed)

    async def _read(self, race: Race, feed: Feed) -> None:
        def count(_: object) -> None:
            feed.emitted += 1

        async with race.ctx.events.subscribe(_FEED_CLASSES, capacity=self.capacity) as rx:
            feed.rx = rx
            for cls in _FEED_CLASSES:
                race.ctx.events.on(cls, count)
            with contextlib.suppress(trio.EndOfChannel, trio.ClosedResourceError):
                while True:
                    feed.take(await rx.receive())
                    await trio.sleep(self.every)
