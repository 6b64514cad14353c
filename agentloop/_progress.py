"""Progress from running tools: the delivery of what ``agentloop.report_progress`` reports.

A tool body runs with its call's :class:`Reporter` in a context variable (set by the
scheduler in the tool's own task), so ``report_progress`` needs no handle. Reports become
``tools/progress`` control events; they are never logged and never reach the model.

A tool may report far faster than anyone can read (a loop reporting every item). Each call's
deliveries are paced by a token bucket on trio's clock: a burst of ``BURST`` at once, then
``RATE`` a second. A report over the pace is kept as the call's latest and delivered when the
pace allows it (a timer, not a poll), or when the call ends; one it replaced is dropped. So a
reader always ends up with the latest report, and the reporting tool pays a few microseconds
a report whatever the readers do.
"""

from __future__ import annotations

import contextvars
import math
from typing import Final

import trio

from ._bus import EventBus
from ._events import ToolProgress

__all__ = ["BURST", "RATE", "Reporter", "begin_call", "current_reporter"]

BURST: Final = 10
"""Reports of one call delivered at once before the pace applies."""
RATE: Final = 30.0
"""Reports of one call delivered per second, once a burst is spent."""

# A fresh call's bucket: full, last filled never (one a tool call, so made once here).
_FULL: Final = float(BURST)
_NEVER: Final = -math.inf

_current: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar(
    "agentloop_tool_progress", default=None
)


class Reporter:
    """The progress of one running tool call."""

    __slots__ = (
        "_agent_id", "_at", "_bus", "_call_id", "_pending", "_timer", "_tokens", "closed",
    )

    def __init__(self, bus: EventBus, agent_id: str, call_id: str) -> None:
        self._bus = bus
        self._agent_id = agent_id
        self._call_id = call_id
        self._tokens = _FULL
        self._at = _NEVER
        self._pending: tuple[str, float | None] | None = None
        self._timer: trio.CancelScope | None = None
        self.closed = False

    @property
    def call_id(self) -> str:
        return self._call_id

    def report(self, message: str, fraction: float | None) -> None:
        if self.closed:
            return  # a worker thread's report that reached the trio thread after the call
        if self._timer is not None:
            # Over the pace: this report replaces the one waiting for the timer (the hot
            # path of a flood, so it only stores).
            self._pending = (message, fraction)
            return
        if not self._bus.has_listeners(ToolProgress):
            return
        now = trio.current_time()
        tokens = min(float(BURST), self._tokens + (now - self._at) * RATE)
        self._at = now
        if tokens >= 1.0:
            self._tokens = tokens - 1.0
            self._bus.emit_nowait(ToolProgress(self._agent_id, self._call_id, message, fraction))
            return
        self._tokens = tokens
        self._pending = (message, fraction)
        self._timer = trio.CancelScope(deadline=now + (1.0 - tokens) / RATE)
        trio.lowlevel.spawn_system_task(
            self._trail, self._timer, name=f"agentloop.progress:{self._call_id}"
        )

    async def _trail(self, timer: trio.CancelScope) -> None:
        # The pace's next slot: the call's latest report goes out then, unless the call ends
        # first (close() cancels the timer and delivers it).
        with timer:
            await trio.sleep_forever()
        if timer is not self._timer:
            return
        self._timer = None
        self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        now = trio.current_time()
        self._tokens = max(0.0, min(float(BURST), self._tokens + (now - self._at) * RATE) - 1)
        self._at = now
        self._bus.emit_nowait(ToolProgress(self._agent_id, self._call_id, *pending))

    def close(self) -> None:
        """The call ended: its latest undelivered report goes out now."""
        self.closed = True
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.deadline = math.inf
            timer.cancel()
        if self._pending is not None:  # most calls report nothing: no call here, then
            self._flush()


def begin_call(bus: EventBus, agent_id: str, call_id: str) -> Reporter:
    """Make the calling task the body of tool call ``call_id``: its reports are this call's.

    The task runs that one call (each tool body has a task of its own), so the context
    variable is not reset; the caller closes the reporter when the call ends.
    """
    reporter = Reporter(bus, agent_id, call_id)
    _current.set(reporter)
    return reporter


def current_reporter() -> Reporter | None:
    """The reporter of the tool call the calling code runs in (also in a worker thread the
    body started, whose context is a copy), or ``None`` outside every call."""
    return _current.get()
