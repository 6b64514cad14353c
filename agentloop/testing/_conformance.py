"""``check_persistence_backend``: what every ``SessionPersistence`` backend must do."""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from .._errors import PersistenceError, SessionNotFound
from .._json import FrozenDict, freeze
from .._model import SessionEvent
from .._persistence import SessionPersistence

__all__ = ["check_persistence_backend"]

Factory = Callable[[Path], Any]
Corrupt = Callable[[Path, str], "Awaitable[None] | None"]


def _event(seq: int, type_: str, turn: int | None, /, **data: Any) -> SessionEvent:
    frozen = freeze(data)
    assert isinstance(frozen, FrozenDict)
    return SessionEvent(seq, type_, turn, frozen)


def _turn(first_seq: int, turn: int, text: str) -> list[SessionEvent]:
    """One realistic turn's events, from ``first_seq``."""
    s = first_seq
    return [
        _event(s, "turn/start", turn, turn=turn),
        _event(s + 1, "user/message", turn, message_id=f"m{turn}", content=text, source=None),
        _event(s + 2, "assistant/chunk", turn, step=1, kind="text", delta="é ✓ "),
        _event(s + 3, "assistant/message", turn, step=1, content="é ✓ ", tool_calls=[],
               source_event_seqs=[s + 2], finish_reason="stop", usage=None,
               interrupted=False),
        _event(s + 4, "turn/end", turn, turn=turn, reason="completed"),
    ]


def _log(turns: int, tag: str = "") -> list[SessionEvent]:
    out: list[SessionEvent] = []
    for t in range(1, turns + 1):
        out.extend(_turn(len(out) + 1, t, f"{tag} prompt {t}"))
    return out


@contextlib.asynccontextmanager
async def _opened(factory: Factory, path: Path) -> AsyncIterator[SessionPersistence]:
    backend = factory(path)
    if inspect.isawaitable(backend):
        backend = await backend
    if hasattr(backend, "__aenter__"):
        async with backend as entered:
            yield entered if entered is not None else backend
        return
    try:
        yield backend
    finally:
        close = getattr(backend, "aclose", None)
        if close is not None:
            with trio.move_on_after(30, shield=True):
                await close()


def _fail(what: str, expected: str, found: object) -> AssertionError:
    return AssertionError(f"persistence conformance: {what}: expected {expected}, got {found!r}")


async def _expect_persistence_error(what: str, awaitable: Awaitable[object]) -> None:
    try:
        await awaitable
    except PersistenceError:
        return
    except Exception as exc:
        raise _fail(what, "PersistenceError", exc) from exc
    raise _fail(what, "PersistenceError", "no error")


def _same(what: str, loaded: object, expected: list[SessionEvent]) -> None:
    got = list(loaded)  # type: ignore[call-overload]
    if got == expected:
        return
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            raise _fail(f"{what}, event #{i + 1}", repr(b), a)
    raise _fail(what, f"{len(expected)} events", f"{len(got)} events")


async def check_persistence_backend(
    factory: Factory,
    *,
    directory: str | os.PathLike[str] | None = None,
    corrupt: Corrupt | None = None,
    file_based: bool = True,
) -> None:
    """Check a ``SessionPersistence`` backend; raise ``AssertionError`` saying what is wrong.

    ``factory(path)`` returns a fresh, unopened backend storing at ``path`` (an async
    context manager is entered; otherwise ``aclose()`` is awaited if it has one); it is
    called several times with the same path, and two backends on one path may be open at
    once. ``directory`` is where paths are made (a new temporary directory by default).

    Checked: unknown sessions (``exists`` false, ``load`` raises ``SessionNotFound``); a
    duplicate ``create`` is a ``PersistenceError``; events load in seq order with their data
    and the metadata intact, also after the backend is closed and reopened once ``flush``
    returned (the durability barrier); ``flush`` with nothing pending returns; a lease held
    by one owner is refused to a second owner (on the same backend and on another one on the
    same path) with ``PersistenceError``, stays held when anyone else releases it, and is free
    once its holder releases it; ``exists`` is false for a session never created even once
    others are stored; events that cannot be
    stored (a session never created, a repeated seq) make ``flush`` of that session raise
    ``PersistenceError`` while other sessions keep working; with ``file_based`` a file at
    ``path`` that is not a store is refused with ``PersistenceError``; with ``corrupt``
    (``corrupt(path, session_id)``, sync or async, damages that session's stored events the
    backend's own way) ``load`` refuses the damage with ``PersistenceError``; and several
    sessions written concurrently each load exactly as written, and ``list`` names them all.
    """
    base = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="alp-"))
    path = base / "store"
    meta = FrozenDict(cwd="/work/project", label="conformance", nested=FrozenDict(a=(1, 2)))
    log = _log(3, "first")
    async with _opened(factory, path) as store:
        await _check_create(store, meta)
        await _check_round_trip(store, meta, log)
        await _check_leases(store, factory, path, log)
        log += await _check_refused_events(store, len(log))
    async with _opened(factory, path) as reopened:
        _same("the log after closing and reopening the backend",
              (await reopened.load("s1")).events, log)
        await _check_concurrent_sessions(reopened)
    if corrupt is not None:
        await _check_damage_refused(factory, path, corrupt)
    if file_based:
        await _check_not_a_store(factory, base)


async def _check_create(store: SessionPersistence, meta: FrozenDict) -> None:
    """An unknown session does not exist and does not load; a second create is refused."""
    if await store.exists("s1"):
        raise _fail("exists() of a session never created", "False", True)
    try:
        await store.load("s1")
    except SessionNotFound:
        pass
    else:
        raise _fail("load() of a session never created", "SessionNotFound", "a session")
    await store.create("s1", meta)
    if not await store.exists("s1"):
        raise _fail("exists() after create()", "True", False)
    if await store.exists("s0"):
        raise _fail("exists() of a session never created, once another is stored",
                    "False", True)
    await _expect_persistence_error("a second create() of the same id",
                                    store.create("s1", meta))


async def _check_round_trip(
    store: SessionPersistence, meta: FrozenDict, log: list[SessionEvent]
) -> None:
    """Flushed events and the metadata load back as written; an idle flush returns."""
    for e in log:
        store.append("s1", e)
    await store.flush("s1", log[-1].seq)
    await store.flush("s1", log[-1].seq)  # nothing pending: must simply return
    loaded = await store.load("s1")
    if loaded.meta != meta:
        raise _fail("the metadata loaded back", repr(meta), loaded.meta)
    _same("the log loaded back after flush", loaded.events, log)


async def _check_leases(
    store: SessionPersistence, factory: Factory, path: Path, log: list[SessionEvent]
) -> None:
    """A held lease is refused to a second owner, here and through another backend on the
    same path (which reads the same log); once released, another owner takes it."""
    await store.acquire("s1", "owner-a")
    await _expect_persistence_error("acquire() by a second owner on the same backend",
                                    store.acquire("s1", "owner-b"))
    async with _opened(factory, path) as other:
        await _expect_persistence_error(
            "acquire() by a second owner through another backend on the same path",
            other.acquire("s1", "owner-b"),
        )
        _same("the log read through another backend on the same path",
              (await other.load("s1")).events, log)
    await store.release("s1", "owner-b")  # not the holder's: must free nothing
    await _expect_persistence_error("acquire() after a release by someone who never held "
                                    "the lease", store.acquire("s1", "owner-c"))
    await store.release("s1", "owner-a")
    await store.acquire("s1", "owner-b")
    await store.release("s1", "owner-b")


async def _check_refused_events(store: SessionPersistence, stored: int) -> list[SessionEvent]:
    """Events that cannot be stored fail their session's flush, and only that session's:
    one more turn of ``s1`` (which holds ``stored`` events) is flushed after them and
    returned."""
    store.append("ghost", _event(1, "turn/start", 1, turn=1))
    await _expect_persistence_error("flush() of events of a session never created",
                                    store.flush("ghost", 1))
    await store.create("s2", FrozenDict())
    store.append("s2", _event(1, "turn/start", 1, turn=1))
    store.append("s2", _event(1, "turn/start", 1, turn=1))
    await _expect_persistence_error("flush() after a repeated seq", store.flush("s2", 1))
    more = _turn(stored + 1, 4, "after the broken sessions")
    for e in more:
        store.append("s1", e)
    await store.flush("s1", more[-1].seq)
    return more


async def _check_concurrent_sessions(store: SessionPersistence) -> None:
    """Sessions written concurrently each load as written, and ``list`` names them all."""

    async def write(sid: str, n: int) -> None:
        await store.create(sid, FrozenDict(n=n))
        events = _log(n, sid)
        for e in events:
            store.append(sid, e)
            if e.seq % 3 == 0:
                await trio.lowlevel.checkpoint()
        await store.flush(sid, events[-1].seq)

    sids = [f"c{i}" for i in range(6)]
    async with trio.open_nursery() as nursery:
        for i, sid in enumerate(sids):
            nursery.start_soon(write, sid, i + 2)
    for i, sid in enumerate(sids):
        _same(f"session {sid} written concurrently with others",
              (await store.load(sid)).events, _log(i + 2, sid))
    listed = {info.id for info in await store.list()}
    missing = {"s1", *sids} - listed
    if missing:
        raise _fail("list()", f"every stored session, including {sorted(missing)}",
                    sorted(listed))


async def _check_damage_refused(factory: Factory, path: Path, corrupt: Corrupt) -> None:
    done = corrupt(path, "s1")
    if inspect.isawaitable(done):
        await done
    async with _opened(factory, path) as damaged:
        await _expect_persistence_error("load() of a session whose stored data is damaged",
                                        damaged.load("s1"))


async def _check_not_a_store(factory: Factory, base: Path) -> None:
    garbage = base / "not-a-store"
    garbage.write_bytes(b"this is not a session store\n" * 64)

    async def open_garbage() -> None:
        async with _opened(factory, garbage) as store:
            await store.list()

    await _expect_persistence_error("opening a file that is not a store", open_garbage())
