"""``run_race``: one example of a lifecycle race, in a fresh trio run on a virtual clock.

Operations and model behaviours are plain frozen values (hypothesis draws them in
:mod:`agentloop.testing.strategies`, but a test may also write a list by hand), so a failing
example prints as the list of what was done and replays by passing that list again.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, runtime_checkable

import attrs
import trio
import trio.testing

from .._errors import (
    AgentDisposed,
    ProviderError,
    RuntimeClosed,
    SessionIdInUse,
    SettingsError,
)
from .._events import AgentCreated, InboxClaimed, InboxDiscarded, InboxInserted
from .._events import AgentDisposed as AgentDisposedEvent
from .._model import (
    AgentOptions,
    Finish,
    LLMRequest,
    ReasoningDelta,
    StreamPart,
    TextDelta,
    ToolCallDelta,
)
from .._runtime import open_runtime
from .._tools import Tool
from ..llm._base import ModelAdapter
from ._checks import check_history, check_inbox, check_log
from ._doubles import example_arguments

if TYPE_CHECKING:
    from .._agents import AgentHandle
    from .._context import Context
    from .._session import Session

__all__ = [
    "Race", "Operation", "run_race", "RaceModel", "DEFAULT_TOOLS", "register_race_tools",
    # operations
    "Followup", "Steer", "Inject", "Edit", "Remove", "Cancel", "Close", "CreateSameId",
    "WriteSetting", "Advance", "Settle", "Spawn", "Exit",
    # model behaviours
    "Say", "Think", "CallTools", "Fail", "Stall", "MaxTokens", "Behaviour",
]

PROVIDER = "race"
OPTIONS = AgentOptions(provider=PROVIDER, model="race-model")
DEFAULT_TOOLS = ("fast", "slow", "excl")
# A turn that keeps calling tools is cut short after this many steps, so every example ends.
MAX_TOOL_STEPS = 3


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
    sessions: dict[int, Session] = attrs.field(factory=dict)
    disposed_at: dict[int, int] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    """Free text for the failure report (``race.note(...)``)."""
    state: dict[str, Any] = attrs.field(factory=dict)
    """Scratch space for your own operations (empty when the race starts)."""

    def handle(self, index: int) -> AgentHandle | None:
        """The handle ``index`` modulo the number of handles (``None`` when there are none)."""
        if not self.handles:
            return None
        return self.handles[index % len(self.handles)]

    def note(self, text: str) -> None:
        self.notes.append(text)


# --- operations ------------------------------------------------------------------------------


def _tolerated(fn: Callable[[], object]) -> None:
    # Acting on an agent that is already disposed is refused, and that is part of the race.
    with contextlib.suppress(AgentDisposed):
        fn()


@attrs.frozen
class Followup:
    agent: int
    text: str = "hello"

    async def apply(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            _tolerated(lambda: h.agent.followup(self.text))


@attrs.frozen
class Steer:
    agent: int
    text: str = "steer"

    async def apply(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            _tolerated(lambda: h.agent.steer(self.text))


@attrs.frozen
class Inject:
    agent: int
    text: str = "note"

    async def apply(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            _tolerated(lambda: h.agent.inject(self.text))


def _pending(h: AgentHandle, pick: int) -> str | None:
    inbox = h.agent.inbox
    pending = [*inbox.next_turn, *inbox.next_step]
    return pending[pick % len(pending)].id if pending else None


@attrs.frozen
class Edit:
    """Edit the ``pick``-th pending message (modulo), if there is one."""

    agent: int
    pick: int = 0
    text: str = "edited"

    async def apply(self, race: Race) -> None:
        h = race.handle(self.agent)
        mid = _pending(h, self.pick) if h is not None else None
        if h is not None and mid is not None:
            _tolerated(lambda: h.agent.edit(mid, self.text))


@attrs.frozen
class Remove:
    """Remove the ``pick``-th pending message (modulo), if there is one."""

    agent: int
    pick: int = 0

    async def apply(self, race: Race) -> None:
        h = race.handle(self.agent)
        mid = _pending(h, self.pick) if h is not None else None
        if h is not None and mid is not None:
            _tolerated(lambda: h.agent.remove(mid))


@attrs.frozen
class Cancel:
    agent: int
    keep_inbox: bool = False

    async def apply(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            h.agent.cancel(keep_inbox=self.keep_inbox)


@attrs.frozen
class Close:
    """Start closing the agent's handle; it reaches quiescence while later operations run."""

    agent: int

    async def apply(self, race: Race) -> None:
        h = race.handle(self.agent)
        if h is not None:
            race.nursery.start_soon(h.aclose)


@attrs.frozen
class CreateSameId:
    """Start creating an agent with the same session id: refused while it lives, else new."""

    agent: int

    async def apply(self, race: Race) -> None:
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
class Spawn:
    """Spawn a sub-agent with ``ctx.subagents.spawn``; does nothing where that is absent."""

    text: str = "sub task"

    async def apply(self, race: Race) -> None:
        subagents = getattr(race.ctx, "subagents", None)
        if subagents is None:
            return

        async def spawn() -> None:
            try:
                new = await subagents.spawn(self.text, agent_options=OPTIONS)
            except (SessionIdInUse, RuntimeClosed):
                return
            race.handles.append(new)

        race.nursery.start_soon(spawn)


# --- model behaviours ------------------------------------------------------------------------


@attrs.frozen
class Say:
    text: str = "ok"


@attrs.frozen
class Think:
    reasoning: str = "hmm"
    text: str = "ok"


@attrs.frozen
class CallTools:
    """Call these tools (in one reply); arguments come from each tool's schema."""

    names: tuple[str, ...]
    text: str = ""


@attrs.frozen
class Fail:
    """Fail the call with ``ProviderError(status)`` after streaming ``after`` text chunks."""

    status: int | None = 500
    after: int = 0


@attrs.frozen
class Stall:
    """Wait ``seconds`` (virtual) before streaming ``text``, a chunk every ``seconds``."""

    seconds: float
    text: str = "slow answer"


@attrs.frozen
class MaxTokens:
    text: str = "cut"


Behaviour = Say | Think | CallTools | Fail | Stall | MaxTokens


def _words(text: str) -> list[str]:
    return [w + " " for w in text.split()] or ([text] if text else [])


class RaceModel(ModelAdapter):
    """An adapter playing a script of behaviours, one per call, cycling through it.

    A turn that has called tools for ``MAX_TOOL_STEPS`` steps gets a plain answer instead,
    so every turn ends. Records every request in ``.requests``.
    """

    def __init__(self, script: Sequence[Behaviour] = (Say(),)) -> None:
        self.script = tuple(script) or (Say(),)
        self.requests: list[LLMRequest] = []

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        behaviour = self.script[len(self.requests) % len(self.script)]
        self.requests.append(request)
        if isinstance(behaviour, CallTools) and request.step > MAX_TOOL_STEPS:
            behaviour = Say("enough tools")
        return self._play(behaviour, request)

    async def _play(self, b: Behaviour, request: LLMRequest) -> AsyncIterator[StreamPart]:
        await trio.lowlevel.checkpoint()
        if isinstance(b, Stall):
            for piece in _words(b.text):
                await trio.sleep(b.seconds)
                yield TextDelta(piece)
            yield Finish("stop")
        elif isinstance(b, Fail):
            for i in range(b.after):
                await trio.lowlevel.checkpoint()
                yield TextDelta(f"part{i} ")
            raise ProviderError(status=b.status, code="race_failure")
        elif isinstance(b, CallTools):
            for piece in _words(b.text):
                yield TextDelta(piece)
            specs = {s.name: s for s in request.tools}
            for i, name in enumerate(b.names):
                await trio.lowlevel.checkpoint()
                spec = specs.get(name)
                arguments = example_arguments(spec.parameters) if spec is not None else {}
                yield ToolCallDelta(i, id=f"call_{request.turn}_{request.step}_{i}", name=name,
                                    arguments=json.dumps(arguments))
            yield Finish("tool_calls" if b.names else "stop")
        else:
            if isinstance(b, Think):
                for piece in _words(b.reasoning):
                    await trio.lowlevel.checkpoint()
                    yield ReasoningDelta(piece)
            for piece in _words(b.text):
                await trio.lowlevel.checkpoint()
                yield TextDelta(piece)
            yield Finish("max_tokens" if isinstance(b, MaxTokens) else "stop")


def _sleeper(seconds: float, answer: str) -> Callable[..., Awaitable[str]]:
    async def run() -> str:
        await trio.sleep(seconds)
        return answer

    return run


def register_race_tools(ctx: Context) -> None:
    """The kit's tools: ``fast`` and ``slow`` (parallel, 1 s and 5 s), ``excl`` (2 s)."""
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    for name, seconds, concurrency in (
        ("fast", 1, "parallel"), ("slow", 5, "parallel"), ("excl", 2, "exclusive"),
    ):
        ctx.tools.register(Tool(
            name=name, description=f"Answers after {seconds} s ({concurrency}).",
            parameters=no_arguments, run=_sleeper(seconds, name),
            concurrency=concurrency,  # type: ignore[arg-type]
        ))


# --- running one example ---------------------------------------------------------------------

Built: TypeAlias = "Sequence[AgentHandle] | None"
Build: TypeAlias = "Callable[[Context], Awaitable[Built] | Built]"
Check: TypeAlias = "Callable[[Context, Sequence[AgentHandle]], Awaitable[None] | None]"


def _report(
    ops: Sequence[Operation], applied: int, script: Sequence[Behaviour], race: Race | None,
    error: BaseException,
) -> str:
    lines = [f"run_race failed: {type(error).__name__}: {error}", "operations:"]
    for i, op in enumerate(ops):
        mark = "  <- failed here" if i == applied and applied < len(ops) else ""
        lines.append(f"  {i + 1:>3}. {op!r}{mark}")
    lines.append(f"model script: {list(script)!r}")
    if race is not None and race.notes:
        lines.append("notes:")
        lines.extend(f"  {n}" for n in race.notes)
    return "\n".join(lines)


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def run_race(
    operations: Iterable[Operation],
    *,
    build: Build | None = None,
    check: Check | None = None,
    script: Sequence[Behaviour] = (Say(),),
    agents: int = 2,
    config: Any = None,
    plugins: Sequence[Any] = (),
    providers: Sequence[Literal["openai", "anthropic"]] = ("openai", "anthropic"),
    timeout: float = 100_000,
) -> None:
    """Run one example: a fresh ``trio.run`` on ``MockClock(autojump_threshold=0)``.

    Opens a runtime (``config``, ``plugins``), awaits ``build(ctx)`` (it may register models,
    tools and hooks, and returns the :class:`~agentloop.AgentHandle` s the operations act
    on), or, when ``build`` is ``None`` or returns ``None``, creates ``agents`` agents
    ``"race-0"``, ``"race-1"``, ... on provider ``"race"`` (served by a :class:`RaceModel`
    playing ``script`` unless ``build`` registered that provider) with the kit's tools (when
    ``build`` is ``None``). Then it applies the operations one by one with a scheduling point
    after each, waits for overlapping work and for every live agent to go idle (not after an
    :class:`Exit` operation, which leaves the runtime with turns in flight), and checks:
    :func:`check_log` on every session seen, :func:`check_history` for each of ``providers``,
    :func:`check_inbox` over everything the inboxes did; then ``check(ctx, handles)`` (sync
    or async); then it leaves the runtime (disposing every agent) and checks the logs again,
    with nothing appended after any agent's disposal.

    Any failure raises ``AssertionError`` whose message lists the operations and the model
    script (and the original error chained), so hypothesis can shrink it and a person can
    replay it by passing the same list.
    """
    ops = list(operations)
    state: dict[str, Any] = {"applied": 0, "race": None}

    async def main() -> None:
        seen = _Seen()
        async with open_runtime(config, plugins=plugins) as ctx:
            seen.watch(ctx)
            handles = await _build_agents(ctx, build, script, agents)
            async with trio.open_nursery() as nursery:
                race = Race(ctx, handles, nursery, seen.events, seen.sessions, seen.disposed_at)
                state["race"] = race
                for op in ops:
                    await op.apply(race)
                    await trio.lowlevel.checkpoint()
                    state["applied"] += 1
                    if race.state.get("exit"):
                        break
            exiting = bool(race.state.get("exit"))
            if not exiting:
                with trio.fail_after(timeout):
                    await _wait_idle(handles)
            await _check_live(ctx, handles, seen, providers, check, quiescent=not exiting)
        _check_sessions(seen.sessions, seen.disposed_at, providers, closed=True)

    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    except Exception as exc:  # noqa: BLE001 - any failure of the example is reported with it
        error = _leaf(exc)
        raise AssertionError(
            _report(ops, state["applied"], script, state["race"], error)
        ) from error


@attrs.define(eq=False)
class _Seen:
    """What a race records as it runs: the inbox events, every session an agent was created
    on (by ``id``), and each one's length when its agent was disposed."""

    events: list[Any] = attrs.field(factory=list)
    sessions: dict[int, Session] = attrs.field(factory=dict)
    latest: dict[str, Session] = attrs.field(factory=dict)  # agent id -> its newest session
    disposed_at: dict[int, int] = attrs.field(factory=dict)

    def watch(self, ctx: Context) -> None:
        for cls in (InboxInserted, InboxClaimed, InboxDiscarded):
            ctx.events.on(cls, self.events.append)

        def created(e: AgentCreated) -> None:
            agent = ctx.agents.get(e.agent_id)
            if agent is not None:
                self.sessions[id(agent.session)] = self.latest[e.agent_id] = agent.session

        def disposed(e: AgentDisposedEvent) -> None:
            session = self.latest.get(e.agent_id)
            if session is not None:
                self.disposed_at.setdefault(id(session), len(session.events))

        ctx.events.on(AgentCreated, created)
        ctx.events.on(AgentDisposedEvent, disposed)


async def _build_agents(
    ctx: Context, build: Build | None, script: Sequence[Behaviour], agents: int
) -> list[AgentHandle]:
    """The handles the operations act on: ``build``'s, or ``agents`` new ones on ``"race"``."""
    built: Any = None
    if build is not None:
        built = build(ctx)
        if inspect.isawaitable(built):
            built = await built
    else:
        register_race_tools(ctx)
    if ctx.llm.adapter(PROVIDER) is None:
        ctx.llm.register(PROVIDER, RaceModel(script))
    if built is None:
        built = [
            await ctx.agents.create(session_id=f"race-{i}", agent_options=OPTIONS)
            for i in range(agents)
        ]
    return list(built)


async def _wait_idle(handles: list[AgentHandle]) -> None:
    """Every live agent idle, then every task blocked."""
    for h in list(handles):
        if h.agent.status != "disposed":
            await h.agent.wait_idle()
    await trio.testing.wait_all_tasks_blocked()


async def _check_live(
    ctx: Context, handles: list[AgentHandle], seen: _Seen,
    providers: Sequence[Literal["openai", "anthropic"]], check: Check | None, *,
    quiescent: bool,
) -> None:
    """The checks made before the runtime closes: logs, histories, inbox fates, ``check``."""
    live = [h.agent for h in handles if h.agent.status != "disposed"]
    pending = [m for a in live for m in (*a.inbox.next_turn, *a.inbox.next_step)]
    for h in handles:
        seen.sessions.setdefault(id(h.agent.session), h.agent.session)
    _check_sessions(seen.sessions, seen.disposed_at, providers, quiescent=quiescent)
    check_inbox(seen.events, pending=pending)
    if check is not None:
        result = check(ctx, handles)
        if inspect.isawaitable(result):
            await result


def _check_sessions(
    sessions: dict[int, Session], disposed_at: dict[int, int],
    providers: Sequence[Literal["openai", "anthropic"]], *, closed: bool = False,
    quiescent: bool = True,
) -> None:
    for key, session in sessions.items():
        where = f"session {session.id!r}{' after the runtime closed' if closed else ''}: "
        try:
            check_log(session, quiescent=quiescent,
                      disposed_at=disposed_at.get(key) if closed else None)
            if not quiescent:
                continue  # a turn in flight may hold calls not answered yet
            for provider in providers:
                check_history(session.messages(), provider)
        except AssertionError as exc:
            raise AssertionError(where + str(exc)) from None

