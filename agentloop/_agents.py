"""The supervisor side of agents: creation as a transaction, handles, teardown, registries.

Creation prepares privately (session, agent, scope, setup), enters both registries in one
synchronous step, announces ``session/created``, ``agent/created``, ``agent/session-start``, and
only then starts the driver. Anything that fails or is cancelled before the entry rolls back
what was prepared. Teardown runs stop and drain -> unwind the agent's scope -> detach agent ->
detach session, once, and every way of asking for it waits for the same boundary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, Protocol, Self, cast, final

import attrs
import trio

from ._agent import CLOSE_GRACE, Agent, _freeze_content, current_agent, life_of
from ._bus import Disposer
from ._errors import AgentDisposed as AgentDisposedError
from ._errors import (
    AgentLoopError,
    InvalidContent,
    InvalidOptions,
    PersistenceUnavailable,
    RuntimeClosed,
    ScopeClosed,
    SessionIdInUse,
    SessionNotFound,
    SettingsError,
)
from ._events import (
    AgentCreated,
    AgentDisposed,
    AgentSessionStart,
    SessionCreated,
    SessionDisposed,
)
from ._inbox import TARGETS
from ._inputs import check_meta, check_seed
from ._json import FrozenDict, freeze
from ._lifecycle import Lifecycle
from ._model import AgentOptions, CallConfig, SessionEvent
from ._services import LeaseClaim, Services
from ._session import Session, recover_crashed_turn, validate_session_id
from ._settings import CRASHED_TURN
from ._tail import SessionTail
from ._util import NoPublicConstructor, construct

__all__ = [
    "AgentHandle", "AgentsService", "AgentLoopService", "SessionsService", "SubagentLimitExceeded",
    "Scope", "Supervisor", "MAX_DEPTH", "MAX_CHILDREN",
]

log = logging.getLogger("agentloop")


class Scope(Protocol):
    """What the supervisor's side needs of a :class:`~agentloop.Context` (which is above it)."""

    name: str
    agent_id: str | None

    @property
    def closed(self) -> bool: ...
    @property
    def closing(self) -> bool: ...
    def child(self, name: str, *, agent_id: str | None = None) -> Scope: ...
    def agent_scope(self, agent_id: str, *, closed: bool = False) -> Scope: ...
    def own(self, resource: AgentHandle) -> None: ...
    def disown(self, resource: AgentHandle) -> None: ...
    def track(self, disposer: Disposer) -> Disposer: ...
    def close_registrations(self) -> None: ...
    async def aclose(self) -> None: ...


Setup = Callable[[Any], Awaitable[None]]

MAX_DEPTH: Final = "subagents.max_depth"
MAX_CHILDREN: Final = "subagents.max_children"
_LIMIT_DEFAULTS: Final = {MAX_DEPTH: 3, MAX_CHILDREN: 8}


class SubagentLimitExceeded(AgentLoopError):  # noqa: N818 - reads as a state
    """A sub-agent would exceed ``subagents.max_depth`` or ``subagents.max_children``."""


def subagent_limit(services: Services, key: str) -> int:
    """The current value of a sub-agent limit setting (its default while it is unregistered)."""
    try:
        value: object = services.settings.get(key)
    except SettingsError:
        value = _LIMIT_DEFAULTS[key]
    return check_limit(value, key)


def check_limit(value: object, key: str) -> int:
    """The write-time validation of a sub-agent limit."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SettingsError(f"{key}: must be a positive integer, got {value!r}")
    return value


def _check_id(session_id: object, what: str = "session_id") -> str:
    return validate_session_id(session_id, what)


def _freeze_meta(meta: Mapping[str, Any] | None) -> FrozenDict:
    if meta is None:
        return FrozenDict()
    if not isinstance(meta, Mapping):
        raise InvalidContent(f"meta: must be a mapping, got {type(meta).__name__}")
    frozen = freeze(meta, path="meta")
    assert isinstance(frozen, FrozenDict)
    check_meta(frozen)
    return frozen


def _seed_events(seed: Sequence[Any] | None) -> list[SessionEvent]:
    """Validate a forked prefix: ``SessionEvent`` values or ``{"type", "data", "turn"?}``."""
    out: list[SessionEvent] = []
    for i, item in enumerate(seed or ()):
        type_: object
        turn: object
        payload: object
        if isinstance(item, SessionEvent):
            type_, turn, payload = item.type, item.turn, item.data
        elif isinstance(item, Mapping):
            type_, turn, payload = item.get("type"), item.get("turn"), item.get("data", {})
        else:
            raise InvalidContent(f"seed[{i}]: must be a SessionEvent or a mapping, got {item!r}")
        if not isinstance(type_, str) or not type_:
            raise InvalidContent(f"seed[{i}].type: must be a non-empty string, got {type_!r}")
        if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int)):
            raise InvalidContent(f"seed[{i}].turn: must be an integer or null, got {turn!r}")
        frozen = freeze(payload, path=f"seed[{i}].data")
        if not isinstance(frozen, FrozenDict):
            raise InvalidContent(f"seed[{i}].data: must be an object, got {payload!r}")
        out.append(SessionEvent(i + 1, type_, turn, frozen))
    check_seed(out)
    return out


@final
class AgentHandle(metaclass=NoPublicConstructor):
    """The owner's capability over one agent: ``aclose()`` tears down exactly that agent.

    ``aclose`` is idempotent and memoized; it returns only at quiescence: the driver stopped
    (a running turn ended ``disposed``), closing events were flushed, and the agent and its
    session left the registries. ``ctx`` is the agent's own scope (what its ``setup``
    registered, its sub-agents and jobs): only the handle holder has it.
    """

    __slots__ = ("_life", "_owner", "agent")

    def __init__(self, agent: Agent, life: Lifecycle) -> None:
        self.agent = agent
        self._life = life
        self._owner: Scope | None = None

    def __repr__(self) -> str:
        return f"<AgentHandle {self.agent.id!r}>"

    @property
    def ctx(self) -> Any:
        """The agent's scope (a :class:`~agentloop.Context`)."""
        return self._life.scope

    def owned_by(self, owner: Scope) -> None:
        """Enter the owner's scope: it closes this handle when it closes."""
        owner.own(self)
        self._owner = owner

    async def aclose(self) -> None:
        await self._life.dispose()
        if self._owner is not None:
            self._owner.disown(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Reply:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


@attrs.frozen(slots=True, eq=False)
class _Enter:
    agent: Agent
    life: Lifecycle
    handle: AgentHandle
    owner: Scope
    reply: _Reply
    parent: Agent | None = None


@attrs.frozen(slots=True, eq=False)
class _Detach:
    agent: Agent


class Supervisor:
    """The supervisor actor: the only writer of the agent and session registries.

    It runs as the task ``agentloop.supervisor`` for the runtime's lifetime and owns the
    nursery every top-level agent actor runs in. Creators prepare privately and send an entry
    request; an agent actor that reaches quiescence sends a detach request. Both are applied in
    the order they arrive, each in one synchronous step, so same-id contenders are arbitrated
    by arrival and a detach only ever removes the exact entry it names.
    """

    def __init__(self, services: Services) -> None:
        self._services = services
        self._tx, self._rx = trio.open_memory_channel[_Enter | _Detach](math.inf)
        self._actors: trio.Nursery | None = None
        self.agents: dict[str, Agent] = {}
        self.sessions: dict[str, Session] = {}
        # The agents being prepared, so a setup's children find their parent. Every agent's
        # lifecycle (which holds its scope) is its own (life_of), active from preparation
        # to quiescence: no table here keeps one per agent.
        self._preparing: dict[Agent, None] = {}
        # The tree: each live child under its parent's id, and each child's parent.
        self.children: dict[str, dict[str, Agent]] = {}
        # Parents with a child being created (by id, how many): they do not hibernate.
        self._expected: dict[str, int] = {}
        self.parent_of: dict[str, Agent] = {}
        # Background jobs by id (``ctx.jobs``), entered and removed by their owners (the
        # sub-agents module, a layer above in spirit, which alone knows what a job is).
        self.jobs: dict[str, object] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as actors:
            self._actors = actors
            task_status.started()
            async with self._rx:
                async for request in self._rx:
                    # Nothing a request does may take the supervisor down with it.
                    try:
                        if isinstance(request, _Enter):
                            self._apply_enter(request)
                        else:
                            self._apply_detach(request.agent)
                    except Exception:
                        log.exception("supervisor: a %s request failed", type(request).__name__)
                    del request  # a detached agent must not live on until the next request

    def close(self) -> None:
        """No more requests (runtime exit, once every agent is quiescent)."""
        self._tx.close()

    # --- asked by the other parts --------------------------------------------------------

    def prepare(self, services: Services, session: Session, options: AgentOptions | None,
                owner: Scope, *, cwd: str | None, resumed: bool = False,
                proposal: CallConfig | None = None) -> tuple[Agent, Lifecycle]:
        """A private agent and its lifecycle (its scope, a child of ``owner``'s, is made
        when first used: ``life.scope``)."""
        life = Lifecycle(services.system_nursery, self, session.id, owner)
        agent = construct(Agent, services, session, options or AgentOptions(), life, cwd=cwd,
                          resumed=resumed, proposal=proposal)
        self._preparing[agent] = None
        return agent, life

    @staticmethod
    def _life(agent: Agent) -> Lifecycle | None:
        """``agent``'s lifecycle from its preparation to its quiescence (else None)."""
        life = life_of(agent)
        return life if life.active else None

    def forget(self, agent: Agent) -> None:
        """A preparation rolled back: the agent never was."""
        life = self._life(agent)
        if life is not None:
            life.abandon()
            self._preparing.pop(agent, None)

    def cancel_children(self, agent_id: str) -> None:
        """Cancel the running turn of every live child of ``agent_id`` (cause ``parent``)."""
        for child in list(self.children.get(agent_id, {}).values()):
            if child.status == "running":
                child.cancel("parent")

    def has_children(self, agent_id: str) -> bool:
        return bool(self.children.get(agent_id)) or agent_id in self._expected

    @contextlib.contextmanager
    def expecting(self, parent: Agent | None) -> Iterator[None]:
        """A child of ``parent`` is being created: its actor will run in the parent's, so a
        hibernated parent is woken, and stays awake until the child is entered (or not)."""
        if parent is None:
            yield
            return
        parent.wake()  # its actor is up by the entry, after the awaits of lease and store
        self._expected[parent.id] = self._expected.get(parent.id, 0) + 1
        try:
            yield
        finally:
            left = self._expected[parent.id] - 1
            if left:
                self._expected[parent.id] = left
            else:
                del self._expected[parent.id]

    def rested(self, agent: Agent) -> None:
        """``agent`` hibernated: its in-memory session is released (it reloads on a wake)."""
        if self.agents.get(agent.id) is agent:
            self.sessions.pop(agent.id, None)

    def woken(self, agent: Agent, session: Session) -> None:
        """``agent`` was reloaded from the store: its session is live again."""
        if self.agents.get(agent.id) is agent:
            self.sessions[agent.id] = session

    def agent_of(self, scope: Scope) -> Agent | None:
        """The agent (live or being prepared) whose own scope ``scope`` is."""
        agent_id = scope.agent_id
        if agent_id is None:
            return None
        live = self.agents.get(agent_id)
        if live is not None and life_of(live).made_scope is scope:
            return live
        for agent in self._preparing:  # same-id contenders: told apart by their scope
            if agent.id == agent_id and life_of(agent).made_scope is scope:
                return agent
        return None

    def scope_of(self, agent: Agent) -> Scope | None:
        life = self._life(agent)
        return None if life is None else cast("Scope", life.scope)

    def made_scope_of(self, agent: Agent) -> Scope | None:
        """``agent``'s scope if it was used (else None: it owns nothing to close)."""
        life = self._life(agent)
        return None if life is None else cast("Scope | None", life.made_scope)

    def disposing(self, agent: Agent) -> bool:
        life = self._life(agent)
        return life is None or life.disposing

    def nursery_for(self, agent: Agent | None) -> trio.Nursery:
        """Where work owned by ``agent`` runs: its actor's nursery (else the supervisor's)."""
        life = self._life(agent) if agent is not None else None
        if life is not None and life.nursery is not None:
            return life.nursery
        assert self._actors is not None
        return self._actors

    async def start_early(self, agent: Agent, parent: Agent | None) -> None:
        """Start ``agent``'s actor before publication (its setup spawns children under it)."""
        await life_of(agent).start_actor_early(self.nursery_for(parent))

    async def dispose(self, agent: Agent) -> None:
        life = self._life(agent)
        if life is not None:
            await life.dispose()

    def all_agents(self) -> list[Agent]:
        return list(self.agents.values())

    def preparing(self, session_id: str) -> Agent | None:
        """An agent being prepared under this id (its children join the tree before it)."""
        for agent in self._preparing:
            if agent.id == session_id:
                return agent
        return None

    # --- entry and detach ------------------------------------------------------------------

    def _child_nursery(self, agent: Agent, parent: Agent) -> trio.Nursery:
        """Where a child's actor runs: its parent's nursery, checked against the limits."""
        if self.disposing(parent):
            raise AgentDisposedError(
                f"agent {parent.id!r} is disposed; it cannot start sub-agent {agent.id!r}"
            )
        limit = subagent_limit(self._services, MAX_CHILDREN)
        if len(self.children.get(parent.id, ())) >= limit:
            raise SubagentLimitExceeded(
                f"agent {parent.id!r} already has {limit} live sub-agents "
                f"({MAX_CHILDREN} = {limit}); wait for one to finish or close one"
            )
        return self.nursery_for(parent)

    async def enter(self, agent: Agent, handle: AgentHandle, owner: Scope,
                    parent: Agent | None = None) -> None:
        """Ask for publication and wait for the verdict (``SessionIdInUse`` for a loser)."""
        reply = _Reply()
        self._tx.send_nowait(_Enter(agent, life_of(agent), handle, owner, reply, parent))
        # Shielded: the verdict is immediate, and a creator cancelled while the supervisor
        # publishes must not be left not knowing it won.
        with trio.CancelScope(shield=True):
            await reply.done.wait()
        if reply.error is not None:
            raise reply.error

    def enter_now(self, agent: Agent, handle: AgentHandle, owner: Scope) -> None:
        """Publication for ``agent_loop.create``, which is synchronous by contract and so
        cannot wait for a message round trip; applied by the same code as a request."""
        reply = _Reply()
        self._apply_enter(_Enter(agent, life_of(agent), handle, owner, reply))
        if reply.error is not None:
            raise reply.error

    def detach(self, agent: Agent) -> None:
        """Called by an agent actor as its last act."""
        try:
            self._tx.send_nowait(_Detach(agent))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._apply_detach(agent)  # the runtime is past its supervisor: detach in place

    def _apply_enter(self, request: _Enter) -> None:
        services, agent, parent, life = self._services, request.agent, request.parent, \
            request.life
        try:
            if agent.id in self.agents or agent.id in self.sessions:
                raise SessionIdInUse(f"session id {agent.id!r} is already in use by a live agent")
            if self._actors is None:
                raise RuntimeClosed("the runtime's supervisor is not running")
            if request.owner.closed or request.owner.closing:
                # Its owner would never dispose it: it snapshots what it owns when it closes.
                raise AgentDisposedError(
                    f"{request.owner.name} closed while agent {agent.id!r} was being created"
                )
            nursery = self._actors if parent is None else self._child_nursery(agent, parent)
            self.agents[agent.id] = agent
            self.sessions[agent.id] = agent.session
            del self._preparing[agent]
            life.publish()
            request.handle.owned_by(request.owner)
            if parent is not None:
                self.children.setdefault(parent.id, {})[agent.id] = agent
                self.parent_of[agent.id] = parent
            try:
                services.emit(SessionCreated(agent.id, agent.session.meta, agent.resumed))
                services.emit(AgentCreated(agent.id))
                services.emit(AgentSessionStart(agent.id, agent.resumed))
            finally:
                life.announced()
                if life.nursery is None:  # not started early, for a setup
                    life.start_actor(nursery)
        except Exception as exc:  # noqa: BLE001 - handed to the creator, who re-raises
            request.reply.error = exc
        finally:
            request.reply.done.set()

    def _apply_detach(self, agent: Agent) -> None:
        services = self._services
        try:
            parent = self.parent_of.get(agent.id)
            if parent is not None and self.children.get(parent.id, {}).get(agent.id) is agent:
                del self.parent_of[agent.id]
                siblings = self.children[parent.id]
                del siblings[agent.id]
                if not siblings:
                    del self.children[parent.id]
            entered = self.agents.get(agent.id) is agent
            if entered:
                del self.agents[agent.id]
                services.emit(AgentDisposed(agent.id))
                # Entered with its agent; a hibernated agent's session is no longer held.
                self.sessions.pop(agent.id, None)
                services.emit(SessionDisposed(agent.id))
        finally:
            life = self._life(agent)
            if life is not None:
                life.quiesced()


class SessionsService:
    """``ctx.sessions``: the live sessions."""

    def __init__(self, services: Services, supervisor: Supervisor) -> None:
        self._services = services
        self._supervisor = supervisor

    def get(self, session_id: str) -> Session | None:
        return self._supervisor.sessions.get(session_id)

    def list(self) -> list[Session]:
        return list(self._supervisor.sessions.values())

    def tail(self, session_id: str, *, from_seq: int = 0) -> SessionTail:
        """Async-iterate the session's events with ``seq >= from_seq``, then live.

        Read from memory while this runtime drives the session, else from the store (a
        hibernated agent is not woken); new events are announced by this runtime's bus and by
        the store's own notifications (SQLite: any store of this process on the same file;
        PostgreSQL: any runtime on the database, through ``NOTIFY agentloop_events``).
        A slow reader never holds up the driver: it reads again from where it stopped.

        Raises:
            InvalidContent: the id or ``from_seq`` is invalid.
            SessionNotFound: (when iterated) nobody here drives it and the store lacks it.
        """
        _check_id(session_id)
        services = self._services
        return SessionTail(
            services.bus, self._supervisor.sessions.get, lambda: services.persistence,
            session_id, from_seq,
        )

    async def send(
        self,
        session_id: str,
        content: object,
        *,
        target: Literal["next-turn", "next-step"] = "next-turn",
        wakeup: bool = True,
        source: object = None,
    ) -> str:
        """Deliver input to the session's live driver, wherever it runs; returns the message id.

        A session driven in this runtime gets it at once (``agent.send``). Otherwise a backend
        that routes input between runtimes (the PostgreSQL store's ``send``) commits it for
        whichever runtime drives the session, or for the next one to resume it.

        Raises:
            SessionNotFound: nobody here drives it and no routing backend knows it.
            InvalidContent: the content, source or target is invalid.
        """
        agent = self._supervisor.agents.get(session_id)
        if agent is not None:
            return agent.send(content, source=source, target=target, wakeup=wakeup)
        # Refused here exactly as a local inbox refuses it: what the store commits for
        # another runtime must be deliverable there, or it would be lost at delivery.
        if target not in TARGETS:
            raise InvalidContent(f"target: must be 'next-turn' or 'next-step', got {target!r}")
        content = _freeze_content(content)
        source = freeze(source, path="source")
        route = getattr(self._services.persistence, "send", None)
        if route is None:
            raise SessionNotFound(
                f"session {session_id!r} is not driven by this runtime, and its store does not "
                "route input to other runtimes"
            )
        message_id: str = await route(
            session_id, content, target=target, wakeup=wakeup, source=source
        )
        return message_id


class AgentsService:
    """``ctx.agents``: programmatic creation and resume, and the live-agent registry."""

    def __init__(self, scope: Scope, services: Services, supervisor: Supervisor) -> None:
        self._scope = scope
        self._services = services
        self._supervisor = supervisor

    def get(self, agent_id: str) -> Agent | None:
        """The live agent with this id (a bare ``Agent``: handles belong to their owners)."""
        return self._supervisor.agents.get(agent_id)

    def list(self) -> list[Agent]:
        return self._supervisor.all_agents()

    @staticmethod
    def current() -> Agent | None:
        """The agent on whose behalf the calling task runs (its driver, tools, hooks)."""
        return current_agent()

    async def create(
        self,
        *,
        session_id: str,
        meta: Mapping[str, Any] | None = None,
        seed: Sequence[Any] | None = None,
        agent_options: AgentOptions | None = None,
        setup: Setup | None = None,
    ) -> AgentHandle:
        """Create and publish an agent on a new session ``session_id``.

        Cancelling the caller during setup or publication rolls everything back.

        Raises:
            SessionIdInUse: a live agent (or a stored session) already has this id.
            InvalidContent: ``meta`` or ``seed`` is not JSON.
            InvalidOptions: ``agent_options`` is not an ``AgentOptions``.
        """
        _check_id(session_id)
        frozen_meta = _freeze_meta(meta)
        events = _seed_events(seed)
        return await Creation(
            self._services, self._supervisor, self._scope, session_id, agent_options, setup,
            resumed=False,
        ).run(frozen_meta, events)

    async def resume(
        self,
        *,
        resume_session_id: str,
        agent_options: AgentOptions | None = None,
        setup: Setup | None = None,
        crashed_turn: Literal["close", "continue"] | None = None,
    ) -> AgentHandle:
        """Load a persisted session and publish an agent that continues it.

        ``crashed_turn`` says what becomes of a turn a crash left open (default: the
        setting ``agent-loop.crashed_turn``, itself ``"close"`` by default). ``"close"`` ends
        it ``aborted`` with cause ``crash``. ``"continue"`` goes on where it stopped: a
        ``turn/resumed`` event records the crash point, a cut reply keeps its seen prefix as
        interrupted, calls without a result run again when their tool is idempotent and are
        answered ``INTERRUPTED_BY_CRASH`` otherwise, then the step loop continues. A turn
        whose calls await approval is suspended as with ``"close"``.

        Raises:
            PersistenceUnavailable: no persistence backend is loaded.
            SessionNotFound: nothing is stored under this id.
            SessionIdInUse: a live agent already drives it (here, or in another runtime:
                :class:`~agentloop.SessionLeased`).
        """
        _check_id(resume_session_id, "resume_session_id")
        if self._services.persistence is None:
            raise PersistenceUnavailable(
                "resume needs a session-persistence backend; enable one with "
                '{"persistence": {"backend": "sqlite", "path": "..."}}'
            )
        if resume_session_id in self._supervisor.agents:
            raise SessionIdInUse(f"session {resume_session_id!r} is already driven by a live agent")
        if crashed_turn is None:
            crashed_turn = self._services.settings.get(CRASHED_TURN)
        elif crashed_turn not in ("close", "continue"):
            raise InvalidOptions(
                f"crashed_turn must be 'close' or 'continue', got {crashed_turn!r}"
            )
        creation = Creation(
            self._services, self._supervisor, self._scope, resume_session_id, agent_options,
            setup, resumed=True,
        )
        creation.crashed_turn = crashed_turn
        return await creation.run(FrozenDict(), [])


RecoverChildren = Callable[
    [Services, Supervisor, Agent], Awaitable[list[Callable[[Agent], None]]]
]


class Creation:
    """One create or resume as a transaction: prepare privately, set up, store, publish;
    any failure or cancellation before publication rolls back what was prepared."""

    # Installed by the sub-agents module (above this one): it mends a resumed parent's tree.
    recover_children: RecoverChildren | None = None

    def __init__(
        self, services: Services, supervisor: Supervisor, owner: Scope, session_id: str,
        options: AgentOptions | None, setup: Setup | None, *, resumed: bool,
        parent: Agent | None = None,
    ) -> None:
        services.check_open()
        if owner.closed:
            raise ScopeClosed(f"{owner!r} is closed; it cannot create agents")
        if options is not None and not isinstance(options, AgentOptions):
            raise InvalidOptions(f"agent_options must be an AgentOptions, got {options!r}")
        self.services, self.supervisor, self.owner = services, supervisor, owner
        self.session_id, self.options, self.setup = session_id, options, setup
        self.resumed, self.parent = resumed, parent
        self.token = LeaseClaim()
        self.leased = False
        self.agent: Agent | None = None
        self.crashed_turn = "close"
        self.going_on = False  # a crashed turn is left open for the agent to take up

    async def run(self, meta: FrozenDict, events: list[SessionEvent]) -> AgentHandle:
        services = self.services
        with services.inflight(), self.supervisor.expecting(self.parent):
            backend = services.persistence
            if backend is not None:
                await self._claim_lease()
            try:
                handle, owed = await self._prepare_and_publish(meta, events)
            except BaseException:
                with trio.move_on_after(CLOSE_GRACE, shield=True):
                    await self._roll_back()
                self._release_claim()
                raise
        self.token.published = True
        self.token.settled.set()
        for deliver in owed:
            # As soon as the agent can take input (published): its next step, or next turn.
            deliver(handle.agent)
        return handle

    async def _claim_lease(self) -> None:
        # The lease is the runtime's, so same-id contenders of one runtime are arbitrated
        # before it: only one at a time ever acquires (and so can release) the lease. The
        # others wait for it to publish (they lose) or roll back (the next one tries).
        leases, session_id = self.services.leases, self.session_id
        while (held := leases.get(session_id)) is not None:
            if held.published:
                raise SessionIdInUse(f"session {session_id!r} is already driven by a live agent")
            await held.settled.wait()
        leases[session_id] = self.token

    async def _load(
        self, meta: FrozenDict, events: list[SessionEvent]
    ) -> tuple[Session, CallConfig | None]:
        backend, session_id = self.services.persistence, self.session_id
        if not self.resumed and backend is not None and await backend.exists(session_id):
            raise SessionIdInUse(
                f"session {session_id!r} already exists in persistence; resume it instead"
            )
        if backend is not None:
            await backend.acquire(session_id, self.services.owner_id)
            self.leased = True
        proposal = None
        if self.resumed:
            # Loaded under the lease, so no other driver can append after this snapshot.
            assert backend is not None
            stored = await backend.load(session_id)
            meta, events = stored.meta, list(stored.events)
        session = Session(session_id, meta, self.services.bus)
        session.load(events)
        if self.resumed:
            self.going_on = (
                self.crashed_turn == "continue" and session.open_turn() is not None
                and not session.awaiting_approval
            )
            if not self.going_on:
                # Recovered before setup, so whoever gets the handle sees a valid history.
                recover_crashed_turn(session)
            proposal = resumed_config(session, self.options)
        return session, proposal

    async def _prepare_and_publish(
        self, meta: FrozenDict, events: list[SessionEvent]
    ) -> tuple[AgentHandle, list[Callable[[Agent], None]]]:
        services, supervisor = self.services, self.supervisor
        session, proposal = await self._load(meta, events)
        cwd = session.meta.get("cwd")
        agent, life = supervisor.prepare(
            services, session, self.options, self.owner,
            cwd=cwd if isinstance(cwd, str) else None, resumed=self.resumed, proposal=proposal,
        )
        self.agent = agent
        owed: list[Callable[[Agent], None]] = []
        if self.resumed and Creation.recover_children is not None:
            # The crash that left this turn open left its sub-agents' turns open too, and
            # took its jobs' registry; both are mended before setup sees the agent.
            owed = await Creation.recover_children(services, supervisor, agent)
        if self.going_on:
            owed.append(Agent.continue_crashed_turn)
        if self.setup is not None:
            # The actor runs from here, so the children its setup spawns run under it.
            await supervisor.start_early(agent, self.parent)
            await self.setup(life.scope)
        await trio.lowlevel.checkpoint()
        services.check_open()
        if self.owner.closed or self.owner.closing:
            raise AgentDisposedError(
                f"{self.owner.name} closed while agent {self.session_id!r} was being set up; "
                "nothing was published"
            )
        backend = services.persistence
        if backend is not None and not self.resumed:
            # Stored before publication: a session that cannot be stored fails create()
            # rather than an agent that would drop the prompt it accepted.
            with trio.CancelScope(shield=True):
                await backend.create(self.session_id, session.meta)
            for event in session.events:
                backend.append(self.session_id, event)
        life.attached = True
        if backend is not None:
            life.lease = self.token  # released by the actor once it is quiescent
        handle = construct(AgentHandle, agent, life)
        await supervisor.enter(agent, handle, self.owner, self.parent)
        return handle, owed

    async def _roll_back(self) -> None:
        """Undo what was prepared (run shielded and bounded by the caller)."""
        services, backend = self.services, self.services.persistence
        if self.agent is not None:
            scope = self.supervisor.made_scope_of(self.agent)
            self.supervisor.forget(self.agent)
            if scope is not None:
                await scope.aclose()
        if self.leased and backend is not None:
            await backend.release(self.session_id, services.owner_id)

    def _release_claim(self) -> None:
        services = self.services
        if services.leases.get(self.session_id) is self.token:
            del services.leases[self.session_id]
        self.token.settled.set()


def resumed_config(session: Session, options: AgentOptions | None) -> CallConfig | None:
    """The call settings a resumed agent continues with: those of its last ``request/header``
    without what the adapter filled in, under any field ``options`` sets explicitly."""
    for event in reversed(session.events):
        if event.type == "request/header":
            stored = event.data.get("config")
            if not isinstance(stored, FrozenDict):
                return None
            filled = set(event.data.get("adapter_defaults") or ())
            fields: dict[str, Any] = {}
            for name in ("provider", "model", "reasoning_effort", "max_tokens"):
                explicit = getattr(options, name, None) if options is not None else None
                value = explicit if explicit is not None else stored.get(name)
                fields[name] = None if (name in filled and explicit is None) else value
            extra = stored.get("extra")
            try:
                return CallConfig(**fields, extra=extra if isinstance(extra, FrozenDict)
                                  else FrozenDict())
            except (TypeError, ValueError) as exc:
                log.warning("session %s: its last request/header config is unusable (%s); "
                            "continuing with the given options", session.id, exc)
                return None
    return None


class AgentLoopService:
    """``ctx.agent_loop``: synchronous creation of agents owned by the calling scope."""

    def __init__(self, scope: Scope, services: Services, supervisor: Supervisor) -> None:
        self._scope = scope
        self._services = services
        self._supervisor = supervisor

    def create(
        self,
        id: str,  # noqa: A002 - the contract's name
        options: AgentOptions | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Agent:
        """Create and start an agent on session ``id`` now; it is disposed with this scope.

        Raises:
            SessionIdInUse: a live agent has this id, or the store already holds it (resume
                it instead); checked before anything is published.
            InvalidOptions: ``options`` is not an ``AgentOptions``.
            ScopeClosed: this scope is closed.
        """
        services, supervisor, owner = self._services, self._supervisor, self._scope
        services.check_open()
        _check_id(id, "id")
        if owner.closed:
            raise ScopeClosed(f"{owner!r} is closed; it cannot create agents")
        if options is not None and not isinstance(options, AgentOptions):
            raise InvalidOptions(f"options must be an AgentOptions, got {options!r}")
        frozen_meta = _freeze_meta(meta)
        backend = services.persistence
        if backend is not None:
            if id in services.leases:
                raise SessionIdInUse(f"session id {id!r} is already in use by a live agent")
            _refuse_stored(backend, id)
        session = Session(id, frozen_meta, services.bus)
        cwd = frozen_meta.get("cwd")
        agent, life = supervisor.prepare(
            services, session, options, owner, cwd=cwd if isinstance(cwd, str) else None
        )
        if backend is not None:
            claim = life.lease = services.leases[id] = LeaseClaim()
            claim.published = True
        life.needs_lease = True
        try:
            supervisor.enter_now(agent, construct(AgentHandle, agent, life), owner)
        except BaseException:
            supervisor.forget(agent)
            made = life.made_scope
            if made is not None:
                cast("Scope", made).close_registrations()
            if services.leases.get(id) is life.lease:
                del services.leases[id]
            raise
        return agent


def _refuse_stored(backend: object, session_id: str) -> None:
    """``agent_loop.create`` cannot await the store: a backend that can say at once whether
    a session is stored (``exists_now``) is asked; others are checked by the actor."""
    exists_now = getattr(backend, "exists_now", None)
    if exists_now is not None and exists_now(session_id):
        raise SessionIdInUse(
            f"session {session_id!r} already exists in persistence; resume it instead"
        )


def fresh_session_id(label: str) -> str:
    return f"{label}-session-{uuid.uuid4()}"


