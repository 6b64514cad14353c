"""Sessions: the append-only durable log and the history derived from it.

The derived history is folded incrementally, one event at a time, by the reducer of the event's
type; it is never rebuilt from the whole log. Because it only grows, a snapshot of it is the
list plus a length, so taking one per step costs O(1) whatever the history's size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, overload

from ._bus import EventBus
from ._errors import InvalidContent
from ._events import SessionEventAppended
from ._json import FrozenDict
from ._model import Message, SessionEvent, ToolCall

__all__ = ["Session", "LogView", "HistoryView", "Reducer", "validate_session_id"]

_SESSION_ID: Final = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,127}")


def validate_session_id(session_id: object, what: str = "session id") -> str:
    """Return ``session_id`` if it is 1-128 characters of ``[A-Za-z0-9._:-]`` not starting with
    ``.``; otherwise raise :class:`~agentloop.InvalidContent` naming it.

    Ids are only ever used as keys (never raw in a path), but a narrow alphabet keeps them safe
    to show, log and type.
    """
    if not isinstance(session_id, str) or _SESSION_ID.fullmatch(session_id) is None:
        raise InvalidContent(
            f"invalid {what} {session_id!r}: use 1 to 128 characters of A-Z a-z 0-9 . _ : -"
            " not starting with '.'"
        )
    return session_id


class LogView(Sequence[SessionEvent]):
    """A read-only live view of a session's log."""

    __slots__ = ("_items",)

    def __init__(self, items: list[SessionEvent]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, i: int) -> SessionEvent: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[SessionEvent]: ...
    def __getitem__(self, i: int | slice) -> SessionEvent | Sequence[SessionEvent]:
        return self._items[i]

    def __iter__(self) -> Iterator[SessionEvent]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"<LogView of {len(self._items)} events>"


class HistoryView(Sequence[Message]):
    """An immutable snapshot of the derived history (the first ``n`` messages)."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[Message], n: int) -> None:
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Message: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Message]: ...
    def __getitem__(self, i: int | slice) -> Message | Sequence[Message]:
        if isinstance(i, slice):
            return self._items[: self._n][i]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("history index out of range")
        return self._items[i]

    def __iter__(self) -> Iterator[Message]:
        items, n = self._items, self._n
        for i in range(n):
            yield items[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HistoryView({list(self)!r})"


Reducer = Callable[[list[Message], SessionEvent], None]


def _user(history: list[Message], event: SessionEvent) -> None:
    history.append(Message("user", event.data["content"]))


def tool_calls_of(data: FrozenDict) -> tuple[ToolCall, ...]:
    return tuple(
        ToolCall(c["id"], c["name"], c["arguments"]) for c in data.get("tool_calls", ())
    )


def _assistant(history: list[Message], event: SessionEvent) -> None:
    data = event.data
    content = data.get("content") or ""
    tool_calls = tool_calls_of(data)
    reasoning = data.get("reasoning") or None
    if not content and not tool_calls and not reasoning:
        return  # empty assistant content stays out of history
    history.append(
        Message(
            "assistant",
            content,
            tool_calls=tool_calls,
            interrupted=bool(data.get("interrupted")),
            reasoning=reasoning,
            reasoning_signature=data.get("reasoning_signature"),
        )
    )


def _tool_result(history: list[Message], event: SessionEvent) -> None:
    data = event.data
    history.append(
        Message(
            "tool",
            data["content"],
            tool_call_id=data["call_id"],
            name=data.get("name"),
            is_error=bool(data.get("is_error")),
        )
    )


REDUCERS: dict[str, Reducer] = {
    "user/message": _user,
    "steering/message": _user,
    "assistant/message": _assistant,
    "tool/result": _tool_result,
}


class Session:
    """A session: id, metadata, the durable log and the derived history.

    Only the agent that drives a session appends to it.
    """

    __slots__ = ("_bus", "_history", "_log", "_view", "id", "meta", "turns")

    def __init__(self, session_id: str, meta: FrozenDict, bus: EventBus) -> None:
        self.id = session_id
        self.meta = meta
        self._bus = bus
        self._log: list[SessionEvent] = []
        self._history: list[Message] = []
        self._view = LogView(self._log)
        self.turns = 0
        """The number of the last turn opened in this session."""

    @property
    def events(self) -> LogView:
        """The append-only log: ``SessionEvent(seq, type, turn, data)``, seq from 1."""
        return self._view

    @property
    def last_seq(self) -> int:
        return len(self._log)

    def messages(self) -> HistoryView:
        """The derived history sent to the model (an O(1) immutable snapshot)."""
        return HistoryView(self._history, len(self._history))

    def append(self, type_: str, data: FrozenDict, turn: int | None) -> SessionEvent:
        """Append one event whose ``data`` is already frozen JSON; returns it."""
        event = SessionEvent(len(self._log) + 1, type_, turn, data)
        self._log.append(event)
        reducer = REDUCERS.get(type_)
        if reducer is not None:
            reducer(self._history, event)
        elif type_ == "turn/start":
            self.turns = turn or self.turns + 1
        bus = self._bus
        if bus.has_listeners(SessionEventAppended):
            bus.emit_nowait(SessionEventAppended(self.id, event))
        return event

    def load(self, events: Sequence[SessionEvent]) -> None:
        """Rebuild from a stored log (same seqs), without re-announcing the events."""
        for event in events:
            if event.seq != len(self._log) + 1:
                raise ValueError(
                    f"session {self.id!r}: stored log jumps from seq {len(self._log)} to "
                    f"{event.seq}"
                )
            self._log.append(event)
            reducer = REDUCERS.get(event.type)
            if reducer is not None:
                reducer(self._history, event)
            elif event.type == "turn/start" and event.turn is not None:
                self.turns = max(self.turns, event.turn)

    def __repr__(self) -> str:
        return f"<Session {self.id!r} events={len(self._log)}>"


def data(**fields: Any) -> FrozenDict:
    """Build event data from values agentloop already froze."""
    return FrozenDict(fields)
