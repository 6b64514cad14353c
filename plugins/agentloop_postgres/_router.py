"""Routing input to the runtime that drives a session, through LISTEN/NOTIFY.

Senders insert a row in ``agentloop_inbox`` and notify (:meth:`PostgresSessionStore.send`).
Every runtime listens on its own connection; the one holding the session's lease claims the
rows at its epoch and hands each to its agent with ``source = {"inbox": id, ...}``, which is
how a later driver knows (from the log) what already arrived. A message the driver discards
(``cancel()``, ``remove``) or cannot accept is marked done in the table, so no later driver
delivers it again. A periodic sweep covers notifications missed while the listening
connection was down.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from typing import Any

import psycopg
import trio

from agentloop import Context, FrozenDict, InvalidContent
from agentloop.events import AgentSessionStart, InboxDiscarded

from ._store import INBOX_CHANNEL, PostgresSessionStore

__all__ = ["route_inbox", "delivered_ids", "listen"]

log = logging.getLogger("agentloop.postgres")

_INPUT_TYPES = frozenset({"user/message", "steering/message"})


def delivered_ids(events: Any) -> set[str]:
    """The routed message ids a session log already holds."""
    found = set()
    for e in events:
        if e.type in _INPUT_TYPES:
            source = e.data.get("source")
            if isinstance(source, FrozenDict) and isinstance(source.get("inbox"), str):
                found.add(source["inbox"])
    return found


def listen(
    store: PostgresSessionStore, token: trio.lowlevel.TrioToken,
    push: Any, stop: threading.Event,
) -> None:
    """On a thread: hand each session id notified on the inbox channel to ``push`` on the
    trio thread, reconnecting after a failure, until ``stop`` is set."""
    while not stop.is_set():
        try:
            with psycopg.connect(store.dsn, autocommit=True, connect_timeout=10) as conn:
                conn.execute(f"LISTEN {INBOX_CHANNEL}")
                while not stop.is_set():
                    for note in conn.notifies(timeout=0.25):
                        with contextlib.suppress(trio.RunFinishedError):
                            token.run_sync_soon(push, note.payload)
        except psycopg.Error as exc:
            # The sweep delivers what arrives meanwhile; the DSN is never logged.
            log.warning("listening for routed input on %s failed (%s); retrying",
                        store.path, type(exc).__name__)
            stop.wait(1.0)


def routed_id(source: object) -> str | None:
    """The routed message id an inbox message's ``source`` carries, or None."""
    if isinstance(source, FrozenDict):
        found = source.get("inbox")
        if isinstance(found, str):
            return found
    return None


async def _deliver(ctx: Context, store: PostgresSessionStore, session_id: str) -> None:
    agent = ctx.agents.get(session_id)
    if agent is None or agent.status == "disposed" or store.epoch(session_id) is None:
        return
    routed = await store.claim(session_id, delivered_ids(agent.session.events))
    refused: list[str] = []
    for message in routed:
        try:
            agent.send(
                message.content,
                source=FrozenDict(inbox=message.id, sender=message.source),
                target=message.target,  # type: ignore[arg-type]
                wakeup=message.wakeup,
            )
        except InvalidContent as exc:
            # Sent before sends were checked as the inbox checks them: it can never be
            # delivered, so it is done rather than refused again by every later driver.
            refused.append(message.id)
            log.warning("session %s: routed message %s cannot be delivered: %s",
                        session_id, message.id, exc)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop routing
            log.warning("session %s: routed message %s was not delivered: %r",
                        session_id, message.id, exc)
    if refused:
        await store.discard(session_id, refused)


async def _mark_discarded(
    store: PostgresSessionStore, discarded: trio.MemoryReceiveChannel[tuple[str, str]]
) -> None:
    async for session_id, message_id in discarded:
        batch = [message_id]
        while discarded.statistics().current_buffer_used:
            sid, mid = discarded.receive_nowait()
            if sid == session_id:
                batch.append(mid)
            else:
                await _discard_safely(store, sid, [mid])
        await _discard_safely(store, session_id, batch)


async def _discard_safely(store: PostgresSessionStore, session_id: str, ids: list[str]) -> None:
    try:
        await store.discard(session_id, ids)
    except Exception as exc:  # noqa: BLE001 - routing outlives one failure
        log.warning("session %s: marking discarded routed input failed: %r", session_id, exc)


async def route_inbox(
    ctx: Context, store: PostgresSessionStore, *, sweep_every: float = 5.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Deliver routed input to the agents of this runtime, until cancelled."""
    send, receive = trio.open_memory_channel[str](math.inf)

    def push(session_id: str) -> None:
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            send.send_nowait(session_id)

    undo = ctx.events.on(AgentSessionStart, lambda e: push(e.agent_id))
    done_tx, done_rx = trio.open_memory_channel[tuple[str, str]](math.inf)

    def discarded(e: InboxDiscarded) -> None:
        # A disposal's discards are not the driver's decision: the next driver gets them.
        message_id = routed_id(e.message.source)
        if e.outcome != "disposed" and message_id is not None:
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                done_tx.send_nowait((e.agent_id, message_id))

    undo_discarded = ctx.events.on(InboxDiscarded, discarded)
    stop = threading.Event()
    listener = threading.Thread(
        target=listen, args=(store, trio.lowlevel.current_trio_token(), push, stop),
        name="agentloop-postgres-listen", daemon=True,
    )
    listener.start()
    try:
        async with trio.open_nursery() as nursery, done_tx:
            nursery.start_soon(_mark_discarded, store, done_rx)
            task_status.started()
            await _route(ctx, store, send, receive, sweep_every)
    finally:
        stop.set()
        undo()
        undo_discarded()
        # Discards made as the runtime stopped (a last cancel()) are still the driver's word.
        with trio.CancelScope(shield=True):
            while True:
                try:
                    sid, mid = done_rx.receive_nowait()
                except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                    break
                await _discard_safely(store, sid, [mid])


async def _route(
    ctx: Context, store: PostgresSessionStore, send: trio.MemorySendChannel[str],
    receive: trio.MemoryReceiveChannel[str], sweep_every: float,
) -> None:
    async with send, receive:
        while True:
            pending: set[str] = set()
            with trio.move_on_after(sweep_every) as waited:
                pending.add(await receive.receive())
            if waited.cancelled_caught:
                pending.update(store.held())
            while receive.statistics().current_buffer_used:
                pending.add(receive.receive_nowait())
            for session_id in sorted(pending):
                try:
                    await _deliver(ctx, store, session_id)
                except Exception as exc:  # noqa: BLE001 - routing outlives one failure
                    log.warning("session %s: claiming routed input failed: %r",
                                session_id, exc)
