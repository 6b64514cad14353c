"""The typed, scoped event bus.

Handlers are kept per event class in dispatch order; a class with no handler and no subscriber
costs one dict lookup to emit (hot paths check :meth:`EventBus.has_listeners` before they even
build the event). Subscribers are actor-style observers fed through a per-subscription queue:
delivery never blocks the emitter and never hops a channel per event, and a subscriber that
falls more than ``capacity`` events behind is told so with a :class:`Lagged` marker (durable
events can then be re-read from ``session.events``).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

from ._events import Event

__all__ = ["EventBus", "Lagged", "Subscription", "Disposer"]

log = logging.getLogger("agentloop")
E = TypeVar("E", bound=Event)
Handler = Callable[[Any], Any]


class Disposer:
    """Undo one registration. Idempotent; calling it after its scope closed is harmless."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()

    @property
    def disposed(self) -> bool:
        return self._fn is None


@attrs.frozen(slots=True)
class Lagged:
    """Delivered to a subscriber in place of the ``missed`` events it was too slow to take."""

    missed: int


@attrs.define(slots=True, eq=False)
class _Handler:
    fn: Handler
    is_async: bool
    priority: int
    order: int
    agent_id: str | None


class Subscription(trio.abc.ReceiveChannel[Any]):
    """The receive side of :meth:`EventBus.subscribe`: events in emission order."""

    def __init__(self, classes: tuple[type[Event], ...], capacity: float, agent_id: str | None):
        self.classes = classes
        self.agent_id = agent_id
        self._capacity = capacity
        self._queue: deque[Any] = deque()
        self._missed = 0
        self._waiter: trio.Event | None = None
        self._closed = False

    def _push(self, event: Event) -> None:
        if self._closed:
            return
        if len(self._queue) >= self._capacity:
            self._missed += 1
        else:
            if self._missed:
                self._queue.append(Lagged(self._missed))
                self._missed = 0
            self._queue.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    def receive_nowait(self) -> Any:
        if self._queue:
            return self._queue.popleft()
        if self._missed:
            missed, self._missed = self._missed, 0
            return Lagged(missed)
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                value = self.receive_nowait()
            except trio.WouldBlock:
                self._waiter = waiter = trio.Event()
                await waiter.wait()
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return value

    def pending(self) -> int:
        """Events queued and not yet received."""
        return len(self._queue)

    def _end(self) -> None:
        self._closed = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    async def aclose(self) -> None:
        self._end()
        await trio.lowlevel.checkpoint()


def _owner(event: Event) -> str | None:
    """The agent an event is about; a session event's session id is its agent's id."""
    owner = getattr(event, "agent_id", None)
    return owner if owner is not None else getattr(event, "session_id", None)


class EventBus:
    """Registrations and dispatch for every :class:`Event` class."""

    def __init__(self) -> None:
        self._handlers: dict[type[Event], list[_Handler]] = {}
        self._subs: dict[type[Event], list[Subscription]] = {}
        self._order = itertools.count()

    def has_listeners(self, cls: type[Event]) -> bool:
        """Whether emitting ``cls`` would reach anyone (a cheap pre-check for hot paths)."""
        return cls in self._handlers or cls in self._subs

    def has_handlers(self, cls: type[Event]) -> bool:
        return cls in self._handlers

    def on(
        self,
        cls: type[E],
        handler: Callable[[E], Any],
        *,
        priority: int = 0,
        agent_id: str | None = None,
    ) -> Disposer:
        """Register ``handler`` for ``cls``: higher ``priority`` first, then registration order.

        Control and durable events are dispatched synchronously, so their handlers must be plain
        functions; hooks accept plain or async handlers.
        """
        if not (isinstance(cls, type) and issubclass(cls, Event) and hasattr(cls, "name")):
            raise TypeError(f"{cls!r} is not an agentloop event class")
        is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 - async callable objects
        )
        if is_async and cls.kind != "hook":
            raise TypeError(
                f"{cls.name!r} is a {cls.kind} event, dispatched synchronously: register a plain "
                f"function, or use events.subscribe() to observe it from a task"
            )
        entry = _Handler(handler, is_async, priority, next(self._order), agent_id)
        handlers = self._handlers.get(cls)
        if handlers is None:
            handlers = []
        # Copy-on-write: a dispatch in progress keeps iterating the list it started with.
        handlers = sorted([*handlers, entry], key=lambda h: (-h.priority, h.order))
        self._handlers[cls] = handlers

        def dispose() -> None:
            current = self._handlers.get(cls)
            if current is None or entry not in current:
                return
            remaining = [h for h in current if h is not entry]
            if remaining:
                self._handlers[cls] = remaining
            else:
                del self._handlers[cls]

        return Disposer(dispose)

    def emit_nowait(self, event: Event) -> None:
        """Dispatch a control or durable event synchronously, to handlers then subscribers.

        A handler that raises is logged and skipped: observers cannot break what they observe.
        """
        cls = type(event)
        handlers = self._handlers.get(cls)
        if handlers is not None:
            agent_id = _owner(event)
            for h in handlers:
                if h.agent_id is None or h.agent_id == agent_id:
                    try:
                        h.fn(event)
                    except Exception:
                        # An observer's bug must not break the state change it observes.
                        log.exception("a %s handler failed", cls.name)
        subs = self._subs.get(cls)
        if subs is not None:
            self._deliver(subs, event)

    @staticmethod
    def _deliver(subs: list[Subscription], event: Event) -> None:
        agent_id = _owner(event)
        for sub in subs:
            if sub.agent_id is None or sub.agent_id == agent_id:
                sub._push(event)

    async def emit(self, event: Event) -> Any:
        """Dispatch a hook and return its outcome.

        notify: ``None``; waterfall: the final value of the waterfall field; decision: the first
        non-``None`` handler result, or ``None``.
        """
        cls = type(event)
        handlers = self._handlers.get(cls)
        subs = self._subs.get(cls)
        if subs is not None:
            self._deliver(subs, event)
        field = cls.waterfall_field
        if handlers is None:
            return getattr(event, field) if field is not None else None
        agent_id = _owner(event)
        mode = cls.mode
        for h in handlers:
            if h.agent_id is not None and h.agent_id != agent_id:
                continue
            result = h.fn(event)
            if h.is_async:
                result = await result
            if result is None:
                continue
            if mode == "decision":
                return result
            if mode == "waterfall":
                assert field is not None
                event = attrs.evolve(event, **{field: result})  # type: ignore[misc]
        return getattr(event, field) if field is not None else None

    def open_subscription(
        self,
        classes: type[Event] | tuple[type[Event], ...],
        *,
        capacity: float = 65536,
        agent_id: str | None = None,
    ) -> tuple[Subscription, Disposer]:
        """A subscription and the disposer that detaches (and ends) it."""
        if not isinstance(classes, tuple):
            classes = (classes,)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, Event)):
                raise TypeError(f"{cls!r} is not an agentloop event class")
        if capacity != math.inf and (not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity must be a positive integer or math.inf, got {capacity!r}")
        sub = Subscription(classes, capacity, agent_id)
        for cls in classes:
            self._subs[cls] = [*self._subs.get(cls, ()), sub]

        def detach() -> None:
            for cls in classes:
                remaining = [s for s in self._subs.get(cls, ()) if s is not sub]
                if remaining:
                    self._subs[cls] = remaining
                else:
                    self._subs.pop(cls, None)
            sub._end()

        return sub, Disposer(detach)

    @asynccontextmanager
    async def subscribe(
        self,
        classes: type[Event] | tuple[type[Event], ...],
        *,
        capacity: float = 65536,
        agent_id: str | None = None,
    ) -> AsyncIterator[Subscription]:
        """Yield a receive channel of the given event classes until the block exits."""
        sub, detach = self.open_subscription(classes, capacity=capacity, agent_id=agent_id)
        try:
            yield sub
        finally:
            detach()
