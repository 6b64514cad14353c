"""``agentloop.report_progress``: what a tool body calls to report its progress.

Apart from the delivery (:mod:`agentloop._progress`), so that it stays pure Python in every
build: the opt-in compiled build compiles the delivery, and a compiled function refuses an
argument of the wrong type with a ``TypeError`` of its own before this one could say what
was wrong with it.
"""

from __future__ import annotations

import trio

from ._errors import AgentLoopError
from ._progress import current_reporter

__all__ = ["report_progress"]


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
    reporter = current_reporter()
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
