"""``check_persistence_backend``: the SQLite store passes it on real files, and backends that
break one rule each fail it with that rule named."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
from agentloop_sqlite import SqliteSessionStore

import agentloop
from agentloop import FrozenDict, PersistenceError, SessionEvent, SessionNotFound, StoredSession
from agentloop.testing import check_persistence_backend


def damage_sqlite(path: Path, session_id: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE events SET data = '{not json' WHERE session_id = ? AND seq = 2",
                     (session_id,))


async def test_the_sqlite_store_conforms(tmp_path: Path) -> None:
    await check_persistence_backend(SqliteSessionStore, directory=tmp_path,
                                    corrupt=damage_sqlite)


# An in-memory backend shared per path, correct unless a flag breaks one rule.
_STORES: dict[Path, dict[str, Any]] = {}


class MemoryBackend:
    def __init__(self, path: Path, *, leases: bool = True, ordered: bool = True,
                 refuse_bad: bool = True, durable: bool = True, honest_exists: bool = True,
                 owned_release: bool = True) -> None:
        self._db = _STORES.setdefault(path, {"sessions": {}, "leases": {}})
        self._leases, self._ordered = leases, ordered
        self._refuse_bad, self._durable = refuse_bad, durable
        self._failed: set[str] = set()
        self._honest_exists, self._owned_release = honest_exists, owned_release

    async def exists(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        if not self._honest_exists and self._db["sessions"]:
            return True  # the flaw: any id "exists" once something is stored
        return session_id in self._db["sessions"]

    async def list(self) -> list[agentloop.SessionInfo]:
        await trio.lowlevel.checkpoint()
        return [agentloop.SessionInfo(id=sid, turns=0, events=len(s[1]), created_at=0,
                                      updated_at=0) for sid, s in self._db["sessions"].items()]

    async def load(self, session_id: str) -> StoredSession:
        await trio.lowlevel.checkpoint()
        if session_id not in self._db["sessions"]:
            raise SessionNotFound(session_id)
        meta, events = self._db["sessions"][session_id]
        ordered = events if self._ordered else sorted(events, key=lambda e: e.type)
        return StoredSession(id=session_id, meta=meta, events=tuple(ordered))

    async def create(self, session_id: str, meta: FrozenDict) -> None:
        await trio.lowlevel.checkpoint()
        if session_id in self._db["sessions"]:
            raise PersistenceError(f"{session_id} exists")
        self._db["sessions"][session_id] = (meta, [])

    def append(self, session_id: str, event: SessionEvent) -> None:
        stored = self._db["sessions"].get(session_id)
        if stored is None or (stored[1] and stored[1][-1].seq >= event.seq):
            self._failed.add(session_id)
            return
        stored[1].append(event)

    async def flush(self, session_id: str, seq: int) -> None:
        await trio.lowlevel.checkpoint()
        if self._refuse_bad and session_id in self._failed:
            raise PersistenceError(f"{session_id} is broken")

    async def acquire(self, session_id: str, owner: str) -> None:
        await trio.lowlevel.checkpoint()
        holder = self._db["leases"].get(session_id)
        if self._leases and holder not in (None, owner):
            raise PersistenceError(f"held by {holder}")
        self._db["leases"][session_id] = owner

    async def release(self, session_id: str, owner: str) -> None:
        await trio.lowlevel.checkpoint()
        if self._db["leases"].get(session_id) == owner or (
            not self._owned_release and session_id in self._db["leases"]
        ):
            del self._db["leases"][session_id]

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        if not self._durable:
            for _meta, events in self._db["sessions"].values():
                del events[len(events) // 2:]


async def test_a_correct_in_memory_backend_conforms(tmp_path: Path) -> None:
    await check_persistence_backend(MemoryBackend, directory=tmp_path, file_based=False)


@pytest.mark.parametrize(("flaw", "message"), [
    ({"leases": False}, ("acquire() by a second owner on the same backend: expected "
                        "PersistenceError, got 'no error'")),
    ({"ordered": False}, "the log loaded back after flush, event #1"),
    ({"refuse_bad": False}, ("flush() of events of a session never created: expected "
                            "PersistenceError")),
    ({"durable": False}, "the log after closing and reopening the backend"),
    ({"honest_exists": False}, "exists() of a session never created, once another is stored"),
    ({"owned_release": False}, "acquire() after a release by someone who never held"),
])
async def test_a_backend_breaking_one_rule_fails_naming_it(
    tmp_path: Path, flaw: dict[str, bool], message: str
) -> None:
    with pytest.raises(AssertionError) as info:
        await check_persistence_backend(lambda path: MemoryBackend(path, **flaw),
                                        directory=tmp_path, file_based=False)
    assert message in str(info.value)


async def test_a_backend_that_opens_any_file_fails_the_file_check(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="opening a file that is not a store"):
        await check_persistence_backend(MemoryBackend, directory=tmp_path)


async def test_damage_that_loads_anyway_fails_the_corruption_check(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="stored data is damaged: expected PersistenceError"):
        await check_persistence_backend(MemoryBackend, directory=tmp_path, file_based=False,
                                        corrupt=lambda path, sid: None)
