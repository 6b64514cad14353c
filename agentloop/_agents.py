"""The supervisor side of agents: creation as a transaction, handles, teardown, registries.

Creation prepares privately (session, agent, scope, setup), enters both registries in one
synchronous step, announces ``session/created``, ``agent/created``, ``agent/session-start``, and
only then starts the driver. Anything that fails or is cancelled before the entry rolls back
what was prepared. Teardown runs stop and drain -> unwind the agent's scope -> detach agent ->
detach session, once, and every way of asking for it waits for the same boundary.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, Self, final

import attrs
import trio

from ._agent import CLOSE_GRACE, Agent, current_agent
from ._errors import AgentDisposed as AgentDisposedError
from ._errors import (
    AgentLoopError,
    InvalidContent,
    PersistenceUnavailable,
    RuntimeClosed,
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
from ._inputs import check_meta, check_seed
from ._json import FrozenDict, freeze
from ._model import AgentOptions, CallConfig, SessionEvent
from ._session import Session, recover_crashed_turn, validate_session_id
from ._util import NoPublicConstructor

if TYPE_CHECKING:
    from ._context import Context
    from ._runtime import Runtime
    from ._subagents import Job

__all__ = [
    "AgentHandle", "AgentsService", "AgentLoopService", "SessionsService", "SubagentLimitExceeded",
    "MAX_DEPTH", "MAX_CHILDREN",
]

log = logging.getLogger("agentloop")

Setup = Callable[["Context"], Awaitable[None]]

MAX_DEPTH: Final = "subagents.max_depth"
MAX_CHILDREN: Final = "subagents.max_children"
_LIMIT_DEFAULTS: Final = {MAX_DEPTH: 3, MAX_CHILDREN: 8}


class SubagentLimitExceeded(AgentLoopError):  # noqa: N818 - reads as a state
    """A sub-agent would exceed ``subagents.max_depth`` or ``subagents.max_children``."""


def subagent_limit(rt: Runtime, key: str) -> int:
    """The current value of a sub-agent limit setting (its default while it is unregistered)."""
    try:
        value: object = rt.settings.get(key)
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
    session left the registries.
    """

    def __init__(self, agent: Agent, owner: Context) -> None:
        self.agent = agent
        self._owner = owner

    def __repr__(self) -> str:
        return f"<AgentHandle {self.agent.id!r}>"

    async def aclose(self) -> None:
        await dispose(self.agent)
        self._owner._disown(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def dispose(agent: Agent) -> None:
    """Begin the agent's disposal if needed and wait for its quiescence boundary."""
    if not agent._teardown_requested:
        agent._teardown_requested = True
        if agent._announced.is_set():
            agent._stop()  # the input barrier: from here on send() raises AgentDisposed
        else:
            # A dispose requested from inside a creation notification waits for it to unwind.
            agent._rt.system_nursery.start_soon(_stop_once_announced, agent)
    await agent._quiescent.wait()


async def _stop_once_announced(agent: Agent) -> None:
    await agent._announced.wait()
    agent._stop()


class _Reply:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


@attrs.frozen(slots=True, eq=False)
class _Enter:
    agent: Agent
    handle: AgentHandle
    owner: Context
    reply: _Reply
    parent: Agent | None = None


@attrs.frozen(slots=True, eq=False)
class _Detach:
    agent: Agent


class Supervisor:
    """The supervisor actor: the only writer of the agent and session registries.

    It runs as the task ``agentloop.supervisor`` for the runtime's lifetime and owns the
    nursery every agent actor runs in. Creators prepare privately and send an entry request;
    an agent actor that reaches quiescence sends a detach request. Both are applied in the
    order they arrive, each in one synchronous step, so same-id contenders are arbitrated by
    arrival and a detach only ever removes the exact entry it names.
    """

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._tx, self._rx = trio.open_memory_channel[_Enter | _Detach](math.inf)
        self._actors: trio.Nursery | None = None
        # The tree: each live child under its parent's id, and each child's parent.
        self.children: dict[str, dict[str, Agent]] = {}
        self.parent_of: dict[str, Agent] = {}
        # Agents between preparation and publication, so their setup can spawn children.
        self.preparing: dict[str, Agent] = {}
        # Background jobs by id (``ctx.jobs``), entered and removed by their owners.
        self.jobs: dict[str, Job] = {}

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

    def _child_nursery(self, agent: Agent, parent: Agent) -> trio.Nursery:
        """Where a child's actor runs: its parent's nursery, checked against the limits.

        A parent still in its ``setup`` has no actor (and so no nursery) yet: its children
        run in the supervisor's nursery. They are owned by the parent's scope all the same,
        so they are disposed, to quiescence, before the parent is.
        """
        if parent._disposing or parent._quiescent.is_set():
            raise AgentDisposedError(
                f"agent {parent.id!r} is disposed; it cannot start sub-agent {agent.id!r}"
            )
        limit = subagent_limit(self._rt, MAX_CHILDREN)
        if len(self.children.get(parent.id, ())) >= limit:
            raise SubagentLimitExceeded(
                f"agent {parent.id!r} already has {limit} live sub-agents "
                f"({MAX_CHILDREN} = {limit}); wait for one to finish or close one"
            )
        assert self._actors is not None
        return parent._nursery if parent._nursery is not None else self._actors

    async def enter(
        self, agent: Agent, handle: AgentHandle, owner: Context, parent: Agent | None = None
    ) -> None:
        """Ask for publication and wait for the verdict (``SessionIdInUse`` for a loser)."""
        reply = _Reply()
        self._tx.send_nowait(_Enter(agent, handle, owner, reply, parent))
        # Shielded: the verdict is immediate, and a creator cancelled while the supervisor
        # publishes must not be left not knowing it won.
        with trio.CancelScope(shield=True):
            await reply.done.wait()
        if reply.error is not None:
            raise reply.error

    def enter_now(self, agent: Agent, handle: AgentHandle, owner: Context) -> None:
        """Publication for ``agent_loop.create``, which is synchronous by contract and so
        cannot wait for a message round trip; applied by the same code as a request."""
        reply = _Reply()
        self._apply_enter(_Enter(agent, handle, owner, reply))
        if reply.error is not None:
            raise reply.error

    def detach(self, agent: Agent) -> None:
        """Called by an agent actor as its last act."""
        try:
            self._tx.send_nowait(_Detach(agent))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._apply_detach(agent)  # the runtime is past its supervisor: detach in place

    def _apply_enter(self, request: _Enter) -> None:
        rt, agent, parent = self._rt, request.agent, request.parent
        try:
            if agent.id in rt.agents or agent.id in rt.sessions:
                raise SessionIdInUse(f"session id {agent.id!r} is already in use by a live agent")
            if self._actors is None:
                raise RuntimeClosed("the runtime's supervisor is not running")
            if request.owner.closed or request.owner.closing:
                # Its owner would never dispose it: it snapshots what it owns when it closes.
                raise AgentDisposedError(
                    f"{request.owner.name} closed while agent {agent.id!r} was being created"
                )
            nursery = self._actors
            if parent is not None:
                nursery = self._child_nursery(agent, parent)
            rt.agents[agent.id] = agent
            rt.sessions[agent.id] = agent.session
            agent._published = True
            request.owner._own(request.handle)
            if parent is not None:
                self.children.setdefault(parent.id, {})[agent.id] = agent
                self.parent_of[agent.id] = parent
            try:
                rt.emit(SessionCreated(agent.id, agent.session.meta, agent.resumed))
                rt.emit(AgentCreated(agent.id))
                rt.emit(AgentSessionStart(agent.id, agent.resumed))
            finally:
                agent._announced.set()
                nursery.start_soon(agent._actor, name=f"agentloop.agent:{agent.id}")
        except Exception as exc:  # noqa: BLE001 - handed to the creator, who re-raises
            request.reply.error = exc
        finally:
            request.reply.done.set()

    def _apply_detach(self, agent: Agent) -> None:
        rt = self._rt
        try:
            parent = self.parent_of.get(agent.id)
            if parent is not None and self.children.get(parent.id, {}).get(agent.id) is agent:
                del self.parent_of[agent.id]
                siblings = self.children[parent.id]
                del siblings[agent.id]
                if not siblings:
                    del self.children[parent.id]
            if rt.agents.get(agent.id) is agent:
                del rt.agents[agent.id]
                rt.emit(AgentDisposed(agent.id))
            if rt.sessions.get(agent.id) is agent.session:
                del rt.sessions[agent.id]
                rt.emit(SessionDisposed(agent.id))
        finally:
            agent._quiescent.set()


class SessionsService:
    """``ctx.sessions``: the live sessions."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt

    def get(self, session_id: str) -> Session | None:
        return self._rt.sessions.get(session_id)

    def list(self) -> list[Session]:
        return list(self._rt.sessions.values())

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
        agent = self._rt.agents.get(session_id)
        if agent is not None:
            return agent.send(content, source=source, target=target, wakeup=wakeup)
        route = getattr(self._rt.persistence, "send", None)
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

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._rt = ctx._runtime

    def get(self, agent_id: str) -> Agent | None:
        """The live agent with this id (a bare ``Agent``: handles belong to their owners)."""
        return self._rt.agents.get(agent_id)

    def list(self) -> list[Agent]:
        return list(self._rt.agents.values())

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
        """
        _check_id(session_id)
        frozen_meta = _freeze_meta(meta)
        events = _seed_events(seed)
        return await _transaction(
            self._ctx, session_id, frozen_meta, events, agent_options, setup, resumed=False
        )

    async def resume(
        self,
        *,
        resume_session_id: str,
        agent_options: AgentOptions | None = None,
        setup: Setup | None = None,
    ) -> AgentHandle:
        """Load a persisted session and publish an agent that continues it.

        Raises:
            PersistenceUnavailable: no persistence backend is loaded.
            SessionNotFound: nothing is stored under this id.
            SessionIdInUse: a live agent already drives it.
        """
        _check_id(resume_session_id, "resume_session_id")
        backend = self._rt.persistence
        if backend is None:
            raise PersistenceUnavailable(
                "resume needs a session-persistence backend; enable one with "
                '{"persistence": {"backend": "sqlite", "path": "..."}}'
            )
        if resume_session_id in self._rt.agents:
            raise SessionIdInUse(f"session {resume_session_id!r} is already driven by a live agent")
        return await _transaction(
            self._ctx, resume_session_id, FrozenDict(), [], agent_options, setup, resumed=True
        )


async def _transaction(
    owner: Context,
    session_id: str,
    meta: FrozenDict,
    events: list[SessionEvent],
    options: AgentOptions | None,
    setup: Setup | None,
    *,
    resumed: bool,
    parent: Agent | None = None,
) -> AgentHandle:
    rt = owner._runtime
    rt.check_open()
    if options is not None and not isinstance(options, AgentOptions):
        raise TypeError(f"agent_options must be an AgentOptions, got {options!r}")
    with rt.inflight():
        backend = rt.persistence
        token = LeaseClaim()
        if backend is not None:
            # The lease is the runtime's, so same-id contenders of one runtime are arbitrated
            # before it: only one at a time ever acquires (and so can release) the lease.
            # The others wait for it to publish (they lose) or roll back (the next one tries).
            while (held := rt.leases.get(session_id)) is not None:
                if held.published:
                    raise SessionIdInUse(
                        f"session {session_id!r} is already driven by a live agent"
                    )
                await held.settled.wait()
            rt.leases[session_id] = token
        leased = False
        scope: Context | None = None
        owed: list[Job] = []  # jobs a crash cut short, whose failure a resume delivers
        try:
            if not resumed and backend is not None and await backend.exists(session_id):
                raise SessionIdInUse(
                    f"session {session_id!r} already exists in persistence; resume it instead"
                )
            if backend is not None:
                await backend.acquire(session_id, rt.owner_id)
                leased = True
            proposal = None
            if resumed:
                # Loaded under the lease, so no other driver can append after this snapshot.
                assert backend is not None
                stored = await backend.load(session_id)
                meta, events = stored.meta, list(stored.events)
            session = Session(session_id, meta, rt.bus)
            session.load(events)
            if resumed:
                # Recovered before setup, so whoever gets the handle sees a valid history.
                recover_crashed_turn(session)
                proposal = resumed_config(session, options)
            cwd = meta.get("cwd") if isinstance(meta.get("cwd"), str) else None
            agent = Agent._create(rt, session, options or AgentOptions(), cwd=cwd, resumed=resumed,
                          proposal=proposal)
            scope = owner.child(f"agent:{session_id}", agent_id=session_id)
            agent.ctx = scope
            if resumed:
                # The crash that left this turn open left its sub-agents' turns open too, and
                # took its jobs' registry; both are mended before setup sees the agent.
                from ._subagents import recover_children

                owed = await recover_children(agent)
            if setup is not None:
                preparing = rt.supervisor.preparing
                preparing[session_id] = agent
                try:
                    await setup(scope)
                finally:
                    if preparing.get(session_id) is agent:
                        del preparing[session_id]
            await trio.lowlevel.checkpoint()
            rt.check_open()
            if owner.closed or owner.closing:
                raise AgentDisposedError(
                    f"{owner.name} closed while agent {session_id!r} was being set up; "
                    "nothing was published"
                )
            if backend is not None and not resumed:
                # Stored before publication: a session that cannot be stored fails create()
                # rather than an agent that would drop the prompt it accepted.
                with trio.CancelScope(shield=True):
                    await backend.create(session_id, meta)
                for event in session.events:
                    backend.append(session_id, event)
            agent._attached = True
            handle = AgentHandle._create(agent, owner)
            await rt.supervisor.enter(agent, handle, owner, parent)
        except BaseException:
            with trio.move_on_after(CLOSE_GRACE, shield=True):
                if scope is not None:
                    await scope.aclose()
                if leased and backend is not None:
                    await backend.release(session_id, rt.owner_id)
            if rt.leases.get(session_id) is token:
                del rt.leases[session_id]
            token.settled.set()
            raise
        token.published = True
        token.settled.set()
        agent._lease = token if backend is not None else None
        for job in owed:
            # As soon as the agent can take input (published): its next step, or next turn.
            job._deliver_to(agent)
        return handle


class LeaseClaim:
    """One contender's claim on a session's persistence lease within this runtime."""

    __slots__ = ("published", "settled")

    def __init__(self) -> None:
        self.published = False
        self.settled = trio.Event()


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

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._rt = ctx._runtime

    def create(
        self,
        id: str,  # noqa: A002 - the contract's name
        options: AgentOptions | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Agent:
        """Create and start an agent on session ``id`` now; it is disposed with this scope."""
        rt, owner = self._rt, self._ctx
        rt.check_open()
        _check_id(id, "id")
        if options is not None and not isinstance(options, AgentOptions):
            raise TypeError(f"options must be an AgentOptions, got {options!r}")
        frozen_meta = _freeze_meta(meta)
        session = Session(id, frozen_meta, rt.bus)
        cwd = frozen_meta.get("cwd") if isinstance(frozen_meta.get("cwd"), str) else None
        agent = Agent._create(rt, session, options or AgentOptions(), cwd=cwd)
        scope = owner.child(f"agent:{id}", agent_id=id)
        agent.ctx = scope
        if rt.persistence is not None and id in rt.leases:
            scope.close_registrations()
            raise SessionIdInUse(f"session id {id!r} is already in use by a live agent")
        if rt.persistence is not None:
            claim = agent._lease = rt.leases[id] = LeaseClaim()
            claim.published = True
        agent._needs_lease = True
        try:
            rt.supervisor.enter_now(agent, AgentHandle._create(agent, owner), owner)
        except BaseException:
            scope.close_registrations()
            if rt.leases.get(id) is agent._lease:
                del rt.leases[id]
            raise
        return agent


def fresh_session_id(label: str) -> str:
    return f"{label}-session-{uuid.uuid4()}"


