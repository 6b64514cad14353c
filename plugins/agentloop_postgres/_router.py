"""Routing input to the runtime that drives a session, through LISTEN/NOTIFY.

Senders insert a row in ``agentloop_inbox`` and notify (:meth:`PostgresSessionStore.send`).
Every runtime listens on its own connection; the one holding the session's lease claims the
rows at its epoch and hands each to its agent with ``source = {"inbox": id, ...}``, which is
how a later driver knows (from the log) what already arrived. A periodic sweep covers
notifications missed while the listening connection was down.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from typing import Any

import psycopg
import trio

from agentloop import Context, FrozenDict
from agentloop.events import AgentSessionStart

from ._store import INBOX_CHANNEL, PostgresSessionStore

__all__ = ["route_inbox", "delivered_ids"]

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


def _listen(
    store: PostgresSessionStore, token: trio.lowlevel.TrioToken,
    push: Any, stop: threading.Event,
) -> None:
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


async def _deliver(ctx: Context, store: PostgresSessionStore, session_id: str) -> None:
    agent = ctx.agents.get(session_id)
    if agent is None or agent.status == "disposed" or store.epoch(session_id) is None:
        return
    routed = await store.claim(session_id, delivered_ids(agent.session.events))
    for message in routed:
        try:
            agent.send(
                message.content,
                source=FrozenDict(inbox=message.id, sender=message.source),
                target=message.target,  # type: ignore[arg-type]
                wakeup=message.wakeup,
            )
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop routing
            log.warning("session %s: routed message %s was not delivered: %r",
                        session_id, message.id, exc)


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
    stop = threading.Event()
    listener = threading.Thread(
        target=_listen, args=(store, trio.lowlevel.current_trio_token(), push, stop),
        name="agentloop-postgres-listen", daemon=True,
    )
    listener.start()
    try:
        task_status.started()
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
    finally:
        stop.set()
        undo()
