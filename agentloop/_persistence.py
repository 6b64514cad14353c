"""The session-persistence boundary.

The runtime writes through this protocol and never touches storage itself. ``append`` is
synchronous and cheap (it runs on the driver's per-event path, in log order); ``flush`` is the
durability barrier: it returns only when every event up to ``seq`` is committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from ._json import FrozenDict
from ._model import SessionEvent

__all__ = ["SessionPersistence", "StoredSession", "SessionInfo"]


@attrs.frozen(slots=True, kw_only=True)
class SessionInfo:
    """A summary row for listings."""

    id: str
    turns: int
    events: int
    created_at: float
    updated_at: float
    cwd: str | None = None
    # The lineage recorded in a sub-agent's ``meta``; None for a top-level session, or where
    # the store does not derive it.
    parent_session_id: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class StoredSession:
    """A persisted session: its metadata and its whole log, in seq order."""

    id: str
    meta: FrozenDict
    events: Sequence[SessionEvent]


@runtime_checkable
class SessionPersistence(Protocol):
    """What a persistence backend provides to the runtime."""

    async def exists(self, session_id: str) -> bool:
        """Whether a session with this id is stored."""
        ...

    async def list(self) -> list[SessionInfo]:
        """Every stored session, most recently active first."""
        ...

    async def load(self, session_id: str) -> StoredSession:
        """The stored session; raises ``SessionNotFound`` when there is none."""
        ...

    async def create(self, session_id: str, meta: FrozenDict) -> None:
        """Record a new session and its metadata (before its first event is appended)."""
        ...

    def append(self, session_id: str, event: SessionEvent) -> None:
        """Queue one event for writing. Called in seq order; must not block."""
        ...

    async def flush(self, session_id: str, seq: int) -> None:
        """Return once every event of the session up to ``seq`` is committed to disk."""
        ...

    async def acquire(self, session_id: str, owner: str) -> None:
        """Take the live-driver lease for a session; raise ``PersistenceError`` if held."""
        ...

    async def release(self, session_id: str, owner: str) -> None:
        """Give the lease back."""
        ...
