"""A PostgreSQL session store with fenced single-driver leases.

One worker thread owns the connection (psycopg 3, synchronous API) and serves a FIFO queue, as
the SQLite store does: ``append`` only queues the event; the worker drains whatever has
accumulated and writes all of it in one statement (one round trip, one commit). Every other
operation is a request on the same queue, so each caller's writes and reads stay in the order
it issued them.

Fencing: a lease row per session carries an epoch that grows by one at every takeover. Each
appended row carries the epoch its writer held, and a statement trigger refuses a batch whose
epoch is not the session's current one, after locking those lease rows: a takeover waits for an
append in flight to commit, and an append that comes after a takeover fails. A paused or
partitioned writer that wakes up after another runtime took its session can therefore never
write to it again, whatever its own clock or state says.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Final, Self, TypeAlias, TypeVar, cast

import attrs
import psycopg
import psycopg.conninfo
import trio
from agentloop_storekit import DECODER as _DECODER
from agentloop_storekit import ENCODER as _ENCODER
from agentloop_storekit import Flush as _Flush
from agentloop_storekit import Request as _Request
from agentloop_storekit import Stop as _Stop
from agentloop_storekit import frozen_array as _frozen_array
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

__all__ = [
    "PostgresSessionStore", "StoreStats", "Routed", "SCHEMA_VERSION", "INBOX_CHANNEL", "masked_dsn"
]

log = logging.getLogger("agentloop.postgres")

SCHEMA_VERSION: Final = 4
"""The schema version this module writes and the newest one it reads."""

DEFAULT_LEASE_SECONDS: Final = 30.0
_MAX_BATCH: Final = 10_000
# Reconnecting after the server went away: the first retry, and the longest wait between two.
_RETRY_FIRST: Final = 0.05
_RETRY_MAX: Final = 1.0
_TURN_START: Final = "turn/start"
_INT64: Final = 2**63
# Serialises concurrent migrations of one database (pg_advisory_xact_lock takes a bigint).
_MIGRATION_LOCK: Final = 0x6167_6E74_6C6F_6F70 & (_INT64 - 1)
_FENCED: Final = "AGL01"
_UNKNOWN_SESSION: Final = "AGL02"

_TABLES: Final = frozenset({
    "agentloop_schema", "agentloop_sessions", "agentloop_events", "agentloop_leases",
    "agentloop_inbox",
})
# The tables each version has: an older schema lacks those added after it.
_TABLES_OF: Final = {1: _TABLES - {"agentloop_inbox"}, 2: _TABLES, 3: _TABLES, 4: _TABLES}

# Each entry upgrades the schema from the version before it; the index is the version reached.
_MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (),
    (
        "CREATE TABLE agentloop_schema (version integer NOT NULL)",
        """CREATE TABLE agentloop_sessions (
            id text PRIMARY KEY,
            n bigint GENERATED ALWAYS AS IDENTITY,
            meta json NOT NULL,
            created_at double precision NOT NULL,
            updated_at double precision NOT NULL,
            turns integer NOT NULL DEFAULT 0,
            events integer NOT NULL DEFAULT 0,
            cwd text
        )""",
        "CREATE INDEX agentloop_sessions_by_activity ON agentloop_sessions (updated_at, n)",
        """CREATE TABLE agentloop_events (
            session_id text NOT NULL,
            seq bigint NOT NULL,
            epoch bigint NOT NULL,
            type text NOT NULL,
            turn bigint,
            data json NOT NULL,
            PRIMARY KEY (session_id, seq)
        )""",
        # A lease row is never deleted: its epoch must only grow, or a writer fenced long ago
        # could match a fresh epoch again. A free lease has no owner.
        """CREATE TABLE agentloop_leases (
            session_id text PRIMARY KEY,
            epoch bigint NOT NULL,
            owner text,
            host text,
            pid integer,
            started text,
            acquired_at timestamptz,
            expires_at timestamptz
        )""",
        """CREATE FUNCTION agentloop_check_append() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            bad record;
        BEGIN
            -- Locked first: a takeover (an UPDATE of the row) then waits for this commit,
            -- and the check below sees any takeover that committed before it.
            PERFORM 1 FROM agentloop_leases l
                WHERE l.session_id IN (SELECT DISTINCT session_id FROM added)
                ORDER BY l.session_id FOR SHARE;
            SELECT a.session_id, a.epoch AS wrote, l.epoch AS current, l.owner
                INTO bad
                FROM (SELECT DISTINCT session_id, epoch FROM added) a
                LEFT JOIN agentloop_leases l ON l.session_id = a.session_id
                -- Epoch 0 is a writer that never took the lease: fine while nobody holds it.
                WHERE CASE WHEN l.owner IS NULL THEN a.epoch <> 0
                           ELSE l.epoch <> a.epoch END
                LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'AGL01',
                    MESSAGE = format('append to session %s at lease epoch %s refused:'
                        ' the lease is at epoch %s, held by %s', bad.session_id, bad.wrote,
                        coalesce(bad.current::text, 'none'), coalesce(bad.owner, 'nobody'));
            END IF;
            SELECT a.session_id INTO bad FROM added a
                WHERE NOT EXISTS (SELECT 1 FROM agentloop_sessions s WHERE s.id = a.session_id)
                LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'AGL02',
                    MESSAGE = format('session %s was never created', bad.session_id);
            END IF;
            RETURN NULL;
        END
        $$""",
        """CREATE TRIGGER agentloop_check_append AFTER INSERT ON agentloop_events
            REFERENCING NEW TABLE AS added FOR EACH STATEMENT
            EXECUTE FUNCTION agentloop_check_append()""",
        "INSERT INTO agentloop_schema (version) VALUES (0)",
    ),
    (
        # Input routed to whichever runtime drives a session. A row is claimed by the driver
        # at its lease epoch; a takeover claims again what an older epoch claimed, and the
        # new driver skips what its log already holds, so each message lands exactly once.
        """CREATE TABLE agentloop_inbox (
            id text PRIMARY KEY,
            n bigint GENERATED ALWAYS AS IDENTITY,
            session_id text NOT NULL,
            content json NOT NULL,
            source json,
            target text NOT NULL,
            wakeup boolean NOT NULL,
            sent_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            claimed_by text,
            claimed_epoch bigint,
            claimed_at timestamptz
        )""",
        "CREATE INDEX agentloop_inbox_by_session ON agentloop_inbox (session_id, n)",
    ),
    (
        # A message its driver discarded (cancel, remove) or could never deliver is done:
        # no later driver claims it again.
        "ALTER TABLE agentloop_inbox ADD COLUMN discarded_at timestamptz",
    ),
    (
        # A message found in its session's stored log is delivered: a serving runtime looks
        # for work among the rows neither delivered nor discarded, through this small index.
        "ALTER TABLE agentloop_inbox ADD COLUMN delivered_at timestamptz",
        (
            "CREATE INDEX agentloop_inbox_pending ON agentloop_inbox (session_id)"
            " WHERE discarded_at IS NULL AND delivered_at IS NULL"
        ),
    ),
)
assert len(_MIGRATIONS) == SCHEMA_VERSION + 1

# One statement (so one implicit transaction and one round trip) per batch: the rows, then the
# session counters; the trigger checks epochs and sessions before it commits.
_WRITE: Final = """
WITH added AS (
    INSERT INTO agentloop_events (session_id, seq, epoch, type, turn, data)
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::bigint[],
                         %s::text[]::json[])
    RETURNING 1
), bumped AS (
    UPDATE agentloop_sessions s
    SET events = s.events + b.n, turns = s.turns + b.t, updated_at = %s
    FROM unnest(%s::text[], %s::integer[], %s::integer[]) AS b(id, n, t)
    WHERE s.id = b.id
    RETURNING 1
), told AS (
    -- Delivered when the batch commits: tails of these sessions, in any runtime, read on.
    SELECT pg_notify('agentloop_events', t.id) FROM unnest(%s::text[]) AS t(id)
)
SELECT (SELECT count(*) FROM added), (SELECT count(*) FROM bumped), (SELECT count(*) FROM told)
"""

def _decode_any(text: str, where: str) -> Any:
    try:
        value = _DECODER.decode(text)
    except (TypeError, ValueError, RecursionError) as exc:
        raise PersistenceError(f"{where} does not decode: {exc}") from exc
    return _frozen_array(value) if type(value) is list else value


def masked_dsn(dsn: str) -> str:
    """``dsn`` as a ``postgresql://user@host:port/dbname`` URI without its password."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return "postgresql://(a connection string that does not parse)"
    user = params.get("user")
    host = params.get("host") or params.get("hostaddr") or ""
    port = params.get("port")
    where = f"{user}@" if user else ""
    where += str(host)
    if port:
        where += f":{port}"
    return f"postgresql://{where}/{params.get('dbname') or ''}"


def _password(dsn: str) -> str | None:
    try:
        value = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        return None
    return str(value) if value else None


_T = TypeVar("_T")
_Row: TypeAlias = tuple[str, int, int, str, "int | None", str]


@attrs.frozen(slots=True)
class _Failure:
    """Why a session stopped being stored: its first event that could not be."""

    seq: int
    message: str
    cause: BaseException | None


@attrs.define(slots=True)
class StoreStats:
    """Counters of the writer's work (read them from the trio thread; the worker updates them)."""

    transactions: int = 0
    """Committed statements that wrote appended events."""
    events_written: int = 0
    """Appended events committed."""
    fenced: int = 0
    """Append batches the database refused because their lease epoch was stale."""
    leases_lost: int = 0
    """Leases found taken over by another runtime when renewing them."""
    renewals: int = 0
    """Lease renewals sent."""


_Append: TypeAlias = "tuple[str, int, SessionEvent]"
_Item: TypeAlias = "_Append | _Request[Any]"


@attrs.frozen(slots=True)
class Routed:
    """A message sent to a session through the database, claimed by its driver."""

    id: str
    content: Any
    source: Any
    target: str
    wakeup: bool


_TARGETS: Final = ("next-turn", "next-step")
# The deepest nesting a runtime's inbox accepts (agentloop refuses deeper content at every
# send): routed input is refused at the same depth, before it is committed.
_MAX_NESTING: Final = 200


def _nesting_problem(value: object, path: str) -> str | None:
    """Where ``value`` nests deeper than an inbox accepts, or ``None`` (iterative: a value
    thousands of levels deep is refused with its path, not a ``RecursionError``)."""
    stack: builtins.list[tuple[object, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, (builtins.list, tuple)):
            children: Any = ((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif isinstance(item, dict):
            children = ((v, f"{where}.{k}") for k, v in item.items())
        else:
            continue
        if depth >= _MAX_NESTING:
            return f"{where}: nested more than {_MAX_NESTING} levels deep"
        stack.extend((v, w, depth + 1) for v, w in children)
    return None
INBOX_CHANNEL: Final = "agentloop_inbox"
_Watch: TypeAlias = "tuple[trio.lowlevel.TrioToken, Callable[[], None]]"
EVENTS_CHANNEL: Final = "agentloop_events"
"""Notified with a session id each time a batch of that session's events commits."""


class _LostError(Exception):
    """The server cannot be reached: what was being written is kept and retried."""


class _RowRaceError(Exception):
    """Another runtime inserted a session's first lease row between our read and insert."""


class PostgresSessionStore:
    """Session persistence in a PostgreSQL database, shared by any number of runtimes.

    Use it from a single trio run: ``async with PostgresSessionStore(dsn) as store: ...``.
    ``append`` never blocks: the event is queued for a dedicated writer thread that commits
    queued events in batches; ``flush`` waits until the session's queued events are committed.
    The tables (``agentloop_*``) live in the connection's current schema (``search_path``);
    other tables there are left alone.

    An event that cannot be stored (text with a lone surrogate or NUL, an integer too large, a
    duplicate seq, an unknown session, a lease taken over by another runtime) breaks only its
    session: the events before it stay stored, it and every later append of the session are
    refused, and every ``flush`` from that seq on raises :class:`~agentloop.PersistenceError`
    naming the session, the seq, the event type and the reason.

    Leases: :meth:`acquire` takes a session's lease for ``lease_seconds`` (measured by the
    database's clock) and a new epoch; the writer thread renews every held lease each
    ``renew_every`` seconds (a third of the lease by default). A lease whose holder stopped
    renewing, or whose holder process died on this host, may be taken by another runtime;
    from then on the database refuses the old holder's appends.

    The password of ``dsn`` never appears in a message, a log record or a repr.
    """

    def __init__(
        self,
        dsn: str,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        renew_every: float | None = None,
        read_only: bool = False,
        connect_timeout: int = 10,
    ) -> None:
        if not (lease_seconds > 0 and math.isfinite(lease_seconds)):
            raise ValueError(f"lease_seconds must be a positive number, got {lease_seconds!r}")
        self._dsn = dsn
        self._where = masked_dsn(dsn)
        self._secret = _password(dsn)
        self._lease_seconds = float(lease_seconds)
        self._renew_every = lease_seconds / 3 if renew_every is None else renew_every
        self._read_only = read_only
        self._connect_timeout = connect_timeout
        self.stats = StoreStats()
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._state = "new"
        # Trio-thread state: the ticket of each session's latest append, and held epochs.
        self._enqueued = 0
        self._last_ticket: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        # Written by the worker thread only.
        self._processed = 0
        self._failed: dict[str, _Failure] = {}
        # While the server is unreachable: the acknowledged appends not yet committed, the
        # flushes waiting for the next attempt, when it is, and why the last one failed.
        self._backlog: builtins.list[_Append] = []
        self._held_flushes: builtins.list[_Request[Any]] = []
        self._outage: str | None = None
        self._retry_at = 0.0
        self._retry_delay = _RETRY_FIRST
        # Read by the trio thread: sessions with appends kept through an outage, and the
        # first seq of each not yet stored (replaced whole, never mutated in place).
        self._unstored: dict[str, int] = {}
        self._fatal: BaseException | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._held: dict[str, tuple[str, int]] = {}
        # Tails of this store (``watch``), by session id, and the thread that listens for them.
        self._watchers: dict[str, builtins.list[_Watch]] = {}
        self._watch_lock = threading.Lock()
        self._watch_stop: threading.Event | None = None
        # The lease each session's routed input was last claimed under: it fences discards.
        self._claimed: dict[str, tuple[str, int]] = {}
        self._written: dict[str, int] = {}
        self._next_renewal = 0.0
        self._pid = os.getpid()
        self._host = socket.gethostname()
        self._started: str | None = None
        # The lease owner of sessions picked for a serving runtime, until it resumes them.
        self._reserver = f"fleet:{self._host}:{self._pid}:{uuid.uuid4().hex[:8]}"

    @classmethod
    def open_read_only(cls, dsn: str) -> PostgresSessionStore:
        """A store that reads and never writes: it creates and migrates nothing."""
        return cls(dsn, read_only=True)

    def __repr__(self) -> str:
        return f"PostgresSessionStore({self._where!r}, state={self._state!r})"

    @property
    def path(self) -> str:
        """Where the store is, for messages: the DSN without its password."""
        return self._where

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def lease_seconds(self) -> float:
        return self._lease_seconds

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect, then create or migrate the schema (a read-only store only checks it).

        Raises:
            PersistenceError: the server cannot be reached or refuses the login, the schema
                holds tables of these names that are not a session store, or its version is
                one this module does not know.
        """
        if self._state != "new":
            raise PersistenceError(f"session store {self._where} was already opened")
        self._state = "opening"
        opened: _Request[None] = _Request(self._connect)
        self._queue.put(opened)
        threading.Thread(target=self._work, name="agentloop-postgres", daemon=True).start()
        try:
            with trio.CancelScope(shield=True):
                await opened.wait()
        except BaseException:
            self._state = "closed"
            raise
        self._state = "open"

    def watch(self, session_id: str, changed: Callable[[], None]) -> Callable[[], None]:
        """Call ``changed`` (in this trio run) each time events of the session commit, written
        by any runtime on this database (``NOTIFY agentloop_events``); returns the function
        that stops it. One listening connection per store serves all its tails."""
        entry = (trio.lowlevel.current_trio_token(), changed)
        with self._watch_lock:
            self._watchers.setdefault(session_id, []).append(entry)
            if self._watch_stop is None:
                self._watch_stop = threading.Event()
                threading.Thread(
                    target=self._listen_events, args=(self._watch_stop,), daemon=True,
                    name=f"agentloop-postgres-tails:{self.path}",
                ).start()

        def stop() -> None:
            with self._watch_lock:
                found = self._watchers.get(session_id, [])
                if entry in found:
                    found.remove(entry)
                if not found:
                    self._watchers.pop(session_id, None)
                if not self._watchers and self._watch_stop is not None:
                    self._watch_stop.set()
                    self._watch_stop = None

        return stop

    def _listen_events(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                    # Something may have committed while this connection was not listening.
                    self._tell(None)
                    while not stop.is_set():
                        for note in conn.notifies(timeout=0.25):
                            self._tell(note.payload)
            except psycopg.Error as exc:
                log.warning("listening for session events on %s failed (%s); retrying",
                            self.path, type(exc).__name__)
                stop.wait(1.0)

    def _tell(self, session_id: str | None) -> None:
        with self._watch_lock:
            due = [
                w for sid, found in self._watchers.items()
                if session_id is None or sid == session_id for w in found
            ]
        for token, changed in due:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(changed)

    async def aclose(self) -> None:
        """Commit everything queued, release the leases this store holds and disconnect."""
        with self._watch_lock:
            if self._watch_stop is not None:
                self._watch_stop.set()
                self._watch_stop = None
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
        return await self._call(functools.partial(self._do_exists, session_id))

    async def list(self) -> builtins.list[SessionInfo]:
        """Every stored session, most recently active first."""
        return await self._call(self._do_list)

    async def load(self, session_id: str) -> StoredSession:
        """The stored session and its whole log in seq order, from one snapshot.

        Raises:
            SessionNotFound: no session has this id.
            PersistenceError: a stored row is malformed (the message names session and seq).
        """
        return await self._call(functools.partial(self._do_load, session_id))

    async def read_events(
        self, session_id: str, from_seq: int, limit: int
    ) -> builtins.list[SessionEvent]:
        """At most ``limit`` stored events of the session from seq ``from_seq`` on: a tail's
        read, which must not load the whole log on every commit it is told of."""
        call = functools.partial(self._do_read_events, session_id, from_seq, limit)
        return await self._call(call)

    async def create(self, session_id: str, meta: FrozenDict) -> None:
        """Record a new session; ``meta["cwd"]``, when a string, is listed as its directory.

        Raises:
            InvalidContent: the id is invalid or ``meta`` is not storable JSON.
            PersistenceError: a session with this id is already stored.
        """
        validate_session_id(session_id)
        self._check_writable("create a session")
        try:
            meta_json = _ENCODER.encode(meta)
            meta_json.encode()
        except UnicodeEncodeError as exc:
            raise InvalidContent(
                f"metadata of session {session_id!r}: {_unicode_reason(exc)}"
            ) from exc
        except (TypeError, ValueError) as exc:
            raise InvalidContent(f"metadata of session {session_id!r}: {exc}") from exc
        if "\\u0000" in meta_json:
            # PostgreSQL's text cannot carry NUL, and the listing copies cwd out of meta.
            raise InvalidContent(f"metadata of session {session_id!r}: contains a NUL character")
        cwd = meta.get("cwd")
        call = functools.partial(
            self._do_create, session_id, meta_json, cwd if isinstance(cwd, str) else None
        )
        await self._call(call, shield=True)

    def append(self, session_id: str, event: SessionEvent) -> None:
        """Queue one event, with the lease epoch held now. O(1), never blocks.

        Raises:
            PersistenceError: the store is not open, or is read-only.
        """
        if self._state != "open":
            raise self._not_open()
        self._check_writable("append events")
        self._enqueued += 1
        self._last_ticket[session_id] = self._enqueued
        self._queue.put((session_id, self._epochs.get(session_id, 0), event))

    async def flush(self, session_id: str, seq: int) -> None:
        """Return once every event appended to the session so far is committed.

        Raises:
            PersistenceError: an event of the session up to ``seq`` could not be stored, or
                the session's lease was taken over (the message names session and seq).
        """
        if self._state != "open":
            raise self._not_open()
        self._check_writable("flush events")
        if self._last_ticket.get(session_id, 0) > self._processed or (
            session_id in self._unstored
        ):
            # During an outage the answer comes after the writer's next attempt.
            marker = _Flush(_nothing)
            self._queue.put(marker)
            await marker.wait()
        else:
            await trio.lowlevel.checkpoint()
        failure = self._failed.get(session_id)
        if failure is not None and seq >= failure.seq:
            raise PersistenceError(failure.message) from failure.cause
        first = self._unstored.get(session_id)
        if first is not None and seq >= first:
            raise PersistenceError(
                f"session {session_id!r}: events from seq {first} on are not stored yet:"
                f" {self._outage or 'the server cannot be reached'}; they are kept and"
                " written when the server is back"
            )

    async def acquire(self, session_id: str, owner: str) -> None:
        """Take the live-driver lease of a session for ``owner``, at a new epoch.

        Taking again a lease this store holds for ``owner`` renews it. A lease held by another
        owner is refused until it expires or (on this host) its holder process has died.

        Raises:
            InvalidContent: the id is invalid.
            PersistenceError: another owner holds a live lease on the session.
        """
        validate_session_id(session_id)
        self._check_writable("take a lease")
        epoch = await self._call(
            functools.partial(self._do_acquire, session_id, owner), shield=True
        )
        self._epochs[session_id] = epoch

    async def release(self, session_id: str, owner: str) -> None:
        """Give the lease back if this store holds it for ``owner``; otherwise do nothing."""
        if self._read_only:
            if self._state != "open":
                raise self._not_open()
            await trio.lowlevel.checkpoint()
            return
        released = await self._call(
            functools.partial(self._do_release, session_id, owner), shield=True
        )
        if released or session_id not in self._held:
            # Released, or lost to a takeover: either way nothing is written under it again.
            self._epochs.pop(session_id, None)

    async def renew(self) -> builtins.list[str]:
        """Renew every lease this store holds now, as the writer does in the background.

        Returns the sessions whose lease turned out to be taken over: from then on their
        appends are refused here and their flushes raise.
        """
        self._check_writable("renew leases")
        return await self._call(self._renew_now, shield=True)

    async def send(
        self,
        session_id: str,
        content: object,
        *,
        target: str = "next-turn",
        wakeup: bool = True,
        source: object = None,
        message_id: str | None = None,
    ) -> str:
        """Queue input for the session's driver, wherever it runs; returns the message id.

        Committed before it returns, and announced with NOTIFY: the runtime driving the
        session claims it and hands it to its agent. Sending again with the same
        ``message_id`` changes nothing (at-least-once senders may retry). Input for a session
        nobody drives waits until a runtime resumes it.

        Raises:
            InvalidContent: the id, target or content is invalid.
            SessionNotFound: no session has this id.
        """
        validate_session_id(session_id)
        self._check_writable("send input")
        if target not in _TARGETS:
            raise InvalidContent(f"target: must be 'next-turn' or 'next-step', got {target!r}")
        if not isinstance(content, (str, builtins.list, tuple)):
            raise InvalidContent(f"content: must be a string or a list of parts, got {content!r}")
        problem = _nesting_problem(content, "content") or _nesting_problem(source, "source")
        if problem is not None:
            raise InvalidContent(f"input for session {session_id!r}: {problem}")
        empty = _empty_prompt(content)
        if empty is not None:
            # The driving runtime would refuse it too, but only after it was committed.
            raise InvalidContent(f"input for session {session_id!r}: {empty}")
        try:
            content_json = _ENCODER.encode(content)
            source_json = None if source is None else _ENCODER.encode(source)
            content_json.encode()
            (source_json or "").encode()
        except UnicodeEncodeError as exc:
            raise InvalidContent(f"input for session {session_id!r}: {_unicode_reason(exc)}") \
                from exc
        except (TypeError, ValueError) as exc:
            raise InvalidContent(f"input for session {session_id!r}: {exc}") from exc
        mid = message_id if message_id is not None else f"routed_{uuid.uuid4().hex}"
        validate_session_id(mid, "message id")
        call = functools.partial(
            self._do_send, session_id, mid, content_json, source_json, target, wakeup
        )
        await self._call(call, shield=True)
        return mid

    async def claim(
        self, session_id: str, delivered: Collection[str] = ()
    ) -> builtins.list[Routed]:
        """Claim the input sent to a session this store drives, oldest first.

        ``delivered`` names messages the session's log already holds: they are claimed but
        not returned. Returns nothing when this store does not hold the session's lease.
        """
        call = functools.partial(self._do_claim, session_id, frozenset(delivered))
        return await self._call(call, shield=True)

    async def discard(self, session_id: str, message_ids: Collection[str]) -> None:
        """Mark routed messages done without delivering them: their driver discarded them
        (``cancel``, ``remove``) or they cannot be delivered. No later driver claims them.
        Only messages this store claimed, at the epoch it claimed them, are marked."""
        call = functools.partial(self._do_discard, session_id, builtins.list(message_ids))
        await self._call(call, shield=True)

    async def pick(self, limit: int, only: Collection[str] | None = None) -> builtins.list[str]:
        """Reserve up to ``limit`` sessions that have routed input nobody is driving.

        A session qualifies when it has input neither delivered nor discarded and its lease
        is free or expired (a killed driver's). Several runtimes pick at once without waiting
        on each other: ``FOR UPDATE SKIP LOCKED`` passes over the lease rows another one is
        taking, and the lease is taken (a new epoch, owned by :attr:`reserver`) in the same
        statement, so each session goes to one of them. ``acquire`` by any owner of this
        store then takes the reserved lease over; ``release(id, store.reserver)`` gives back
        one that will not be driven. ``only`` restricts the search to those sessions.
        """
        self._check_writable("pick sessions")
        if limit <= 0:
            await trio.lowlevel.checkpoint()
            return []
        call = functools.partial(
            self._do_pick, limit, None if only is None else sorted(only)
        )
        return await self._call(call, shield=True)

    async def mark_delivered(self, session_id: str) -> int:
        """Mark the session's routed input that its stored log holds as delivered, so that no
        serving runtime picks the session for it again.

        Returns how many messages still wait for this store's claim: sent, neither delivered
        nor discarded, and not claimed under the lease this store holds. Their driver is
        about to get them; letting the session go now would only hand them to the next one.
        """
        self._check_writable("mark routed input delivered")
        return await self._call(
            functools.partial(self._do_mark_delivered, session_id), shield=True
        )

    @property
    def reserver(self) -> str:
        """The lease owner under which :meth:`pick` reserves sessions for this store."""
        return self._reserver

    def lost(self) -> builtins.list[str]:
        """The sessions this store wrote under a lease another runtime has since taken."""
        return [
            sid for sid, epoch in self._epochs.items()
            if (self._held.get(sid) or ("", None))[1] != epoch
        ]

    def epoch(self, session_id: str) -> int | None:
        """The lease epoch this store holds for the session, or None."""
        return self._epochs.get(session_id)

    def held(self) -> builtins.list[str]:
        """The sessions whose lease this store holds."""
        return builtins.list(self._epochs)

    @property
    def dsn(self) -> str:
        """The connection string, password included: for opening another connection."""
        return self._dsn

    # -- trio side helpers -------------------------------------------------------------------

    def _not_open(self) -> PersistenceError:
        return PersistenceError(f"session store {self._where} is not open ({self._state})")

    def _check_writable(self, what: str) -> None:
        if self._read_only:
            raise PersistenceError(f"session store {self._where} is open read-only: cannot {what}")

    async def _call(self, fn: Callable[[], _T], *, shield: bool = False) -> _T:
        if self._state != "open":
            raise self._not_open()
        request = _Request(functools.partial(self._guarded, fn))
        self._queue.put(request)
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
            try:
                due = self._next_due()
                if due is None:
                    batch = [self._queue.get()]
                else:
                    batch = [self._queue.get(timeout=max(0.0, due - time.monotonic()))]
            except queue.Empty:
                if self._backlog and time.monotonic() >= self._retry_at:
                    self._commit([], [])
                if self._held and time.monotonic() >= self._next_renewal:
                    self._renew_safely()
                continue
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
            if self._held and time.monotonic() >= self._next_renewal:
                self._renew_safely()

    def _next_due(self) -> float | None:
        """When the writer has work of its own: a lease renewal, or retrying the backlog."""
        due = []
        if self._held and not self._read_only:
            due.append(self._next_renewal)
        if self._backlog:
            due.append(self._retry_at)
        return min(due) if due else None

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
        appends: builtins.list[_Append] = []
        flushes: builtins.list[_Request[Any]] = []
        for item in batch:
            if isinstance(item, tuple):
                appends.append(item)
            elif isinstance(item, _Flush):
                flushes.append(item)
            else:
                # Stopping: one last attempt, whatever the backoff says.
                self._commit(appends, flushes, force=isinstance(item, _Stop))
                appends, flushes = [], []
                item.run()
                if isinstance(item, _Stop):
                    return True
        self._commit(appends, flushes)
        return False

    def _worker_failed(self) -> PersistenceError:
        error = PersistenceError(
            f"the writer of session store {self._where} failed: {self._scrub(repr(self._fatal))}"
        )
        error.__cause__ = self._fatal
        return error

    def _scrub(self, text: str) -> str:
        if self._secret:
            text = text.replace(self._secret, "***")
        return text.replace(self._dsn, self._where)

    @property
    def _db(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            # A dropped connection is replaced: the leases and the log live in the database.
            self._close_connection()
            conn = self._open_connection()
        return conn

    def _guarded(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except psycopg.Error as exc:
            raise PersistenceError(
                f"session store {self._where}: {self._scrub(str(exc).strip())}"
            ) from exc

    def _open_connection(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(
                self._dsn,
                autocommit=True,
                connect_timeout=self._connect_timeout,
                application_name="agentloop",
            )
        except psycopg.Error as exc:
            raise PersistenceError(
                f"cannot connect to session store {self._where}: {self._scrub(str(exc).strip())}"
            ) from None
        if self._read_only:
            conn.execute("SET default_transaction_read_only = on")
        else:
            # A holder paused inside a transaction (a stopped process, a partitioned host)
            # must not keep its row locks, and so block a takeover, longer than its lease.
            timeout_ms = max(1000, int(self._lease_seconds * 500))
            conn.execute(f"SET idle_in_transaction_session_timeout = {timeout_ms}")
        self._conn = conn
        return conn

    def _close_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def _connect(self) -> None:
        identity = _process_identity(self._pid)
        self._started = identity[1] if identity else None
        self._open_connection()
        try:
            if self._read_only:
                version = self._check_version()
                if version == 0:
                    raise PersistenceError(
                        f"{self._where} holds no session store (no agentloop_* tables) yet"
                    )
                if version != SCHEMA_VERSION:
                    raise PersistenceError(
                        f"{self._where} has session schema version {version}; this read-only"
                        f" store reads version {SCHEMA_VERSION} and migrates nothing"
                    )
            else:
                self._migrate()
        except psycopg.Error as exc:
            self._close_connection()
            raise PersistenceError(
                f"{self._where} is not a usable session store: {self._scrub(str(exc).strip())}"
            ) from exc
        except BaseException:
            self._close_connection()
            raise

    def _table_names(self) -> set[str]:
        rows = self._db.execute(
            "SELECT c.relname FROM pg_class c"
            " WHERE c.relnamespace = current_schema()::regnamespace"
            " AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND c.relname LIKE 'agentloop%'"
        ).fetchall()
        return {name for (name,) in rows}

    def _check_version(self) -> int:
        """The schema's version: 0 for none of our tables; refuses what is not a store."""
        names = self._table_names() & _TABLES
        if not names:
            return 0
        if "agentloop_schema" not in names:
            raise PersistenceError(
                f"{self._where} is not a session store: it has tables"
                f" {', '.join(sorted(names))} but no agentloop_schema"
            )
        rows = self._db.execute("SELECT version FROM agentloop_schema").fetchall()
        if len(rows) != 1 or type(rows[0][0]) is not int:
            raise PersistenceError(
                f"{self._where} is not a session store: agentloop_schema holds {len(rows)} rows"
            )
        version: int = rows[0][0]
        if version > SCHEMA_VERSION:
            raise PersistenceError(
                f"{self._where} has session schema version {version}, newer than version"
                f" {SCHEMA_VERSION} supported here; upgrade agentloop to open it"
            )
        if version < 1:
            raise PersistenceError(
                f"{self._where} has schema version {version}, which no agentloop writes:"
                " not a session store"
            )
        missing = _TABLES_OF.get(version, _TABLES) - names
        if missing:
            raise PersistenceError(
                f"{self._where} is not a session store: it has schema version {version}"
                f" but no tables {', '.join(sorted(missing))}"
            )
        return version

    def _migrate(self) -> None:
        if self._check_version() == SCHEMA_VERSION:
            return
        conn = self._db
        with conn.transaction():
            # Read again under the lock: another runtime may have migrated meanwhile.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            version = self._check_version()
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target]:
                    conn.execute(statement)
            conn.execute("UPDATE agentloop_schema SET version = %s", (SCHEMA_VERSION,))

    def _shutdown(self) -> None:
        try:
            if self._held and self._conn is not None and not self._conn.broken:
                self._release_rows(list(self._held.items()))
            self._held.clear()
        finally:
            self._close_connection()

    def _release_rows(self, held: builtins.list[tuple[str, tuple[str, int]]]) -> None:
        self._db.execute(
            "UPDATE agentloop_leases l SET owner = NULL, host = NULL, pid = NULL,"
            " started = NULL, expires_at = NULL"
            " FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS h(id, owner, epoch)"
            " WHERE l.session_id = h.id AND l.owner = h.owner AND l.epoch = h.epoch",
            ([sid for sid, _ in held], [o for _, (o, _) in held], [e for _, (_, e) in held]),
        )

    # -- writing -------------------------------------------------------------------------------

    def _commit(
        self, appends: builtins.list[_Append], flushes: builtins.list[_Request[Any]],
        *, force: bool = False,
    ) -> None:
        if appends:
            self._processed += len(appends)
            self._backlog.extend(appends)
        attempted = False
        if self._backlog and (
            self._outage is None or force or time.monotonic() >= self._retry_at
        ):
            self._write_backlog()
            attempted = True
        if self._outage is not None and not attempted:
            self._held_flushes.extend(flushes)  # answered after the next attempt
            return
        if self._held_flushes:
            flushes, self._held_flushes = [*self._held_flushes, *flushes], []
        for flush in flushes:
            flush.run()

    def _write_backlog(self) -> None:
        """Write every kept append; on losing the server keep them and schedule a retry."""
        backlog = self._backlog
        try:
            try:
                if self._outage is not None:
                    backlog = self._not_yet_stored(backlog)
                self._write(backlog)
            except _LostError:
                if self._outage is not None:
                    raise
                # One dropped connection is not an outage: reconnect and try again at once.
                backlog = self._not_yet_stored(backlog)
                self._write(backlog)
        except _LostError as exc:
            self._backlog = backlog
            if self._outage is None:
                log.warning("session store %s cannot be reached (%s): %d events kept,"
                            " retrying with backoff", self._where, exc, len(backlog))
            self._outage = str(exc)
            self._retry_at = time.monotonic() + self._retry_delay
            self._retry_delay = min(2 * self._retry_delay, _RETRY_MAX)
            unstored: dict[str, int] = {}
            for sid, _, event in backlog:
                if sid not in self._failed:
                    unstored.setdefault(sid, event.seq)
            self._unstored = unstored
            return
        if self._outage is not None:
            log.warning("session store %s is back: %d kept events written",
                        self._where, len(backlog))
        self._backlog, self._outage, self._unstored = [], None, {}
        self._retry_delay = _RETRY_FIRST

    def _not_yet_stored(self, backlog: builtins.list[_Append]) -> builtins.list[_Append]:
        """``backlog`` without what the server committed before the connection broke (a
        commit whose answer was lost)."""
        sids = sorted({sid for sid, _, _ in backlog})
        try:
            stored = dict(self._db.execute(
                "SELECT session_id, max(seq) FROM agentloop_events"
                " WHERE session_id = ANY(%s) GROUP BY session_id",
                (sids,),
            ).fetchall())
        except (psycopg.Error, PersistenceError) as exc:
            raise _LostError(self._lost_reason(exc)) from exc
        return [a for a in backlog if a[2].seq > stored.get(a[0], -_INT64)]

    def _lost_reason(self, exc: BaseException) -> str:
        if isinstance(exc, PersistenceError):
            return str(exc)
        return f"the connection to {self._where} failed: {self._scrub(str(exc).strip())}"

    def _connection_lost(self) -> bool:
        conn = self._conn
        return conn is None or conn.closed or conn.broken

    def _write(self, appends: builtins.list[_Append]) -> None:
        failed = self._failed
        rows: dict[str, builtins.list[_Row]] = {}
        encode = _ENCODER.encode
        for sid, epoch, event in appends:
            if sid in failed:
                continue
            seq, type_, turn = event.seq, event.type, event.turn
            try:
                if not -_INT64 <= seq < _INT64 or not -_INT64 <= (turn or 0) < _INT64:
                    raise OverflowError("out of range")
                data = encode(event.data)
                type_.encode()
                data.encode()
                if "\x00" in type_:
                    raise ValueError("its type contains a NUL character")
            except Exception as exc:  # noqa: BLE001 - recorded as the session's failure
                self._fail(sid, seq, type_, exc, "its data cannot be written as JSON: ")
                continue
            row = (sid, seq, epoch, type_, turn, data)
            session_rows = rows.get(sid)
            if session_rows is None:
                rows[sid] = [row]
            else:
                session_rows.append(row)
        if not rows:
            return
        try:
            self._insert(rows)
        except PersistenceError as exc:  # reconnecting failed
            raise _LostError(self._lost_reason(exc)) from exc
        except psycopg.Error as exc:
            if self._connection_lost():
                raise _LostError(self._lost_reason(exc)) from exc
            # Find the rows at fault, keeping every session's rows before them.
            for sid, session_rows in rows.items():
                self._insert_each(sid, session_rows)

    def _insert(self, rows: dict[str, builtins.list[_Row]]) -> None:
        flat = [row for session_rows in rows.values() for row in session_rows]
        sids = list(rows)
        params = (
            [r[0] for r in flat], [r[1] for r in flat], [r[2] for r in flat],
            [r[3] for r in flat], [r[4] for r in flat], [r[5] for r in flat],
            time.time(),
            sids,
            [len(rows[sid]) for sid in sids],
            [sum(1 for r in rows[sid] if r[3] == _TURN_START) for sid in sids],
            sids,
        )
        self._db.execute(_WRITE, params)
        self.stats.transactions += 1
        self.stats.events_written += len(flat)
        for sid in sids:
            self._written[sid] = rows[sid][-1][1]

    def _insert_each(self, sid: str, rows: builtins.list[_Row]) -> None:
        """Store one session's rows up to the first that fails, and record that failure."""
        for row in rows:
            try:
                self._insert({sid: [row]})
            except PersistenceError as exc:
                raise _LostError(self._lost_reason(exc)) from exc
            except psycopg.Error as exc:
                if self._connection_lost():
                    raise _LostError(self._lost_reason(exc)) from exc
                self._fail(sid, row[1], row[3], exc)
                return

    def _fail(
        self, sid: str, seq: int, type_: str, exc: BaseException, prefix: str = ""
    ) -> None:
        sqlstate = getattr(exc, "sqlstate", None)
        if isinstance(exc, UnicodeEncodeError):
            where = " in its type" if exc.object == type_ else " in its data"
            reason = _unicode_reason(exc, where)
        elif isinstance(exc, OverflowError):
            reason = f"its seq or turn does not fit in a 64-bit integer ({exc})"
        elif isinstance(exc, ValueError) and "integer string conversion" in str(exc):
            reason = f"an integer in its data is too large to write as JSON ({exc})"
        elif isinstance(exc, ValueError) and "NUL" in str(exc):
            reason = str(exc)
        elif sqlstate == _FENCED:
            self.stats.fenced += 1
            diag = exc.diag.message_primary if isinstance(exc, psycopg.Error) else None
            reason = f"another runtime took the session over (fenced: {diag})"
            self._held.pop(sid, None)
        elif sqlstate == _UNKNOWN_SESSION:
            reason = "the session was never created"
        elif isinstance(exc, psycopg.Error):
            reason = self._scrub(str(exc).strip())
        else:
            reason = f"{prefix}{exc}"
        message = (
            f"session {sid!r}: event seq {seq} ({type_}) could not be stored in {self._where}:"
            f" {reason}; no later event of the session is stored"
        )
        self._failed[sid] = _Failure(seq, _readable(message), exc)

    # -- leases --------------------------------------------------------------------------------

    def _renew_safely(self) -> None:
        # A failed renewal is retried next period; the lease outlives a few missed ones.
        with contextlib.suppress(psycopg.Error, PersistenceError):
            self._renew_now()

    def _renew_now(self) -> builtins.list[str]:
        self._next_renewal = time.monotonic() + self._renew_every
        held = list(self._held.items())
        if not held:
            return []
        self.stats.renewals += 1
        kept = {
            sid
            for (sid,) in self._db.execute(
                "UPDATE agentloop_leases l"
                " SET expires_at = clock_timestamp() + make_interval(secs => %s)"
                " FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS h(id, owner, epoch)"
                " WHERE l.session_id = h.id AND l.owner = h.owner AND l.epoch = h.epoch"
                " RETURNING l.session_id",
                (
                    self._lease_seconds,
                    [sid for sid, _ in held],
                    [o for _, (o, _) in held],
                    [e for _, (_, e) in held],
                ),
            ).fetchall()
        }
        lost = []
        for sid, (_, epoch) in held:
            if sid in kept:
                continue
            lost.append(sid)
            self.stats.leases_lost += 1
            del self._held[sid]
            if sid not in self._failed:
                seq = self._written.get(sid, 0) + 1
                self._failed[sid] = _Failure(
                    seq,
                    f"session {sid!r}: events from seq {seq} on cannot be stored in {self._where}:"
                    f" the lease (epoch {epoch}) was taken over by another runtime",
                    None,
                )
        return lost

    def _do_acquire(self, session_id: str, owner: str) -> int:
        try:
            return self._try_acquire(session_id, owner)
        except _RowRaceError:
            # Another runtime created the lease row meanwhile: judge its lease as any other.
            return self._try_acquire(session_id, owner)

    def _try_acquire(self, session_id: str, owner: str) -> int:
        conn = self._db
        ttl = self._lease_seconds
        with conn.transaction():
            row = conn.execute(
                "SELECT epoch, owner, host, pid, started,"
                " expires_at > clock_timestamp(),"
                " extract(epoch FROM expires_at - clock_timestamp())"
                " FROM agentloop_leases WHERE session_id = %s FOR UPDATE",
                (session_id,),
            ).fetchone()
            if row is None:
                inserted = conn.execute(
                    "INSERT INTO agentloop_leases"
                    " (session_id, epoch, owner, host, pid, started, acquired_at, expires_at)"
                    " VALUES (%s, 1, %s, %s, %s, %s, clock_timestamp(),"
                    " clock_timestamp() + make_interval(secs => %s))"
                    " ON CONFLICT (session_id) DO NOTHING RETURNING epoch",
                    (session_id, owner, self._host, self._pid, self._started, ttl),
                ).fetchone()
                if inserted is None:
                    raise _RowRaceError
                epoch = int(inserted[0])
            else:
                epoch, holder, host, pid, started, live, left = row
                mine = self._held.get(session_id)
                # A session this store reserved for a serving runtime (pick) is handed over.
                reserved = mine == (holder, epoch) and holder == self._reserver
                if holder is not None and mine == (holder, epoch) and holder == owner:
                    conn.execute(
                        "UPDATE agentloop_leases"
                        " SET expires_at = clock_timestamp() + make_interval(secs => %s)"
                        " WHERE session_id = %s",
                        (ttl, session_id),
                    )
                    return int(epoch)
                if (holder is not None and live and not reserved
                        and self._holder_alive(pid, host, started)):
                    raise SessionLeased(
                        f"session {session_id!r} is already driven by {holder!r}"
                        f" (pid {pid} on {host}); its lease expires in"
                        f" {max(0.0, float(left)):.1f} s unless renewed"
                    )
                (epoch,) = cast(
                    "tuple[int]",
                    conn.execute(
                        "UPDATE agentloop_leases SET epoch = epoch + 1, owner = %s, host = %s,"
                        " pid = %s, started = %s, acquired_at = clock_timestamp(),"
                        " expires_at = clock_timestamp() + make_interval(secs => %s)"
                        " WHERE session_id = %s RETURNING epoch",
                        (owner, self._host, self._pid, self._started, ttl, session_id),
                    ).fetchone(),
                )
        if not self._held:
            self._next_renewal = time.monotonic() + self._renew_every
        self._held[session_id] = (owner, int(epoch))
        # A fresh epoch: whatever broke the session under an earlier lease is behind it.
        self._failed.pop(session_id, None)
        return int(epoch)

    def _holder_alive(self, pid: object, host: object, started: object) -> bool:
        """Whether a live lease's holder may still be running (only this host can be probed)."""
        if host != self._host:
            return True
        if not isinstance(pid, int) or pid <= 0:
            return False
        if pid == self._pid and (started is None or started == self._started):
            return True  # this process: another store or owner in it holds the lease
        if sys.platform == "win32":
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        identity = _process_identity(pid)
        if identity is None:
            return True
        state, start = identity
        if state in ("Z", "X"):
            return False
        return started is None or started == start

    def _do_release(self, session_id: str, owner: str) -> bool:
        mine = self._held.get(session_id)
        if mine is None or mine[0] != owner:
            return False
        self._release_rows([(session_id, mine)])
        del self._held[session_id]
        # Its driver is gone; whoever resumes it continues from the stored log.
        self._failed.pop(session_id, None)
        return True

    # -- serving -------------------------------------------------------------------------------

    def _do_pick(self, limit: int, only: builtins.list[str] | None) -> builtins.list[str]:
        ttl = self._lease_seconds
        conn = self._db
        # A session created without a lease (epoch 0, never driven) gets its free lease row,
        # which is what the database locks to hand it to one runtime.
        conn.execute(
            "INSERT INTO agentloop_leases (session_id, epoch)"
            " SELECT DISTINCT i.session_id, 0 FROM agentloop_inbox i"
            " WHERE i.discarded_at IS NULL AND i.delivered_at IS NULL"
            " AND (%s::text[] IS NULL OR i.session_id = ANY(%s::text[]))"
            " AND NOT EXISTS (SELECT 1 FROM agentloop_leases l WHERE l.session_id = i.session_id)"
            " ON CONFLICT (session_id) DO NOTHING",
            (only, only),
        )
        rows = conn.execute(
            "UPDATE agentloop_leases l SET epoch = l.epoch + 1, owner = %s, host = %s,"
            " pid = %s, started = %s, acquired_at = clock_timestamp(),"
            " expires_at = clock_timestamp() + make_interval(secs => %s)"
            " WHERE l.session_id IN (SELECT c.session_id FROM agentloop_leases c"
            " WHERE (c.owner IS NULL OR c.expires_at <= clock_timestamp())"
            " AND c.session_id IN (SELECT i.session_id FROM agentloop_inbox i"
            " WHERE i.discarded_at IS NULL AND i.delivered_at IS NULL"
            " AND (%s::text[] IS NULL OR i.session_id = ANY(%s::text[])))"
            " LIMIT %s FOR UPDATE SKIP LOCKED)"
            " RETURNING l.session_id, l.epoch",
            (self._reserver, self._host, self._pid, self._started, ttl, only, only, limit),
        ).fetchall()
        if rows and not self._held:
            self._next_renewal = time.monotonic() + self._renew_every
        for sid, epoch in rows:
            # Renewed with the others until the runtime takes it over or gives it back.
            self._held[sid] = (self._reserver, int(epoch))
        return [sid for sid, _ in rows]

    def _do_mark_delivered(self, session_id: str) -> int:
        conn = self._db
        conn.execute(
            "UPDATE agentloop_inbox i SET delivered_at = clock_timestamp()"
            " WHERE i.session_id = %s AND i.discarded_at IS NULL AND i.delivered_at IS NULL"
            " AND EXISTS (SELECT 1 FROM agentloop_events e WHERE e.session_id = i.session_id"
            " AND e.type IN ('user/message', 'steering/message')"
            " AND e.data -> 'source' ->> 'inbox' = i.id)",
            (session_id,),
        )
        mine = self._held.get(session_id)
        if mine is None:
            return 0  # not this store's to claim any more
        row = conn.execute(
            "SELECT count(*) FROM agentloop_inbox WHERE session_id = %s"
            " AND discarded_at IS NULL AND delivered_at IS NULL"
            " AND (claimed_epoch IS NULL OR claimed_epoch < %s)",
            (session_id, mine[1]),
        ).fetchone()
        return int(row[0]) if row is not None else 0

    # -- routing -------------------------------------------------------------------------------

    def _do_send(
        self, session_id: str, mid: str, content: str, source: str | None, target: str,
        wakeup: bool,
    ) -> None:
        conn = self._db
        with conn.transaction():
            if conn.execute(
                "SELECT 1 FROM agentloop_sessions WHERE id = %s", (session_id,)
            ).fetchone() is None:
                raise SessionNotFound(f"no session {session_id!r} in {self._where}")
            conn.execute(
                "INSERT INTO agentloop_inbox (id, session_id, content, source, target, wakeup)"
                " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                (mid, session_id, content, source, target, wakeup),
            )
            # Delivered at commit, to every runtime listening.
            conn.execute("SELECT pg_notify(%s, %s)", (INBOX_CHANNEL, session_id))

    def _do_claim(self, session_id: str, delivered: frozenset[str]) -> builtins.list[Routed]:
        mine = self._held.get(session_id)
        if mine is None or session_id in self._failed:
            return []
        owner, epoch = mine
        self._claimed[session_id] = mine
        # One statement: the lease row is share-locked only while it runs, so no takeover
        # commits between the check and the claim, and a paused client holds no lock.
        rows = self._db.execute(
            "WITH lease AS (SELECT 1 FROM agentloop_leases WHERE session_id = %s"
            " AND owner = %s AND epoch = %s FOR SHARE)"
            " UPDATE agentloop_inbox SET claimed_by = %s, claimed_epoch = %s,"
            " claimed_at = clock_timestamp()"
            " WHERE id IN (SELECT id FROM agentloop_inbox WHERE session_id = %s"
            # Delivered rows are in the stored log, which every new driver loads.
            " AND discarded_at IS NULL AND delivered_at IS NULL"
            " AND (claimed_epoch IS NULL OR claimed_epoch < %s) FOR UPDATE SKIP LOCKED)"
            " AND EXISTS (SELECT 1 FROM lease)"
            " RETURNING n, id, content::text, source::text, target, wakeup",
            (session_id, owner, epoch, owner, epoch, session_id, epoch),
        ).fetchall()
        out = []
        for _, mid, content, source, target, wakeup in sorted(rows):
            if mid in delivered:
                continue
            where = f"routed message {mid!r} of session {session_id!r}"
            out.append(Routed(
                id=mid,
                content=_decode_any(content, where),
                source=None if source is None else _decode_any(source, where),
                target=target,
                wakeup=wakeup,
            ))
        return out

    def _do_discard(self, session_id: str, message_ids: builtins.list[str]) -> None:
        # Fenced by the claim, not the lease: a discard made just before the lease was
        # released still counts, and one a newer driver's claim overtook changes nothing.
        mine = self._claimed.get(session_id)
        if mine is None or not message_ids:
            return
        owner, epoch = mine
        self._db.execute(
            "UPDATE agentloop_inbox SET discarded_at = clock_timestamp()"
            " WHERE session_id = %s AND id = ANY(%s) AND claimed_by = %s"
            " AND claimed_epoch = %s",
            (session_id, message_ids, owner, epoch),
        )

    # -- reading -------------------------------------------------------------------------------

    def _do_exists(self, session_id: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM agentloop_sessions WHERE id = %s", (session_id,)
        ).fetchone()
        return row is not None

    def _do_list(self) -> builtins.list[SessionInfo]:
        rows = self._db.execute(
            "SELECT id, turns, events, created_at, updated_at, cwd,"
            # Any meta is accepted: only a string names a parent.
            " CASE WHEN json_typeof(meta -> 'parent_session_id') = 'string'"
            " THEN meta ->> 'parent_session_id' END"
            " FROM agentloop_sessions ORDER BY updated_at DESC, n DESC"
        ).fetchall()
        return [
            SessionInfo(
                id=sid, turns=turns, events=events, created_at=created, updated_at=updated, cwd=cwd,
                parent_session_id=parent,
            )
            for sid, turns, events, created, updated, cwd, parent in rows
        ]

    def _do_create(self, session_id: str, meta_json: str, cwd: str | None) -> None:
        now = time.time()
        try:
            self._db.execute(
                "INSERT INTO agentloop_sessions (id, meta, created_at, updated_at, cwd)"
                " VALUES (%s, %s, %s, %s, %s)",
                (session_id, meta_json, now, now, cwd),
            )
        except psycopg.errors.UniqueViolation as exc:
            raise PersistenceError(
                f"session {session_id!r} already exists in {self._where}"
            ) from exc

    def _do_load(self, session_id: str) -> StoredSession:
        conn = self._db
        # One snapshot: the metadata and the log agree even while another runtime appends.
        with self._snapshot(conn):
            found = conn.execute(
                "SELECT meta::text FROM agentloop_sessions WHERE id = %s", (session_id,)
            ).fetchone()
            if found is None:
                raise SessionNotFound(f"no session {session_id!r} in {self._where}")
            rows = conn.execute(
                "SELECT seq, type, turn, data::text FROM agentloop_events"
                " WHERE session_id = %s ORDER BY seq",
                (session_id,),
            ).fetchall()
        meta = self._decode(found[0], f"the metadata of session {session_id!r}")
        return StoredSession(id=session_id, meta=meta, events=self._events(session_id, rows, 1))

    def _do_read_events(
        self, session_id: str, from_seq: int, limit: int
    ) -> builtins.list[SessionEvent]:
        first = max(from_seq, 1)
        rows = self._db.execute(
            "SELECT seq, type, turn, data::text FROM agentloop_events"
            " WHERE session_id = %s AND seq >= %s ORDER BY seq LIMIT %s",
            (session_id, first, limit),
        ).fetchall()
        return builtins.list(self._events(session_id, rows, first))

    def _events(
        self, session_id: str, rows: builtins.list[Any], first: int
    ) -> tuple[SessionEvent, ...]:
        """Stored rows as events, checked: seqs from ``first`` with no gap, each well formed."""
        events = []
        for expected, (seq, type_, turn, data) in enumerate(rows, start=first):
            if seq != expected:
                raise PersistenceError(
                    f"session {session_id!r}, event seq {expected} is missing in {self._where}:"
                    f" the stored log goes from seq {expected - 1} to seq {seq!r}"
                )
            where = f"session {session_id!r}, event seq {seq}"
            value = self._decode(data, where)
            problem = _shape_problem(type_, value)
            if problem is not None:
                raise PersistenceError(
                    _readable(f"{where} ({type_}) in {self._where} is malformed: it {problem}")
                )
            events.append(SessionEvent(seq, type_, turn, value))
        return tuple(events)

    @contextlib.contextmanager
    def _snapshot(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            yield
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.execute("COMMIT")

    def _decode(self, data: str, where: str) -> FrozenDict:
        try:
            value = _DECODER.decode(data)
        except (TypeError, ValueError, RecursionError) as exc:
            raise PersistenceError(f"{where} in {self._where} does not decode: {exc}") from exc
        if not isinstance(value, FrozenDict):
            raise PersistenceError(f"{where} in {self._where} is not a JSON object")
        return value


def _empty_prompt(content: str | builtins.list[Any] | tuple[Any, ...]) -> str | None:
    """Why ``content`` is a prompt with nothing in it, as ``agent.send`` says it."""
    if isinstance(content, str):
        return None if content.strip() else f"content: the prompt is empty ({content!r})"
    if not content:
        return "content: the prompt is an empty list of parts"
    for i, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
            if isinstance(text, str) and not text.strip():
                return f"content[{i}].text: the text part is empty ({text!r})"
    return None
