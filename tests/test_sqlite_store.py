from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from agentloop_sqlite import SqliteSessionStore, validate_session_id
from agentloop_sqlite._store import _DECODER, _ENCODER, SCHEMA_VERSION
from conftest import read_only_prefix, ready_child
from hypothesis import given
from hypothesis import strategies as st

from agentloop._errors import InvalidContent, PersistenceError, SessionNotFound
from agentloop._json import FrozenDict, freeze
from agentloop._model import SessionEvent
from agentloop._persistence import SessionPersistence

META = FrozenDict(cwd="/home/u/project", model="m")


def event(seq: int, kind: str = "message", turn: int | None = 1, **data: Any) -> SessionEvent:
    frozen = freeze(data)
    assert isinstance(frozen, FrozenDict)
    return SessionEvent(seq, kind, turn, frozen)


def raw(path: Path) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(path))


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(data)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "sessions.db"


@pytest.fixture
async def store(db: Path) -> AsyncIterator[SqliteSessionStore]:
    async with SqliteSessionStore(db) as opened:
        yield opened


async def test_is_a_session_persistence(store: SqliteSessionStore) -> None:
    assert isinstance(store, SessionPersistence)


async def test_round_trip_through_a_new_store(db: Path) -> None:
    with trio.fail_after(10):
        written = []
        async with SqliteSessionStore(db) as store:
            await store.create("s1", META)
            for seq in range(1, 1001):
                turn = (seq - 1) // 10 + 1
                if seq % 10 == 1:
                    e = event(seq, "turn/start", turn, n=seq)
                else:
                    e = event(
                        seq,
                        turn=None if seq % 7 == 0 else turn,
                        text=f"héllo {seq}",
                        parts=[{"type": "text", "text": "x", "ids": [seq, seq + 0.5]}],
                        nested={"a": {"b": [True, None, -seq]}},
                    )
                store.append("s1", e)
                written.append(e)
            await store.flush("s1", 1000)

        async with SqliteSessionStore(db) as reopened:
            loaded = await reopened.load("s1")
            (info,) = await reopened.list()

    assert loaded.id == "s1"
    assert loaded.meta == META
    assert isinstance(loaded.meta, FrozenDict)
    assert [e.seq for e in loaded.events] == list(range(1, 1001))
    assert list(loaded.events) == written
    sample = loaded.events[1].data
    assert isinstance(sample, FrozenDict)
    assert isinstance(sample["parts"], tuple)
    assert isinstance(sample["parts"][0], FrozenDict)
    assert sample["nested"]["a"]["b"] == (True, None, -2)
    with pytest.raises(TypeError):
        sample["text"] = "changed"
    assert (info.id, info.turns, info.events, info.cwd) == ("s1", 100, 1000, "/home/u/project")


async def test_flush_makes_events_visible_to_another_connection(
    store: SqliteSessionStore, db: Path
) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        for seq in range(1, 51):
            store.append("s1", event(seq, text="t"))
        await store.flush("s1", 50)
        with raw(db) as conn:
            (count,) = conn.execute(
                "SELECT count(*) FROM events WHERE session_id = 's1'"
            ).fetchone()
            (events,) = conn.execute("SELECT events FROM sessions WHERE id = 's1'").fetchone()
        assert count == events == 50


async def test_appends_are_batched_into_few_transactions(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        before = store.stats.transactions
        for seq in range(1, 1001):
            store.append("s1", event(seq, text="t"))
        await store.flush("s1", 1000)
        assert 1 <= store.stats.transactions - before < 50
        assert store.stats.events_written == 1000


async def test_flush_with_nothing_pending_returns(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        await store.flush("s1", 0)
        await store.flush("never-appended", 3)
        assert store.stats.transactions == 0


async def test_load_sees_appends_not_yet_flushed(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        store.append("s1", event(1, text="a"))
        store.append("s1", event(2, text="b"))
        loaded = await store.load("s1")
        assert [e.seq for e in loaded.events] == [1, 2]


async def test_list_derives_the_parent_session_from_meta(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        await store.create("top", META)
        await store.create("kid", FrozenDict(parent_session_id="top", depth=1))
        await store.create("odd", FrozenDict(parent_session_id=7))
        parents = {i.id: i.parent_session_id for i in await store.list()}
        assert parents == {"top": None, "kid": "top", "odd": None}


async def test_list_exists_and_missing_sessions(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        assert await store.list() == []
        await store.create("older", META)
        await store.create("newer", FrozenDict(cwd=None))
        await store.create("no-meta", FrozenDict())
        store.append("older", event(1, "turn/start", 1))
        store.append("older", event(2, "message", 1, text="hi"))
        await store.flush("older", 2)

        infos = await store.list()
        assert [i.id for i in infos] == ["older", "no-meta", "newer"]
        older = infos[0]
        assert (older.turns, older.events, older.cwd) == (1, 2, "/home/u/project")
        assert older.updated_at >= older.created_at
        assert (infos[2].turns, infos[2].events, infos[2].cwd) == (0, 0, None)

        assert await store.exists("older")
        assert not await store.exists("missing")
        with pytest.raises(SessionNotFound, match="missing"):
            await store.load("missing")
        assert (await store.load("newer")).events == ()


async def test_create_refuses_a_duplicate_and_a_bad_id(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        with pytest.raises(PersistenceError, match="'s1' already exists"):
            await store.create("s1", META)
        with pytest.raises(InvalidContent, match=r"'\.\./etc'"):
            await store.create("../etc", META)


async def test_append_to_an_unknown_session_fails_only_that_session(
    store: SqliteSessionStore,
) -> None:
    with trio.fail_after(10):
        await store.create("real", META)
        store.append("real", event(1, text="kept"))
        store.append("ghost", event(1, text="lost"))
        store.append("real", event(2, text="kept"))
        await store.flush("real", 2)
        with pytest.raises(PersistenceError, match=r"'ghost'.*never created"):
            await store.flush("ghost", 1)
        assert [e.seq for e in (await store.load("real")).events] == [1, 2]


async def test_a_failed_write_poisons_its_session_without_holes(
    store: SqliteSessionStore,
) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        store.append("s1", event(1, text="first"))
        await store.flush("s1", 1)
        store.append("s1", event(1, text="duplicate seq"))
        store.append("s1", event(2, text="after the failure"))
        with pytest.raises(PersistenceError, match="'s1'") as failure:
            await store.flush("s1", 2)
        assert isinstance(failure.value.__cause__, sqlite3.IntegrityError)
        store.append("s1", event(3, text="still dropped"))
        with pytest.raises(PersistenceError, match="'s1'"):
            await store.flush("s1", 3)
        loaded = await store.load("s1")
        assert [(e.seq, e.data["text"]) for e in loaded.events] == [(1, "first")]


async def test_a_writer_bug_fails_callers_instead_of_hanging(
    store: SqliteSessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("boom")

    with trio.fail_after(10):
        await store.create("s1", META)
        monkeypatch.setattr(store, "_write", broken)
        store.append("s1", event(1))
        with pytest.raises(PersistenceError, match=r"writer .* failed.*boom"):
            await store.flush("s1", 1)
        with pytest.raises(PersistenceError, match="boom"):
            await store.load("s1")
        await store.aclose()


async def test_newer_schema_version_is_refused(db: Path) -> None:
    db.parent.mkdir(parents=True)
    with raw(db) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 41}")
    with trio.fail_after(10):
        store = SqliteSessionStore(db)
        with pytest.raises(PersistenceError) as failure:
            await store.open()
    message = str(failure.value)
    assert str(db) in message
    assert str(SCHEMA_VERSION + 41) in message
    assert f"version {SCHEMA_VERSION}" in message
    with pytest.raises(PersistenceError, match="not open"):
        store.append("s1", event(1))


async def test_corrupt_file_is_refused(db: Path) -> None:
    _write_file(db, b"this is not an sqlite database\n" * 200)
    with trio.fail_after(10), pytest.raises(PersistenceError) as failure:
        await SqliteSessionStore(db).open()
    assert str(db) in str(failure.value)


async def test_another_applications_database_is_refused(db: Path) -> None:
    db.parent.mkdir(parents=True)
    with raw(db) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    with trio.fail_after(10), pytest.raises(PersistenceError, match="invoices"):
        await SqliteSessionStore(db).open()


@pytest.mark.parametrize(
    ("column", "bad"),
    [
        ("data", '{"text": '),
        ("data", "NaN"),
        ("data", '{"x": Infinity}'),
        ("data", '{"x": 1e999}'),
        ("data", "[1, 2]"),
        ("data", b"{}"),
        ("data", "[" * 100_000),
        ("turn", "first"),
    ],
)
async def test_undecodable_row_names_session_and_seq(db: Path, column: str, bad: object) -> None:
    with trio.fail_after(10):
        async with SqliteSessionStore(db) as store:
            await store.create("s1", META)
            for seq in range(1, 6):
                store.append("s1", event(seq, text="ok"))
            await store.flush("s1", 5)
        with raw(db) as conn, conn:
            conn.execute(f"UPDATE events SET {column} = ? WHERE seq = 3", (bad,))
        async with SqliteSessionStore(db) as store:
            with pytest.raises(PersistenceError, match=r"'s1', event seq 3 ") as failure:
                await store.load("s1")
            assert str(db) in str(failure.value)


def assert_deeply_frozen(value: object) -> None:
    assert not isinstance(value, list)
    if isinstance(value, dict):
        assert isinstance(value, FrozenDict)
        for item in value.values():
            assert_deeply_frozen(item)
    elif isinstance(value, tuple):
        for item in value:
            assert_deeply_frozen(item)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=25,
)


@pytest.mark.slow
@given(st.dictionaries(st.text(), json_values))
def test_stored_data_decodes_to_what_freeze_gives(value: dict[str, Any]) -> None:
    decoded = _DECODER.decode(_ENCODER.encode(value))
    assert decoded == freeze(value)
    assert isinstance(decoded, FrozenDict)
    assert_deeply_frozen(decoded)


async def test_reopen_after_close_is_refused(db: Path) -> None:
    with trio.fail_after(10):
        store = SqliteSessionStore(db)
        async with store:
            pass
        await store.aclose()
        with pytest.raises(PersistenceError, match="not open"):
            store.append("s1", event(1))
        with pytest.raises(PersistenceError, match="not open"):
            await store.flush("s1", 1)
        with pytest.raises(PersistenceError, match="already opened"):
            await store.open()


async def test_lease_is_refused_to_a_second_owner(db: Path) -> None:
    with trio.fail_after(10):
        async with SqliteSessionStore(db) as a, SqliteSessionStore(db) as b:
            await a.acquire("s1", "runtime-a")
            await a.acquire("s1", "runtime-a")
            with pytest.raises(PersistenceError, match="'s1' is already driven by 'runtime-a'"):
                await a.acquire("s1", "runtime-b")
            with pytest.raises(PersistenceError, match="already driven by 'runtime-a'"):
                await b.acquire("s1", "runtime-b")
            await b.release("s1", "runtime-b")
            with pytest.raises(PersistenceError, match="already driven"):
                await b.acquire("s1", "runtime-b")
            await a.release("s1", "runtime-a")
            await b.acquire("s1", "runtime-b")


async def test_closing_a_store_releases_its_leases(db: Path) -> None:
    with trio.fail_after(10):
        async with SqliteSessionStore(db) as a:
            await a.acquire("s1", "runtime-a")
        async with SqliteSessionStore(db) as b:
            await b.acquire("s1", "runtime-b")


def _plant_lease(db: Path, pid: int, host: str, started: str | None) -> None:
    with raw(db) as conn, conn:
        conn.execute(
            "INSERT INTO leases (session_id, owner, pid, host, started, acquired_at)"
            " VALUES ('s1', 'gone', ?, ?, ?, 0)",
            (pid, host, started),
        )


async def test_lease_of_a_dead_or_earlier_process_is_free(
    store: SqliteSessionStore, db: Path
) -> None:
    with trio.fail_after(10):
        _plant_lease(db, 2**31 - 1, socket.gethostname(), None)
        await store.acquire("s1", "me")
        await store.release("s1", "me")
        # Our own pid, but a different start time: an earlier process that had the same pid.
        _plant_lease(db, os.getpid(), socket.gethostname(), "0")
        if sys.platform == "linux":
            await store.acquire("s1", "me")
            await store.release("s1", "me")
        else:
            with pytest.raises(PersistenceError):
                await store.acquire("s1", "me")


async def test_lease_held_on_another_host_is_respected(store: SqliteSessionStore, db: Path) -> None:
    with trio.fail_after(10):
        _plant_lease(db, 2**31 - 1, "some-other-host.invalid", None)
        with pytest.raises(PersistenceError, match=r"'gone' .*some-other-host\.invalid"):
            await store.acquire("s1", "me")


_CHILD = """
import sys, trio
from agentloop_sqlite import SqliteSessionStore

async def main():
    async with SqliteSessionStore(sys.argv[1]) as store:
        await store.acquire("s1", "child")
        print("ready", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@pytest.mark.slow
async def test_lease_of_a_killed_process_is_released(
    store: SqliteSessionStore, db: Path, tmp_path: Path
) -> None:
    with trio.fail_after(10):
        async with ready_child([sys.executable, "-c", _CHILD, str(db)],
                               tmp_path / "child.log", ready=b"ready") as proc:
            with pytest.raises(PersistenceError, match=f"'child' \\(pid {proc.pid} "):
                await store.acquire("s1", "parent")
            proc.kill()
            await proc.wait()
            await store.acquire("s1", "parent")


async def test_two_stores_on_one_file_append_concurrently(db: Path) -> None:
    async def drive(store: SqliteSessionStore, session_id: str) -> None:
        await store.create(session_id, META)
        seq = 0
        for turn in range(1, 26):
            for _ in range(20):
                seq += 1
                store.append(session_id, event(seq, turn=turn, by=session_id, n=seq))
            await store.flush(session_id, seq)

    with trio.fail_after(10):
        async with (
            SqliteSessionStore(db) as a,
            SqliteSessionStore(db) as b,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(drive, a, "from-a")
            nursery.start_soon(drive, b, "from-b")
        async with SqliteSessionStore(db) as reader:
            for session_id in ("from-a", "from-b"):
                loaded = await reader.load(session_id)
                assert [e.seq for e in loaded.events] == list(range(1, 501))
                assert all(e.data["by"] == session_id for e in loaded.events)
        with raw(db) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize(
    "session_id", ["a", "s1", "A-b_c.d:e", "2024-01-01T10:00:00.5", "_x", "x" * 128]
)
def test_validate_session_id_accepts(session_id: str) -> None:
    assert validate_session_id(session_id) == session_id


@pytest.mark.parametrize(
    "session_id",
    ["", ".hidden", "..", "a/b", "a\\b", "a b", "x" * 129, "é", "a\n", "\x00", 5],
)
def test_validate_session_id_rejects(session_id: Any) -> None:
    with pytest.raises(InvalidContent, match="invalid session id") as failure:
        validate_session_id(session_id)
    assert repr(session_id) in str(failure.value)


# --- one unstorable event breaks only its session --------------------------------------------

UNSTORABLE = [
    pytest.param({"delta": "bad \udcff byte"}, 1, r"lone surrogate '\udcff'", id="low-surrogate"),
    pytest.param({"delta": "half \ud83d"}, 1, r"lone surrogate '\ud83d'", id="high-surrogate"),
    pytest.param({"n": 10**5000}, 1, "integer in its data is too large", id="huge-int"),
    pytest.param({"delta": "x"}, 2**63, "64-bit", id="huge-turn"),
]


@pytest.mark.parametrize(("data", "turn", "reason"), UNSTORABLE)
async def test_an_unstorable_event_fails_only_its_session(
    db: Path, data: dict[str, Any], turn: int, reason: str
) -> None:
    bad = SessionEvent(2, "assistant/chunk", turn, FrozenDict(data))
    with trio.fail_after(10):
        async with SqliteSessionStore(db) as store:
            await store.create("s1", META)
            await store.create("s2", META)
            # Queued together, so the bad row lands in one batch with the other session's.
            for seq in (1, 2, 3):
                store.append("s1", bad if seq == 2 else event(seq, text="s1"))
                store.append("s2", event(seq, text="s2"))
            await store.flush("s2", 3)
            expected = r"^session 's1': event seq 2 \(assistant/chunk\) could not be stored"
            with pytest.raises(PersistenceError, match=expected) as failure:
                await store.flush("s1", 3)
            assert reason in str(failure.value)
            # Broken for good: later appends are refused and every flush says why.
            store.append("s1", event(4, text="after"))
            with pytest.raises(PersistenceError, match=expected):
                await store.flush("s1", 4)
            await store.flush("s1", 1)  # what was stored before the bad event is durable
            store.append("s2", event(4, text="s2"))
            await store.flush("s2", 4)
            await store.create("s3", META)
            store.append("s3", event(1, text="s3"))
            await store.flush("s3", 1)
        async with SqliteSessionStore(db) as reopened:
            assert [e.seq for e in (await reopened.load("s1")).events] == [1]
            kept = (await reopened.load("s2")).events
            assert [(e.seq, e.data["text"]) for e in kept] == [(n, "s2") for n in (1, 2, 3, 4)]
            assert [e.seq for e in (await reopened.load("s3")).events] == [1]
            counts = {i.id: i.events for i in await reopened.list()}
            assert counts == {"s1": 1, "s2": 4, "s3": 1}


async def test_an_unstorable_event_alone_in_its_batch(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        store.append("s1", event(1, text="ok"))
        await store.flush("s1", 1)
        store.append("s1", SessionEvent(2, "user/message", 1, FrozenDict(content="\udcff")))
        with pytest.raises(
            PersistenceError, match=r"'s1': event seq 2 \(user/message\) .*lone surrogate"
        ) as failure:
            await store.flush("s1", 2)
        assert isinstance(failure.value.__cause__, UnicodeEncodeError)
        assert str(store.path) in str(failure.value)
        assert await store.exists("s1")


async def test_releasing_a_broken_session_lets_it_be_resumed(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        await store.create("s1", META)
        await store.acquire("s1", "rt")
        store.append("s1", event(1, text="ok"))
        store.append("s1", SessionEvent(2, "message", 1, FrozenDict(text="\udcff")))
        with pytest.raises(PersistenceError, match="event seq 2"):
            await store.flush("s1", 2)
        await store.release("s1", "rt")
        # A resumed driver continues from the stored log, which ends before the failed event.
        await store.acquire("s1", "rt")
        assert [e.seq for e in (await store.load("s1")).events] == [1]
        store.append("s1", event(2, text="again"))
        await store.flush("s1", 2)
        assert [e.data["text"] for e in (await store.load("s1")).events] == ["ok", "again"]


async def test_metadata_that_is_not_utf8_is_invalid_content(store: SqliteSessionStore) -> None:
    with trio.fail_after(10):
        with pytest.raises(InvalidContent, match=r"'s1'.*lone surrogate"):
            await store.create("s1", FrozenDict(cwd="/home/\udcff"))
        assert not await store.exists("s1")
        await store.create("s2", META)


# --- corrupt logs are PersistenceErrors naming session and seq -------------------------------

LOG = [
    ("turn/start", {"turn": 1}),
    ("user/message", {"message_id": "m1", "content": "hi", "source": None}),
    ("assistant/chunk", {"step": 1, "kind": "text", "delta": "ok"}),
    (
        "assistant/message",
        {"content": "ok", "tool_calls": [{"id": "c1", "name": "f", "arguments": {}}]},
    ),
    ("tool/call", {"call_id": "c1", "name": "f", "arguments": {}}),
    ("tool/result", {"call_id": "c1", "name": "f", "content": "done", "is_error": False}),
    ("turn/end", {"turn": 1, "reason": "completed"}),
]


async def _store_log(db: Path) -> None:
    async with SqliteSessionStore(db) as store:
        await store.create("s1", META)
        for seq, (kind, data) in enumerate(LOG, start=1):
            frozen = freeze(data)
            assert isinstance(frozen, FrozenDict)
            store.append("s1", SessionEvent(seq, kind, 1, frozen))
        await store.flush("s1", len(LOG))


@pytest.mark.parametrize(
    ("sql", "seq", "what"),
    [
        ("DELETE FROM events WHERE seq = 3", 3, "missing"),
        ("UPDATE events SET seq = 9 WHERE seq = 1", 1, "missing"),
        ("UPDATE events SET seq = 'three' WHERE seq = 3", 3, "missing"),
        ("UPDATE events SET data = '{\"message_id\": \"m1\"}' WHERE seq = 2", 2, "'content'"),
        ("UPDATE events SET data = '{\"kind\": \"text\"}' WHERE seq = 3", 3, "'delta'"),
        (
            "UPDATE events SET data = '{\"tool_calls\": [{\"id\": \"c1\"}]}' WHERE seq = 4",
            4,
            "'name'",
        ),
        ("UPDATE events SET data = '{\"tool_calls\": \"c1\"}' WHERE seq = 4", 4, "tool_calls"),
        ("UPDATE events SET data = '{\"name\": \"f\"}' WHERE seq = 5", 5, "'call_id'"),
        (
            "UPDATE events SET data = '{\"call_id\": \"c1\", \"name\": \"f\"}' WHERE seq = 6",
            6,
            "'content'",
        ),
        ("UPDATE events SET data = '{\"x\": ' WHERE seq = 6", 6, "does not decode"),
        ("UPDATE events SET type = x'00' WHERE seq = 2", 2, "malformed"),
    ],
)
async def test_a_corrupt_log_names_session_and_seq(
    db: Path, sql: str, seq: int, what: str
) -> None:
    with trio.fail_after(10):
        await _store_log(db)
        with raw(db) as conn, conn:
            conn.execute(sql)
        async with SqliteSessionStore(db) as store:
            with pytest.raises(PersistenceError, match=rf"'s1', event seq {seq} ") as failure:
                await store.load("s1")
            assert what in str(failure.value)
            assert str(db) in str(failure.value)


async def test_the_intact_log_loads(db: Path) -> None:
    with trio.fail_after(10):
        await _store_log(db)
        async with SqliteSessionStore(db) as store:
            loaded = await store.load("s1")
        assert [e.type for e in loaded.events] == [kind for kind, _ in LOG]


async def test_a_schema_version_changed_under_an_open_store_is_refused(db: Path) -> None:
    with trio.fail_after(10):
        await _store_log(db)
        async with SqliteSessionStore(db) as store:
            with raw(db) as conn:
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
            with pytest.raises(PersistenceError, match=r"'s1'.* schema version 2") as failure:
                await store.load("s1")
            assert str(db) in str(failure.value)


@pytest.mark.parametrize("version", [-1, -(2**31)])
async def test_an_unknown_older_schema_version_is_refused(db: Path, version: int) -> None:
    db.parent.mkdir(parents=True)
    with raw(db) as conn:
        conn.execute(f"PRAGMA user_version = {version}")
    with trio.fail_after(10), pytest.raises(PersistenceError, match=f"version {version}"):
        await SqliteSessionStore(db).open()
    with raw(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (version,)


# --- a file that is not a store is refused untouched -----------------------------------------


def _snapshot(path: Path) -> tuple[bytes, list[str]]:
    return path.read_bytes(), sorted(os.listdir(path.parent))


@pytest.mark.parametrize("user_version", [0, SCHEMA_VERSION])
async def test_a_foreign_database_is_refused_unchanged(db: Path, user_version: int) -> None:
    db.parent.mkdir(parents=True)
    with raw(db) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
        conn.execute("INSERT INTO t VALUES (42)")
        conn.execute(f"PRAGMA user_version = {user_version}")
        conn.commit()
    before = _snapshot(db)
    with trio.fail_after(10), pytest.raises(PersistenceError) as failure:
        await SqliteSessionStore(db).open()
    assert str(db) in str(failure.value)
    assert "not a session store" in str(failure.value)
    assert _snapshot(db) == before
    with raw(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    assert _snapshot(db) == before


async def test_a_text_file_is_refused_unchanged(db: Path) -> None:
    _write_file(db, b"name,amount\nwidget,3\n" * 300)
    before = _snapshot(db)
    with trio.fail_after(10), pytest.raises(PersistenceError) as failure:
        await SqliteSessionStore(db).open()
    assert str(db) in str(failure.value)
    assert _snapshot(db) == before


async def test_an_empty_file_becomes_a_store(db: Path) -> None:
    _write_file(db, b"")
    with trio.fail_after(10):
        async with SqliteSessionStore(db) as store:
            await store.create("s1", META)
            store.append("s1", event(1))
            await store.flush("s1", 1)
        with raw(db) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)


# --- read-only access ------------------------------------------------------------------------


async def _store_one_session(db: Path) -> None:
    async with SqliteSessionStore(db) as store:
        await store.create("s1", META)
        store.append("s1", event(1, "turn/start", 1))
        store.append("s1", event(2, "user/message", 1, content="hello"))
        await store.flush("s1", 2)


async def test_a_read_only_store_reads_and_never_writes(tmp_path: Path) -> None:
    # Characters that mean something in a URI must stay part of the file name.
    db = tmp_path / "odd ?name#1 100%" / "sessions.db"
    with trio.fail_after(10):
        await _store_one_session(db)
        before = await trio.Path(db).read_bytes()
        async with SqliteSessionStore.open_read_only(db) as store:
            assert [i.id for i in await store.list()] == ["s1"]
            assert await store.exists("s1")
            loaded = await store.load("s1")
            assert [e.data.get("content") for e in loaded.events] == [None, "hello"]
            with pytest.raises(PersistenceError, match="read-only"):
                await store.create("s2", META)
            with pytest.raises(PersistenceError, match="read-only"):
                store.append("s1", event(3))
            with pytest.raises(PersistenceError, match="read-only"):
                await store.flush("s1", 3)
            with pytest.raises(PersistenceError, match="read-only"):
                await store.acquire("s1", "rt")
            assert not await store.exists("s2")
        assert await trio.Path(db).read_bytes() == before


async def test_a_read_only_open_creates_and_migrates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.db"
    with trio.fail_after(10):
        with pytest.raises(PersistenceError, match=rf"{missing}.* does not exist"):
            await SqliteSessionStore.open_read_only(missing).open()
        assert not missing.parent.exists()
        empty = tmp_path / "empty.db"
        empty.write_bytes(b"")
        with pytest.raises(PersistenceError, match=rf"{empty}.*not a session store"):
            await SqliteSessionStore.open_read_only(empty).open()
        assert empty.read_bytes() == b""
        assert sorted(os.listdir(tmp_path)) == ["empty.db"]




_READ_ONLY_CHILD = """
import sys, trio
from agentloop_sqlite import SqliteSessionStore

async def main():
    async with SqliteSessionStore.open_read_only(sys.argv[1]) as store:
        print([i.id for i in await store.list()])
        print([e.seq for e in (await store.load("s1")).events])

trio.run(main)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "filesystem"])
async def test_a_store_in_a_read_only_place_is_readable(tmp_path: Path, kind: str) -> None:
    db = tmp_path / "ro" / "sessions.db"
    with trio.fail_after(20):
        await _store_one_session(db)
        before = _snapshot(db)
        prefix = read_only_prefix(kind, db.parent)
        if kind == "directory":
            db.chmod(0o444)
            db.parent.chmod(0o555)
        try:
            done = await trio.run_process(
                [*prefix, sys.executable, "-c", _READ_ONLY_CHILD, str(db)],
                capture_stdout=True, capture_stderr=True, check=False,
            )
        finally:
            db.parent.chmod(0o755)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().splitlines() == ["['s1']", "[1, 2]"]
    assert _snapshot(db) == before


@pytest.mark.slow
async def test_a_crashed_writers_log_in_a_read_only_place_is_refused(tmp_path: Path) -> None:
    live = tmp_path / "live" / "sessions.db"
    db = tmp_path / "ro" / "sessions.db"
    db.parent.mkdir()
    with trio.fail_after(20):
        await _store_one_session(live)
        # What a writer killed mid-run leaves: commits in the -wal file, never checkpointed.
        with raw(live) as conn:
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            with conn:
                conn.execute("UPDATE sessions SET turns = 7")
            for suffix in ("", "-wal"):
                shutil.copyfile(f"{live}{suffix}", f"{db}{suffix}")
        prefix = read_only_prefix("filesystem", db.parent)
        done = await trio.run_process(
            [*prefix, sys.executable, "-c", _READ_ONLY_CHILD, str(db)],
            capture_stdout=True, capture_stderr=True, check=False,
        )
        assert done.returncode != 0
        assert "holds commits" in done.stderr.decode()
        # Where SQLite can write its -shm file, it replays those commits instead.
        async with SqliteSessionStore.open_read_only(db) as store:
            assert [i.turns for i in await store.list()] == [7]
