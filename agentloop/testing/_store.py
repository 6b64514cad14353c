"""The race's session store: in memory, with leases, a flush barrier, and a crash.

Appended events are written through at once (``flush`` checks what was written), so a crash
between two appends leaves exactly the log up to the first: the worst case a recovery meets.
``crash()`` is the process dying: later writes go nowhere and the dead owner's leases lapse,
so a fresh runtime on :meth:`reopened` resumes what was written. The dying runtime itself
still reads its own later writes back (a hibernated agent of it wakes from them), from a copy
nothing durable shares.
"""

from __future__ import annotations

import time

import trio

from .._errors import PersistenceError, SessionLeased, SessionNotFound
from .._json import FrozenDict
from .._model import SessionEvent
from .._persistence import SessionInfo, StoredSession

__all__ = ["RaceStore"]


class RaceStore:
    """A ``SessionPersistence`` backend kept in memory for one race."""

    def __init__(self, data: dict[str, tuple[FrozenDict, list[SessionEvent]]] | None = None
                 ) -> None:
        self.sessions: dict[str, tuple[FrozenDict, list[SessionEvent]]] = (
            data if data is not None else {}
        )
        self.broken: set[str] = set()
        self.leases: dict[str, str] = {}
        self.crashed = False
        # After the crash: what the dead process still sees of its own writes.
        self.after: dict[str, tuple[FrozenDict, list[SessionEvent]]] = {}
        self.appends = 0
        self.crash_at: int | None = None

    def reopened(self) -> RaceStore:
        """The store as a fresh process finds it: what was committed, no leases."""
        return RaceStore(self.sessions)

    def crash(self) -> None:
        self.crashed = True
        self.after = {sid: (meta, list(events)) for sid, (meta, events) in self.sessions.items()}

    def _seen(self) -> dict[str, tuple[FrozenDict, list[SessionEvent]]]:
        """The sessions as this store's own runtime reads them."""
        return self.after if self.crashed else self.sessions

    async def exists(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return session_id in self._seen()

    async def list(self) -> list[SessionInfo]:
        await trio.lowlevel.checkpoint()
        now = time.time()
        return [
            SessionInfo(id=sid, turns=sum(e.type == "turn/start" for e in events),
                        events=len(events), created_at=now, updated_at=now,
                        parent_session_id=_parent(meta))
            for sid, (meta, events) in self._seen().items()
        ]

    async def load(self, session_id: str) -> StoredSession:
        await trio.lowlevel.checkpoint()
        return self.load_now(session_id)

    def load_now(self, session_id: str) -> StoredSession:
        """What :meth:`load` returns, without awaiting (a hibernated agent's wake)."""
        seen = self._seen()
        if session_id not in seen:
            raise SessionNotFound(f"no stored session {session_id!r}")
        meta, events = seen[session_id]
        return StoredSession(id=session_id, meta=meta, events=tuple(events))

    async def create(self, session_id: str, meta: FrozenDict) -> None:
        await trio.lowlevel.checkpoint()
        seen = self._seen()
        if session_id in seen:
            raise PersistenceError(f"session {session_id!r} is already stored")
        seen[session_id] = (meta, [])

    def append(self, session_id: str, event: SessionEvent) -> None:
        if not self.crashed and self.crash_at is not None and self.appends >= self.crash_at:
            self.crash()  # the process dies between the last append and this one
        if self.crashed:
            stored = self.after.get(session_id)
            if stored is not None:
                stored[1].append(event)
            return
        self.appends += 1
        stored = self.sessions.get(session_id)
        if stored is None or (stored[1] and event.seq != stored[1][-1].seq + 1):
            self.broken.add(session_id)  # refused at the next flush, as a real store would
            return
        stored[1].append(event)

    async def flush(self, session_id: str, seq: int) -> None:
        await trio.lowlevel.checkpoint()
        if not self.crashed and session_id in self.broken:
            raise PersistenceError(f"session {session_id!r}: events that cannot be stored")

    async def acquire(self, session_id: str, owner: str) -> None:
        await trio.lowlevel.checkpoint()
        if self.crashed:
            return
        holder = self.leases.get(session_id)
        if holder not in (None, owner):
            raise SessionLeased(f"session {session_id!r} is leased by {holder}")
        self.leases[session_id] = owner

    async def release(self, session_id: str, owner: str) -> None:
        await trio.lowlevel.checkpoint()
        if self.crashed:
            return
        if self.leases.get(session_id) == owner:
            del self.leases[session_id]


def _parent(meta: FrozenDict) -> str | None:
    parent = meta.get("parent_session_id")
    return parent if isinstance(parent, str) else None
