"""Sessions: the append-only durable log and the history derived from it.

The derived history is folded incrementally, one event at a time, by the reducer of the event's
type; it is never rebuilt from the whole log. Because it only grows, a snapshot of it is the
list plus a length, so taking one per step costs O(1) whatever the history's size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Final, cast, overload

from . import _log
from ._bus import EventBus
from ._errors import InvalidContent, PersistenceError
from ._events import SessionEventAppended
from ._json import FrozenDict
from ._model import Content, Message, PendingApproval, SessionEvent, ToolCall

__all__ = [
    "Session", "LogView", "HistoryView", "Reducer", "recover_crashed_turn", "validate_session_id",
]

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
    data = cast("_log.ClaimedMessageData", event.data)
    content = data["content"]
    if not isinstance(content, (str, tuple)):
        raise TypeError(f"content must be text or a list of parts, got {content!r}")
    history.append(Message("user", content))


def tool_calls_of(data: FrozenDict) -> tuple[ToolCall, ...]:
    calls = cast("_log.AssistantMessageData", data).get("tool_calls", ())
    return tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in calls)


def _assistant(history: list[Message], event: SessionEvent) -> None:
    data = cast("_log.AssistantMessageData", event.data)
    content = data.get("content") or ""
    tool_calls = tool_calls_of(event.data)
    reasoning = data.get("reasoning") or None
    blocks = data.get("reasoning_blocks", ())
    if not content and not tool_calls and not reasoning and not blocks:
        return  # empty assistant content stays out of history
    history.append(
        Message(
            "assistant",
            content,
            tool_calls=tool_calls,
            interrupted=bool(data.get("interrupted")),
            reasoning=reasoning,
            reasoning_signature=data.get("reasoning_signature"),
            reasoning_blocks=blocks,
        )
    )


def _tool_result(history: list[Message], event: SessionEvent) -> None:
    data = cast("_log.ToolResultData", event.data)
    history.append(
        Message(
            "tool",
            cast("Content", data["content"]),
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

    __slots__ = (
        "_awaiting", "_bus", "_call_ids", "_history", "_log", "_unanswered", "_view", "id",
        "meta", "turns",
    )

    def __init__(self, session_id: str, meta: FrozenDict, bus: EventBus) -> None:
        self.id = session_id
        self.meta = meta
        self._bus = bus
        self._log: list[SessionEvent] = []
        self._history: list[Message] = []
        self._view = LogView(self._log)
        # Calls the model made that have no tool/result yet, with whether their tool/call is
        # logged. Kept as events arrive, so closing a turn never rescans the log.
        self._unanswered: dict[str, tuple[ToolCall, bool]] = {}
        # Every call id the session has used: providers refuse a conversation that repeats one.
        self._call_ids: set[str] | None = None  # allocated with the first call
        # Calls parked for approval and not answered yet (rebuilt from the log on load).
        self._awaiting: dict[str, PendingApproval] | None = None
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

    @property
    def unanswered(self) -> tuple[tuple[ToolCall, bool], ...]:
        """The model's calls without a ``tool/result``, in order, each with whether its
        ``tool/call`` is logged."""
        return tuple(self._unanswered.values())

    @property
    def awaiting_approval(self) -> tuple[PendingApproval, ...]:
        """Calls with a ``tool/approval-requested`` and neither an answer nor a result yet,
        in the order they were parked."""
        return tuple(self._awaiting.values()) if self._awaiting else ()

    def unique_call_id(self, call_id: str, taken: set[str]) -> str:
        """``call_id``, or the first free ``f"{call_id}_{n}"`` (n from 2) if this session or
        ``taken`` already has it: deterministic, so a replayed stream gets the same ids."""
        used = self._call_ids or ()
        if call_id not in used and call_id not in taken:
            return call_id
        n = 2
        while f"{call_id}_{n}" in used or f"{call_id}_{n}" in taken:
            n += 1
        return f"{call_id}_{n}"

    def _track(self, event: SessionEvent) -> None:
        type_ = event.type
        if type_ == "assistant/message":
            if not event.data.get("interrupted"):
                for call in tool_calls_of(event.data):
                    self._unanswered[call.id] = (call, False)
                    if self._call_ids is None:
                        self._call_ids = set()
                    self._call_ids.add(call.id)
        elif type_ == "tool/call":
            entry = self._unanswered.get(event.data["call_id"])
            if entry is not None:
                self._unanswered[entry[0].id] = (entry[0], True)
        elif type_ == "tool/result":
            self._unanswered.pop(event.data["call_id"], None)
            if self._awaiting:
                self._awaiting.pop(event.data["call_id"], None)
        elif type_ == "tool/approval-requested":
            data = cast("_log.ApprovalRequestedData", event.data)
            if self._awaiting is None:
                self._awaiting = {}
            self._awaiting[data["call_id"]] = PendingApproval(
                data["call_id"], data["name"], data["arguments"], data["prompt"]
            )
        elif type_ == "tool/approval-answered" and self._awaiting:
            self._awaiting.pop(event.data["call_id"], None)

    def append(self, type_: str, data: FrozenDict, turn: int | None) -> SessionEvent:
        """Append one event whose ``data`` is already frozen JSON; returns it."""
        event = SessionEvent(len(self._log) + 1, type_, turn, data)
        self._log.append(event)
        reducer = REDUCERS.get(type_)
        if reducer is not None:
            reducer(self._history, event)
            if type_ != "user/message" and type_ != "steering/message":
                self._track(event)
        elif type_ == "turn/start":
            self.turns = turn or self.turns + 1
        elif type_ == "tool/call" or type_.startswith("tool/approval-"):
            self._track(event)
        bus = self._bus
        if bus.has_listeners(SessionEventAppended):
            bus.emit_nowait(SessionEventAppended(self.id, event))
        return event

    def load(self, events: Sequence[SessionEvent]) -> None:
        """Rebuild from a stored log (same seqs), without re-announcing the events.

        Raises:
            PersistenceError: the log has a gap or an event lacks what its type requires;
                the message names the session and the seq.
        """
        for event in events:
            if event.seq != len(self._log) + 1:
                raise PersistenceError(
                    f"session {self.id!r}: stored log jumps from seq {len(self._log)} to "
                    f"{event.seq}"
                )
            try:
                reducer = REDUCERS.get(event.type)
                if reducer is not None:
                    reducer(self._history, event)
                elif event.type == "turn/start" and event.turn is not None:
                    self.turns = max(self.turns, event.turn)
                self._track(event)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                raise PersistenceError(
                    f"session {self.id!r}: stored event seq {event.seq} ({event.type}) is "
                    f"malformed: {type(exc).__name__}: {exc}"
                ) from None
            self._log.append(event)

    def __repr__(self) -> str:
        return f"<Session {self.id!r} events={len(self._log)}>"


def recover_crashed_turn(session: Session) -> None:
    """Close a turn a crash left open, so the history is valid for every provider.

    A stream cut by the crash keeps what the user saw, as a cancelled one does: an
    ``interrupted`` anchor citing its text and reasoning chunks. Calls without a result get a
    synthetic ``INTERRUPTED`` result, except calls parked for approval: they stay unanswered
    and pending. Then ``turn/end`` records ``aborted`` (``suspended`` when calls await
    approval) with cause ``crash``.
    """
    open_turn: int | None = None
    cut: list[SessionEvent] = []  # visible chunks of a stream with no anchor yet
    step = None
    for event in session.events:
        kind = event.type
        if kind == "turn/start":
            open_turn, cut = event.turn, []
        elif kind == "turn/end":
            open_turn, cut = None, []
        elif kind == "request/header":
            cut, step = [], event.data.get("step")
        elif kind == "assistant/chunk":
            if event.data.get("kind") in ("text", "reasoning"):
                cut.append(event)
        elif kind == "assistant/message":
            cut = []
    if open_turn is None:
        return
    if cut:
        session.append(
            _log.ASSISTANT_MESSAGE,
            _log.assistant_message(
                step=step,
                content="".join(e.data["delta"] for e in cut if e.data["kind"] == "text"),
                reasoning="".join(e.data["delta"] for e in cut if e.data["kind"] == "reasoning")
                or None,
                reasoning_signature=None,
                tool_calls=(),
                source_event_seqs=tuple(e.seq for e in cut),
                finish_reason=None,
                usage=None,
                interrupted=True,
            ),
            open_turn,
        )
    awaiting = {p.call_id for p in session.awaiting_approval}
    for call, logged in session.unanswered:
        if call.id in awaiting:
            continue  # still the person's to answer: pending again once resumed
        if not logged:
            session.append(_log.TOOL_CALL, _log.tool_call(call), open_turn)
        session.append(
            _log.TOOL_RESULT,
            _log.tool_result(
                call, "Error: the process stopped before this call finished",
                is_error=True, error_code="INTERRUPTED",
            ),
            open_turn,
        )
    reason = "suspended" if awaiting else "aborted"
    session.append(_log.TURN_END, _log.turn_end(open_turn, reason, cause="crash"), open_turn)
