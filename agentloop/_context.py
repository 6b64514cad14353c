"""``Context``: a scope through which services are reached and registrations are owned.

Every registration made through a context (hooks, tools, guards, adapters, prompt overrides,
persistence backends, agents) is undone when the context closes, latest first. The runtime has a
root context; each plugin and each programmatic agent gets a child context of its own.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast, overload

import trio

from ._agents import AgentHandle, AgentLoopService, AgentsService, SessionsService, Supervisor
from ._bus import E1, E2, E3, Classes, Disposer, Lagged, Subscribe
from ._errors import InvalidOptions, ScopeClosed
from ._events import Event, SessionEventAppended
from ._services import Services
from ._subagents import JobsService, SubagentsService
from ._tools import ToolsFacade

if TYPE_CHECKING:
    from ._config import Config
    from ._llm import LLMService
    from ._persistence import SessionPersistence
    from ._settings import Settings
    from .llm import ModelAdapter, RetryPolicy

__all__ = ["Context", "EventsFacade", "LLMFacade", "PromptFacade"]

log = logging.getLogger("agentloop")
E = TypeVar("E", bound=Event)
_ids = itertools.count(1)


def _is_async(handler: object) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - async callable objects
    )


class EventsFacade:
    """``ctx.events``: hooks and subscriptions owned by the context."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._bus = ctx._services.bus

    def on(self, cls: type[E], handler: Callable[[E], Any], *, priority: int = 0) -> Disposer:
        """Register a handler for ``cls``; the registration ends with this scope.

        Hooks are awaited, sync or async. Control and durable events are dispatched
        synchronously at the moment they happen, and a plain function runs right there.

        An ``async def`` handler of a control or durable event cannot run there: it becomes
        an observer task of its own, fed by a subscription (see :meth:`subscribe`), that
        awaits the handler for one event after another, in emission order, without holding
        up the emitter (so it sees each event after the fact, and ``priority`` does not
        apply). For a durable class nothing is ever dropped, however slow the handler: the
        backlog is kept in memory until the handler catches up. For a control class a
        handler that falls 65,536 events behind misses the overflow, and a warning is
        logged saying how many it missed. Inside an agent's scope (its ``setup``) the
        handler only sees that agent's events.
        """
        agent_id = self._ctx.agent_id
        if cls.kind == "hook" or not _is_async(handler):
            return self._ctx.track(self._bus.on(cls, handler, priority=priority,
                                                agent_id=agent_id))
        rx, detach = self._bus.open_subscription(cls, agent_id=agent_id)
        # The bus only feeds this channel events of ``cls`` and markers.
        sub = cast("trio.MemoryReceiveChannel[E | Lagged]", rx)
        scope = trio.CancelScope()

        async def observe() -> None:
            with scope:
                async for event in sub:
                    if isinstance(event, Lagged):
                        log.warning(
                            "the async %s handler %r runs as an observer task and fell too far "
                            "behind: it missed %d events (register a plain function to run "
                            "at the moment of each event, or make the handler faster)",
                            cls.name, handler, event.missed,
                        )
                        continue
                    try:
                        await handler(event)
                    except Exception:
                        log.exception("an async %s handler failed", cls.name)

        self._ctx._services.system_nursery.start_soon(observe)

        def stop() -> None:
            detach()
            scope.cancel()

        return self._ctx.track(Disposer(stop))

    @overload
    def subscribe(
        self, cls: type[SessionEventAppended], /, *, capacity: float = ...
    ) -> Subscribe[SessionEventAppended]: ...
    @overload
    def subscribe(self, cls: type[E1], /, *, capacity: float = ...) -> Subscribe[E1 | Lagged]: ...
    @overload
    def subscribe(
        self, c1: type[E1], c2: type[E2], /, *, capacity: float = ...
    ) -> Subscribe[E1 | E2 | Lagged]: ...
    @overload
    def subscribe(
        self, c1: type[E1], c2: type[E2], c3: type[E3], /, *, capacity: float = ...
    ) -> Subscribe[E1 | E2 | E3 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[SessionEventAppended]], /, *, capacity: float = ...
    ) -> Subscribe[SessionEventAppended]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[E1]], /, *, capacity: float = ...
    ) -> Subscribe[E1 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[E1], type[E2]], /, *, capacity: float = ...
    ) -> Subscribe[E1 | E2 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[E1], type[E2], type[E3]], /, *, capacity: float = ...
    ) -> Subscribe[E1 | E2 | E3 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: Classes, /, *more: Classes, capacity: float = ...
    ) -> Subscribe[Event | Lagged]: ...
    def subscribe(
        self, classes: Classes, /, *more: Classes, capacity: float = 65536
    ) -> Subscribe[Any]:
        """``async with ctx.events.subscribe(Cls, *more) as rx:``: a channel of those events.

        ``rx`` is a ``trio.MemoryReceiveChannel`` of the events of the given classes (as
        arguments, a tuple, or both), in emission order across all of them; it ends when the
        block exits. Delivery never blocks the emitter and costs it no task switch per event.

        Durable events (``SessionEventAppended``) are never dropped: a subscriber receives
        every one, in seq order for each session, however slow it is, and until it catches up
        the channel holds its backlog in memory (one queue slot per event). Any other event
        is bounded by ``capacity``: a subscriber with that many items queued unread misses
        the next ones and receives one :class:`agentloop.Lagged` marker in their place.

        Each ``receive`` (and each turn of ``async for``) checks for cancellation; it takes
        what is already queued without a trip through the scheduler, passing one every 64
        events so that a long backlog lets other tasks run, and parks when nothing is
        queued. ``receive_nowait`` until ``trio.WouldBlock`` skips the cancel check too.
        Closing the channel ends the subscription. Inside an agent's scope the channel only
        carries that agent's events.
        """
        return self._bus.subscribe(
            classes, *more, capacity=capacity, agent_id=self._ctx.agent_id
        )

    async def emit(self, event: Event) -> Any:
        """Emit a hook event (plugins may define their own hook events)."""
        return await self._bus.emit(event)

    def emit_nowait(self, event: Event) -> None:
        """Emit a control event synchronously."""
        self._bus.emit_nowait(event)


class LLMFacade:
    """``ctx.llm``: adapter registrations owned by the context."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._service: LLMService = ctx._services.llm

    def register(
        self, provider: str, adapter: ModelAdapter, *, retry: RetryPolicy | None = None
    ) -> Disposer:
        """Serve calls for ``provider`` with ``adapter`` until the scope closes.

        An object with a ``stream`` method that is not a :class:`agentloop.llm.ModelAdapter`
        is accepted too; an object without one raises ``TypeError``. ``retry`` (else the
        adapter's own ``retry``) is this route's retry policy: every failed call it serves
        carries it to ``agent/request-error`` as ``retry_policy``.
        """
        return self._ctx.track(self._service.register(provider, adapter, retry=retry))

    def adapter(self, provider: str) -> ModelAdapter | None:
        """The adapter serving ``provider`` now, or ``None``."""
        return self._service.adapter(provider)

    def providers(self) -> list[str]:
        """The provider names that have an adapter, sorted."""
        return self._service.providers()


class PromptFacade:
    """``ctx.system_prompt``: the deployment persona, or (in an agent's setup) its override."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._prompt = ctx._services.prompt

    def set(self, text: str) -> Disposer:
        """Use ``text`` as the system prompt; ``{provider}``, ``{model}``, ``{cwd}`` are filled."""
        if not isinstance(text, str):
            raise InvalidOptions(
                f"the system prompt must be a string, got {type(text).__name__}"
            )
        if self._ctx.agent_id is None:
            previous = self._prompt.persona
            self._prompt.persona = text

            def restore() -> None:
                if self._prompt.persona == text:
                    self._prompt.persona = previous

            return self._ctx.track(Disposer(restore))
        return self._ctx.track(Disposer(self._prompt.override(self._ctx.agent_id, text)))

    @property
    def persona(self) -> str:
        return self._prompt.persona


_NONE: Final[dict[Any, Any]] = {}  # shared and never written: see Context.__init__


class Context:
    """A scope: the services, plus ownership of everything registered through them.

    Its properties ``agents``, ``agent_loop``, ``sessions``, ``llm``, ``tools``,
    ``system_prompt``, ``events``, ``settings`` and ``session_persistence`` are the runtime's
    services, seen from this scope.

    Attributes:
        name: what the scope belongs to (``"root"``, ``"plugin:retry"``, ``"agent:s1"``).
        agent_id: the agent this scope belongs to, if any.
    """

    def __init__(
        self, services: Services, supervisor: Supervisor, *, name: str,
        parent: Context | None = None, agent_id: str | None = None,
    ) -> None:
        self._services = services
        self._supervisor = supervisor
        self.name = name
        self.parent = parent
        self.agent_id = agent_id
        # Made on first write (an agent's scope usually never owns anything): until then the
        # shared empty dict, which is only read, popped from with a default, or tested.
        self._disposers: dict[int, Disposer] = _NONE
        self._owned: dict[AgentHandle, None] = _NONE
        self._children: dict[int, Context] = _NONE
        self._key = next(_ids)
        self._closed = False
        self._closing: trio.Event | None = None
        if parent is not None:
            if parent._children is _NONE:
                parent._children = {}
            parent._children[self._key] = self

    def __repr__(self) -> str:
        return f"<Context {self.name}>"

    # --- services (built on first use: agents' scopes are many and mostly idle) ----------

    @functools.cached_property
    def events(self) -> EventsFacade:
        return EventsFacade(self)

    @functools.cached_property
    def tools(self) -> ToolsFacade:
        return ToolsFacade(self._services.tools, self.track, self.agent_id)

    @functools.cached_property
    def llm(self) -> LLMFacade:
        return LLMFacade(self)

    @functools.cached_property
    def system_prompt(self) -> PromptFacade:
        return PromptFacade(self)

    @property
    def settings(self) -> Settings:
        return self._services.settings

    @property
    def config(self) -> Config:
        return self._services.config

    @property
    def session_persistence(self) -> SessionPersistence | None:
        return self._services.persistence

    @property
    def agents(self) -> AgentsService:
        return AgentsService(self, self._services, self._supervisor)

    @property
    def agent_loop(self) -> AgentLoopService:
        return AgentLoopService(self, self._services, self._supervisor)

    @property
    def sessions(self) -> SessionsService:
        return SessionsService(self._services, self._supervisor)

    @property
    def subagents(self) -> SubagentsService:
        return SubagentsService(self, self._services, self._supervisor)

    @property
    def jobs(self) -> JobsService:
        return JobsService(self, self._services, self._supervisor)

    @property
    def invariants(self) -> Any:
        """The invariant companion, when the ``invariants`` plugin is loaded (else ``None``)."""
        return self._services.named.get("invariants")

    def provide(self, name: str, service: object) -> Disposer:
        """Make ``service`` reachable from every scope as ``ctx.<name>`` (for the names the
        runtime knows, e.g. ``invariants``) until this scope closes."""
        services = self._services.named
        if name in services:
            raise ValueError(f"a {name!r} service is already provided")
        services[name] = service

        def withdraw() -> None:
            if services.get(name) is service:
                del services[name]

        return self.track(Disposer(withdraw))

    def provide_persistence(self, backend: SessionPersistence) -> Disposer:
        """Install a session-persistence backend for as long as this scope lives."""
        return self.track(self._services.install_persistence(backend))

    # --- ownership -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def closing(self) -> bool:
        """Whether ``aclose`` has begun (the scope may still be disposing what it owns)."""
        return self._closing is not None

    def track(self, disposer: Disposer) -> Disposer:
        """Own ``disposer``: it runs when this scope closes, unless it ran before."""
        if self._closed:
            disposer()
            raise ScopeClosed(f"{self!r} is closed; it cannot own new registrations")
        key = id(disposer)
        if self._disposers is _NONE:
            self._disposers = {}
        self._disposers[key] = disposer

        def dispose() -> None:
            self._disposers.pop(key, None)
            disposer()

        return Disposer(dispose)

    def own(self, handle: AgentHandle) -> None:
        """Own ``handle``: this scope closes it (to quiescence) when it closes, unless
        :meth:`disown` lets go of it first (its ``aclose`` does, once it is quiescent)."""
        if self._closed:
            raise ScopeClosed(f"{self!r} is closed; it cannot own agents")
        if self._owned is _NONE:
            self._owned = {}
        # The handle is its own key (compared by identity): nothing is allocated per agent
        # beyond the entry, where a disposer per handle cost more than the handle itself.
        self._owned[handle] = None

    def disown(self, handle: AgentHandle) -> None:
        """Let go of ``handle`` (harmless when it is not owned, or the scope closed)."""
        self._owned.pop(handle, None)

    def agent_scope(self, agent_id: str, *, closed: bool = False) -> Context:
        """Agent ``agent_id``'s own scope, a child of this one (made when the agent first
        uses it). Made closed, and nobody's child, when ``closed`` or this scope is closed:
        the agent is then disposed, or being disposed, with its owner."""
        name = f"agent:{agent_id}"
        if not (closed or self._closed):
            return self.child(name, agent_id=agent_id)
        scope = Context(self._services, self._supervisor, name=name, agent_id=agent_id)
        scope.close_registrations()
        return scope

    def child(self, name: str, *, agent_id: str | None = None) -> Context:
        """A nested scope, closed with this one (or earlier)."""
        if self._closed:
            raise ScopeClosed(f"{self!r} is closed; it cannot create agents or scopes")
        return Context(self._services, self._supervisor, name=name, parent=self,
                       agent_id=agent_id)

    async def aclose(self) -> None:
        """Dispose owned agents (to quiescence), close child scopes, undo registrations."""
        if self._closing is not None:
            await self._closing.wait()
            return
        self._closing = trio.Event()
        try:
            if self._owned:
                async with trio.open_nursery() as nursery:
                    for handle in list(self._owned):
                        nursery.start_soon(handle.aclose)
            for child in reversed(list(self._children.values())):
                await child.aclose()
        finally:
            self.close_registrations()
            self._closing.set()

    def close_registrations(self) -> None:
        """Undo every registration synchronously, latest first (owned agents are not awaited)."""
        self._closed = True
        for child in reversed(list(self._children.values())):
            child.close_registrations()
        while self._disposers:
            _, disposer = self._disposers.popitem()
            try:
                disposer()
            except Exception:
                log.exception("%r: a disposer failed", self)
        if self.parent is not None:
            self.parent._children.pop(self._key, None)
