"""The kit's own facts about a race, beyond what one log shows: each names the rule it checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._ops import Race

if TYPE_CHECKING:
    from .._agent import Agent

__all__ = ["check_facts", "check_probe", "check_released"]

_NOT_AFTER_CANCEL = frozenset({"completed", "max-tokens"})


def check_probe(race: Race) -> None:
    """What the kit's model, tools and operations saw go wrong while the race ran."""
    if race.probe.violations:
        more = len(race.probe.violations) - 1
        raise AssertionError(race.probe.violations[0] + (f" (and {more} more)" if more else ""))


def _turn_end(race: Race, session_id: str, turn: int) -> str | None:
    for session in race.sessions.values():
        if session.id != session_id:
            continue
        for e in session.events:
            if e.type == "turn/end" and e.turn == turn:
                reason = e.data.get("reason")
                return reason if isinstance(reason, str) else None
    return None


def check_cancelled_turns(race: Race) -> None:
    """A turn open when a cancel of it took effect never ends ``completed``: cancellation
    takes precedence even over work that finished before noticing it."""
    for session, turn in race.cancelled:
        reason = _turn_end(race, session.id, turn)
        if reason in _NOT_AFTER_CANCEL:
            raise AssertionError(f"session {session.id!r}: turn {turn} was cancelled while "
                                 f"open, yet it ended {reason!r}; expected 'aborted' (or "
                                 "'disposed', 'suspended', 'error')")


def check_stranded(race: Race, live: Sequence[Agent]) -> None:
    """At quiescence, input the race sent to wake an agent is not left pending on an idle
    agent that waits for nothing (no turn would ever take it)."""
    for agent in live:
        if agent.status != "idle" or agent.pending_approvals:
            continue
        woken = race.woken.get(agent.id, set())
        inbox = agent.inbox
        stranded = [m.id for m in (*inbox.next_turn, *inbox.next_step) if m.id in woken]
        if stranded:
            raise AssertionError(f"agent {agent.id!r} is idle with {len(stranded)} waking "
                                 f"message(s) pending ({stranded[0]!r}); expected a turn "
                                 "to take every follow-up and steer")


def check_feeds(race: Race) -> None:
    """A slow subscriber that lost events was told so by a ``Lagged`` marker, and never
    counted more than it lost. (Losses after the last marker are told before the next event
    delivered, so a race that ends quietly may leave the last few untold.)"""
    for i, feed in enumerate(race.feeds):
        feed.drain()
        lost = feed.emitted - feed.received
        if lost < 0 or feed.missed > lost or (lost and not feed.missed):
            raise AssertionError(f"subscriber #{i} was sent {feed.emitted} events, received "
                                 f"{feed.received} and was told of {feed.missed} missed; "
                                 "expected every loss told by a Lagged marker, and no more")


def check_leases(race: Race, live: Sequence[Agent]) -> None:
    """Every live agent's session lease is held in the race's store (when it has one)."""
    store = race.state.get("store")
    if store is None:
        return
    for agent in live:
        holder = store.leases.get(agent.id)
        if holder is None:
            raise AssertionError(f"agent {agent.id!r} is live but its session's lease is free "
                                 "in the store; expected it held while the agent lives")


def check_released(race: Race) -> None:
    """Once the runtime closed, the race's store holds no lease: every agent gave its back."""
    store = race.state.get("store")
    if store is not None and not store.crashed and store.leases:
        sid = sorted(store.leases)[0]
        raise AssertionError(f"the runtime closed but the store still holds the lease of "
                             f"session {sid!r}; expected every lease released at disposal")


def check_facts(race: Race, live: Sequence[Agent], *, quiescent: bool) -> None:
    check_probe(race)
    check_cancelled_turns(race)
    check_leases(race, live)
    if quiescent:
        check_stranded(race, live)
        check_feeds(race)
