"""An agent's lifecycle: publication, teardown and quiescence, owned by one object.

The supervisor publishes an agent and detaches it, the handle and the runtime ask for its
disposal, the agent's actor runs it: each through this object's methods, so the flags that say
where an agent stands in its life have one owner. The agent binds the one thing only it can do,
stopping itself (an input barrier that ends the running turn ``disposed``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

if TYPE_CHECKING:
    from ._services import LeaseClaim

__all__ = ["Family", "Lifecycle", "Scope"]


class Family(Protocol):
    """What a lifecycle asks of the supervisor (a layer above)."""

    def detach(self, agent: Any) -> None: ...
    def cancel_children(self, agent_id: str) -> None: ...
    def has_children(self, agent_id: str) -> bool: ...
    def rested(self, agent: Any) -> None: ...
    def woken(self, agent: Any, session: Any) -> None: ...


class Scope(Protocol):
    """The agent's own scope (a :class:`~agentloop.Context`, a layer above)."""

    async def aclose(self) -> None: ...


class Owner(Protocol):
    """The scope that creates the agent, which makes the agent's own scope."""

    def agent_scope(self, agent_id: str, *, closed: bool = False) -> Any: ...


def _unbound(agent: object) -> None:
    raise AssertionError("the agent binds its stop before anyone can dispose it")


class Lifecycle:
    """Where one agent stands: being prepared, published, stopping, quiescent.

    Attributes:
        published: the supervisor entered it in the registries (it may be driven).
        stopping: disposal began (``status`` reads ``disposed``; input is refused).
        nursery: the actor's nursery while the actor runs (its children and tools run there).
        attached: its session is stored (else its actor stores it first).
        needs_lease: its actor must take the session's lease (``agent_loop.create``).
        lease: its claim on the session's persistence lease, once published.
        home: the nursery its actor task runs in (a hibernated agent's actor restarts there).
        dormant: while hibernated, the call settings it goes on with when woken (else None).
    """

    __slots__ = (
        "_abandoned", "_actor", "_agent", "_announced", "_changed", "_family", "_owner",
        "_quiescent", "_scope", "_settled", "_stop", "_system", "_teardown_requested",
        "agent_id", "attached", "dormant", "home", "lease", "needs_lease", "nursery",
        "published", "stopping",
    )

    def __init__(
        self, system_nursery: trio.Nursery, family: Family, agent_id: str, owner: Owner
    ) -> None:
        # References, not closures: an idle agent's lifecycle is kept for its whole life.
        self._system = system_nursery
        self._family = family
        self.agent_id = agent_id
        # The agent's own scope is made on first use: most agents never register anything,
        # and an idle one is kept for its whole life.
        self._owner = owner
        self._scope: Scope | None = None
        self._agent: Any = None
        self._stop: Callable[[Any], None] = _unbound
        self._actor: Callable[..., Awaitable[None]]
        self.published = False
        self.stopping = False
        self.attached = False
        self.needs_lease = False
        self.lease: LeaseClaim | None = None
        self.nursery: trio.Nursery | None = None
        self.home: trio.Nursery | None = None
        self.dormant: object | None = None
        self._teardown_requested = False
        self._abandoned = False
        # Flags, and one event made only when someone has to wait for one of them (most are
        # set before anyone waits, and idle agents are numerous).
        self._announced = False  # publication's notifications are over
        self._settled = False  # announced, or abandoned before publication
        self._quiescent = False
        self._changed: trio.Event | None = None

    def bind(
        self, agent: object, stop: Callable[[Any], None], actor: Callable[..., Awaitable[None]]
    ) -> None:
        """The agent, and the functions of its class (shared, not bound: nothing per agent)
        called with it: its own stop, run once when its disposal begins, and its actor task
        (``task_status`` reports its nursery open), which the supervisor starts."""
        self._agent = agent
        self._stop = stop
        self._actor = actor

    def start_actor(self, nursery: trio.Nursery) -> None:
        """Start the agent's actor task in ``nursery`` (where it runs from now on)."""
        self.home = nursery
        nursery.start_soon(self._actor, self._agent, name=f"agentloop.agent:{self.agent_id}")

    async def start_actor_early(self, nursery: trio.Nursery) -> None:
        """Start the actor before publication and wait until its nursery is open."""
        self.home = nursery
        await nursery.start(self._actor, self._agent, name=f"agentloop.agent:{self.agent_id}")

    def _signal(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def _until(self, flag: str) -> None:
        while not getattr(self, flag):
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()

    # --- what the supervisor's side does for the agent ---------------------------------------

    @property
    def scope(self) -> Any:
        """The agent's own scope (a child of its creator's), made on first use."""
        if self._scope is None:
            self._scope = self._owner.agent_scope(self.agent_id)
        return self._scope

    @property
    def made_scope(self) -> Scope | None:
        """The agent's own scope if anyone used it yet (else None: nothing to close)."""
        return self._scope

    async def close_scope(self) -> None:
        """Close the agent's scope: its sub-agents (to quiescence), then its registrations.
        A scope nobody used is made closed, so a later ``handle.ctx`` reads it closed."""
        if self._scope is None:
            self._scope = self._owner.agent_scope(self.agent_id, closed=True)
        await self._scope.aclose()

    def detach(self) -> None:
        """The actor's last act: ask the supervisor to take the agent out of the registries."""
        self._family.detach(self._agent)

    def cancel_children(self) -> None:
        """Cancel the running turns of the agent's live sub-agents (cause ``parent``)."""
        self._family.cancel_children(self.agent_id)

    # --- hibernation ---------------------------------------------------------------------

    def has_children(self) -> bool:
        """Live sub-agents (hibernated ones too: their actors restart in this one's nursery)."""
        return self._family.has_children(self.agent_id)

    def rest(self, proposal: object) -> None:
        """The agent hibernated: the supervisor forgets its in-memory session."""
        self.dormant = proposal
        self._family.rested(self._agent)

    def wake(self, session: object) -> None:
        """The agent was reloaded: its session is live again, and its actor restarts where it
        ran before."""
        self.dormant = None
        self._family.woken(self._agent, session)
        assert self.home is not None, "a hibernated agent's actor ran in a nursery"
        self.start_actor(self.home)

    def retire(self, retire: Callable[[], Awaitable[None]]) -> None:
        """A hibernated agent is disposed: no actor runs, so its teardown runs on its own
        (``dormant`` stays set: a later read of its session loads the stored log)."""
        self._system.start_soon(retire, name=f"agentloop.agent:{self.agent_id}")

    # --- publication ---------------------------------------------------------------------

    def publish(self, lease: LeaseClaim | None = None) -> None:
        self.published = True
        if lease is not None:
            self.lease = lease

    def announced(self) -> None:
        """Publication's notifications are over: the actor may drive, a disposal may stop."""
        self._announced = self._settled = True
        self._signal()

    def abandon(self) -> None:
        """The creation rolled back: an actor started early exits without a trace."""
        self._abandoned = self._settled = True
        self._signal()

    async def wait_settled(self) -> bool:
        """For an actor started before publication: True once published, False if the
        creation rolled back instead."""
        if self._settled:
            await trio.lowlevel.checkpoint()
        else:
            await self._until("_settled")
        return not self._abandoned

    # --- teardown ------------------------------------------------------------------------

    @property
    def disposing(self) -> bool:
        """Disposal was asked for or began (a disposed agent starts no sub-agents)."""
        return self.stopping or self._teardown_requested or self._quiescent

    def request_teardown(self) -> None:
        """Begin the disposal once (at once, or when publication's notifications are over)."""
        if self._teardown_requested or self._quiescent:
            return
        self._teardown_requested = True
        if self._announced:
            self._stop(self._agent)  # the input barrier: from here on send() raises AgentDisposed
        else:
            # A dispose requested from inside a creation notification waits for it to unwind.
            self._system.start_soon(self._stop_once_announced)

    async def _stop_once_announced(self) -> None:
        await self._until("_announced")
        if not self._quiescent:
            self._stop(self._agent)

    async def dispose(self) -> None:
        """Begin the disposal if needed and wait for the quiescence boundary."""
        self.request_teardown()
        if self._quiescent:
            await trio.lowlevel.checkpoint()
        else:
            await self._until("_quiescent")

    def quiesced(self) -> None:
        """The supervisor detached the agent: its life is over.

        Nothing is asked of the agent from here on, so it is let go: the agent keeps this
        object (its status reads from it), and a reference back would keep a closed agent,
        and its whole session, for the cyclic collector to find."""
        self._quiescent = True
        self._agent = None
        self._signal()

    @property
    def quiescent(self) -> bool:
        return self._quiescent

    @property
    def active(self) -> bool:
        """From preparation until quiescence, unless its creation rolled back."""
        return not (self._quiescent or self._abandoned)
