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
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from ._bus import Disposer, Lagged
from ._events import Event
from ._tools import ToolsFacade

if TYPE_CHECKING:
    from ._agents import AgentHandle, AgentLoopService, AgentsService, SessionsService
    from ._config import Config
    from ._llm import LLMService
    from ._persistence import SessionPersistence
    from ._runtime import Runtime
    from ._settings import Settings

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
        self._bus = ctx.runtime.bus

    def on(self, cls: type[E], handler: Callable[[E], Any], *, priority: int = 0) -> Disposer:
        """Register a handler for ``cls``; the registration ends with this scope.

        Hooks are awaited, sync or async. Control and durable events are dispatched
        synchronously at the moment they happen: a plain function runs right there; an async
        handler runs as an observer task that receives them in order, without holding up
        the emitter. Inside an agent's scope (its ``setup``) the handler only sees that
        agent's events.
        """
        agent_id = self._ctx.agent_id
        if cls.kind == "hook" or not _is_async(handler):
            return self._ctx.track(self._bus.on(cls, handler, priority=priority,
                                                agent_id=agent_id))
        sub, detach = self._bus.open_subscription(cls, agent_id=agent_id)
        scope = trio.CancelScope()

        async def observe() -> None:
            with scope:
                async for event in sub:
                    if isinstance(event, Lagged):
                        log.warning("an async %s handler fell %d events behind and missed them",
                                    cls.name, event.missed)
                        continue
                    try:
                        await handler(event)
                    except Exception:
                        log.exception("an async %s handler failed", cls.name)

        self._ctx.runtime.system_nursery.start_soon(observe)

        def stop() -> None:
            detach()
            scope.cancel()

        return self._ctx.track(Disposer(stop))

    def subscribe(
        self, classes: type[Event] | tuple[type[Event], ...], *, capacity: float = 65536
    ) -> Any:
        """``async with ctx.events.subscribe(Cls) as rx:``: a receive channel of those events.

        Delivery never blocks the emitter. A subscriber more than ``capacity`` events behind
        receives one :class:`agentloop.Lagged` marker in place of what it missed; durable
        events can be re-read from ``agent.session.events`` by seq.
        """
        return self._bus.subscribe(classes, capacity=capacity, agent_id=self._ctx.agent_id)

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
        self._service: LLMService = ctx.runtime.llm

    def register(self, provider: str, adapter: Any) -> Disposer:
        """Serve calls for ``provider`` with ``adapter`` until the scope closes."""
        return self._ctx.track(self._service.register(provider, adapter))

    def adapter(self, provider: str) -> Any | None:
        return self._service.adapter(provider)

    def providers(self) -> list[str]:
        return self._service.providers()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)


class PromptFacade:
    """``ctx.system_prompt``: the deployment persona, or (in an agent's setup) its override."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._prompt = ctx.runtime.prompt

    def set(self, text: str) -> Disposer:
        """Use ``text`` as the system prompt; ``{provider}``, ``{model}``, ``{cwd}`` are filled."""
        if not isinstance(text, str):
            raise TypeError(f"the system prompt must be a string, got {type(text).__name__}")
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


class Context:
    """A scope: the services, plus ownership of everything registered through them.

    Attributes:
        agents, agent_loop, sessions, llm, tools, system_prompt, events, settings,
        session_persistence: the runtime's services, seen from this scope.
        name: what the scope belongs to (``"root"``, ``"plugin:retry"``, ``"agent:s1"``).
        agent_id: the agent this scope belongs to, if any.
    """

    def __init__(
        self, runtime: Runtime, *, name: str, parent: Context | None = None,
        agent_id: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.name = name
        self.parent = parent
        self.agent_id = agent_id
        self._disposers: dict[int, Disposer] = {}
        self._owned: dict[int, AgentHandle] = {}
        self._children: dict[int, Context] = {}
        self._key = next(_ids)
        self._closed = False
        self._closing: trio.Event | None = None
        if parent is not None:
            parent._children[self._key] = self

    def __repr__(self) -> str:
        return f"<Context {self.name}>"

    # --- services (built on first use: agents' scopes are many and mostly idle) ----------

    @functools.cached_property
    def events(self) -> EventsFacade:
        return EventsFacade(self)

    @functools.cached_property
    def tools(self) -> ToolsFacade:
        return ToolsFacade(self.runtime.tools, self.track, self.agent_id)

    @functools.cached_property
    def llm(self) -> LLMFacade:
        return LLMFacade(self)

    @functools.cached_property
    def system_prompt(self) -> PromptFacade:
        return PromptFacade(self)

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def config(self) -> Config:
        return self.runtime.config

    @property
    def session_persistence(self) -> SessionPersistence | None:
        return self.runtime.persistence

    @property
    def agents(self) -> AgentsService:
        from ._agents import AgentsService

        return AgentsService(self)

    @property
    def agent_loop(self) -> AgentLoopService:
        from ._agents import AgentLoopService

        return AgentLoopService(self)

    @property
    def sessions(self) -> SessionsService:
        from ._agents import SessionsService

        return SessionsService(self.runtime)

    def provide_persistence(self, backend: SessionPersistence) -> Disposer:
        """Install a session-persistence backend for as long as this scope lives."""
        return self.track(self.runtime.install_persistence(backend))

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
            raise RuntimeError(f"{self!r} is closed; it cannot own new registrations")
        key = id(disposer)
        self._disposers[key] = disposer

        def dispose() -> None:
            self._disposers.pop(key, None)
            disposer()

        return Disposer(dispose)

    def _own(self, handle: AgentHandle) -> None:
        self._owned[id(handle)] = handle

    def _disown(self, handle: AgentHandle) -> None:
        self._owned.pop(id(handle), None)

    def child(self, name: str, *, agent_id: str | None = None) -> Context:
        """A nested scope, closed with this one (or earlier)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        return Context(self.runtime, name=name, parent=self, agent_id=agent_id)

    async def aclose(self) -> None:
        """Dispose owned agents (to quiescence), close child scopes, undo registrations."""
        if self._closing is not None:
            await self._closing.wait()
            return
        self._closing = trio.Event()
        try:
            if self._owned:
                async with trio.open_nursery() as nursery:
                    for handle in list(self._owned.values()):
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
