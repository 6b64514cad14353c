"""An embedded SQLite session store.

One worker thread owns the connection and serves a FIFO queue. ``append`` only puts the event
on that queue; the worker drains whatever has accumulated and writes all the appends it found
in one transaction, so a busy runtime pays one commit (one fsync) per batch instead of one per
event. Every other operation is a request on the same queue, which keeps each caller's writes
and reads in the order it issued them (a ``load`` sees every ``append`` made before it).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import itertools
import os
import pathlib
import queue
import socket
import sqlite3
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, Self, TypeAlias, TypeVar

import attrs
import trio
from agentloop_storekit import DECODER as _DECODER
from agentloop_storekit import ENCODER as _ENCODER
from agentloop_storekit import Flush as _Flush
from agentloop_storekit import Request as _Request
from agentloop_storekit import Stop as _Stop
from agentloop_storekit import nothing as _nothing
from agentloop_storekit import process_identity as _process_identity
from agentloop_storekit import readable as _readable
from agentloop_storekit import shape_problem as _shape_problem
from agentloop_storekit import unicode_reason as _unicode_reason

from agentloop import (
    FrozenDict,
    InvalidContent,
    PersistenceError,
    SessionEvent,
    SessionInfo,
    SessionLeased,
    SessionNotFound,
    StoredSession,
    validate_session_id,
)

__all__ = ["SqliteSessionStore", "StoreStats", "validate_session_id", "SCHEMA_VERSION"]

SCHEMA_VERSION: Final = 1
"""The ``PRAGMA user_version`` this module writes and the newest one it reads."""

_BUSY_TIMEOUT_MS: Final = 5000
_MAX_BATCH: Final = 10_000
_TURN_START: Final = "turn/start"

_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY,
        meta TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        turns INTEGER NOT NULL DEFAULT 0,
        events INTEGER NOT NULL DEFAULT 0,
        cwd TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS sessions_by_activity ON sessions (updated_at)",
    """CREATE TABLE IF NOT EXISTS events (
        session_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        type TEXT NOT NULL,
        turn INTEGER,
        data TEXT NOT NULL,
        PRIMARY KEY (session_id, seq)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS leases (
        session_id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        pid INTEGER NOT NULL,
        host TEXT NOT NULL,
        started TEXT,
        acquired_at REAL NOT NULL
    )""",
)
_TABLES: Final = frozenset({"sessions", "events", "leases"})

_INSERT_EVENT: Final = (
    "INSERT INTO events (session_id, seq, type, turn, data) VALUES (?, ?, ?, ?, ?)"
)
_BUMP_SESSION: Final = (
    "UPDATE sessions SET events = events + ?, turns = turns + ?, updated_at = ? WHERE id = ?"
)
_DELETE_LEASE: Final = (
    "DELETE FROM leases WHERE session_id = ? AND owner = ? AND pid = ? AND host = ?"
)

_T = TypeVar("_T")
_Row: TypeAlias = tuple[str, int, str, "int | None", str]


@attrs.frozen(slots=True)
class _Failure:
    """Why a session stopped being stored: its first event that could not be."""

    seq: int
    message: str
    cause: BaseException


@attrs.define(slots=True)
class StoreStats:
    """Counters of the writer's work (read them from the trio thread; the worker updates them)."""

    transactions: int = 0
    """Committed transactions that wrote appended events."""
    events_written: int = 0
    """Appended events committed."""


_Appends: TypeAlias = "list[tuple[str, SessionEvent]]"
_Item: TypeAlias = "tuple[str, SessionEvent] | _Request[Any]"


def _cannot_create_wal_files(exc: sqlite3.OperationalError) -> bool:
    """Whether a read-only open failed for want of the ``-wal``/``-shm`` files beside it."""
    name = getattr(exc, "sqlite_errorname", "")
    return name == "SQLITE_CANTOPEN" or name.startswith("SQLITE_READONLY")


class SqliteSessionStore:
    """Session persistence in one SQLite file (WAL mode), shareable by several processes.

    Use it from a single trio run: ``async with SqliteSessionStore(path) as store: ...``, or
    ``await store.open()`` and ``await store.aclose()``. ``append`` never blocks: the event is
    queued for a dedicated writer thread that commits queued events in batches with
    ``synchronous=FULL``; ``flush`` waits until the session's queued events are committed.

    An event that cannot be stored (text with a lone surrogate, an integer too large for JSON
    or SQLite, a duplicate seq, an unknown session, a full disk) breaks only its session, never
    the writer: the events before it stay stored; it and every later append of that session
    are refused (``append`` still returns at once), so the stored log never has a gap; and
    every ``flush`` of the session from that seq on raises :class:`~agentloop.PersistenceError`
    naming the session, the seq, the event type and the reason. Other sessions keep writing.
    Releasing the session's lease ends its driver, and so the breakage: a driver that resumes
    it later continues from the stored log, which ends just before the refused event.

    :meth:`open_read_only` gives a store that only reads: it creates, initialises and migrates
    nothing, so it works on a read-only file, directory or filesystem.

    The live-driver lease records the holder's pid, host and process start time; a lease whose
    holder process has died on this host is free, so a crash never locks a session for good.
    """

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False) -> None:
        self._path = os.fspath(path)
        # The file's one name among this process's stores, for change notices (a relative
        # path is resolved now: a later chdir must not make it another file's).
        self._key = os.path.realpath(self._path)
        self._read_only = read_only
        self.stats = StoreStats()
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._state = "new"
        # Trio-thread bookkeeping for flush: the ticket of each session's latest append.
        self._enqueued = 0
        self._last_ticket: dict[str, int] = {}
        # Written by the worker thread only.
        self._processed = 0
        self._failed: dict[str, _Failure] = {}
        self._fatal: BaseException | None = None
        self._conn: sqlite3.Connection | None = None
        self._held: dict[str, str] = {}
        self._pid = os.getpid()
        self._host = socket.gethostname()
        self._started: str | None = None

    @classmethod
    def open_read_only(cls, path: str | os.PathLike[str]) -> SqliteSessionStore:
        """A store that reads the existing store at ``path`` and never writes to it.

        Use it as ``async with SqliteSessionStore.open_read_only(path) as store: ...``. The
        file is opened with SQLite's ``mode=ro``; where SQLite cannot create the ``-wal`` and
        ``-shm`` files it needs beside it (a read-only directory or filesystem), it is opened
        ``immutable``, which reads the main file only: complete unless a writer crashed and
        left commits in its ``-wal`` file, which is then refused rather than ignored. Writes
        (``create``, ``append``, ``flush``, ``acquire``) raise :class:`PersistenceError`;
        ``release`` does nothing, as such a store holds no lease.
        """
        return cls(path, read_only=True)

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    @property
    def read_only(self) -> bool:
        """Whether this store only reads (see :meth:`open_read_only`)."""
        return self._read_only

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Open (creating if needed) the database file, its parent directories and schema.

        A read-only store (:meth:`open_read_only`) creates nothing: the file must be a store.
        A file that is refused is left exactly as it was found.

        Raises:
            PersistenceError: the file is not an SQLite database, is some other application's
                database, or has a schema version this module does not know; a read-only
                store's file does not exist or is not yet a store.
        """
        if self._state != "new":
            raise PersistenceError(f"session store {self._path} was already opened")
        self._state = "opening"
        opened: _Request[None] = _Request(self._connect)
        self._queue.put(opened)
        threading.Thread(
            target=self._work, name=f"agentloop-sqlite:{self._path}", daemon=True
        ).start()
        try:
            # Shielded: the worker finishes opening anyway, and must not be left half-owned.
            with trio.CancelScope(shield=True):
                await opened.wait()
        except BaseException:
            self._state = "closed"
            raise
        self._state = "open"

    async def aclose(self) -> None:
        """Commit everything queued, release the leases this store holds and close the file."""
        if self._state != "open":
            await trio.lowlevel.checkpoint()
            return
        self._state = "closing"
        stop = _Stop(functools.partial(self._guarded, self._shutdown))
        self._queue.put(stop)
        try:
            with trio.CancelScope(shield=True):
                await stop.wait()
        finally:
            self._state = "closed"

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- the SessionPersistence protocol -----------------------------------------------------

    async def exists(self, session_id: str) -> bool:
        """Whether a session with this id is stored."""
        return await self._call(functools.partial(self._do_exists, session_id))

    def exists_now(self, session_id: str) -> bool:
        """Whether a session with this id is stored, answered without awaiting (for the
        synchronous ``agent_loop.create``): one indexed read on a connection of its own,
        which sees every committed write."""
        if self._state != "open" or not os.path.exists(self._path):
            return False
        uri = pathlib.Path(os.path.abspath(self._path)).as_uri() + "?mode=ro"
        try:
            with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as conn:
                row = conn.execute(
                    "SELECT 1 FROM sessions WHERE id = ?", (session_id,)
                ).fetchone()
        except sqlite3.Error as exc:
            raise PersistenceError(
                f"cannot check for session {session_id!r} in {self._path}: {exc}"
            ) from exc
        return row is not None

    async def list(self) -> builtins.list[SessionInfo]:
        """Every stored session, most recently active first."""
        return await self._call(self._do_list)

    async def load(self, session_id: str) -> StoredSession:
        """The stored session and its whole log in seq order, data deep-frozen.

        Raises:
            SessionNotFound: no session has this id.
            PersistenceError: a stored row does not decode (the message names session and seq).
        """
        return await self._call(functools.partial(self._do_load, session_id))

    def load_now(self, session_id: str) -> StoredSession:
        """The stored session, read without awaiting (a hibernated agent wakes synchronously):
        one read transaction on a connection of its own, which sees every committed write.
        Also works once the store is closed, while its file exists (the log of a hibernated
        agent disposed at shutdown).

        Raises:
            SessionNotFound: no session has this id.
            PersistenceError: the file cannot be read or a stored row does not decode.
        """
        with self._reader() as conn:
            return self._guarded(functools.partial(self._read_session, conn, session_id))

    async def read_events(
        self, session_id: str, from_seq: int, limit: int
    ) -> builtins.list[SessionEvent]:
        """At most ``limit`` stored events of the session from seq ``from_seq`` on (a tail's
        read): on a connection of its own in a worker thread, so the writer is not held up."""
        call = functools.partial(self._read_events, session_id, from_seq, limit)
        return await trio.to_thread.run_sync(functools.partial(self._guarded, call))

    def watch(self, session_id: str, changed: Callable[[], None]) -> Callable[[], None]:
        """Call ``changed`` (in this trio run) each time events of the session are committed
        to this file by any store of this process; returns the function that stops it."""
        watcher = _Watcher(session_id, trio.lowlevel.current_trio_token(), changed)
        key = self._key
        with _HUB_LOCK:
            _HUB.setdefault(key, []).append(watcher)

        def stop() -> None:
            with _HUB_LOCK:
                found = _HUB.get(key, [])
                if watcher in found:
                    found.remove(watcher)
                if not found:
                    _HUB.pop(key, None)

        return stop

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """A read-only connection of its own, which sees every committed write."""
        if self._state == "new" or not os.path.exists(self._path):
            raise PersistenceError(f"session store {self._path} is not open ({self._state})")
        uri = pathlib.Path(os.path.abspath(self._path)).as_uri() + "?mode=ro"
        try:
            conn = sqlite3.connect(
                uri, uri=True, timeout=5, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise PersistenceError(f"cannot read {self._path}: {exc}") from exc
        with contextlib.closing(conn):
            yield conn

    async def create(self, session_id: str, meta: FrozenDict) -> None:
        """Record a new session; ``meta["cwd"]``, when a string, is listed as its directory.

        Raises:
            InvalidContent: the id is invalid (see :func:`validate_session_id`) or ``meta`` is
                not JSON.
            PersistenceError: a session with this id is already stored.
        """
        validate_session_id(session_id)
        self._check_writable("create a session")
        try:
            meta_json = _ENCODER.encode(meta)
            # SQLite takes UTF-8 only; a lone surrogate would fail in the writer instead.
            meta_json.encode()
        except UnicodeEncodeError as exc:
            raise InvalidContent(
                f"metadata of session {session_id!r}: {_unicode_reason(exc)}"
            ) from exc
        except (TypeError, ValueError) as exc:
            raise InvalidContent(f"metadata of session {session_id!r}: {exc}") from exc
        cwd = meta.get("cwd")
        call = functools.partial(
            self._do_create, session_id, meta_json, cwd if isinstance(cwd, str) else None
        )
        await self._call(call, shield=True)

    def append(self, session_id: str, event: SessionEvent) -> None:
        """Queue one event for the writer. Call in seq order; O(1), never blocks.

        Raises:
            PersistenceError: the store is not open, or is read-only.
        """
        if self._state != "open":
            raise self._not_open()
        self._check_writable("append events")
        self._enqueued += 1
        self._last_ticket[session_id] = self._enqueued
        self._queue.put((session_id, event))

    async def flush(self, session_id: str, seq: int) -> None:
        """Return once every event appended to the session so far (so up to ``seq``, as appends
        come in seq order) is committed to disk.

        Raises:
            PersistenceError: an event of this session up to ``seq`` could not be stored (the
                message names the first such event and why; the cause is chained), or the
                store is read-only.
        """
        if self._state != "open":
            raise self._not_open()
        self._check_writable("flush events")
        if self._last_ticket.get(session_id, 0) > self._processed:
            marker = _Flush(_nothing)
            self._queue.put(marker)
            await marker.wait()
        else:
            await trio.lowlevel.checkpoint()
        if self._last_ticket.get(session_id, 0) <= self._processed:
            # All of it is written: a session that rests (most do) keeps no entry here.
            self._last_ticket.pop(session_id, None)
        failure = self._failed.get(session_id)
        if failure is not None and seq >= failure.seq:
            # A fresh error each time: re-raising one instance would pile up tracebacks.
            raise PersistenceError(failure.message) from failure.cause

    async def acquire(self, session_id: str, owner: str) -> None:
        """Take the live-driver lease of a session for ``owner``.

        Taking a lease ``owner`` already holds from this process succeeds again.

        Raises:
            InvalidContent: the id is invalid.
            PersistenceError: another owner holds it: in this process, or in a process that is
                still alive (or runs on another host, where liveness cannot be checked).
        """
        validate_session_id(session_id)
        self._check_writable("take a lease")
        await self._call(functools.partial(self._do_acquire, session_id, owner), shield=True)

    async def release(self, session_id: str, owner: str) -> None:
        """Give the lease back if ``owner`` (in this process) holds it; otherwise do nothing."""
        if self._read_only:
            if self._state != "open":
                raise self._not_open()
            await trio.lowlevel.checkpoint()
            return
        await self._call(functools.partial(self._do_release, session_id, owner), shield=True)

    # -- trio side helpers -------------------------------------------------------------------

    def _not_open(self) -> PersistenceError:
        return PersistenceError(f"session store {self._path} is not open ({self._state})")

    def _check_writable(self, what: str) -> None:
        if self._read_only:
            raise PersistenceError(f"session store {self._path} is open read-only: cannot {what}")

    async def _call(self, fn: Callable[[], _T], *, shield: bool = False) -> _T:
        if self._state != "open":
            raise self._not_open()
        request = _Request(functools.partial(self._guarded, fn))
        self._queue.put(request)
        # Writes are shielded so a cancelled caller never leaves their outcome unknown.
        with trio.CancelScope(shield=shield):
            return await request.wait()
        raise AssertionError("unreachable: nothing cancels this scope, so it swallows nothing")

    # -- worker thread -----------------------------------------------------------------------

    def _work(self) -> None:
        opened = self._queue.get()
        assert isinstance(opened, _Request)
        if not opened.run():
            return
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < _MAX_BATCH:
                    batch.append(self._queue.get_nowait())
            try:
                if self._handle(batch):
                    return
            except Exception as exc:  # noqa: BLE001 - a bug must not leave callers waiting
                self._fatal = exc
                for item in batch:
                    if isinstance(item, _Stop):
                        item.run()
                        return
                    if isinstance(item, _Request):
                        item.fail(self._worker_failed())

    def _handle(self, batch: builtins.list[_Item]) -> bool:
        """Serve one batch; True once the store is shut down."""
        if self._fatal is not None:
            for item in batch:
                if isinstance(item, _Stop):
                    item.run()
                    return True
                if isinstance(item, _Request):
                    item.fail(self._worker_failed())
            return False
        appends: _Appends = []
        flushes: builtins.list[_Request[Any]] = []
        for item in batch:
            if isinstance(item, tuple):
                appends.append(item)
            elif isinstance(item, _Flush):
                flushes.append(item)
            else:
                self._commit(appends, flushes)
                appends, flushes = [], []
                item.run()
                if isinstance(item, _Stop):
                    return True
        self._commit(appends, flushes)
        return False

    def _worker_failed(self) -> PersistenceError:
        error = PersistenceError(
            f"the writer of session store {self._path} failed: {self._fatal!r}"
        )
        error.__cause__ = self._fatal
        return error

    @property
    def _db(self) -> sqlite3.Connection:
        assert self._conn is not None
        return self._conn

    def _guarded(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except sqlite3.Error as exc:
            raise PersistenceError(f"session store {self._path}: {exc}") from exc

    @staticmethod
    def _read(conn: sqlite3.Connection) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return _in_transaction(conn, "BEGIN")

    def _transaction(
        self, begin: str = "BEGIN IMMEDIATE"
    ) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front, so two writers queue on busy_timeout
        # instead of one failing with SQLITE_BUSY when it upgrades a read lock mid-transaction.
        return _in_transaction(self._db, begin)

    def _connect(self) -> None:
        _refuse_special(self._path)
        if self._read_only:
            self._connect_read_only()
            return
        path = self._path
        identity = _process_identity(self._pid)
        self._started = identity[1] if identity else None
        try:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise PersistenceError(f"cannot create the directory of {path}: {exc}") from exc
        try:
            conn = sqlite3.connect(path, isolation_level=None, cached_statements=64)
        except sqlite3.Error as exc:
            raise PersistenceError(f"cannot open session store {path}: {exc}") from exc
        self._conn = conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            # Only reads until the file is known to be a store (or empty): switching the
            # journal mode rewrites the header of another application's database.
            self._check_tables(self._check_version())
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._close_connection()
            raise PersistenceError(f"{path} is not a usable session database: {exc}") from exc
        except BaseException:
            self._close_connection()
            raise

    def _connect_read_only(self) -> None:  # the caller checked the path is not special
        path = self._path
        if not os.path.exists(path):
            raise PersistenceError(f"session store {path} does not exist")
        uri = pathlib.Path(os.path.abspath(path)).as_uri()
        try:
            try:
                self._open_uri(f"{uri}?mode=ro")
                self._check_store()
            except sqlite3.OperationalError as exc:
                if not _cannot_create_wal_files(exc):
                    raise
                self._close_connection()
                wal = f"{path}-wal"
                if os.path.exists(wal) and os.path.getsize(wal) > 0:
                    raise PersistenceError(
                        f"cannot read {path}: its write-ahead log {wal} holds commits that"
                        f" SQLite cannot replay where it cannot write ({exc})"
                    ) from exc
                self._open_uri(f"{uri}?mode=ro&immutable=1")
                self._check_store()
        except sqlite3.DatabaseError as exc:
            self._close_connection()
            raise PersistenceError(f"cannot read session store {path}: {exc}") from exc
        except BaseException:
            self._close_connection()
            raise

    def _open_uri(self, uri: str) -> None:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, cached_statements=64)
        self._conn = conn
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")

    def _check_store(self) -> None:
        version = self._check_version()
        if version == 0:
            if not self._table_names():
                raise PersistenceError(f"{self._path} is empty: not a session store (yet)")
            self._check_tables(0)
        if version != SCHEMA_VERSION:
            raise PersistenceError(
                f"{self._path} has session schema version {version}; this read-only store"
                f" reads version {SCHEMA_VERSION} and migrates nothing"
            )
        self._check_tables(version)

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _check_version(self) -> int:
        (version,) = self._db.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise PersistenceError(
                f"{self._path} has session schema version {version}, newer than version"
                f" {SCHEMA_VERSION} supported here; upgrade agentloop to open it"
            )
        if version < 0:
            raise PersistenceError(
                f"{self._path} has schema version {version}, which no agentloop writes:"
                " not a session store"
            )
        return int(version)

    def _table_names(self) -> set[str]:
        return {
            name
            for (name,) in self._db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'"
                " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"
            )
        }

    def _check_tables(self, version: int) -> None:
        names = self._table_names()
        if version == 0:
            foreign = names - _TABLES
            if foreign:
                raise PersistenceError(
                    f"{self._path} is an SQLite database of another application"
                    f" (tables {', '.join(sorted(foreign))}), not a session store"
                )
        else:
            missing = _TABLES - names
            if missing:
                raise PersistenceError(
                    f"{self._path} is not a session store: it has schema version {version}"
                    f" but no tables {', '.join(sorted(missing))}"
                )

    def _migrate(self) -> None:
        if self._check_version() == SCHEMA_VERSION:
            return
        with self._transaction() as conn:
            # Read again under the write lock: another process may have migrated meanwhile.
            version = self._check_version()
            if version == 0:
                self._check_tables(0)
                for statement in _SCHEMA:
                    conn.execute(statement)
            # Later schema versions add their steps here, each guarded by `version < N`.
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _shutdown(self) -> None:
        try:
            if self._held:
                with self._transaction() as conn:
                    conn.executemany(
                        _DELETE_LEASE,
                        [(sid, owner, self._pid, self._host) for sid, owner in self._held.items()],
                    )
                self._held.clear()
        finally:
            self._close_connection()

    def _commit(self, appends: _Appends, flushes: builtins.list[_Request[Any]]) -> None:
        if appends:
            self._write(appends)
            self._processed += len(appends)
            if _HUB:
                _announce(self._key, {sid for sid, _ in appends})
        for flush in flushes:
            flush.run()

    def _write(self, appends: _Appends) -> None:
        failed = self._failed
        rows: dict[str, builtins.list[_Row]] = {}
        encode = _ENCODER.encode
        for sid, event in appends:
            if sid in failed:
                continue
            try:
                row = (sid, event.seq, event.type, event.turn, encode(event.data))
            except Exception as exc:  # noqa: BLE001 - recorded as the session's failure
                self._fail(sid, event.seq, event.type, exc, "its data cannot be written as JSON: ")
                continue
            session_rows = rows.get(sid)
            if session_rows is None:
                rows[sid] = [row]
            else:
                session_rows.append(row)
        if not rows:
            return
        try:
            self._insert(rows)
        except Exception:  # noqa: BLE001 - whatever it was, find its rows and keep the rest
            for sid, session_rows in rows.items():
                self._insert_each(sid, session_rows)

    def _insert(self, rows: dict[str, builtins.list[_Row]]) -> None:
        now = time.time()
        count = 0
        with self._transaction() as conn:
            conn.executemany(_INSERT_EVENT, itertools.chain.from_iterable(rows.values()))
            for sid, session_rows in rows.items():
                self._bump(conn, sid, session_rows, now)
                count += len(session_rows)
        self.stats.transactions += 1
        self.stats.events_written += count

    def _bump(
        self, conn: sqlite3.Connection, sid: str, rows: builtins.list[_Row], now: float
    ) -> None:
        turns = sum(1 for row in rows if row[2] == _TURN_START)
        if conn.execute(_BUMP_SESSION, (len(rows), turns, now, sid)).rowcount != 1:
            raise PersistenceError("the session was never created")

    def _insert_each(self, sid: str, rows: builtins.list[_Row]) -> None:
        """Store one session's rows up to the first that fails, and record that failure."""
        culprit: _Row | None = None
        error: BaseException | None = None
        stored = 0
        try:
            with self._transaction() as conn:
                for row in rows:
                    try:
                        conn.execute(_INSERT_EVENT, row)
                    except Exception as exc:
                        if not conn.in_transaction:
                            raise  # SQLite rolled the transaction back: none of it stays
                        culprit, error = row, exc
                        break
                    stored += 1
                if stored:
                    self._bump(conn, sid, rows[:stored], time.time())
        except Exception as exc:  # noqa: BLE001 - nothing of this transaction was stored
            culprit, error, stored = rows[0], exc, 0
        if stored:
            self.stats.transactions += 1
            self.stats.events_written += stored
        if culprit is not None and error is not None:
            self._fail(sid, culprit[1], culprit[2], error)

    def _fail(self, sid: str, seq: int, type_: str, exc: BaseException, prefix: str = "") -> None:
        if isinstance(exc, UnicodeEncodeError):
            where = " in its type" if exc.object == type_ else " in its data"
            reason = _unicode_reason(exc, where)
        elif isinstance(exc, OverflowError):
            reason = f"its seq or turn does not fit in a 64-bit integer ({exc})"
        elif isinstance(exc, ValueError) and "integer string conversion" in str(exc):
            reason = f"an integer in its data is too large to write as JSON ({exc})"
        else:
            reason = f"{prefix}{exc}"
        message = (
            f"session {sid!r}: event seq {seq} ({type_}) could not be stored in {self._path}:"
            f" {reason}; no later event of the session is stored"
        )
        self._failed[sid] = _Failure(seq, _readable(message), exc)

    def _do_exists(self, session_id: str) -> bool:
        row = self._db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None

    def _do_list(self) -> builtins.list[SessionInfo]:
        rows = self._db.execute(
            "SELECT id, turns, events, created_at, updated_at, cwd,"
            " json_extract(meta, '$.parent_session_id') FROM sessions"
            " ORDER BY updated_at DESC, rowid DESC"
        ).fetchall()
        return [
            SessionInfo(
                id=sid, turns=turns, events=events, created_at=created, updated_at=updated, cwd=cwd,
                # Any meta is accepted: only a string names a parent.
                parent_session_id=parent if isinstance(parent, str) else None,
            )
            for sid, turns, events, created, updated, cwd, parent in rows
        ]

    def _do_create(self, session_id: str, meta_json: str, cwd: str | None) -> None:
        now = time.time()
        try:
            with self._transaction() as conn:
                conn.execute(
                    "INSERT INTO sessions (id, meta, created_at, updated_at, cwd)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (session_id, meta_json, now, now, cwd),
                )
        except sqlite3.IntegrityError as exc:
            raise PersistenceError(
                f"session {session_id!r} already exists in {self._path}"
            ) from exc

    def _do_load(self, session_id: str) -> StoredSession:
        return self._read_session(self._db, session_id)

    def _read_session(self, db: sqlite3.Connection, session_id: str) -> StoredSession:
        # One read transaction: the metadata and the log come from the same snapshot even
        # while another process appends.
        with self._read(db) as conn:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version != SCHEMA_VERSION:
                # Another process changed the file since it was opened.
                raise PersistenceError(
                    f"cannot read session {session_id!r}: {self._path} now has schema version"
                    f" {version}, not version {SCHEMA_VERSION} it had when opened here"
                )
            found = conn.execute("SELECT meta FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if found is None:
                raise SessionNotFound(f"no session {session_id!r} in {self._path}")
            rows = conn.execute(
                "SELECT seq, type, turn, data FROM events WHERE session_id = ? ORDER BY seq",
                (session_id,),
            ).fetchall()
        meta = self._decode(found[0], f"the metadata of session {session_id!r}")
        return StoredSession(id=session_id, meta=meta, events=self._events(session_id, rows, 1))

    def _events(
        self, session_id: str, rows: builtins.list[Any], first: int
    ) -> tuple[SessionEvent, ...]:
        events = []
        for expected, (seq, type_, turn, data) in enumerate(rows, start=first):
            if seq != expected or type(seq) is not int:
                raise PersistenceError(
                    f"session {session_id!r}, event seq {expected} is missing in {self._path}:"
                    f" the stored log goes from seq {expected - 1} to seq {seq!r}"
                )
            where = f"session {session_id!r}, event seq {seq}"
            if not isinstance(type_, str) or not (turn is None or isinstance(turn, int)):
                raise PersistenceError(f"{where} in {self._path} has a malformed type or turn")
            value = self._decode(data, where)
            problem = _shape_problem(type_, value)
            if problem is not None:
                raise PersistenceError(
                    _readable(f"{where} ({type_}) in {self._path} is malformed: it {problem}")
                )
            events.append(SessionEvent(seq, type_, turn, value))
        return tuple(events)

    def _read_events(
        self, session_id: str, from_seq: int, limit: int
    ) -> builtins.list[SessionEvent]:
        with self._reader() as conn:
            rows = conn.execute(
                "SELECT seq, type, turn, data FROM events WHERE session_id = ? AND seq >= ?"
                " ORDER BY seq LIMIT ?",
                (session_id, from_seq, limit),
            ).fetchall()
        return builtins.list(self._events(session_id, rows, from_seq))

    def _decode(self, data: object, where: str) -> FrozenDict:
        try:
            value = _DECODER.decode(data)  # type: ignore[arg-type]
        except (TypeError, ValueError, RecursionError) as exc:
            raise PersistenceError(f"{where} in {self._path} does not decode: {exc}") from exc
        if not isinstance(value, FrozenDict):
            raise PersistenceError(f"{where} in {self._path} is not a JSON object")
        return value

    def _do_acquire(self, session_id: str, owner: str) -> None:
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT owner, pid, host, started FROM leases WHERE session_id = ?",
                (session_id,),
            ).fetchone()
            if row is not None:
                holder, pid, host, started = row
                # A matching start time tells this process from an earlier one with its pid.
                ours = (
                    pid == self._pid
                    and host == self._host
                    and (started is None or started == self._started)
                )
                if ours and holder == owner:
                    self._held[session_id] = owner
                    return
                if ours or self._holder_alive(pid, host, started):
                    raise SessionLeased(
                        f"session {session_id!r} is already driven by {holder!r}"
                        f" (pid {pid} on {host})"
                    )
            conn.execute(
                "INSERT OR REPLACE INTO leases"
                " (session_id, owner, pid, host, started, acquired_at) VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, owner, self._pid, self._host, self._started, time.time()),
            )
        self._held[session_id] = owner

    def _holder_alive(self, pid: object, host: object, started: object) -> bool:
        if host != self._host:
            return True  # another machine's processes cannot be probed
        if not isinstance(pid, int) or pid <= 0:
            return False  # never a real holder; and kill(0 or -n) would signal a group
        if sys.platform == "win32":
            return True  # os.kill there terminates rather than probes
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, owned by another user
        identity = _process_identity(pid)
        if identity is None:
            return True
        state, start = identity
        if state in ("Z", "X"):
            return False  # exited, waiting to be reaped
        return started is None or started == start

    def _do_release(self, session_id: str, owner: str) -> None:
        with self._transaction() as conn:
            conn.execute(_DELETE_LEASE, (session_id, owner, self._pid, self._host))
        if self._held.get(session_id) == owner:
            del self._held[session_id]
            # Its driver is gone; whoever resumes it continues from the stored log.
            self._failed.pop(session_id, None)


@attrs.frozen(eq=False)
class _Watcher:
    session_id: str
    token: trio.lowlevel.TrioToken
    changed: Callable[[], None]


# Tails of this process, by database file: a commit by any store of the process tells them.
_HUB: dict[str, builtins.list[_Watcher]] = {}
_HUB_LOCK = threading.Lock()


def _announce(key: str, sessions: set[str]) -> None:
    """From the writer thread, after a commit: wake the tails of these sessions."""
    with _HUB_LOCK:
        due = [w for w in _HUB.get(key, ()) if w.session_id in sessions]
    for watcher in due:
        # A run that ended left its watcher behind: nothing to wake.
        with contextlib.suppress(trio.RunFinishedError):
            watcher.token.run_sync_soon(watcher.changed)


def _refuse_special(path: str) -> None:
    """A store is a regular file (or none yet): SQLite would block forever reading a FIFO,
    and read a character device such as ``/dev/zero`` without end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise PersistenceError(f"cannot open session store {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(mode):
        raise PersistenceError(
            f"session store {path} is not a regular file (it is {_kind_of(mode)})"
        )


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


@contextlib.contextmanager
def _in_transaction(conn: sqlite3.Connection, begin: str) -> Iterator[sqlite3.Connection]:
    conn.execute(begin)
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
