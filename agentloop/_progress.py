"""Progress from running tools: ``agentloop.report_progress`` and its delivery.

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
from ._errors import AgentLoopError
from ._events import ToolProgress

__all__ = ["BURST", "RATE", "Reporter", "begin_call", "report_progress"]

BURST: Final = 10
"""Reports of one call delivered at once before the pace applies."""
RATE: Final = 30.0
"""Reports of one call delivered per second, once a burst is spent."""

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
        self._tokens = float(BURST)
        self._at = -math.inf
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
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.deadline = math.inf
            timer.cancel()
        self._flush()


def begin_call(bus: EventBus, agent_id: str, call_id: str) -> Reporter:
    """Make the calling task the body of tool call ``call_id``: its reports are this call's.

    The task runs that one call (each tool body has a task of its own), so the context
    variable is not reset; the caller closes the reporter when the call ends.
    """
    reporter = Reporter(bus, agent_id, call_id)
    _current.set(reporter)
    return reporter


def _check(message: object, fraction: object) -> float | None:
    if not isinstance(message, str):
        raise AgentLoopError(
            f"report_progress: message must be a string, got {type(message).__name__}"
        )
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
        0.0 <= fraction <= 1.0
    ):
        raise AgentLoopError(
            f"report_progress: fraction must be a number from 0 to 1 or None, got {fraction!r}"
        )
    return float(fraction)


def report_progress(message: str, *, fraction: float | None = None) -> None:
    """Report the progress of the tool call this code runs in: ``message`` and, when known,
    the ``fraction`` done (0 to 1).

    Subscribers of :class:`agentloop.events.ToolProgress`, ``run.progress()``, the chat UI and
    the inspector show it; it never enters the log or the model's history. Cheap enough to
    call in a tight loop: reports faster than about 30 a second are coalesced, keeping the
    latest. Callable from the tool's task or from a thread the tool started with
    ``trio.to_thread.run_sync``.

    Raises:
        AgentLoopError: outside a tool body, or a message that is not a string or a fraction
            outside 0..1.
    """
    reporter = _current.get()
    if reporter is None or reporter.closed:
        # A task the body started outside its call (a system task, a leftover) inherits
        # the reporter: once the call is over there is nothing to report on.
        raise AgentLoopError(
            "report_progress() was called outside a tool body: only a running tool call "
            "has progress to report"
            + ("" if reporter is None else f" (call {reporter.call_id!r} has ended)")
        )
    checked = _check(message, fraction)
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        # A worker thread of the tool (its context was copied): report on the trio thread.
        trio.from_thread.run_sync(reporter.report, message, checked)
        return
    reporter.report(message, checked)
