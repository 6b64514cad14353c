"""``ctx.subagents`` and ``ctx.jobs``: child agents as child actors, and background jobs.

Called on behalf of an agent (its tools, hooks, setup), a sub-agent is that agent's child: the
supervisor starts its actor in the parent actor's nursery, its session ``meta`` records the
lineage (``parent_session_id``, ``parent_call_id`` inside a tool call, ``depth``), and the
parent's scope owns its handle, so disposing the parent disposes its children first (each to
quiescence, depth-first). Called elsewhere (the root context, a plugin's own task) it is an
ordinary agent owned by the calling context.

Resuming a parent closes the turns a crash left open in its stored descendants and gives it
its jobs back, finished (``recover_children``); ``subscribe_tree`` follows a whole tree.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, Literal, cast, final

import attrs
import trio

from ._agent import CLOSE_GRACE, Agent, _freeze_content, current_agent
from ._agents import (
    MAX_CHILDREN,
    MAX_DEPTH,
    AgentHandle,
    Creation,
    Scope,
    Setup,
    SubagentLimitExceeded,
    Supervisor,
    _check_id,
    _freeze_meta,
    _seed_events,
    subagent_limit,
)
from ._bus import Disposer
from ._errors import AgentDisposed, AgentLoopError, PersistenceError, ScopeClosed, TurnFailed
from ._events import SessionCreated, SessionDisposed, SessionEventAppended
from ._json import FrozenDict
from ._model import AgentOptions, Content, SessionEvent
from ._run import RunResult
from ._services import LeaseClaim, Services
from ._session import Session, recover_crashed_turn
from ._util import NoPublicConstructor, construct

__all__ = [
    "Job", "JobCancelled", "JobFailed", "JobStatus", "JobsService", "SubagentsService",
    "TreeEvent", "current_call_id", "recover_children",
]

log = logging.getLogger("agentloop")

JobStatus = Literal["running", "done", "failed", "cancelled"]

_TOOL_TASK: Final = "agentloop.tool:"
_AGENT_TASK: Final = "agentloop.agent:"


class JobCancelled(AgentLoopError):  # noqa: N818 - reads as a state
    """``job.result()`` of a job that was cancelled (or died with its owner)."""


class JobFailed(AgentLoopError):  # noqa: N818 - reads as a state
    """``job.result()`` of a job whose turn ended without an answer (e.g. ``rejected``)."""


def _jobs(supervisor: Supervisor) -> dict[str, Job]:
    """The runtime's job registry: the supervisor keeps it, this module alone fills it."""
    return cast("dict[str, Job]", supervisor.jobs)


# --- lineage --------------------------------------------------------------------------------


def _parent_of(supervisor: Supervisor, ctx: Scope) -> Agent | None:
    """The agent a call through ``ctx`` is made on behalf of, if any: the agent whose own
    scope it is (live or in its setup: never a same-id contender's), else the agent whose
    task makes the call."""
    found = supervisor.agent_of(ctx)
    if found is None and ctx.agent_id is not None:
        found = supervisor.agents.get(ctx.agent_id)
    if found is not None:
        return found
    agent = current_agent()
    if agent is not None and supervisor.scope_of(agent) is not None:
        return agent
    return None


def current_call_id() -> str | None:
    """The id of the tool call the calling task serves: the nearest ``agentloop.tool:<id>``
    task among its ancestors, below the agent's actor task."""
    task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
    while task is not None:
        name = task.name
        if name.startswith(_TOOL_TASK):
            return name[len(_TOOL_TASK):]
        if name.startswith(_AGENT_TASK):
            return None
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    return None


def _depth(agent: Agent) -> int:
    depth = agent.session.meta.get("depth")
    # max: a session stored before negative depths were refused must not lift the limit.
    return max(depth, 0) if isinstance(depth, int) and not isinstance(depth, bool) else 0


async def _spawn(
    services: Services,
    supervisor: Supervisor,
    ctx: Scope,
    *,
    agent_options: AgentOptions | None,
    setup: Setup | None,
    session_id: str | None,
    seed: Sequence[Any] | None,
    meta: Mapping[str, Any] | None,
) -> tuple[AgentHandle, Agent | None, Scope]:
    services.check_open()
    parent = _parent_of(supervisor, ctx)
    if parent is None and ctx.agent_id is not None:
        raise AgentDisposed(f"agent {ctx.agent_id!r} is gone; it cannot start sub-agents")
    owner = ctx
    lineage: dict[str, Any] = dict(meta or {})
    if parent is not None:
        scope = supervisor.scope_of(parent)
        if supervisor.disposing(parent) or scope is None or scope.closing:
            raise AgentDisposed(f"agent {parent.id!r} is disposed; it cannot start sub-agents")
        owner = scope
        depth = _depth(parent) + 1
        max_depth = subagent_limit(services, MAX_DEPTH)
        if depth > max_depth:
            raise SubagentLimitExceeded(
                f"a sub-agent of {parent.id!r} would be at depth {depth}, beyond "
                f"{MAX_DEPTH} = {max_depth}; do the task here instead of delegating it"
            )
        max_children = subagent_limit(services, MAX_CHILDREN)
        if len(supervisor.children.get(parent.id, ())) >= max_children:
            raise SubagentLimitExceeded(
                f"agent {parent.id!r} already has {max_children} live sub-agents "
                f"({MAX_CHILDREN} = {max_children}); wait for one to finish or close one"
            )
        lineage["parent_session_id"] = parent.id
        # Only a call of the parent's own (not, say, of the agent whose tool runs the
        # parent's setup) is the parent's call.
        call_id = current_call_id() if current_agent() is parent else None
        if call_id is not None:
            lineage["parent_call_id"] = call_id
        lineage["depth"] = depth
        if parent.cwd is not None:
            lineage.setdefault("cwd", parent.cwd)
        if agent_options is None:
            agent_options = parent.options
    sid = session_id if session_id is not None else f"sub-{uuid.uuid4().hex[:16]}"
    _check_id(sid)
    handle = await Creation(
        services, supervisor, owner, sid, agent_options, setup, resumed=False, parent=parent,
    ).run(_freeze_meta(lineage), _seed_events(seed))
    return handle, parent, owner


# --- one turn -----------------------------------------------------------------------------


async def _answer(
    handle: AgentHandle, content: Content, parent_lives: Callable[[], bool],
    output_type: object = None,
) -> RunResult:
    """Run ``content`` as the child's next turn and return how it ended.

    Cancelled (the parent's turn was, when this runs in one of its tool calls), it ends the
    child's turn with cause ``parent`` (or disposes the child, when the parent itself is being
    disposed or there is no parent) and waits, bounded, for the child to converge before
    re-raising.

    Raises:
        TurnFailed: the child's turn ended with reason ``error``.
    """
    agent = handle.agent
    async with agent.run(content, output_type=output_type) as run:
        try:
            return await run.result()
        except trio.Cancelled:
            with trio.move_on_after(CLOSE_GRACE, shield=True):
                if parent_lives():
                    agent.cancel("parent")
                    with contextlib.suppress(TurnFailed):
                        await run.result()
                else:
                    await handle.aclose()
            raise


# --- ctx.subagents ----------------------------------------------------------------------------


class SubagentsService:
    """``ctx.subagents``: child agents of the agent on whose behalf the call is made.

    Limits (settings): ``subagents.max_depth`` (default 3; a top-level agent is at depth 0)
    and ``subagents.max_children`` (live children per agent, default 8). Exceeding one raises
    :class:`agentloop.SubagentLimitExceeded`, which a tool turns into an error result.
    """

    def __init__(self, ctx: Scope, services: Services, supervisor: Supervisor) -> None:
        self._ctx = ctx
        self._services = services
        self._supervisor = supervisor

    async def spawn(
        self,
        content: object = None,
        *,
        agent_options: AgentOptions | None = None,
        setup: Setup | None = None,
        session_id: str | None = None,
        seed: Sequence[Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> AgentHandle:
        """Create a child agent and keep it; ``content``, when given, is its first prompt.

        Its options default to the parent's. The parent's scope owns the handle: the child is
        disposed before the parent, or earlier through ``handle.aclose()``.

        Raises:
            SubagentLimitExceeded: beyond ``subagents.max_depth`` or ``max_children``.
            AgentDisposed: the parent is being disposed.
            InvalidContent: ``content``, ``meta`` or ``seed`` is not JSON.
        """
        frozen = _freeze_content(content) if content is not None else None
        handle, _, _ = await _spawn(
            self._services, self._supervisor, self._ctx, agent_options=agent_options, setup=setup,
            session_id=session_id,
            seed=seed, meta=meta,
        )
        if frozen is not None:
            handle.agent.followup(frozen)
        return handle

    async def run(
        self,
        content: object,
        *,
        agent_options: AgentOptions | None = None,
        setup: Setup | None = None,
        session_id: str | None = None,
        output_type: object = None,
        seed: Sequence[Any] | None = None,
    ) -> RunResult:
        """Run one turn of a fresh child agent on ``content``, dispose it, return the outcome.

        Cancelled (for instance with the parent's turn), the child's turn ends ``aborted``
        with cause ``parent`` before this re-raises.

        Raises:
            TurnFailed: the child's turn ended with reason ``error``.
            SubagentLimitExceeded, AgentDisposed, InvalidContent: as :meth:`spawn`.
        """
        frozen = _freeze_content(content)
        handle, parent, _ = await _spawn(
            self._services, self._supervisor, self._ctx, agent_options=agent_options, setup=setup,
            session_id=session_id,
            seed=seed, meta=None,
        )
        try:
            supervisor = self._supervisor
            return await _answer(
                handle, frozen,
                lambda: parent is not None and not supervisor.disposing(parent), output_type,
            )
        finally:
            with trio.move_on_after(CLOSE_GRACE, shield=True):
                await handle.aclose()

    def subscribe_tree(
        self, session_id: str | None = None
    ) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[TreeEvent]]:
        """``async with ctx.subagents.subscribe_tree() as rx:`` follows a whole agent tree.

        ``rx`` receives a :class:`agentloop.TreeEvent` (the session id, its lineage and the
        ``SessionEvent``) for every event appended to the root session (``session_id``, by
        default the agent the call is made on behalf of) or any of its descendants, including
        children created after the subscription began: those from their first event (a seed
        included), live ones from the moment of subscribing. Like any durable subscription it
        is lossless and in seq order per session (in emission order across them), however
        slow the reader: its backlog is kept in memory. The channel ends with the block, or
        when this context's scope closes.

        Raises:
            ValueError: no ``session_id`` and no agent on whose behalf the call is made.
            InvalidContent: ``session_id`` is not a valid session id.
        """
        root = session_id
        if root is None:
            parent = _parent_of(self._supervisor, self._ctx)
            if parent is None:
                raise ValueError("subscribe_tree() outside an agent needs the session_id of "
                                 "the tree's root")
            root = parent.id
        return self._tree(_check_id(root))

    @asynccontextmanager
    async def _tree(self, root: str) -> AsyncIterator[trio.MemoryReceiveChannel[TreeEvent]]:
        bus = self._services.bus
        tx, rx = trio.open_memory_channel[TreeEvent](math.inf)
        # Plain handlers run at the moment of each append, so the snapshot of who is in the
        # tree and the first delivery happen in one synchronous step, with no gap.
        tree = _Tree(self._supervisor, root, tx)
        offs = (
            bus.on(SessionEventAppended, tree.appended),
            bus.on(SessionCreated, tree.created),
            bus.on(SessionDisposed, tree.disposed),
        )

        def stop() -> None:
            for off in offs:
                off()
            tx.close()

        stop_tracked = self._ctx.track(Disposer(stop))
        try:
            yield rx
        finally:
            stop_tracked()


# --- ctx.jobs -------------------------------------------------------------------------------


@final
class Job(metaclass=NoPublicConstructor):
    """A sub-agent running in the background (``ctx.jobs.start``).

    ``status`` is ``"running"`` until it takes exactly one final value: ``"done"`` (the turn
    completed), ``"failed"`` (it ended ``error`` or ``rejected``), or ``"cancelled"``
    (``cancel()``, its turn aborted, or its owner closed). A finished job's child is disposed;
    the job stays listed until its owner closes. Its id is in the child's session ``meta``
    (``job_id``): a resumed owner lists it again, ``failed`` if a crash cut it short.
    """

    __slots__ = (
        "_content", "_deliver", "_done", "_error", "_handle", "_jobs", "_owner", "_parent",
        "_result", "_scope", "id", "session_id", "status",
    )

    def __init__(
        self, job_id: str, session_id: str, handle: AgentHandle | None, content: Content,
        owner: Scope, parent: Agent | None, *, deliver: bool, jobs: dict[str, Job],
    ) -> None:
        self._jobs = jobs  # the runtime's registry of jobs, which this job leaves with its owner
        self.id: Final = job_id
        self.session_id: Final = session_id
        self.status: JobStatus = "running"
        self._handle = handle
        self._content = content
        self._owner = owner
        self._parent = parent
        self._deliver = deliver
        self._done = trio.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._scope = trio.CancelScope()

    def __repr__(self) -> str:
        return f"<Job {self.id!r} {self.status} session={self.session_id!r}>"

    async def result(self) -> RunResult:
        """Wait for the job to finish and return its outcome.

        Raises:
            TurnFailed: its turn ended with reason ``error``.
            JobFailed: it ended without an answer otherwise (``rejected``).
            JobCancelled: it was cancelled.
        """
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def cancel(self) -> bool:
        """Stop the job (its child is disposed); True when it was still running."""
        if self.status != "running" or self._handle is None:
            return False
        agent = self._handle.agent
        agent.cancel("user")
        self._finish("cancelled", error=JobCancelled(f"job {self.id!r} was cancelled"))
        self._scope.cancel()
        return True

    def _finish(
        self, status: JobStatus, *, result: RunResult | None = None,
        error: BaseException | None = None,
    ) -> None:
        if self.status != "running":
            return  # exactly one final status
        self.status, self._result, self._error = status, result, error
        self._done.set()
        if self._deliver and status != "cancelled" and self._parent is not None:
            self._deliver_to(self._parent)

    def _deliver_to(self, agent: Agent) -> None:
        if self._result is not None:
            body = self._result.text
        else:
            body = f"Error: {self._error}"
        # An owner being disposed goes away with its jobs: nothing to deliver to.
        with contextlib.suppress(AgentDisposed):
            agent.inject(
                f"[background job {self.id} {self.status}]\n{body}",
                source={"job": self.id, "status": self.status, "session_id": self.session_id},
            )

    async def _watch(self) -> None:
        assert self._handle is not None
        try:
            with self._scope:
                try:
                    outcome = await _answer(self._handle, self._content, lambda: False)
                except Exception as exc:  # noqa: BLE001 - a job's failure is its status
                    self._finish("failed", error=exc)
                else:
                    if outcome.reason in ("completed", "max-tokens"):
                        self._finish("done", result=outcome)
                    elif outcome.reason in ("aborted", "disposed"):
                        self._finish("cancelled", error=JobCancelled(
                            f"job {self.id!r} ended {outcome.reason}"
                        ))
                    else:
                        self._finish("failed", error=JobFailed(
                            f"job {self.id!r} ended {outcome.reason} without an answer"
                        ))
        finally:
            with trio.move_on_after(CLOSE_GRACE, shield=True):
                await self._handle.aclose()
            self._finish("cancelled", error=JobCancelled(f"job {self.id!r} was cancelled"))
            # A finished job keeps its result, not its disposed child's session.
            self._handle = None

    def _abandon(self) -> None:
        """The owner closes: the job dies with it and leaves the registry."""
        self._finish("cancelled", error=JobCancelled(f"job {self.id!r} died with its owner"))
        self._scope.cancel()
        jobs = self._jobs
        if jobs.get(self.id) is self:
            del jobs[self.id]


class JobsService:
    """``ctx.jobs``: background sub-agents owned by the agent (or context) that starts them."""

    def __init__(self, ctx: Scope, services: Services, supervisor: Supervisor) -> None:
        self._ctx = ctx
        self._services = services
        self._supervisor = supervisor

    def _owner(self) -> Scope:
        parent = _parent_of(self._supervisor, self._ctx)
        scope = self._supervisor.scope_of(parent) if parent is not None else None
        return scope if scope is not None else self._ctx

    async def start(
        self,
        content: object,
        *,
        agent_options: AgentOptions | None = None,
        setup: Setup | None = None,
        session_id: str | None = None,
        deliver: bool = False,
    ) -> Job:
        """Start a sub-agent on ``content`` in the background and return its :class:`Job`.

        With ``deliver=True`` the finished job's answer (or error) is delivered into the
        owning agent's inbox as an ``inject``: it reaches the model at the next step of a
        running turn, or with the next turn, without waking an idle agent. Its ``source`` is
        ``{"job": id, "status": ..., "session_id": ...}``.

        Raises:
            ValueError: ``deliver=True`` outside an agent (there is no inbox to deliver to).
            SubagentLimitExceeded, AgentDisposed, InvalidContent: as ``subagents.spawn``.
        """
        frozen: Content = _freeze_content(content)
        if deliver and _parent_of(self._supervisor, self._ctx) is None:
            raise ValueError("deliver=True needs an owning agent: start the job from one of "
                             "its tools, hooks or its setup")
        # The id is in the child's meta, so a resumed owner can still answer for the job
        # after a crash took its registry (see recover_children).
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        # ``job_deliver`` too, so that a resumed owner still gets an answer that never
        # reached its log (see _rebuild_job).
        meta: dict[str, object] = {"job_id": job_id}
        if deliver:
            meta["job_deliver"] = True
        handle, parent, owner = await _spawn(
            self._services, self._supervisor, self._ctx, agent_options=agent_options, setup=setup,
            session_id=session_id,
            seed=None, meta=meta,
        )
        jobs = _jobs(self._supervisor)
        job = construct(
            Job, job_id, handle.agent.id, handle, frozen, owner, parent, deliver=deliver,
            jobs=jobs,
        )
        jobs[job.id] = job
        try:
            owner.track(Disposer(job._abandon))
        except ScopeClosed:
            # The owner closed during creation: the child is already being disposed with it.
            job._abandon()
        nursery = self._supervisor.nursery_for(parent) if parent is not None \
            else self._services.system_nursery
        nursery.start_soon(job._watch, name=f"agentloop.job:{job.id}")
        return job

    def get(self, job_id: str) -> Job | None:
        """This owner's job with this id, or ``None``."""
        job = _jobs(self._supervisor).get(job_id)
        return job if job is not None and job._owner is self._owner() else None

    def list(self) -> list[Job]:
        """This owner's jobs, oldest first (finished ones stay until the owner closes)."""
        owner = self._owner()
        return [j for j in _jobs(self._supervisor).values() if j._owner is owner]


# --- crash recovery of a resumed parent's tree ----------------------------------------------

_LOST: Final = "the process running it stopped before it finished (a crash); start it again"


async def recover_children(
    services: Services, supervisor: Supervisor, parent: Agent
) -> list[Callable[[Agent], None]]:
    """Close the turns a crash left open in ``parent``'s stored descendants, and give the
    resumed parent its jobs back; the jobs whose answer is still owed to it.

    Run by ``agents.resume`` before the parent's ``setup``. Each descendant (a stored
    session whose ``meta`` names its parent, transitively) is taken under its lease, its
    open turn closed as the parent's own is (cause ``crash``), flushed, and let go; one that
    a live driver holds (here or in another process) is left alone. Each direct child whose
    ``meta`` has a ``job_id`` becomes a finished :class:`Job` of the parent again: ``failed``
    when the crash cut it short, else the status its last turn ended with. A job started
    with ``deliver=True`` that the crash cut short is returned: its failure is delivered
    once the parent is published (the returned callables deliver it).
    """
    backend = services.persistence
    undelivered: list[Callable[[Agent], None]] = []
    if backend is None:
        return undelivered
    try:
        infos = await backend.list()
    except PersistenceError as exc:
        log.warning("session %s: cannot list its sub-agents to recover them: %s", parent.id, exc)
        return undelivered
    below: dict[str, list[str]] = {}
    for info in sorted(infos, key=lambda i: i.created_at):  # oldest first: the job order
        if info.parent_session_id is not None:
            below.setdefault(info.parent_session_id, []).append(info.id)
    if parent.id not in below:
        return undelivered
    seen = {parent.id}
    queue = deque(below[parent.id])
    while queue:
        sid = queue.popleft()
        if sid in seen:
            continue  # a meta loop can only come from hand-edited stores
        seen.add(sid)
        queue.extend(below.get(sid, ()))
        recovered = await _recover_one(services, parent, sid)
        if recovered is None:
            continue
        session, closed = recovered
        if session.meta.get("parent_session_id") == parent.id:
            scope = supervisor.scope_of(parent)
            assert scope is not None, "a parent being resumed has a lifecycle"
            owed = _rebuild_job(_jobs(supervisor), parent, scope, session, closed=closed)
            if owed is not None:
                undelivered.append(owed._deliver_to)
    return undelivered


async def _recover_one(
    rt: Services, parent: Agent, session_id: str
) -> tuple[Session, bool] | None:
    """The stored session, its crashed turn closed and flushed, and whether this closed one;
    None when someone drives it or it cannot be read."""
    backend = rt.persistence
    assert backend is not None
    if session_id in rt.leases:
        return None  # driven (or being resumed) in this runtime
    # Held like a resume's claim, so a concurrent resume of this child here waits for it.
    claim = rt.leases[session_id] = LeaseClaim()
    try:
        # Shielded and bounded: a lease taken must be given back, and a half-closed log
        # would only be closed again by the next resume anyway.
        with trio.move_on_after(CLOSE_GRACE, shield=True):
            try:
                await backend.acquire(session_id, rt.owner_id)
            except PersistenceError:
                return None  # a live driver elsewhere: its turns are its own
            try:
                stored = await backend.load(session_id)
                session = Session(session_id, stored.meta, rt.bus)
                session.load(stored.events)
                before = session.last_seq
                recover_crashed_turn(session)
                closed = session.last_seq != before
                if closed:
                    await backend.flush(session_id, session.last_seq)
                return session, closed
            except PersistenceError as exc:
                log.warning("sub-agent %s of %s: not recovered: %s", session_id, parent.id, exc)
                return None
            finally:
                # Inside the shielded scope above already; flake8-async wants it in sight.
                with trio.move_on_after(CLOSE_GRACE, shield=True):
                    await backend.release(session_id, rt.owner_id)
        return None
    finally:
        if rt.leases.get(session_id) is claim:
            del rt.leases[session_id]
        claim.settled.set()


def _rebuild_job(
    jobs: dict[str, Job], parent: Agent, scope: Scope, session: Session, *, closed: bool
) -> Job | None:
    """The finished job of ``session`` listed again; returned when its failure is owed to
    the parent: a ``deliver=True`` job whose turn this resume found cut by a crash
    (``closed``), and so never delivered anything."""
    job_id = session.meta.get("job_id")
    if not isinstance(job_id, str) or job_id in jobs:
        return None
    end: SessionEvent | None = None
    text = ""
    for event in session.events:
        if event.type == "turn/start":
            end, text = None, ""
        elif event.type == "assistant/message":
            content = event.data.get("content")
            text = content if isinstance(content, str) else ""
        elif event.type == "turn/end":
            end = event
    job = construct(Job, job_id, session.id, None, "", scope, parent, deliver=False, jobs=jobs)
    reason = end.data.get("reason") if end is not None else None
    if end is None or end.data.get("cause") == "crash":
        job._finish("failed", error=JobFailed(f"job {job_id!r} was lost: {_LOST}"))
    elif reason in ("completed", "max-tokens"):
        usage = end.data.get("usage")
        job._finish("done", result=RunResult(
            text, None, str(reason), end.turn, usage if isinstance(usage, FrozenDict) else None
        ))
    elif reason in ("aborted", "disposed"):
        job._finish("cancelled", error=JobCancelled(f"job {job_id!r} ended {reason}"))
    else:
        job._finish("failed", error=JobFailed(f"job {job_id!r} ended {reason} without an answer"))
    jobs[job_id] = job
    scope.track(Disposer(job._abandon))
    # A job that finished before the crash delivered its answer then, into the inbox, where
    # it fared as all pending input does (claimed, removed, or lost with the process). One
    # the crash cut short never delivered: its failure is, once, by the resume that finds
    # the crash (a later resume finds the turn closed already).
    return job if closed and job.status == "failed" and session.meta.get("job_deliver") is True \
        else None


# --- following a whole tree -------------------------------------------------------------------


@attrs.frozen(slots=True)
class TreeEvent:
    """One durable event of a session in a followed tree (``ctx.subagents.subscribe_tree``).

    Attributes:
        session_id: the session the event was appended to.
        parent_session_id: that session's parent (``None`` for a top-level session).
        depth: its depth in the agent tree (0 for a top-level session).
        event: the ``SessionEvent`` itself.
    """

    session_id: str
    parent_session_id: str | None
    depth: int
    event: SessionEvent


def _lineage(meta: FrozenDict) -> tuple[str | None, int]:
    parent = meta.get("parent_session_id")
    depth = meta.get("depth")
    return (
        parent if isinstance(parent, str) else None,
        depth if isinstance(depth, int) and not isinstance(depth, bool) else 0,
    )


class _Tree:
    """The sessions one tree subscription follows, and how far each has been delivered."""

    __slots__ = ("asleep", "delivered", "live", "root", "supervisor", "tx")

    def __init__(
        self, supervisor: Supervisor, root: str, tx: trio.MemorySendChannel[TreeEvent]
    ) -> None:
        self.supervisor, self.root, self.tx = supervisor, root, tx
        self.live: dict[str, tuple[str | None, int]] = {}
        # Per session ever followed: the last seq delivered, so a session that leaves and
        # comes back (disposed, then resumed) is not delivered twice.
        self.delivered: dict[str, int] = {}
        # Hibernated sessions of the tree: followed from the first event after their wake
        # (a wake announces no SessionCreated; what they logged before is in the store).
        self.asleep: set[str] = set()
        # Sessions followed from now on: what they logged before is in their ``events``.
        stack = [root]
        while stack:
            sid = stack.pop()
            session = supervisor.sessions.get(sid)
            if session is None:
                if sid in supervisor.agents:
                    self.asleep.add(sid)
                continue
            self.live[sid] = _lineage(session.meta)
            self.delivered[sid] = session.last_seq
            stack.extend(supervisor.children.get(sid, ()))

    def appended(self, e: SessionEventAppended) -> None:
        lineage = self.live.get(e.session_id)
        if lineage is None and e.session_id in self.asleep:
            lineage = self._woken(e.session_id)
        if lineage is None or e.event.seq <= self.delivered.get(e.session_id, 0):
            return
        self.delivered[e.session_id] = e.event.seq
        self._send(TreeEvent(e.session_id, lineage[0], lineage[1], e.event))

    def _woken(self, session_id: str) -> tuple[str | None, int] | None:
        session = self.supervisor.sessions.get(session_id)
        if session is None:
            return None
        self.asleep.discard(session_id)
        lineage = self.live[session_id] = _lineage(session.meta)
        return lineage

    def _in_tree(self, parent: str | None) -> bool:
        # Up the lineage: a parent still in its setup (whose children are published before
        # it is) is not live yet, but is in the tree all the same.
        supervisor, seen = self.supervisor, set()
        while parent is not None and parent not in seen:
            if parent == self.root or parent in self.live or parent in self.asleep:
                return True
            seen.add(parent)
            session = supervisor.sessions.get(parent)
            if session is None:
                preparing = supervisor.preparing(parent)
                if preparing is None:
                    return False
                session = preparing.session
            parent = _lineage(session.meta)[0]
        return False

    def created(self, e: SessionCreated) -> None:
        parent, depth = _lineage(e.meta)
        if e.session_id != self.root and not self._in_tree(parent):
            return
        self.live[e.session_id] = (parent, depth)
        session = self.supervisor.sessions.get(e.session_id)
        if session is None:
            return
        # A session that joins after the subscription began is delivered from its first
        # event: a seed or a resumed log was never announced event by event.
        start = self.delivered.get(e.session_id, 0)
        for event in session.events[start:]:
            self._send(TreeEvent(e.session_id, parent, depth, event))
        self.delivered[e.session_id] = session.last_seq

    def disposed(self, e: SessionDisposed) -> None:
        self.live.pop(e.session_id, None)
        self.asleep.discard(e.session_id)

    def _send(self, item: TreeEvent) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self.tx.send_nowait(item)  # unbounded: never blocks, never drops


# The creation transaction (a layer below) mends a resumed parent's tree through this.
Creation.recover_children = recover_children
