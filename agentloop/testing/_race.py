"""``run_race``: one example of a lifecycle race, in a fresh trio run on a virtual clock.

Operations and model behaviours are plain frozen values (hypothesis draws them in
:mod:`agentloop.testing.strategies`, but a test may also write a list by hand), and trio's
scheduling tie-breaks are seeded with ``seed``: a failing example prints as a call of
``run_race`` with its operations, script and seed, and that call replays it exactly.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import attrs
import trio
import trio.testing

from .._errors import SessionIdInUse
from .._events import (
    AgentCreated,
    AgentPreStep,
    AgentRequest,
    AgentStatus,
    AgentStepResult,
    AgentTurnContinuation,
    AgentTurnEnd,
    Event,
    InboxClaimed,
    InboxDiscarded,
    InboxInserted,
    ToolApproval,
    ToolPreExecute,
)
from .._events import AgentDisposed as AgentDisposedEvent
from .._runtime import open_runtime
from ._checks import check_history, check_inbox, check_log
from ._facts import check_facts, check_probe, check_released
from ._ops import (
    Advance,
    Approve,
    Cancel,
    Close,
    Crash,
    CreateSameId,
    Deny,
    Edit,
    Exit,
    Followup,
    Hibernate,
    Hold,
    Inject,
    Instant,
    Operation,
    Race,
    Remove,
    Resume,
    Settle,
    Spawn,
    Steer,
    Subscribe,
    Together,
    Wake,
    When,
    WriteSetting,
)
from ._racemodel import (
    DEFAULT_TOOLS,
    OPTIONS,
    PROVIDER,
    Behaviour,
    CallTools,
    Fail,
    MaxTokens,
    Probe,
    RaceModel,
    Say,
    Stall,
    Think,
    register_race_tools,
    reset_probe,
    set_probe,
)
from ._schedule import seeded
from ._store import RaceStore

if TYPE_CHECKING:
    from .._agent import Agent
    from .._agents import AgentHandle
    from .._context import Context

__all__ = [
    "Race", "Operation", "Instant", "run_race", "RaceModel", "DEFAULT_TOOLS", "DEFAULT_SCRIPT",
    "register_race_tools",
    # operations
    "Followup", "Steer", "Inject", "Edit", "Remove", "Cancel", "Close", "CreateSameId",
    "WriteSetting", "Advance", "Settle", "Spawn", "Exit", "Approve", "Deny", "Together",
    "When", "Resume", "Subscribe", "Crash", "Hold", "Hibernate", "Wake",
    # model behaviours
    "Say", "Think", "CallTools", "Fail", "Stall", "MaxTokens", "Behaviour",
]

DEFAULT_SCRIPT: tuple[Behaviour, ...] = (
    CallTools(("fast", "slow")), Stall(2.0, "thinking it over"), CallTools(("guarded",)), Say(),
)
"""What the race's model plays unless told otherwise: parallel tools, a stalled stream, a call
parked for approval, an answer."""

# Virtual time the end of a race lets pass, repeatedly, until nothing changes: longer than
# any kit tool, stall or disposal grace, so a plugin's own background work ends too.
QUIET = 600.0

Built: TypeAlias = "AgentHandle | Sequence[AgentHandle] | None"
Build: TypeAlias = "Callable[[Context], Awaitable[Built] | Built]"
Check: TypeAlias = "Callable[..., Awaitable[None] | None]"

# Extension points a When can fire at, by the event whose synchronous handler reaches them.
_POINT_EVENTS: tuple[tuple[str, type[Event]], ...] = (
    ("pre-step", AgentPreStep), ("request", AgentRequest), ("step-result", AgentStepResult),
    ("pre-execute", ToolPreExecute), ("approval", ToolApproval),
    ("continuation", AgentTurnContinuation), ("turn-end", AgentTurnEnd),
    ("status", AgentStatus),
)


@attrs.define(eq=False)
class _Example:
    """One example's inputs, and how far it got (for the report)."""

    ops: list[Operation]
    build: Build | None
    check: Check | None
    script: Sequence[Behaviour]
    agents: int
    config: Any
    plugins: Sequence[Any]
    providers: Sequence[Literal["openai", "anthropic"]]
    timeout: float
    kit_tools: bool
    probe: Probe
    applied: int = 0
    race: Race | None = None
    all_agents: dict[int, Agent] = attrs.field(factory=dict)
    # Every session object the race saw, by ``id()``: a resumed session's earlier objects too,
    # whose logs the kit checks as well (``race.sessions`` shows each session once).
    logs: dict[int, Any] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)  # every life's race notes into it


def run_race(
    operations: Iterable[Operation],
    *,
    build: Build | None = None,
    check: Check | None = None,
    script: Sequence[Behaviour] = DEFAULT_SCRIPT,
    agents: int = 2,
    config: Any = None,
    plugins: Sequence[Any] = (),
    providers: Sequence[Literal["openai", "anthropic"]] = ("openai", "anthropic"),
    timeout: float = 100_000,
    seed: int = 0,
    kit_tools: bool = True,
) -> None:
    """Run one example: a fresh ``trio.run`` on ``MockClock(autojump_threshold=0)``, with
    trio's scheduling tie-breaks seeded by ``seed``.

    Opens a runtime (``config``, ``plugins``) and registers the kit's tools
    (:func:`register_race_tools`, unless ``kit_tools=False``); awaits ``build(ctx)``: it may
    register models, tools and hooks, and returns the :class:`~agentloop.AgentHandle` (one or
    several) the operations act on, or ``None`` for ``agents`` agents ``"race-0"``,
    ``"race-1"``, ... on provider ``"race"``, served by a :class:`RaceModel` playing
    ``script`` unless ``build`` registered that provider. It applies the operations one by
    one with a scheduling point after each, then lets virtual time pass until nothing changes
    (quiescence: every agent idle, disposed, or waiting for answers to approval requests; a
    plugin's background work done), unless an :class:`Exit` ended the list. Then it checks
    every session the race saw (sub-agents included): :func:`check_log`,
    :func:`check_history` for each of ``providers`` (not for sessions with calls awaiting
    approval), :func:`check_inbox` over everything the inboxes did, and the kit's own facts
    (no tool body started after its turn's cancel, a cancelled turn never completes, no sent
    input stranded on an idle agent, refusals and status agree, slow subscribers told what
    they missed); then ``check(ctx, handles)`` or ``check(race)`` (sync or async); then it
    leaves the runtime (disposing every agent) and checks the logs again, with nothing
    appended after any agent's disposal and every agent's status ``"disposed"``.

    A :class:`Crash` ends the runtime's process: a fresh runtime runs ``build`` again,
    resumes every stored session it did not open, and applies the rest of the operations.

    Any failure raises ``AssertionError`` whose message is the ``run_race`` call that replays
    it (operations, script, seed), the original error chained.
    """
    example = _Example(
        list(operations), build, check, script, agents, config, plugins, providers, timeout,
        kit_tools, Probe(),
    )
    token = set_probe(example.probe)
    try:
        with seeded(seed):
            trio.run(_main, example, clock=trio.testing.MockClock(autojump_threshold=0))
    except Exception as exc:  # noqa: BLE001 - any failure of the example is reported with it
        error = _leaf(exc)
        raise AssertionError(_report(example, seed, error)) from error
    finally:
        reset_probe(token)


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _report(example: _Example, seed: int, error: BaseException) -> str:
    ops, applied = example.ops, example.applied
    lines = [f"run_race failed: {type(error).__name__}: {error}", "replay:",
             "    from agentloop.testing.strategies import *", "    run_race(["]
    for i, op in enumerate(ops):
        mark = "  # <- failed here" if i == applied and applied < len(ops) else ""
        lines.append(f"        {op!r},{mark}")
    lines.append(f"    ], script={list(example.script)!r}, seed={seed})")
    race = example.race
    if race is not None and race.notes:
        lines.append("notes:")
        lines.extend(f"  {n}" for n in race.notes)
    return "\n".join(lines)


async def _main(example: _Example) -> None:
    store: RaceStore | None = RaceStore()
    resumed = False
    while True:
        store = await _life(example, store, resumed=resumed)
        if store is None:
            return
        store, resumed = store.reopened(), True


async def _life(example: _Example, store: RaceStore | None, *, resumed: bool
                ) -> RaceStore | None:
    """One runtime's life; returns the store when the process crashed, to resume from."""
    async with open_runtime(example.config, plugins=example.plugins) as ctx:
        if ctx.session_persistence is None and store is not None:
            ctx.provide_persistence(store)
        else:
            store = None
        events = _record(ctx, example)
        handles = await (_resume(ctx, example, store) if resumed else _build(ctx, example))
        async with trio.open_nursery() as background:
            async with trio.open_nursery() as nursery:
                race = Race(ctx, handles, nursery, events, notes=example.notes,
                            probe=example.probe)
                race.background, race.state["store"] = background, store
                example.race = race
                _seen(race, example)
                await _apply(race, example)
            exiting = bool(race.state.get("exit")) or (store is not None and store.crashed)
            if not exiting:
                with trio.fail_after(example.timeout):
                    await _quiesce(race, example)
            # The process may die while the race settles too (an armed crash point).
            crashed = store is not None and store.crashed
            _seen(race, example)
            if not crashed:
                _check_race(race, example, quiescent=not exiting)
                await _user_check(race, example)
            background.cancel_scope.cancel()
    if crashed:
        assert store is not None
        for meta_events in store.sessions.values():
            check_log(meta_events[1], quiescent=False)
        example.all_agents.clear()
        example.logs.clear()
        return store
    _check_closed(race, example)
    return None


async def _resume(ctx: Context, example: _Example, store: RaceStore | None
                  ) -> list[AgentHandle]:
    # The fresh process runs the user's build again (its hooks, models and tools belong to
    # the runtime, and the crashed one took them along); a create of an id the store holds
    # is refused there, and the stored session is resumed instead.
    try:
        handles = list(await _user_build(ctx, example) or ())
    except SessionIdInUse as exc:
        handles = []
        example.notes.append(f"build, run again after the crash, was refused: {exc}")
    if store is None:
        return handles
    for info in sorted(await store.list(), key=lambda i: i.id):
        if info.parent_session_id is not None or ctx.agents.get(info.id) is not None:
            continue  # a resumed parent recovers its children
        try:
            handles.append(await ctx.agents.resume(resume_session_id=info.id,
                                                   agent_options=OPTIONS))
        except SessionIdInUse:
            continue
    return handles


def _record(ctx: Context, example: _Example) -> list[Any]:
    events: list[Any] = []
    for cls in (InboxInserted, InboxClaimed, InboxDiscarded):
        ctx.events.on(cls, events.append)
    probe = example.probe

    def created(e: AgentCreated) -> None:
        agent = ctx.agents.get(e.agent_id)
        if agent is not None:
            example.all_agents[id(agent)] = agent

    def disposed(e: AgentDisposedEvent) -> None:
        race = example.race
        for agent in example.all_agents.values():
            if agent.id == e.agent_id and race is not None:
                race.disposed_at.setdefault(id(agent.session), len(agent.session.events))

    ctx.events.on(AgentCreated, created)
    ctx.events.on(AgentDisposedEvent, disposed)
    used = _points_used(example.ops)
    for point, hook in _POINT_EVENTS:
        if point not in used:
            # A handler at every point would keep every race off the paths the runtime takes
            # when nobody hooks in (a step's plain tool pass, a request without rewrite):
            # the paths an application without hooks runs.
            continue
        handler: Callable[[Event], object] = (
            _at(probe, point) if hook.kind == "hook" else _reach(probe, point)
        )
        ctx.events.on(hook, handler)
    return events


def _points_used(ops: Iterable[object]) -> set[str]:
    """The points the operations fire at or hold (``When``, ``Hold``, also inside ``When``
    and ``Together``)."""
    used: set[str] = set()
    pending = list(ops)
    while pending:
        op = pending.pop()
        point = getattr(op, "point", None)
        if isinstance(point, str):
            used.add(point)
        inner = getattr(op, "op", None)
        if inner is not None:
            pending.append(inner)
        pending.extend(getattr(op, "ops", None) or ())
    return used


def _reach(probe: Probe, point: str) -> Callable[[Event], None]:
    def reach(_: Event) -> None:
        probe.reach(point)

    return reach


def _at(probe: Probe, point: str) -> Callable[[Event], Awaitable[None]]:
    async def at(_: Event) -> None:
        probe.reach(point)
        seconds = probe.holds.pop(point, None)
        if seconds is not None:
            await trio.sleep(seconds)  # a plugin's slow hook: later operations land inside

    return at


async def _user_build(ctx: Context, example: _Example) -> list[AgentHandle] | None:
    """The kit's tools, then the user's ``build``, then the race's model where build left
    the provider free: the handles build returned, or ``None``."""
    if example.kit_tools:
        register_race_tools(ctx)
    built: Any = None
    if example.build is not None:
        built = example.build(ctx)
        if inspect.isawaitable(built):
            built = await built
    if ctx.llm.adapter(PROVIDER) is None:
        ctx.llm.register(PROVIDER, RaceModel(example.script))
    if built is None:
        return None
    return list(built) if isinstance(built, Sequence) else [built]


async def _build(ctx: Context, example: _Example) -> list[AgentHandle]:
    built = await _user_build(ctx, example)
    if built is not None:
        return built
    return [
        await ctx.agents.create(session_id=f"race-{i}", agent_options=OPTIONS)
        for i in range(example.agents)
    ]


def _seen(race: Race, example: _Example) -> None:
    for h in race.handles:
        example.all_agents.setdefault(id(h.agent), h.agent)
    for agent in example.all_agents.values():
        example.logs.setdefault(id(agent.session), agent.session)
        # The agent seen last holds the session's latest log: a resumed session's log
        # continues the one its disposed agent wrote, so each session is shown once.
        race.sessions[agent.session.id] = agent.session
    race.agents[:] = example.all_agents.values()


async def _apply(race: Race, example: _Example) -> None:
    store = race.state.get("store")
    while example.applied < len(example.ops):
        await example.ops[example.applied].apply(race)
        await trio.lowlevel.checkpoint()
        example.applied += 1
        if race.state.get("exit") or (store is not None and store.crashed):
            break


def _fingerprint(example: _Example) -> tuple[Any, ...]:
    return tuple(
        (a.id, a.status, len(a.session.events), len(a.pending_approvals))
        for a in example.all_agents.values()
    )


def _settled(agent: Agent) -> bool:
    return agent.status != "running" or bool(agent.pending_approvals)


async def _quiesce(race: Race, example: _Example) -> None:
    """Let time pass until nothing changes and every agent is idle, disposed or parked."""
    while True:
        for agent in list(example.all_agents.values()):
            if agent.status == "running":
                await agent.wait_idle()
        before = _fingerprint(example)
        await trio.sleep(QUIET)
        await trio.testing.wait_all_tasks_blocked()
        _seen(race, example)
        if before == _fingerprint(example) and all(
            _settled(a) for a in example.all_agents.values()
        ):
            return


async def _user_check(race: Race, example: _Example) -> None:
    check = example.check
    if check is None:
        return
    wants_race = len(inspect.signature(check).parameters) == 1
    result = check(race) if wants_race else check(race.ctx, race.handles)
    if inspect.isawaitable(result):
        await result


def _check_race(race: Race, example: _Example, *, quiescent: bool) -> None:
    live = [a for a in example.all_agents.values() if a.status != "disposed"]
    for session in example.logs.values():
        agent = next((a for a in example.all_agents.values() if a.session is session), None)
        parked = agent is not None and bool(agent.pending_approvals)
        _check_session(session, example.providers, quiescent=quiescent and not parked,
                       history=quiescent and not session.awaiting_approval)
    pending = [m for a in live for m in (*a.inbox.next_turn, *a.inbox.next_step)]
    check_inbox(race.events, pending=pending)
    check_facts(race, live, quiescent=quiescent)


def _check_closed(race: Race, example: _Example) -> None:
    for key, session in example.logs.items():
        _check_session(session, (), disposed_at=race.disposed_at.get(key), closed=True)
    for agent in example.all_agents.values():
        if agent.status != "disposed":
            raise AssertionError(f"agent {agent.id!r} reads status {agent.status!r} after its "
                                 "runtime closed; expected 'disposed'")
    check_probe(race)
    check_released(race)


def _check_session(
    session: Any, providers: Sequence[Literal["openai", "anthropic"]], *,
    quiescent: bool = True, history: bool = True, disposed_at: int | None = None,
    closed: bool = False,
) -> None:
    where = f"session {session.id!r}{' after the runtime closed' if closed else ''}: "
    try:
        check_log(session, quiescent=quiescent, disposed_at=disposed_at)
        if history:
            for provider in providers:
                check_history(session.messages(), provider)
    except AssertionError as exc:
        raise AssertionError(where + str(exc)) from None

