"""Approvals: the answers given to parked tool calls, when each started waiting, who waits.

One object per agent owns this state. ``agent.approve``/``deny``/``cancel`` give answers; the
scheduler's tool run parks calls, takes answers and reports when it waits for nothing else; a
suspended turn's expiry reads the same park times. Nobody else writes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import attrs
import trio

__all__ = ["Answer", "Approvals", "Waiter"]


@attrs.frozen(slots=True)
class Answer:
    """Someone's answer to a parked call: approve, deny (with a reason), or abort (cancel)."""

    approved: bool
    reason: str | None = None
    abort: bool = False


class Waiter(Protocol):
    """The tool run that holds parked calls: woken when an answer arrives."""

    def notify(self) -> None: ...


_NONE: dict[str, Answer] = {}  # never written: see Approvals.give
_NEVER: dict[str, float] = {}  # never written: see Approvals._own_since


def expired_answer(timeout: float) -> Answer:
    return Answer(False, f"no answer to the approval request within {timeout:g} s")


class Approvals:
    """Answers not yet applied, park times, the run that waits, whether it waits only for
    answers (``blocked``: the agent counts as settled for ``wait_idle``), and who waits for
    that or for the agent's status to change.

    It refers to nobody: the agent tells it of a status change (:meth:`wake_waiters`), so a
    closed agent and its parts are freed without the cyclic collector.
    """

    __slots__ = ("_answers", "_changed", "_since", "blocked", "waiter")

    def __init__(self) -> None:
        # Shared empty tables until the first park or answer: most agents never ask.
        self._answers: dict[str, Answer] = _NONE
        self._since: dict[str, float] = _NEVER
        # Made only for a waiter: most turns end before anyone waits for them.
        self._changed: trio.Event | None = None
        self.waiter: Waiter | None = None
        self.blocked = False

    def answered(self, call_id: str) -> bool:
        return call_id in self._answers

    def has_answers(self) -> bool:
        return bool(self._answers)

    def give(self, call_id: str, answer: Answer) -> None:
        if self._answers is _NONE:
            self._answers = {}
        self._answers[call_id] = answer

    def take(self, call_id: str) -> Answer | None:
        return self._answers.pop(call_id, None) if self._answers else None

    def park(self, call_id: str, now: float) -> None:
        self._own_since()[call_id] = now

    def _own_since(self) -> dict[str, float]:
        if self._since is _NEVER:
            self._since = {}
        return self._since

    def parked_since(self, call_id: str, default: float) -> float:
        return self._since.get(call_id, default)

    def unpark(self, call_id: str) -> None:
        if self._since:
            self._since.pop(call_id, None)

    def note_pending(self, call_ids: Iterable[str], now: float) -> None:
        """Calls pending from before (a resumed log) wait from ``now`` in this process."""
        for call_id in call_ids:
            self._own_since().setdefault(call_id, now)

    def set_blocked(self, blocked: bool) -> None:
        self.blocked = blocked
        if blocked:
            # The running turn waits for nothing but answers: wait_idle() returns.
            self.wake_waiters()

    async def wait_for_change(self) -> None:
        """Until :meth:`wake_waiters`: the run is blocked, or the agent's status changed."""
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    def wake_waiters(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def prune(self, awaiting: set[str]) -> None:
        """Forget answers and park times of calls that no longer await approval."""
        if self._answers:
            self._answers = {k: v for k, v in self._answers.items() if k in awaiting}
        if self._since:
            self._since = {k: v for k, v in self._since.items() if k in awaiting}

    def deadline(self, timeout: float | None, call_ids: Iterable[str]) -> float:
        """When the first of ``call_ids`` runs out of ``timeout``."""
        if timeout is None:
            return math.inf
        now = trio.current_time()
        since = self._own_since()
        return min((since.setdefault(c, now) + timeout for c in call_ids), default=math.inf)

    def expire(self, timeout: float | None, call_ids: Iterable[str]) -> bool:
        """Deny the calls whose ``timeout`` ran out; True when any did."""
        if timeout is None:
            return False
        now = trio.current_time()
        expired = [c for c in call_ids if now >= self._since.get(c, now) + timeout]
        for call_id in expired:
            self.give(call_id, expired_answer(timeout))
        return bool(expired)
