"""The serving runtime's loop: wake, pick, resume, drive, let go.

Waking: every runtime listens on the store's inbox channel (``LISTEN``); a ``send`` to a
session commits its row and ``NOTIFY``s the session id. Picking: :meth:`PostgresSessionStore.pick`
reserves, in one statement with ``FOR UPDATE SKIP LOCKED``, the sessions among those notified
that have input neither delivered nor discarded and no live driver; the runtimes that lose the
race skip the row. Driving: the reserved session is resumed (``ctx.agents.resume``: crash
recovery first, ``agent-loop.crashed_turn`` honoured), and the store's router then claims and
delivers its routed input in order, exactly once (the log names what already arrived). Letting
go: a session idle for ``idle_seconds`` is flushed, its routed input marked delivered, and its
agent disposed, which releases the lease; :attr:`FleetServer.retire` is the seam where
hibernation can replace disposal.

The one timer that is not an event is the bounded fallback: every ``recheck_seconds`` the
runtime looks for work no notification announced (one sent while its listening connection was
down, the sessions of a driver whose lease expired).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from agentloop import AgentHandle, AgentOptions, Context, PersistenceError
from agentloop.events import AgentStatus

if TYPE_CHECKING:
    from agentloop_postgres import PostgresSessionStore

    from . import FleetConfig

__all__ = ["FleetServer", "RetireIdle", "release_idle"]

log = logging.getLogger("agentloop.fleet")

RetireIdle = Callable[["FleetServer", AgentHandle], Awaitable[bool]]
"""What becomes of a session idle for ``idle_seconds``: returns whether it was let go."""

_SCAN = ""  # a wake-up that asks for a search over every session, not one
# Sessions being resumed, or let go, at once. The store serves one request at a time on its
# connection, lease renewals included: a thousand resumes queued at once would delay the
# renewals past the lease, and the sessions would be taken over while they start. Work
# beyond this is left to the other runtimes, or picked once a slot frees.
_IN_FLIGHT = 16


async def release_idle(server: FleetServer, handle: AgentHandle) -> bool:
    """Let an idle session go: its log stored, its routed input marked delivered, its agent
    disposed (which releases the lease). Nothing happens if input arrived meanwhile."""
    agent, store = handle.agent, server.store
    try:
        await store.flush(agent.id, agent.session.last_seq)
        if await store.mark_delivered(agent.id):
            # Input this driver has yet to claim: idle only until the router hands it over.
            return False
    except PersistenceError as exc:
        # Lost to a takeover or an outage: the next driver continues from the stored log.
        log.info("session %s: letting go without marking its input: %s", agent.id, exc)
    if agent.status != "idle":
        return False
    # No checkpoint between the check and the disposal request: no input slips in between.
    await handle.aclose()
    return True


class FleetServer:
    """One serving runtime: it drives sessions picked from the shared store."""

    def __init__(
        self, ctx: Context, store: PostgresSessionStore, config: FleetConfig,
        *, retire: RetireIdle = release_idle,
    ) -> None:
        self.ctx, self.store, self.config = ctx, store, config
        # The seam for idle sessions: hibernation may replace disposal here.
        self.retire = retire
        self.driving: dict[str, AgentHandle] = {}
        self._starting = 0
        self._idle_since: dict[str, float] = {}
        self._idle_changed = trio.Event()
        self._starved = False  # a wake-up found no room: scan once room is made
        self._letting_go = trio.CapacityLimiter(_IN_FLIGHT)
        self._next_scan = -math.inf
        send, receive = trio.open_memory_channel[str](math.inf)
        self._wake_tx, self._wake_rx = send, receive
        self._options = (
            AgentOptions(provider=config.provider, model=config.model)
            if config.provider or config.model else None
        )

    def wake(self, session_id: str = _SCAN) -> None:
        """Look for work now: for ``session_id``, or (no argument) in every session."""
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            self._wake_tx.send_nowait(session_id)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        from agentloop_postgres import listen

        undo = self.ctx.events.on(AgentStatus, self._on_status)
        stop = threading.Event()
        listener = threading.Thread(
            target=listen,
            args=(self.store, trio.lowlevel.current_trio_token(), self.wake, stop),
            name="agentloop-fleet-listen", daemon=True,
        )
        listener.start()
        try:
            async with trio.open_nursery() as nursery, self._wake_tx, self._wake_rx:
                nursery.start_soon(self._expire_idle, nursery)
                self.wake()  # work that waited while no runtime served
                task_status.started()
                await self._pick_forever(nursery)
        finally:
            stop.set()
            undo()

    # -- waking and picking ------------------------------------------------------------------

    async def _next_wakeups(self) -> set[str] | None:
        """The sessions to look at, or None for all of them (the fallback re-check)."""
        wanted: set[str] = set()
        # Due every recheck_seconds whatever the traffic: a steady stream of notifications
        # must not postpone the look for sessions whose driver died.
        with trio.move_on_at(self._next_scan) as waited:
            wanted.add(await self._wake_rx.receive())
        while self._wake_rx.statistics().current_buffer_used:
            wanted.add(self._wake_rx.receive_nowait())
        if waited.cancelled_caught or _SCAN in wanted:
            self._next_scan = trio.current_time() + self.config.recheck_seconds
            return None
        return wanted

    async def _pick_forever(self, nursery: trio.Nursery) -> None:
        while True:
            wanted = await self._next_wakeups()
            self._let_go_of_lost(nursery)
            if wanted is not None:
                wanted -= self.driving.keys()
                if not wanted:
                    continue
            room = min(
                self.config.max_sessions - len(self.driving) - self._starting,
                _IN_FLIGHT - self._starting,
            )
            if room <= 0:
                self._starved = True
                continue
            try:
                picked = await self.store.pick(room, wanted)
            except Exception as exc:  # noqa: BLE001 - serving outlives one failure
                log.warning("picking sessions to serve failed: %r", exc)
                continue
            self._starting += len(picked)
            for session_id in picked:
                nursery.start_soon(self._drive, session_id)
            if len(picked) == room:
                self._starved = True  # there may be more: look again when a slot frees

    async def _drive(self, session_id: str) -> None:
        try:
            handle = await self._resume(session_id)
        finally:
            self._starting -= 1
            self._made_room()
        if handle is None:
            return
        self.driving[session_id] = handle
        if handle.agent.status == "idle":
            self._went_idle(session_id)

    async def _resume(self, session_id: str) -> AgentHandle | None:
        stale = self.ctx.agents.get(session_id)
        try:
            if stale is not None:
                # This runtime drove it, was paused past its lease, and lost it; the old
                # agent can write nothing more, so it goes before the session is resumed.
                old = self.driving.pop(session_id, None)
                if old is None:
                    raise PersistenceError(f"session {session_id!r} is driven here already")
                await old.aclose()
            return await self.ctx.agents.resume(
                resume_session_id=session_id, agent_options=self._options
            )
        except Exception as exc:  # noqa: BLE001 - one session must not stop serving
            log.warning("session %s: could not be resumed to serve it: %r", session_id, exc)
            with contextlib.suppress(Exception):
                await self.store.release(session_id, self.store.reserver)
            return None

    def _let_go_of_lost(self, nursery: trio.Nursery) -> None:
        for session_id in self.store.lost():
            handle = self.driving.pop(session_id, None)
            if handle is not None:
                self._idle_since.pop(session_id, None)
                log.info("session %s: its lease was taken over; its agent here stops",
                         session_id)
                nursery.start_soon(self._close_lost, handle)

    async def _close_lost(self, handle: AgentHandle) -> None:
        # Its lease release on the way out finds nothing held, and the store forgets it.
        await handle.aclose()

    # -- idle sessions ---------------------------------------------------------------------------

    def _on_status(self, event: AgentStatus) -> None:
        if event.agent_id not in self.driving:
            return
        if event.status == "idle":
            self._went_idle(event.agent_id)
        else:
            self._idle_since.pop(event.agent_id, None)

    def _went_idle(self, session_id: str) -> None:
        self._idle_since[session_id] = trio.current_time()
        self._idle_changed.set()

    async def _expire_idle(self, nursery: trio.Nursery) -> None:
        idle = self.config.idle_seconds
        while True:
            self._idle_changed = trio.Event()
            deadline = min(self._idle_since.values(), default=math.inf) + idle
            with trio.move_on_at(deadline):
                await self._idle_changed.wait()
            now = trio.current_time()
            for session_id, since in list(self._idle_since.items()):
                if since + idle <= now:
                    del self._idle_since[session_id]
                    nursery.start_soon(self._retire, session_id)

    async def _retire(self, session_id: str) -> None:
        handle = self.driving.get(session_id)
        if handle is None:
            return
        try:
            async with self._letting_go:
                gone = await self.retire(self, handle)
        except Exception as exc:  # noqa: BLE001 - serving outlives one failure
            log.warning("session %s: letting it go failed: %r", session_id, exc)
            gone = handle.agent.status == "disposed"
        if not gone:
            if handle.agent.status == "idle" and self.driving.get(session_id) is handle:
                self._went_idle(session_id)  # still idle: try again after idle_seconds
            return
        if self.driving.get(session_id) is handle:
            del self.driving[session_id]
        # Input that arrived while it was let go waits in the store: look again.
        self.wake(session_id)
        self._made_room()

    def _made_room(self) -> None:
        if self._starved:
            self._starved = False
            self.wake()
