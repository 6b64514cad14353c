"""The typed, scoped event bus.

Handlers are kept per event class in dispatch order; a class with no handler and no subscriber
costs one dict lookup to emit (hot paths check :meth:`EventBus.has_listeners` before they even
build the event). Subscribers are actor-style observers, each with a queue of its own read
through a ``trio.MemoryReceiveChannel``: the emitter appends to the queue, or hands the event
to a subscriber parked in ``receive`` and reschedules it; it never waits and never switches
task. Durable
events are never dropped, so a stalled subscriber's queue grows with its backlog: they are
what a subscriber needs to follow a session without re-reading its log. Every other event is
bounded by the subscription's ``capacity``, and a subscriber that falls that far behind is
told with a :class:`Lagged` marker. A session's appends, which a subscriber gets fifteen of a
step, reach it through the class's :class:`Route`, without the lookups of an emission."""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import weakref
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeAlias, TypeVar, cast, overload

import attrs
import trio

from ._events import Event, SessionEventAppended

__all__ = ["EventBus", "Lagged", "Disposer", "Route", "Subscribe"]

log = logging.getLogger("agentloop")
E = TypeVar("E", bound=Event)
E1 = TypeVar("E1", bound=Event)
E2 = TypeVar("E2", bound=Event)
E3 = TypeVar("E3", bound=Event)
T = TypeVar("T")
Handler = Callable[[Any], Any]
Subscribe = AbstractAsyncContextManager[trio.MemoryReceiveChannel[T]]
"""The async context manager :meth:`EventBus.subscribe` returns."""
Classes = type[Event] | tuple[type[Event], ...]
# A subscription's bound: a positive int, or math.inf. A union rather than ``float``, which
# the compiled build would turn an int into (and trio takes an int or inf only).
Capacity: TypeAlias = "int | float"


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


class _Feed:
    """One subscription: its queue, the bookkeeping that bounds it, and its parked readers.

    The queue is a deque of the feed's own, so delivering an event is an append; a reader
    parked for the next item is handed it and rescheduled by the put itself, the one parked
    longest first, as trio's channel does. The trio channel the reader holds carries
    nothing (see :class:`_Face`). Durable events are never dropped, so the queue grows with
    a stalled reader's backlog; everything else is bounded by ``capacity`` queued items.
    """

    __slots__ = (
        "_capacity", "_flush_armed", "_marker", "_missed", "_on_broken", "_tx", "agent_id",
        "closed", "durable_only", "parked", "queue", "readers",
    )

    def __init__(
        self,
        tx: trio.MemorySendChannel[Any],
        capacity: Capacity,
        agent_id: str | None,
        on_broken: Callable[[], None],
        durable_only: bool,
    ) -> None:
        self._tx = tx
        self.durable_only = durable_only  # then nothing is ever dropped: no Lagged to tell
        self.agent_id = agent_id
        self._capacity = capacity
        self.queue: deque[Event | Lagged] = deque()
        # The reader tasks parked until an item comes, oldest first, each with the list
        # a put hands it its item in.
        self.parked: dict[trio.lowlevel.Task, list[Event | Lagged]] = {}
        self.readers = 1  # channel objects not closed: the reader's, and its clones
        self.closed = False  # ended by the bus: what is queued is read, then EndOfChannel
        self._missed = 0
        self._marker: Lagged | None = None
        self._flush_armed = False
        self._on_broken = on_broken

    def put(self, item: Event | Lagged) -> None:
        if self.parked:
            self.hand(item)
        else:
            self.queue.append(item)

    def hand(self, item: Event | Lagged) -> None:
        """Give ``item`` to the reader parked longest: it is that reader's from now on,
        whatever happens before it runs (trio's channel hands it over the same way)."""
        parked = self.parked
        task = next(iter(parked))
        parked.pop(task).append(item)
        trio.lowlevel.reschedule(task)

    def put_control(self, event: Event) -> None:
        queue = self.queue
        if len(queue) >= self._capacity:
            if queue[-1] is self._marker and self._marker is not None:
                # The marker is the last thing queued and, the queue being full, still
                # unread: nobody has seen it, so it grows to count this event too. A second
                # marker behind it would grow a stalled reader's queue by one per burst;
                # counting without one would never tell a reader that drains and waits.
                object.__setattr__(self._marker, "missed", self._marker.missed + 1)
                return
            self._missed += 1
            if not self._flush_armed:
                self._arm_flush()
            return
        if self._missed:
            self._mark()
        self.put(event)

    def _mark(self) -> None:
        missed, self._missed = self._missed, 0
        marker = self._marker = Lagged(missed)
        self.put(marker)

    def _arm_flush(self) -> None:
        # A reader that drains what was queued must learn of the gap without waiting for
        # another event, so the marker goes in once the emitter lets other tasks run.
        try:
            trio.lowlevel.spawn_system_task(self._flush, name="agentloop.bus.lagged")
        except RuntimeError:
            return  # outside a run, or at its very end: the marker goes before the next event
        self._flush_armed = True

    async def _flush(self) -> None:
        self._flush_armed = False
        if self._missed and not self.closed:
            self._mark()

    def close(self) -> None:
        """End the feed from the bus's side: readers take what is queued, then the end."""
        self.closed = True
        # Readers keep the queue they were given; what a dispatch still in progress puts
        # after the end goes nowhere, without a check on the path of every event.
        self.queue = deque(maxlen=0)
        self._tx.close()  # the channel's statistics tell the end too
        self.wake_all()

    def wake_all(self) -> None:
        parked, self.parked = self.parked, {}
        for task in parked:
            trio.lowlevel.reschedule(task)

    def reader_closed(self) -> None:
        self.readers -= 1
        if self.readers == 0:
            self._on_broken()  # nobody will ever read this queue again
        else:
            self.wake_all()  # a reader parked in the closed channel object learns of it


_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled

# How many queued items a subscription hands out, one after the other, before its reader
# passes a schedule point again: a step appends about 15 events, so a reader keeping up
# wakes about once a step, and one catching up on a long backlog still lets others run.
DRAIN_PER_WAKE = 64


class _Face:
    """What a subscription's channel object answers itself: the reading half of a feed.

    trio's ``receive`` passes a schedule point even when an item is waiting, and its send
    and receive are some seventy bytecodes an item between them; a subscriber that keeps up
    with a step's fifteen appends paid for both on every one. So the items never enter the
    channel: its ``receive`` (which ``async for`` goes through), ``receive_nowait``,
    ``statistics``, ``clone`` and ``close`` are this object's, set on the channel instance.
    ``receive`` takes up to :data:`DRAIN_PER_WAKE` queued items with a cancel check each
    (trio's ``checkpoint_if_cancelled``), then passes a schedule point (trio's
    ``cancel_shielded_checkpoint``, after taking the item, as trio's own ``receive`` does);
    with nothing queued it parks (``trio.lowlevel.wait_task_rescheduled``) until the feed
    hands it an item, the reader parked longest first. Order, losslessness, cancellation,
    the end of the channel and a closed channel's errors are trio's; a clone reads the same
    queue.
    """

    __slots__ = ("_channel", "closed", "feed", "queue", "taken")

    def __init__(
        self, rx: trio.MemoryReceiveChannel[Any], feed: _Feed, queue: deque[Event | Lagged],
    ) -> None:
        # Weakly: the channel holds this object's methods, and a strong reference back
        # would make them a cycle, so a dropped subscription's queue would wait for the
        # cycle collector.
        self._channel = weakref.ref(rx)
        self.feed = feed
        self.queue = queue  # the feed's, kept past its end: what was queued is still read
        self.taken = 0
        self.closed = False
        namespace = getattr(rx, "__dict__", None)
        if namespace is None:
            raise RuntimeError(
                f"trio {trio.__version__}'s memory channels take no instance attribute, "
                "which a subscription's channel needs (trio 0.30 to 0.35 are known to work)"
            )
        namespace.update(
            receive=self.receive, receive_nowait=self.receive_nowait,
            statistics=self.statistics, clone=self.clone, close=self.close,
        )

    async def receive(self) -> Any:
        await _checkpoint_if_cancelled()
        queue = self.queue
        if queue and self.taken < DRAIN_PER_WAKE:
            self.taken += 1
            return queue.popleft()
        self.taken = 0
        while True:
            if queue:
                item = queue.popleft()
                await trio.lowlevel.cancel_shielded_checkpoint()
                return item
            if self.closed:  # reached through a method kept from before the close
                raise trio.ClosedResourceError("the subscription's channel was closed")
            feed = self.feed
            if feed.closed:
                raise trio.EndOfChannel
            handed = await _wait_for_put(feed.parked)
            if handed:
                return handed[0]  # the park was this receive's schedule point
            # Woken with nothing: the subscription ended, or a channel of it was closed
            # (this one's queue is then empty).
            queue = self.queue

    def receive_nowait(self) -> Any:
        if self.queue:
            return self.queue.popleft()
        if self.closed:
            raise trio.ClosedResourceError("the subscription's channel was closed")
        if self.feed.closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    def statistics(self) -> Any:
        """trio's statistics of the channel, with the queue's: ``current_buffer_used`` and
        ``tasks_waiting_receive`` are the subscription's; a peak is not kept (a put would
        pay for it), so ``peak_buffer_used`` reads at least what is queued now."""
        stats = trio.MemoryReceiveChannel.statistics(self._alive())
        used = len(self.queue)
        stats = attrs.evolve(
            stats, current_buffer_used=used, tasks_waiting_receive=len(self.feed.parked)
        )
        if hasattr(stats, "peak_buffer_used"):
            stats = attrs.evolve(stats, peak_buffer_used=max(stats.peak_buffer_used, used))
        return stats

    def clone(self) -> trio.MemoryReceiveChannel[Any]:
        twin = trio.MemoryReceiveChannel.clone(self._alive())
        self.feed.readers += 1
        _Face(twin, self.feed, self.queue)
        return twin

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Its clones still read the feed's queue; this channel reads nothing more, even
        # through a method taken from it before (trio's answer is ClosedResourceError).
        self.queue = deque(maxlen=0)
        channel = self._channel()
        if channel is not None:
            names = vars(channel)
            for name in ("receive", "receive_nowait", "statistics", "clone", "close"):
                del names[name]  # trio's own methods answer a closed channel
            trio.MemoryReceiveChannel.close(channel)
        self.feed.reader_closed()

    def _alive(self) -> trio.MemoryReceiveChannel[Any]:
        channel = self._channel()
        if channel is None:  # only reachable by keeping a method of a dropped channel
            raise trio.ClosedResourceError("the subscription's channel is gone")
        return channel


async def _wait_for_put(
    parked: dict[trio.lowlevel.Task, list[Event | Lagged]],
) -> list[Event | Lagged]:
    """Park until a put hands this task an item (the list holds it) or the feed wakes
    every reader (the list is empty)."""
    task = trio.lowlevel.current_task()
    handed: list[Event | Lagged] = []
    parked[task] = handed

    def abort(_: Any) -> trio.lowlevel.Abort:
        parked.pop(task, None)  # cancelled while parked: no put will look for it
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)
    return handed


class _Subscription:
    """The ``async with`` of :meth:`EventBus.subscribe`: subscribed as the block is entered,
    detached as it exits. A class rather than a generator: mypyc, which compiles this
    module in the opt-in build, compiles no async generator."""

    __slots__ = ("_args", "_bus", "_detach")

    def __init__(
        self, bus: EventBus, classes: tuple[Classes, ...], capacity: Capacity,
        agent_id: str | None,
    ) -> None:
        self._bus = bus
        self._args = (classes, capacity, agent_id)
        self._detach: Disposer | None = None

    async def __aenter__(self) -> trio.MemoryReceiveChannel[Any]:
        classes, capacity, agent_id = self._args
        rx, self._detach = self._bus.open_subscription(
            *classes, capacity=capacity, agent_id=agent_id
        )
        return rx

    async def __aexit__(self, *exc_info: object) -> None:
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()


def _owner(event: Event) -> str | None:
    """The agent an event is about; a session event's session id is its agent's id."""
    owner = getattr(event, "agent_id", None)
    return owner if owner is not None else getattr(event, "session_id", None)


def _call_handlers(handlers: list[_Handler], event: Event) -> None:
    agent_id = _owner(event)
    for h in handlers:
        if h.agent_id is None or h.agent_id == agent_id:
            try:
                h.fn(event)
            except Exception:
                # An observer's bug must not break the state change it observes.
                log.exception("a %s handler failed", type(event).name)


def _reached(feeds: list[_Feed], event: Event) -> list[_Feed]:
    """The feeds ``event`` goes to: the unscoped ones, and those scoped to its owner."""
    owner: str | None = None
    owned = False  # the event's owner is looked up for the first scoped subscriber only
    reached = []
    for feed in feeds:
        if feed.agent_id is not None:
            if not owned:
                owner, owned = _owner(event), True
            if feed.agent_id != owner:
                continue
        reached.append(feed)
    return reached


class Route:
    """Who listens to one durable event class, kept current by its bus: what a hot path
    that emits one class on every step (a session's appends) calls instead of
    :meth:`EventBus.emit_nowait`, without its lookups. Same order: handlers, then
    subscribers."""

    __slots__ = ("everyone", "handlers", "owners", "plain", "rest")

    def __init__(self) -> None:
        # Whose events reach anyone: every agent's while an unscoped handler or subscriber
        # listens, else only those of ``owners`` (the agents scoped ones are for). A session
        # asks before it makes an event it would announce: a tail on one session, or a
        # subscription to one agent, leaves the others' appends as cheap as with nobody.
        self.everyone = False
        self.owners: frozenset[str] = frozenset()
        self.handlers: list[_Handler] | None = None
        # The subscriptions of durable classes only, for every agent: nothing is ever
        # dropped or filtered for them, so an event is just put.
        self.plain: list[_Feed] = []
        self.rest: list[_Feed] | None = None  # scoped to an agent, or bounded for another class

    def publish(self, event: Event) -> None:
        handlers = self.handlers
        if handlers is not None:
            _call_handlers(handlers, event)
        # Every log append with a subscriber comes here (15 a step): a feed's put is
        # written out rather than called.
        for feed in self.plain:
            if feed.parked:
                feed.hand(event)
            else:
                feed.queue.append(event)
        rest = self.rest
        if rest is None:
            return
        for feed in _reached(rest, event):
            if feed._missed:
                feed._mark()  # what was dropped before this event is told before it
            feed.put(event)

    def update(self, handlers: list[_Handler] | None, feeds: list[_Feed] | None) -> None:
        self.handlers = handlers
        feeds = feeds or []
        scopes = {h.agent_id for h in handlers or ()} | {f.agent_id for f in feeds}
        self.everyone = None in scopes
        self.owners = frozenset(scope for scope in scopes if scope is not None)
        self.plain = [f for f in feeds if f.agent_id is None and f.durable_only]
        self.rest = [f for f in feeds if f not in self.plain] or None


class EventBus:
    """Registrations and dispatch for every :class:`Event` class."""

    def __init__(self) -> None:
        self._handlers: dict[type[Event], list[_Handler]] = {}
        self._handled = self._handlers.keys()  # live: one view, not one per question
        self._subs: dict[type[Event], list[_Feed]] = {}
        # The classes with a handler or a subscriber: one lookup for the hot paths' pre-check.
        self._listened: set[type[Event]] = set()
        self._order = itertools.count()
        self._companions: dict[object, Any] = {}
        self._routes: dict[type[Event], Route] = {}

    def companion(self, make: Callable[[EventBus], T]) -> T:
        """The one object ``make(bus)`` built for this bus (on first use): another module's
        helper that lives as long as the bus does, found in one lookup."""
        found = self._companions.get(make)
        if found is None:
            found = self._companions[make] = make(self)
        return found

    def route(self, cls: type[Event]) -> Route:
        """The live :class:`Route` of durable class ``cls``: ``route.publish(event)`` is
        ``emit_nowait(event)`` for it."""
        if cls.kind != "durable":
            raise TypeError(f"{cls.name!r} is a {cls.kind} event: only a durable class has a route")
        route = self._routes.get(cls)
        if route is None:
            route = self._routes[cls] = Route()
            self._relisten(cls)
        return route

    def _relisten(self, cls: type[Event]) -> None:
        route = self._routes.get(cls)
        if route is not None:
            route.update(self._handlers.get(cls), self._subs.get(cls))
        if cls in self._handlers or cls in self._subs:
            self._listened.add(cls)
        else:
            self._listened.discard(cls)

    def has_listeners(self, cls: type[Event]) -> bool:
        """Whether emitting ``cls`` would reach anyone (a cheap pre-check for hot paths)."""
        return cls in self._listened

    def listened(self) -> AbstractSet[type[Event]]:
        """The classes :meth:`has_listeners` is true of, as a live read-only set: a path
        that checks on every event of a step (a session's appends) keeps it and tests
        membership, without a call each time."""
        return self._listened

    def has_handlers(self, cls: type[Event]) -> bool:
        return cls in self._handlers

    def handled(self) -> AbstractSet[type[Event]]:
        """The classes :meth:`has_handlers` is true of, as a live read-only set: a loop that
        asks about several classes on every step keeps it and tests membership, without a
        call each time."""
        return self._handled

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
        self._relisten(cls)

        def dispose() -> None:
            current = self._handlers.get(cls)
            if current is None or entry not in current:
                return
            remaining = [h for h in current if h is not entry]
            if remaining:
                self._handlers[cls] = remaining
            else:
                del self._handlers[cls]
            self._relisten(cls)

        return Disposer(dispose)

    def emit_nowait(self, event: Event) -> None:
        """Dispatch a control or durable event synchronously, to handlers then subscribers.

        A handler that raises is logged and skipped: observers cannot break what they observe.
        """
        cls = type(event)
        if cls.kind == "durable":
            route = self._routes.get(cls)
            if route is None:
                route = self.route(cls)
            route.publish(event)
            return
        handlers = self._handlers.get(cls)
        if handlers is not None:
            _call_handlers(handlers, event)
        subs = self._subs.get(cls)
        if subs is not None:
            self._deliver(subs, event)

    @staticmethod
    def _deliver(subs: list[_Feed], event: Event) -> None:
        for sub in _reached(subs, event):
            sub.put_control(event)

    async def emit(self, event: Event) -> Any:
        """Dispatch a hook and return its outcome.

        notify: ``None``; waterfall: the final value of the waterfall field; decision: the first
        non-``None`` handler result, or ``None``.
        """
        cls = type(event)
        if cls.kind == "durable":
            self.emit_nowait(event)  # handlers then subscribers, as every append is told
            return None
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
        classes: Classes,
        *more: Classes,
        capacity: Capacity = 65536,
        agent_id: str | None = None,
    ) -> tuple[trio.MemoryReceiveChannel[Event | Lagged], Disposer]:
        """A subscription's receive channel, and the disposer that detaches it and ends it.

        The reader gets what was queued before the detach, then ``trio.EndOfChannel``.
        """
        flat: list[type[Event]] = []
        for group in (classes, *more):
            for cls in group if isinstance(group, tuple) else (group,):
                if not (isinstance(cls, type) and issubclass(cls, Event)):
                    raise TypeError(f"{cls!r} is not an agentloop event class")
                if cls not in flat:
                    flat.append(cls)
        if not flat:
            raise TypeError("subscribe to at least one event class")
        if capacity != math.inf and (not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity must be a positive integer or math.inf, got {capacity!r}")
        tx, rx = trio.open_memory_channel[Any](math.inf)  # unbounded, as its statistics say
        detached = False

        def detach() -> None:
            nonlocal detached
            if detached:
                return
            detached = True
            for cls in flat:
                # Copy-on-write: a dispatch in progress keeps iterating the list it started with.
                remaining = [s for s in self._subs.get(cls, ()) if s is not sub]
                if remaining:
                    self._subs[cls] = remaining
                else:
                    self._subs.pop(cls, None)
                self._relisten(cls)
            sub.close()

        durable_only = all(getattr(cls, "kind", None) == "durable" for cls in flat)
        sub = _Feed(tx, capacity, agent_id, detach, durable_only)
        _Face(rx, sub, sub.queue)
        for cls in flat:
            self._subs[cls] = [*self._subs.get(cls, ()), sub]
            self._relisten(cls)
        return cast("trio.MemoryReceiveChannel[Event | Lagged]", rx), Disposer(detach)

    @overload
    def subscribe(
        self, cls: type[SessionEventAppended], /, *, capacity: Capacity = ...,
        agent_id: str | None = ...,
    ) -> Subscribe[SessionEventAppended]: ...
    @overload
    def subscribe(
        self, cls: type[E1], /, *, capacity: Capacity = ..., agent_id: str | None = ...
    ) -> Subscribe[E1 | Lagged]: ...
    @overload
    def subscribe(
        self, c1: type[E1], c2: type[E2], /, *, capacity: Capacity = ...,
        agent_id: str | None = ...,
    ) -> Subscribe[E1 | E2 | Lagged]: ...
    @overload
    def subscribe(
        self, c1: type[E1], c2: type[E2], c3: type[E3], /, *, capacity: Capacity = ...,
        agent_id: str | None = ...,
    ) -> Subscribe[E1 | E2 | E3 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[SessionEventAppended]], /, *, capacity: Capacity = ...,
        agent_id: str | None = ...,
    ) -> Subscribe[SessionEventAppended]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[E1]], /, *, capacity: Capacity = ..., agent_id: str | None = ...
    ) -> Subscribe[E1 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[E1], type[E2]], /, *, capacity: Capacity = ...,
        agent_id: str | None = ...,
    ) -> Subscribe[E1 | E2 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: tuple[type[E1], type[E2], type[E3]], /, *, capacity: Capacity = ...,
        agent_id: str | None = ...,
    ) -> Subscribe[E1 | E2 | E3 | Lagged]: ...
    @overload
    def subscribe(
        self, classes: Classes, /, *more: Classes, capacity: Capacity = ...,
        agent_id: str | None = ...,
    ) -> Subscribe[Event | Lagged]: ...
    def subscribe(
        self,
        classes: Classes,
        /,
        *more: Classes,
        capacity: Capacity = 65536,
        agent_id: str | None = None,
    ) -> Subscribe[Any]:
        """Yield a ``trio.MemoryReceiveChannel`` of the given event classes until the block exits.

        Classes come as arguments, as tuples, or both; events arrive in emission order across
        all of them. On exit the channel ends: what was queued can still be received, then
        ``trio.EndOfChannel``.

        Durable events (``SessionEventAppended``) are never dropped, in seq order for each
        session: the channel keeps every one the reader has not taken yet, so a stalled reader
        holds memory in proportion to its backlog (one queue slot per event; the events are
        shared with the session log). Every other event is bounded: once ``capacity`` items
        are queued unread, further ones are counted instead, and the reader receives one
        :class:`Lagged` in their place, as soon as it has taken what was queued before them.
        """
        return _Subscription(self, (classes, *more), capacity, agent_id)
