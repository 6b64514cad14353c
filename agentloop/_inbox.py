"""An agent's pending input: the two inbox lists, the steer ids, the wake channel and claims.

The lists are the projection the seed describes: every change is published as a splice
*before* it happens, ``edit`` and ``remove`` act on pending messages, and a claim takes input
atomically. The next-turn channel (``Wakeups``, which keeps a count) carries every *waking*
record to the agent's actor (follow-ups, and waking steers, since a wake while idle must open a
turn boundary exactly as a follow-up does, and an idle actor waits on one channel); it is named
for what it wakes, not for the list a record lands in. A non-waking injection is on no
channel: it must not wake an idle actor, and the claim at the next step boundary reads the
list (a channel of its own would be a channel per agent that nobody waits on). The actor
drains the channel at its boundaries and takes content and order from the projection, so a
removed or edited message is never delivered stale: the lists, not the channel, are the truth
for content.
"""

from __future__ import annotations

from typing import Final, Literal

import attrs
import trio

from ._bus import EventBus
from ._events import InboxDiscarded, InboxInserted, InboxSpliced
from ._model import Content, InboxMessage, MessageId

_REST: Final = InboxMessage(MessageId(""), "")  # a wake that carries no input

__all__ = ["Inbox", "InboxState", "Target", "TARGETS", "Wakeups"]

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
        "_agent_id", "_bus", "_rest", "next_step", "next_turn", "turn_rx", "turn_tx", "waking",
    )

    def __init__(self, agent_id: str, bus: EventBus) -> None:
        self._agent_id = agent_id
        self._bus = bus
        self.next_turn: list[InboxMessage] = []
        self.next_step: list[InboxMessage] = []
        # Ids of pending next-step messages that were sent to wake (steer): only those
        # continue a turn; an injection waits for the next step something else causes.
        self.waking: set[str] = _NO_IDS  # allocated on the first steer: agents are many
        # Unbounded, so send() never blocks; one object is both ends.
        self.turn_tx = self.turn_rx = Wakeups()
        self._rest = False

    def pending(self, target: Target) -> list[InboxMessage]:
        """The pending list of ``target`` (a method, not a table: nothing more per agent)."""
        return self.next_turn if target == "next-turn" else self.next_step

    def ask_rest(self) -> None:
        """Wake the idle actor to hibernate now (the wake carries no record)."""
        self._rest = True
        self.turn_tx.send_nowait(_REST)

    def take_rest(self) -> bool:
        """Whether a rest was asked since the last call."""
        rest, self._rest = self._rest, False
        return rest

    def snapshot(self) -> Inbox:
        return Inbox(tuple(self.next_turn), tuple(self.next_step))

    def accept(self, message: InboxMessage, target: Target, *, wakeup: bool) -> None:
        """Insert an accepted message at the end of ``target`` and hand it to the actor."""
        if wakeup and target == "next-step":
            if self.waking is _NO_IDS:
                self.waking = set()
            self.waking.add(message.id)
        self.splice(target, len(self.pending(target)), 0, (message,), None)
        bus = self._bus
        if bus.has_listeners(InboxInserted):
            bus.emit_nowait(InboxInserted(self._agent_id, target, message))
        if wakeup:
            self.turn_tx.send_nowait(message)

    def find(self, message_id: str) -> tuple[Target, int] | None:
        for target in TARGETS:
            for i, m in enumerate(self.pending(target)):
                if m.id == message_id:
                    return target, i
        return None

    def edit(self, message_id: str, content: Content) -> bool:
        found = self.find(message_id)
        if found is None:
            return False
        target, index = found
        old = self.pending(target)[index]
        self.splice(target, index, 1, (attrs.evolve(old, content=content),), None)
        return True

    def remove(self, message_id: str) -> bool:
        found = self.find(message_id)
        if found is None:
            return False
        self.discard(*found, outcome="canceled")
        return True

    def discard(self, target: Target, index: int, *, outcome: str) -> None:
        message = self.pending(target)[index]
        self.splice(target, index, 1, (), outcome)
        bus = self._bus
        if bus.has_listeners(InboxDiscarded):
            bus.emit_nowait(InboxDiscarded(self._agent_id, target, message, outcome))

    def discard_all(self, outcome: str) -> bool:
        discarded = False
        for target in TARGETS:
            pending = self.pending(target)
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
        pending = self.pending(target)
        if delete_count and target == "next-step" and self.waking:
            kept = {m.id for m in inserted}  # an edit replaces a message under the same id
            for gone in pending[index : index + delete_count]:
                if gone.id not in kept:
                    self.waking.discard(gone.id)
        pending[index : index + delete_count] = inserted

    def claim(self, *, boundary: bool) -> list[tuple[bool, InboxMessage]]:
        """Atomically take the next-step input, plus one queued prompt at a turn boundary;
        each with whether it is a prompt (``user/message``) rather than steering."""
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
        self.turn_rx.drain()

    def close(self) -> None:
        """No more input: ends an idle actor's wait on the next-turn channel."""
        self.turn_tx.close()


_NO_IDS: Final[set[str]] = set()  # shared and never written: see InboxState.accept


class Wakeups:
    """The next-turn channel: an unbounded memory channel of waking records, for one reader.

    The actor reads only how many records arrived (their content comes from the lists), so
    this keeps a count where a trio memory channel kept the records, its send and receive
    ends and their task tables: about 2 KB for every idle agent. It behaves as the channel
    did for its one reader: ``receive`` checkpoints, takes a record or parks until one is
    sent, and raises ``EndOfChannel`` once the channel is closed and drained.
    """

    __slots__ = ("_closed", "_count", "_reader")

    def __init__(self) -> None:
        self._count = 0
        self._closed = False
        self._reader: trio.lowlevel.Task | None = None

    def send_nowait(self, record: InboxMessage) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the next-turn channel is closed")
        self._count += 1
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        reader = self._reader
        if reader is not None:
            self._reader = None
            trio.lowlevel.reschedule(reader)

    def drain(self) -> None:
        """Take every record sent so far, without a schedule point (nor the ``WouldBlock``
        a loop of ``receive_nowait`` would end on)."""
        self._count = 0

    def receive_nowait(self) -> None:
        if self._count:
            self._count -= 1
            return
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._count or self._closed:
            # A record to take (or EndOfChannel), without an exception kept alive on the
            # idle actor's stack while it waits.
            self.receive_nowait()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self._reader is not None:
            raise trio.BusyResourceError("another task is waiting on the next-turn channel")
        self._reader = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)
        # Woken by a send (a record to take) or a close (EndOfChannel), as the channel
        # handed a record over: no second schedule point.
        self.receive_nowait()

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._reader = None
        return trio.lowlevel.Abort.SUCCEEDED

