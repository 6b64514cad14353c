"""``agentloop sessions tail ID``: a session's events from a seq, then (``--follow``) live."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TextIO

import trio

import agentloop

from ._cli import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    _json_text,
    _one_line,
    _open_store,
    _store_path,
)

__all__ = ["sessions_tail"]


def _line(event: agentloop.SessionEvent, as_json: bool) -> str:
    if as_json:
        return _json_text(
            {"seq": event.seq, "type": event.type, "turn": event.turn, "data": event.data}
        )
    turn = "" if event.turn is None else f"turn {event.turn}"
    return f"{event.seq:>6}  {event.type:<26} {turn:<9} {_one_line(_json_text(event.data), 300)}"


def _providing(store: Any) -> Callable[..., Coroutine[Any, Any, None]]:
    async def provide(
        ctx: agentloop.Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        ctx.provide_persistence(store)
        task_status.started()
        await trio.sleep_forever()

    return provide


async def sessions_tail(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print the stored events with ``seq >= --from-seq``; with ``--follow``, then every new
    one as it is written (PostgreSQL: by any runtime; SQLite: by this process only, so a
    SQLite tail ends its backlog and waits)."""
    async with _open_store(_store_path(args), must_exist=args.id) as store:
        if not args.follow:
            try:
                stored = await store.load(args.id)
            except agentloop.SessionNotFound:
                raise CliError(f"no session {args.id!r} in {store.path}", EXIT_USAGE) from None
            for event in stored.events[max(args.from_seq, 1) - 1:]:
                out.write(_line(event, args.json) + "\n")
            return EXIT_OK
        async with agentloop.open_runtime(plugins=[_providing(store)]) as rt, \
                trio.open_nursery() as nursery:
            # Ctrl-C is taken as a signal and becomes a cancel of the follow, so the runtime
            # closes as it always does: a KeyboardInterrupt raised wherever the signal finds
            # the process could stop one of the runtime's tasks halfway, and its close wait.
            interrupted = trio.Event()
            if threading.current_thread() is threading.main_thread():
                await nursery.start(_stop_on_interrupt, nursery.cancel_scope, interrupted)
            try:
                async with rt.sessions.tail(args.id, from_seq=args.from_seq) as tail:
                    async for event in tail:
                        out.write(_line(event, args.json) + "\n")
                        out.flush()
            except agentloop.SessionNotFound:
                raise CliError(f"no session {args.id!r} in {store.path}", EXIT_USAGE) from None
            finally:
                nursery.cancel_scope.cancel()
        return EXIT_INTERRUPTED if interrupted.is_set() else EXIT_OK


async def _stop_on_interrupt(
    scope: trio.CancelScope, interrupted: trio.Event,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        task_status.started()  # before the first event is printed
        async for _ in signals:
            interrupted.set()
            scope.cancel()
            return
