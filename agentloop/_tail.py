"""Tails: a session's events from a seq, then live, wherever the session is driven.

A tail never holds up the driver: what the writers tell it is only that something changed (an
event, set from a synchronous bus handler or a store's change notification), and
the tail reads the events itself, from the session in memory when this runtime drives it, else
from the store. So it is bounded (one batch at a time, however far behind it is) and lossless
(what it missed while it was slow is read again from where it stopped).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, Self

import trio

from ._errors import InvalidContent, SessionNotFound
from ._events import SessionEventAppended
from ._model import SessionEvent

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._persistence import SessionPersistence

__all__ = ["SessionTail", "Live"]

# Events read per pass: a tail far behind catches up in bounded steps.
BATCH: Final = 500


class Live(Protocol):
    """A session this runtime holds in memory (its events are the newest there are)."""

    @property
    def last_seq(self) -> int: ...
    @property
    def events(self) -> Sequence[SessionEvent]: ...


class SessionTail:
    """``async for event in ctx.sessions.tail(session_id, from_seq=n)``: every event of the
    session with ``seq >= from_seq`` in seq order, then each new one as it is written.

    It ends only when you stop iterating; ``async with`` (or :meth:`aclose`) releases what it
    listens to at once, otherwise that goes when the runtime closes.

    Raises (from the first iteration):
        SessionNotFound: no runtime here drives the session and the store does not hold it.
    """

    def __init__(
        self, bus: EventBus, live: Callable[[str], Live | None],
        store: Callable[[], SessionPersistence | None], session_id: str, from_seq: int,
    ) -> None:
        if isinstance(from_seq, bool) or not isinstance(from_seq, int) or from_seq < 0:
            raise InvalidContent(f"from_seq: must be a non-negative integer, got {from_seq!r}")
        self._bus, self._live, self._store = bus, live, store
        self.session_id = session_id
        self._next = max(from_seq, 1)
        self._buffer: collections.deque[SessionEvent] = collections.deque()
        self._changed = trio.Event()
        self._stops: list[Callable[[], None]] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<SessionTail {self.session_id!r} next seq {self._next}>"

    @property
    def next_seq(self) -> int:
        """The seq of the next event this tail yields."""
        return self._next

    def __aiter__(self) -> Self:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        stops, self._stops = self._stops or [], []
        for stop in stops:
            stop()
        await trio.lowlevel.checkpoint()

    async def __anext__(self) -> SessionEvent:
        if self._closed:
            raise StopAsyncIteration
        if self._stops is None:
            await self._listen()
        while not self._buffer:
            # Cleared before the read: a write during the read sets it again.
            changed = self._changed = trio.Event()
            batch = await self._read()
            if batch:
                self._buffer.extend(batch)
                break
            await changed.wait()
        event = self._buffer.popleft()
        self._next = event.seq + 1
        return event

    async def _listen(self) -> None:
        sid = self.session_id

        def appended(e: SessionEventAppended) -> None:
            if e.session_id == sid:
                self._changed.set()

        # Scoped to the session: its appends are announced, and no other session's.
        self._stops = [self._bus.on(SessionEventAppended, appended, agent_id=sid)]
        backend = self._store()
        watch = getattr(backend, "watch", None)
        if watch is not None:
            # Writers elsewhere (another runtime on the same store) are told through it.
            self._stops.append(watch(sid, self._changed_elsewhere))
        if self._live(sid) is None and backend is not None and not await backend.exists(sid):
            await self.aclose()
            raise SessionNotFound(f"no session {sid!r}: nobody here drives it, nothing stores it")
        if self._live(sid) is None and backend is None:
            await self.aclose()
            raise SessionNotFound(
                f"no session {sid!r}: nobody here drives it, and no store is installed"
            )

    def _changed_elsewhere(self) -> None:
        self._changed.set()

    async def _read(self) -> list[SessionEvent]:
        start = self._next
        session = self._live(self.session_id)
        if session is not None:
            # Driven here: memory has every event, the store may lag behind it.
            return list(session.events[start - 1:start - 1 + BATCH])
        backend = self._store()
        if backend is None:
            return []
        read: Any = getattr(backend, "read_events", None)
        if read is not None:
            events: list[SessionEvent] = await read(self.session_id, start, BATCH)
            return events
        try:
            stored = await backend.load(self.session_id)
        except SessionNotFound:
            return []
        return list(stored.events[start - 1:start - 1 + BATCH])
