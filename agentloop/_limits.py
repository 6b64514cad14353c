"""Shared limits on model calls: ``max_concurrent_calls`` and ``max_calls_per_minute`` of a
provider (``[providers.NAME]``) or of one of its models (``[providers.NAME.models.MODEL]``).

One :class:`CallLimits` belongs to a runtime's services, so every agent of that runtime
calling a provider shares its limits; runtimes of a fleet each keep their own. A call holds
its slots from its ``request/header`` until its stream is folded. Waiting callers form one
FIFO per limited provider or route: a slot that frees up goes to the caller that has waited
longest, so no agent starves however many others keep calling. The minute window runs on
trio's clock (a ``MockClock`` drives it in tests); the head of a queue that only the window
holds back waits for the moment its oldest call leaves the window, nothing polls.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Final

import attrs
import trio

__all__ = ["UNLIMITED", "CallLimits", "Limit", "WINDOW_SECONDS"]

WINDOW_SECONDS: Final = 60.0


@attrs.frozen(slots=True)
class Limit:
    """The limits of one provider or route; ``None`` is unlimited."""

    max_concurrent_calls: int | None = None
    max_calls_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        return self.max_concurrent_calls is not None or self.max_calls_per_minute is not None


@attrs.define(slots=True, eq=False)
class _Waiter:
    wake: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False
    # At the head of the queue and waiting with the window's deadline (if any) in view.
    armed: bool = False


class _Gate:
    """One limited provider or route: its calls in flight, its window and its queue."""

    __slots__ = ("_active", "_limit", "_starts", "_waiters", "name")

    def __init__(self, name: str, limit: Limit) -> None:
        self.name = name
        self._limit = limit
        self._active = 0
        self._starts: deque[float] = deque()  # start times of the calls in the window
        self._waiters: deque[_Waiter] = deque()

    def _window_opens(self, now: float) -> float:
        """When the minute window next has room: ``now`` if it has, else later."""
        per_minute = self._limit.max_calls_per_minute
        if per_minute is None:
            return now
        starts = self._starts
        while starts and starts[0] <= now - WINDOW_SECONDS:
            starts.popleft()
        if len(starts) < per_minute:
            return now
        return starts[len(starts) - per_minute] + WINDOW_SECONDS

    def _fits(self, now: float) -> bool:
        most = self._limit.max_concurrent_calls
        if most is not None and self._active >= most:
            return False
        return self._window_opens(now) <= now

    def _take(self, now: float) -> None:
        self._active += 1
        if self._limit.max_calls_per_minute is not None:
            self._starts.append(now)

    def _grant(self) -> None:
        """Hand free slots to the longest waiting callers, in order."""
        now = trio.current_time()
        waiters = self._waiters
        while waiters and self._fits(now):
            waiter = waiters.popleft()
            self._take(now)
            waiter.granted = True
            waiter.wake.set()
        if waiters and not waiters[0].armed:
            # A new head may be held back by the window only: it sets its own deadline.
            waiters[0].wake.set()

    def release(self) -> None:
        self._active -= 1
        self._grant()

    async def acquire(self) -> bool:
        """Take a slot, waiting in line for one; whether the call had to wait."""
        now = trio.current_time()
        if not self._waiters and self._fits(now):
            self._take(now)
            return False
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            while not waiter.granted:
                now = trio.current_time()
                deadline = math.inf
                waiter.armed = self._waiters[0] is waiter
                if waiter.armed:
                    opens = self._window_opens(now)
                    if opens > now:
                        deadline = opens
                with trio.move_on_at(deadline):
                    await waiter.wake.wait()
                if not waiter.granted:
                    waiter.wake = trio.Event()
                    self._grant()
        except BaseException:
            if waiter.granted:
                # Granted in the same tick it was cancelled: the slot goes to the next one.
                self.release()
            else:
                self._waiters.remove(waiter)
                self._grant()
            raise
        return True


def _nothing() -> None:
    return None


# What a call on a route nothing limits holds: no slot to give back, and no wait.
UNLIMITED: Final[tuple[Callable[[], None], float | None]] = (_nothing, None)


class CallLimits:
    """The limited providers and routes of one runtime, asked by each model call."""

    __slots__ = ("_gates",)

    def __init__(self, limits: Mapping[tuple[str, str | None], Limit]) -> None:
        # (provider, None) limits the provider; (provider, model) one of its routes.
        self._gates = {
            key: _Gate(key[0] if key[1] is None else f"{key[0]}:{key[1]}", limit)
            for key, limit in limits.items()
            if limit.limited
        }

    def __bool__(self) -> bool:
        return bool(self._gates)

    async def acquire(
        self, provider: str | None, model: str | None
    ) -> tuple[Callable[[], None], float | None]:
        """Wait for a slot of the route and of its provider, in that order; the function
        that gives them back, and the seconds waited (``None`` when the call did not wait).

        The route's slot comes first, so a call waiting for its route's turn holds none of
        its provider's slots. A cancel while waiting leaves no slot taken.
        """
        if not self._gates:
            return UNLIMITED  # the usual runtime: no route is limited
        gates = [
            gate for gate in (self._gates.get((provider or "", model)),
                              self._gates.get((provider or "", None)))
            if gate is not None
        ]
        if not gates:
            return UNLIMITED
        await trio.lowlevel.checkpoint_if_cancelled()
        start = trio.current_time()
        held: list[_Gate] = []
        waited = False
        try:
            for gate in gates:
                waited = await gate.acquire() or waited
                held.append(gate)
        except BaseException:
            for gate in reversed(held):
                gate.release()
            raise
        def release() -> None:
            for gate in reversed(held):
                gate.release()

        return release, (trio.current_time() - start) if waited else None

