"""An agent's pending input: the two inbox lists, the steer ids, their channels and claims.

The lists are the projection the seed describes: every change is published as a splice
*before* it happens, ``edit`` and ``remove`` act on pending messages, and a claim takes input
atomically. The memory channels carry the accepted records to the agent's actor, and are
named for what they wake, not for the list a record lands in: the next-turn channel carries
every *waking* record (follow-ups, and waking steers, since a wake while idle must open a turn
boundary exactly as a follow-up does, and an idle actor waits on one channel), the next-step
channel the non-waking injections (which must not wake an idle actor). The actor drains them
at its boundaries and takes content and order from the projection, so a removed or edited
message is never delivered stale: the lists, not the channels, are the truth for content.
"""

from __future__ import annotations

import contextlib
import math
from typing import Final, Literal

import attrs
import trio

from ._bus import EventBus
from ._events import InboxDiscarded, InboxInserted, InboxSpliced
from ._model import Content, InboxMessage

__all__ = ["Inbox", "InboxState", "Target", "TARGETS"]

Target = Literal["next-turn", "next-step"]
TARGETS: Final[tuple[Target, Target]] = ("next-turn", "next-step")


@attrs.frozen(slots=True)
class Inbox:
    """A snapshot of an agent's pending input."""

    next_turn: tuple[InboxMessage, ...]
    next_step: tuple[InboxMessage, ...]


class InboxState:
    """The live inbox of one agent (owned by it; every method is synchronous)."""

    __slots__ = (
        "_agent_id", "_bus", "next_step", "next_turn", "pending", "step_rx", "step_tx",
        "turn_rx", "turn_tx", "waking",
    )

    def __init__(self, agent_id: str, bus: EventBus) -> None:
        self._agent_id = agent_id
        self._bus = bus
        self.next_turn: list[InboxMessage] = []
        self.next_step: list[InboxMessage] = []
        self.pending: dict[Target, list[InboxMessage]] = {
            "next-turn": self.next_turn, "next-step": self.next_step,
        }
        # Ids of pending next-step messages that were sent to wake (steer): only those
        # continue a turn; an injection waits for the next step something else causes.
        self.waking: set[str] = _NO_IDS  # allocated on the first steer: agents are many
        # Unbounded, so send() never blocks.
        self.turn_tx, self.turn_rx = trio.open_memory_channel[InboxMessage](math.inf)
        self.step_tx, self.step_rx = trio.open_memory_channel[InboxMessage](math.inf)

    def snapshot(self) -> Inbox:
        return Inbox(tuple(self.next_turn), tuple(self.next_step))

    def accept(self, message: InboxMessage, target: Target, *, wakeup: bool) -> None:
        """Insert an accepted message at the end of ``target`` and hand it to the actor."""
        if wakeup and target == "next-step":
            if self.waking is _NO_IDS:
                self.waking = set()
            self.waking.add(message.id)
        self.splice(target, len(self.pending[target]), 0, (message,), None)
        bus = self._bus
        if bus.has_listeners(InboxInserted):
            bus.emit_nowait(InboxInserted(self._agent_id, target, message))
        (self.turn_tx if wakeup else self.step_tx).send_nowait(message)

    def find(self, message_id: str) -> tuple[Target, int] | None:
        for target in TARGETS:
            for i, m in enumerate(self.pending[target]):
                if m.id == message_id:
                    return target, i
        return None

    def edit(self, message_id: str, content: Content) -> bool:
        found = self.find(message_id)
        if found is None:
            return False
        target, index = found
        old = self.pending[target][index]
        self.splice(target, index, 1, (attrs.evolve(old, content=content),), None)
        return True

    def remove(self, message_id: str) -> bool:
        found = self.find(message_id)
        if found is None:
            return False
        self.discard(*found, outcome="canceled")
        return True

    def discard(self, target: Target, index: int, *, outcome: str) -> None:
        message = self.pending[target][index]
        self.splice(target, index, 1, (), outcome)
        bus = self._bus
        if bus.has_listeners(InboxDiscarded):
            bus.emit_nowait(InboxDiscarded(self._agent_id, target, message, outcome))

    def discard_all(self, outcome: str) -> bool:
        discarded = False
        for target in TARGETS:
            pending = self.pending[target]
            while pending:
                self.discard(target, len(pending) - 1, outcome=outcome)
                discarded = True
        return discarded

    def splice(
        self,
        target: Target,
        index: int,
        delete_count: int,
        inserted: tuple[InboxMessage, ...],
        outcome: str | None,
    ) -> None:
        bus = self._bus
        if bus.has_listeners(InboxSpliced):
            # Published before the change, so an observer can still read what is removed.
            bus.emit_nowait(
                InboxSpliced(self._agent_id, target, index, delete_count, inserted, outcome)
            )
        pending = self.pending[target]
        if delete_count and target == "next-step" and self.waking:
            kept = {m.id for m in inserted}  # an edit replaces a message under the same id
            for gone in pending[index : index + delete_count]:
                if gone.id not in kept:
                    self.waking.discard(gone.id)
        pending[index : index + delete_count] = inserted

    def claim(self, *, boundary: bool) -> list[tuple[bool, InboxMessage]]:
        """Atomically take the next-step input, plus one queued prompt at a turn boundary;
        each with whether it is a prompt (``user/message``) rather than steering."""
        _drain(self.step_rx)  # the projection is the truth for order, edits and removals
        batch: list[tuple[bool, InboxMessage]] = []
        if self.next_step:
            steps = tuple(self.next_step)
            self.splice("next-step", 0, len(steps), (), None)
            batch.extend((False, m) for m in steps)
        if boundary and self.next_turn:
            prompt = self.next_turn[0]
            self.splice("next-turn", 0, 1, (), None)
            batch.append((True, prompt))
        return batch

    def drain_turns(self) -> None:
        """Consume every waking record received so far (a turn boundary sees them all)."""
        _drain(self.turn_rx)

    def close(self) -> None:
        """No more input: ends an idle actor's wait on the next-turn channel."""
        self.turn_tx.close()
        self.step_tx.close()


_NO_IDS: Final[set[str]] = set()  # shared and never written: see InboxState.accept


def _drain(channel: trio.MemoryReceiveChannel[InboxMessage]) -> None:
    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        while True:
            channel.receive_nowait()
