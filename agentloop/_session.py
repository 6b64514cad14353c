"""Sessions: the append-only durable log and the history derived from it.

The derived history is folded incrementally, one event at a time, by the reducer of the event's
type; it is never rebuilt from the whole log. Between replacements it only grows, so a snapshot
of it is the list plus a length, and taking one per step costs O(1) whatever the history's size.
A ``history/replaced`` event splices a *new* list (copy on replace), so earlier snapshots keep
showing what they showed; each message remembers the seq that produced it, which is how a
replacement finds the messages its seqs produced.
"""

from __future__ import annotations

import functools
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Final, TypeVar, cast, overload

import attrs

from . import _log
from ._bus import EventBus
from ._errors import InvalidContent, PersistenceError
from ._events import SessionEventAppended
from ._json import JSON, FrozenDict
from ._model import (
    HistorySnapshot,
    Message,
    PendingApproval,
    SessionEvent,
    ToolCall,
    ToolResult,
    new_message_id,
)
from ._prices import add_cost, add_usage
from ._util import stored_maker

_ROLES: Final = ("user", "assistant", "tool")

__all__ = [
    "Session", "LogView", "HistoryView", "recover_crashed_turn", "validate_session_id",
    "crash_point", "continue_crashed_turn", "Continuation", "CrashPoint", "INTERRUPTED_BY_CRASH",
    "interrupted_by_crash",
    "pairing_problem",
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


# A log entry: an event, or the parts of one not read yet (Session._log): a text chunk's
# delta, a tool-call chunk's (index, id, name, arguments), or (type, turn, *args) of an
# event whose data is ``_MAKE[type](*args)``.
_Entry = SessionEvent | str | tuple[Any, ...]

# The function that makes the data of each type of event a session keeps as its parts. The
# entry names its type, not the function: an entry of strings, numbers and None (a turn's
# start and end, a claimed message, a text result, a reply without calls) is then one the
# cycle collector stops tracking while it is young (a reply's tuple of chunk seqs first,
# then the entry), instead of tracing it in every collection of the older generations for
# as long as the session lives.
_MAKE: dict[str, Callable[..., FrozenDict]] = {
    _log.REQUEST_HEADER: _log.request_header,
    _log.ASSISTANT_MESSAGE: _log.assistant_message,
    _log.TOOL_CALL: _log.tool_call,
    _log.TOOL_RESULT: _log.result_of,
    _log.TURN_START: _log.turn_start,
    _log.USER_MESSAGE: _log.claimed_message,
    _log.STEERING_MESSAGE: _log.claimed_message,
    _log.TURN_END: _log.turn_end,
}


# Where a reply's entry (``Session.append_reply``) keeps what a run's result reads of it.
_REPLY_CONTENT: Final = 3
_REPLY_USAGE: Final = 9
_REPLY_OUTPUT: Final = 13


class LogView(Sequence[SessionEvent]):
    """A read-only live view of a session's log."""

    __slots__ = ("_items", "_runs")

    def __init__(self, items: list[_Entry], runs: list[tuple[int, int, int]]) -> None:
        # The session's own lists, not the session: a view it holds must not make a cycle
        # with it (the session would then wait for the cycle collector to be freed).
        self._items = items
        self._runs = runs

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, i: int) -> SessionEvent: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[SessionEvent]: ...
    def __getitem__(self, i: int | slice) -> SessionEvent | Sequence[SessionEvent]:
        items = self._items
        if isinstance(i, slice):
            for k in range(*i.indices(len(items))):
                cls = type(items[k])
                if cls is str or cls is tuple:
                    _settle(items, self._runs, k)
            return cast("list[SessionEvent]", items[i])
        entry = items[i]
        cls = type(entry)
        if cls is str or cls is tuple:
            return _settle(items, self._runs, i if i >= 0 else i + len(items))
        return cast("SessionEvent", entry)

    def __iter__(self) -> Iterator[SessionEvent]:
        # Live, as a list's iterator is: it sees what is appended while it runs.
        items, runs = self._items, self._runs
        i = 0
        while i < len(items):
            entry = items[i]
            cls = type(entry)
            if cls is str or cls is tuple:
                yield _settle(items, runs, i)
            else:
                yield cast("SessionEvent", entry)
            i += 1

    def __repr__(self) -> str:
        return f"<LogView of {len(self._items)} events>"


_Memo = TypeVar("_Memo")


class HistoryView(HistorySnapshot):
    """An immutable snapshot of the derived history (the first ``n`` messages)."""

    __slots__ = ("_gen", "_items", "_n", "_owner")

    def __init__(
        self, items: list[Message], n: int, gen: int = 0, owner: Session | None = None
    ) -> None:
        self._items = items
        self._n = n
        self._gen = gen  # which spliced list of its session ``items`` is
        self._owner = owner

    def __len__(self) -> int:
        return self._n

    @property
    def source(self) -> object:
        # Appends go to the same list; a replacement makes a new one (Session._replace).
        return self._items

    def memo(self, key: object, new: Callable[[], _Memo]) -> _Memo:
        owner = self._owner
        if owner is None or self._items is not owner._history:
            return new()  # no session, or one whose history has been replaced since
        memos = owner._memos
        if memos is None:
            memos = owner._memos = {}  # made on first use: most sessions never need one
        found = memos.get(key)
        if found is None:
            found = memos[key] = new()
        return cast("_Memo", found)

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


def _first(run: tuple[int, int, int]) -> int:
    return run[0]


def _run_of(runs: list[tuple[int, int, int]], index: int) -> tuple[int, int, int]:
    """The run of text (its first index, step and turn) the chunk at ``index`` is in."""
    # A live reader's chunk is in the latest step's run, or in the one before when the
    # reader runs as the next step waits for its model: no search for either.
    run = runs[-1]
    if run[0] > index:
        if len(runs) > 1 and runs[-2][0] <= index:
            return runs[-2]
        run = runs[bisect_right(runs, index, key=_first) - 1]
    return run


def _settle(log: list[_Entry], runs: list[tuple[int, int, int]], index: int) -> SessionEvent:
    """The event of the entry at ``index`` of ``log``, made from its parts (and, for a
    chunk, the run it is in), and kept in the entry's place."""
    entry = log[index]
    if type(entry) is str:
        _, step, turn = _run_of(runs, index)
        event = _event(index + 1, _log.ASSISTANT_CHUNK, turn, _log.text_chunk(step, "text", entry))
    else:
        parts = cast("tuple[Any, ...]", entry)
        if type(parts[0]) is int:
            _, step, turn = _run_of(runs, index)
            event = _event(
                index + 1, _log.ASSISTANT_CHUNK, turn, _log.tool_call_chunk(step, *parts)
            )
        else:
            event = _event(index + 1, parts[0], parts[1], _MAKE[parts[0]](*parts[2:]))
    log[index] = event
    return event


# Every append makes one: SessionEvent(seq, type, turn, data).
_event = stored_maker(SessionEvent)
# And most add a message to the history: Message(role, content, tool_calls, tool_call_id,
# name, is_error, interrupted, reasoning, reasoning_signature, reasoning_blocks).
_message_of = stored_maker(Message)
_call = stored_maker(ToolCall)
_appended = stored_maker(SessionEventAppended)


def tool_calls_of(data: FrozenDict) -> tuple[ToolCall, ...]:
    calls = data.get("tool_calls", ())  # of _log.AssistantMessageData
    if not calls:
        return ()
    if len(calls) == 1:  # the usual reply with a call: no generator for it
        c = calls[0]
        return (_call(c["id"], c["name"], c["arguments"]),)
    return tuple(_call(c["id"], c["name"], c["arguments"]) for c in calls)


def _message(data: object) -> Message:
    """A history message from its frozen JSON (``_log.message_json``)."""
    if not isinstance(data, FrozenDict):
        raise TypeError(f"a replacement message must be a JSON object, got {data!r}")
    role = data["role"]
    if role not in _ROLES:
        raise ValueError(f"a message role must be user, assistant or tool, got {role!r}")
    content = data.get("content", "")
    if not isinstance(content, (str, tuple)):
        raise TypeError(f"content must be text or a list of parts, got {content!r}")
    return Message(
        role,
        content,
        tool_calls=tuple(
            ToolCall(c["id"], c["name"], c["arguments"]) for c in data.get("tool_calls", ())
        ),
        tool_call_id=data.get("tool_call_id"),
        name=data.get("name"),
        is_error=bool(data.get("is_error")),
        interrupted=bool(data.get("interrupted")),
        reasoning=data.get("reasoning"),
        reasoning_signature=data.get("reasoning_signature"),
        reasoning_blocks=tuple(data.get("reasoning_blocks", ())),
    )


def pairing_problem(messages: Sequence[Message], pending: set[str] | frozenset[str]) -> str | None:
    """Why a provider would refuse ``messages`` as a history (``None`` if it would not).

    Every tool result must answer a call of the assistant message before it, and all of that
    message's calls must be answered before any other message; ``pending`` calls (the model's
    calls still running) may stay unanswered at the end, and must be there.
    """
    waiting: list[str] = []
    seen: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id not in waiting:
                return (
                    f"message #{i} would be a result for tool call {m.tool_call_id!r} "
                    "without its call right before it"
                )
            waiting.remove(m.tool_call_id)
            continue
        if waiting:
            return f"it would leave the tool calls {waiting} unanswered before message #{i}"
        for call in m.tool_calls:
            if call.id in seen:
                return f"message #{i} would repeat the tool call id {call.id!r}"
            seen.add(call.id)
            waiting.append(call.id)
    if set(waiting) != set(pending):
        unanswered = [c for c in waiting if c not in pending]
        if unanswered:
            return f"it would leave the tool calls {unanswered} unanswered"
        missing = sorted(set(pending) - set(waiting))
        return f"it would drop the calls {missing}, whose results are still to come"
    return None


def _add_usage(total: dict[str, Any], usage: object) -> None:
    if not isinstance(usage, FrozenDict):
        return
    for key in _log.USAGE_KEYS:
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
    if "cost" in usage:  # a call made with a [prices] table; logs from before have none
        add_cost(total, usage["cost"])
        unpriced = usage.get("unpriced_calls")
        if isinstance(unpriced, int) and not isinstance(unpriced, bool) and unpriced > 0:
            total["unpriced_calls"] = total.get("unpriced_calls", 0) + unpriced


class Session:
    """A session: id, metadata, the durable log and the derived history.

    Only the agent that drives a session appends to it.
    """

    __slots__ = (
        "_announce", "_awaiting", "_bus", "_call_ids", "_gen", "_history", "_last_call",
        "_listened", "_log", "_memos", "_open_turn", "_origins", "_splices", "_text_data",
        "_text_runs", "_text_turn", "_turn_usage", "_unanswered", "_usage", "_view", "_wake",
        "id", "meta", "turns",
    )

    def __init__(self, session_id: str, meta: FrozenDict, bus: EventBus) -> None:
        self.id = session_id
        self.meta = meta
        self._bus = bus
        self._listened = bus.listened()
        self._announce = bus.route(SessionEventAppended)
        # An entry is its event, or only the parts of an assistant/chunk that nothing has
        # read yet: the text of one of kind "text", or (index, id, name, arguments) of one
        # of kind "tool_call". A step streams about eleven of those, and most are never
        # read back one by one, so the event (and its frozen data) is made when one is
        # (``_settle``). The log's meaning does not change: seq, type, turn and data are all
        # known from the entry and its place.
        self._log: list[_Entry] = []
        # (first index, step, turn) of each chunk writer, in order: the chunk entries from a
        # writer's first index on are its own, until the next writer's (made on first use:
        # by the first writer, or the log's first reader).
        self._text_runs: list[tuple[int, int, int]] | None = None
        # The last writer's data maker and turn, for an entry made at once (a listener).
        self._text_data: Callable[..., FrozenDict] | None = None
        self._text_turn = 0
        self._history: list[Message] = []
        # What adapters keep about _history (its messages encoded), by their key: dropped
        # with each new list, so that it never outlives the history it describes.
        self._memos: dict[object, object] | None = None
        # The seq that produced each message, parallel to _history; non-decreasing, since a
        # replacement's messages count as produced by its last_seq.
        self._origins: list[int] = []
        # Each replacement starts a new list (generation); _splices[g] is the first index at
        # which generation g differs from g - 1.
        self._gen = 0
        self._splices: list[int] = [0]
        self._usage: dict[str, Any] = {}
        self._turn_usage: dict[str, Any] = {}
        self._last_call: tuple[FrozenDict, int] | None = None
        self._open_turn: int | None = None
        self._view: LogView | None = None  # made by the first reader
        # Calls the model made that have no tool/result yet, with whether their tool/call is
        # logged. Kept as events arrive, so closing a turn never rescans the log.
        self._unanswered: dict[str, tuple[ToolCall, bool]] = {}
        # Every call id the session has used: providers refuse a conversation that repeats one.
        self._call_ids: set[str] | None = None  # allocated with the first call
        # Calls parked for approval and not answered yet (rebuilt from the log on load).
        self._awaiting: dict[str, PendingApproval] | None = None
        # Called once, at the next append, while a run handle's reader waits on this
        # session: a direct call, not a bus event, since a reader is woken about once per
        # chunk (``wake_at_next_append``).
        self._wake: Callable[[], None] | None = None
        self.turns = 0
        """The number of the last turn opened in this session."""

    @property
    def events(self) -> LogView:
        """The append-only log: ``SessionEvent(seq, type, turn, data)``, seq from 1."""
        view = self._view
        if view is None:
            view = self._view = LogView(self._log, self._runs())
        return view

    def _runs(self) -> list[tuple[int, int, int]]:
        runs = self._text_runs
        if runs is None:
            runs = self._text_runs = []
        return runs

    @property
    def last_seq(self) -> int:
        return len(self._log)

    def event_at(self, index: int) -> SessionEvent | None:
        """The event at ``index`` (its seq minus one), or None when the log is not that long
        yet: what a reader that follows the log asks once per event."""
        log = self._log
        if index >= len(log):
            return None
        entry = log[index]
        cls = type(entry)
        if cls is str or cls is tuple:
            return _settle(log, self._runs(), index)
        return cast("SessionEvent", entry)

    def text_at(self, index: int, turn: int) -> str | None:
        """What a reader of the text of ``turn`` takes from the entry at ``index``: the delta
        of a text chunk of ``turn`` (taken as the log keeps it, without its event being made
        when it is kept as its delta alone), or the empty string for an entry that gives that
        reader nothing (another kind, another turn), to pass over. None for the turn's own
        ``turn/end`` and past the end of the log."""
        log = self._log
        if index >= len(log):
            return None
        entry = log[index]
        if type(entry) is str:
            return entry if _run_of(self._runs(), index)[2] == turn else ""
        if type(entry) is tuple:
            return "" if entry[0] != _log.TURN_END or entry[1] != turn else None
        event = cast("SessionEvent", entry)
        if event.turn != turn:
            return ""
        if event.type == _log.ASSISTANT_CHUNK:
            data = event.data
            return data["delta"] if data["kind"] == "text" else ""
        return None if event.type == _log.TURN_END else ""

    def turn_close(
        self, turn: int, start: int
    ) -> tuple[str, JSON, dict[str, Any] | None, SessionEvent | None]:
        """What a run's result reads of ``turn``, whose events are at index ``start`` or
        later: its last reply's content, the latest structured output of its replies, their
        usage summed (None when no reply reported any), and its ``turn/end`` (None while
        the turn is open).

        Chunks are passed over as they are kept, and a reply kept as its parts is read from
        them: a turn of fifty steps logs some 750 events, and making each of them to find
        these cost a run that only waited for its result a quarter of the turn again.
        """
        log = self._log
        text = ""
        output: JSON = None
        usage: dict[str, Any] | None = None
        for index in range(start, len(log)):
            entry = log[index]
            cls = type(entry)
            if cls is str:
                continue  # a text chunk
            if cls is tuple:
                parts = cast("tuple[Any, ...]", entry)
                kind = parts[0]  # a tool-call chunk's is its index: neither type below
                if kind == _log.ASSISTANT_MESSAGE:
                    if parts[1] == turn:
                        text = parts[_REPLY_CONTENT] or ""
                        if parts[_REPLY_OUTPUT] is not None:
                            output = parts[_REPLY_OUTPUT]
                        counters = parts[_REPLY_USAGE]
                        if isinstance(counters, Mapping):
                            usage = add_usage({} if usage is None else usage, counters)
                    continue
                if kind != _log.TURN_END or parts[1] != turn:
                    continue
                return text, output, usage, _settle(log, self._runs(), index)
            event = cast("SessionEvent", entry)
            if event.turn != turn:
                continue
            if event.type == _log.ASSISTANT_MESSAGE:
                data = event.data
                text = data.get("content") or ""
                if "output" in data:
                    output = data["output"]
                counters = data.get("usage")
                if isinstance(counters, Mapping):
                    usage = add_usage({} if usage is None else usage, counters)
            elif event.type == _log.TURN_END:
                return text, output, usage, event
        return text, output, usage, None

    def text_writer(self, step: int, turn: int) -> Callable[[str], int]:
        """The writer of ``step``'s streamed text: each call appends one ``assistant/chunk``
        of kind "text" with that delta (already checked as storable) and returns its seq.
        It also makes ``step`` the one :meth:`append_call_chunk` writes for.

        While nothing listens to appends, an entry is kept as the delta alone and its event
        is made when something reads it (``_settle``): the same event, by then.
        """
        self._runs().append((len(self._log), step, turn))
        self._text_data = None  # made by the first chunk a listener takes
        self._text_turn = turn
        return self._append_text

    def _append_text(self, delta: str) -> int:
        log = self._log
        # Something listens to appends, and it is for this session (the route knows whether
        # any listener is for every session, and which sessions scoped ones are for): the
        # same test before every announce below. Written out: a call per append would cost a
        # subscriber's step about 3%.
        if SessionEventAppended in self._listened and (
            self._announce.everyone or self.id in self._announce.owners
        ):
            # A listener takes every event as it is appended: made now, as any other is
            # (what ``append`` does for a chunk, without its call).
            make = self._text_data
            if make is None:
                runs = self._runs()
                # The step and kind are a dict the partial holds: copying it is cheaper than
                # merging keyword arguments on every chunk (the same keys, in the same order).
                make = self._text_data = functools.partial(
                    FrozenDict, {"step": runs[-1][1], "kind": "text"}
                )
            event = _event(len(log) + 1, _log.ASSISTANT_CHUNK, self._text_turn, make(delta=delta))
            log.append(event)
            self._announce.publish(_appended(self.id, event))
        else:
            log.append(delta)
        wake = self._wake
        if wake is not None:
            self._wake = None  # once: a reader that parks again sets it again
            wake()
        return len(log)

    def append_call_chunk(
        self, index: int, call_id: str | None, name: str | None, arguments: str
    ) -> int:
        """Append one ``assistant/chunk`` of kind "tool_call" (parts already checked as
        storable) for the step of the last :meth:`text_writer`; returns its seq. Kept as
        its parts until read, as a text chunk is."""
        log = self._log
        if SessionEventAppended in self._listened and (
            self._announce.everyone or self.id in self._announce.owners
        ):
            step = self._runs()[-1][1]
            chunk = _log.tool_call_chunk(step, index, call_id, name, arguments)
            return self.append(_log.ASSISTANT_CHUNK, chunk, self._text_turn).seq
        log.append((index, call_id, name, arguments))
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake()
        return len(log)

    def wake_at_next_append(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook`` once, at the next append (None: call none). One hook at a time:
        the readers of one session share it."""
        self._wake = hook

    def forget_wake(self, hook: Callable[[], None]) -> None:
        """Drop ``hook`` if it is still waiting for an append."""
        if self._wake is hook:
            self._wake = None

    def open_turn(self) -> int | None:
        """The number of the turn the log leaves open (a crash's, before it is closed or
        taken up), or None: kept as turns open and close, appended or loaded."""
        return self._open_turn

    def messages(self) -> HistoryView:
        """The derived history sent to the model (an O(1) immutable snapshot)."""
        return HistoryView(self._history, len(self._history), self._gen, self)

    def seq_of(self, index: int) -> int:
        """The seq of the event that produced message ``index`` of the history (a
        replacement's messages count as produced by the last seq it replaced)."""
        return self._origins[index]

    @property
    def usage(self) -> FrozenDict:
        """The session's token counts, summed over its model calls (``input_tokens``,
        ``output_tokens``, ``cache_read_tokens``, ``cache_write_tokens``,
        ``reasoning_tokens``; counts no call reported are left out). Calls made with a
        ``[prices]`` table add ``cost`` (the sum over priced calls, ``None`` while none was)
        and ``unpriced_calls`` (calls whose route had no price)."""
        return FrozenDict(self._usage)

    @property
    def turn_usage(self) -> FrozenDict:
        """Like :attr:`usage`, for the latest turn only."""
        return FrozenDict(self._turn_usage)

    @property
    def last_usage(self) -> tuple[FrozenDict, int] | None:
        """The latest model call's usage and how many history messages its request and reply
        cover; ``None`` before any, or once a replacement changed that history."""
        return self._last_call

    def common_prefix(self, before: Sequence[Message], after: Sequence[Message]) -> int:
        """How many leading messages ``before`` and ``after`` share.

        O(1) for two snapshots of this session's history (O(replacements) between them);
        other sequences are compared message by message.
        """
        if isinstance(before, HistoryView) and isinstance(after, HistoryView):
            n = min(before._n, after._n)
            if before._items is after._items:
                return n
            if before._owner is self and after._owner is self and before._gen < after._gen:
                return min(n, *self._splices[before._gen + 1 : after._gen + 1])
        n = min(len(before), len(after))
        for i in range(n):
            a, b = before[i], after[i]
            if a is not b and a != b:
                return i
        return n

    def replace_history(
        self,
        first_seq: int,
        last_seq: int,
        messages: Sequence[Message],
        *,
        reason: str = "compaction",
        usage: FrozenDict | None = None,
    ) -> SessionEvent:
        """Show ``messages`` in place of the history that seqs ``first_seq`` to ``last_seq``
        produced (a durable ``history/replaced`` event; honoured after a resume too).

        The replacement sits where the first shadowed message was (or where messages of
        those seqs would be). ``usage`` (a model call's token counts, for a summary) is added
        to the session's.

        Raises:
            InvalidContent: the seqs are out of range, a message is not JSON, or the result
                would leave a tool call unanswered or a result without its call; nothing is
                logged then.
        """
        if not (
            isinstance(first_seq, int) and isinstance(last_seq, int)
            and 1 <= first_seq <= last_seq <= len(self._log)
        ):
            raise InvalidContent(
                f"replace_history: seqs {first_seq!r}..{last_seq!r} are not a range of this "
                f"session's log (1..{len(self._log)})"
            )
        for m in messages:
            if not isinstance(m, Message):
                raise InvalidContent(f"replace_history: {m!r} is not a Message")
        encoded = tuple(_log.message_json(m) for m in messages)
        decoded = [_message(d) for d in encoded]
        history, _, _ = self._spliced(first_seq, last_seq, decoded)
        pending = {call.id for call, _ in self._unanswered.values()}
        problem = pairing_problem(history, pending)
        if problem is not None:
            raise InvalidContent(f"replace_history refused: {problem}")
        return self.append(
            _log.HISTORY_REPLACED,
            _log.history_replaced(first_seq, last_seq, encoded, reason, usage),
            self._open_turn,
        )

    def _spliced(
        self, first_seq: int, last_seq: int, messages: list[Message]
    ) -> tuple[list[Message], list[int], int]:
        origins = self._origins
        i = bisect_left(origins, first_seq)
        j = bisect_right(origins, last_seq)
        history = [*self._history[:i], *messages, *self._history[j:]]
        return history, [*origins[:i], *([last_seq] * len(messages)), *origins[j:]], i

    def _replace(self, event: SessionEvent) -> None:
        data = cast("_log.HistoryReplacedData", event.data)
        messages = [_message(d) for d in data["messages"]]
        first, last = data["first_seq"], data["last_seq"]
        if not (isinstance(first, int) and isinstance(last, int) and first <= last):
            raise ValueError(f"history/replaced: {first!r}..{last!r} is not a range of seqs")
        self._history, self._origins, at = self._spliced(first, last, messages)
        self._memos = None
        self._gen += 1
        self._splices.append(at)
        self._last_call = None  # the usage it had described no longer matches the history
        for m in messages:
            for call in m.tool_calls:
                if self._call_ids is None:
                    self._call_ids = set()
                self._call_ids.add(call.id)
        usage = data.get("usage")
        _add_usage(self._usage, usage)
        if self._open_turn is not None:
            _add_usage(self._turn_usage, usage)

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

    def unique_call_id(self, call_id: str, taken: AbstractSet[str]) -> str:
        """``call_id``, or the first free ``f"{call_id}_{n}"`` (n from 2) if this session or
        ``taken`` already has it: deterministic, so a replayed stream gets the same ids."""
        used = self._call_ids or ()
        if call_id not in used and call_id not in taken:
            return call_id
        n = 2
        while f"{call_id}_{n}" in used or f"{call_id}_{n}" in taken:
            n += 1
        return f"{call_id}_{n}"

    def _open(self, event: SessionEvent) -> None:
        self._open_turn = event.turn
        self._turn_usage = {}

    # What each kind of event changes (the history, the open turn, the calls), one method
    # a kind, found by one lookup (``_APPLY``): appends and ``load`` fold an event alike.

    def _on_user(self, event: SessionEvent) -> None:
        self._prompted(event.seq, event.data["content"])

    def _prompted(self, seq: int, content: Any) -> None:
        # _log.ClaimedMessageData's content (not cast: a cast is a call at runtime)
        if not isinstance(content, (str, tuple)):
            raise TypeError(f"content must be text or a list of parts, got {content!r}")
        self._history.append(
            _message_of("user", content, (), None, None, False, False, None, None, ())
        )
        self._origins.append(seq)

    def _on_assistant(self, event: SessionEvent) -> None:
        data = event.data  # _log.AssistantMessageData
        self._anchored(
            event.seq, data.get("content") or "", data.get("reasoning") or None,
            data.get("reasoning_signature"), tool_calls_of(data), data.get("usage"),
            data.get("reasoning_blocks", ()), bool(data.get("interrupted")),
        )

    def _anchored(
        self, seq: int, content: str, reasoning: str | None, signature: str | None,
        tool_calls: tuple[ToolCall, ...], usage: FrozenDict | None,
        blocks: tuple[FrozenDict, ...], interrupted: bool,
    ) -> None:
        history = self._history
        # Empty assistant content stays out of the history.
        if content or tool_calls or reasoning or blocks:
            history.append(
                _message_of(
                    "assistant", content, tool_calls, None, None, False, interrupted,
                    reasoning, signature, blocks,
                )
            )
            self._origins.append(seq)
        if usage:
            _add_usage(self._usage, usage)
            _add_usage(self._turn_usage, usage)
            self._last_call = (usage, len(history))
        if not interrupted:
            for call in tool_calls:
                self._unanswered[call.id] = (call, False)
                if self._call_ids is None:
                    self._call_ids = set()
                self._call_ids.add(call.id)

    def _on_tool_call(self, event: SessionEvent) -> None:
        self._call_logged(event.data["call_id"])

    def _call_logged(self, call_id: str) -> None:
        entry = self._unanswered.get(call_id)
        if entry is not None:
            self._unanswered[entry[0].id] = (entry[0], True)

    def _on_tool_result(self, event: SessionEvent) -> None:
        data = event.data  # _log.ToolResultData
        self._answered(
            event.seq, data["call_id"], data.get("name"), data["content"],
            bool(data.get("is_error")),
        )

    def _answered(
        self, seq: int, call_id: str, name: str | None, content: Any, is_error: bool
    ) -> None:
        self._history.append(
            _message_of("tool", content, (), call_id, name, is_error, False, None, None, ())
        )
        self._origins.append(seq)
        self._unanswered.pop(call_id, None)
        if self._awaiting:
            self._awaiting.pop(call_id, None)

    def _on_approval_requested(self, event: SessionEvent) -> None:
        data = cast("_log.ApprovalRequestedData", event.data)
        if self._awaiting is None:
            self._awaiting = {}
        self._awaiting[data["call_id"]] = PendingApproval(
            data["call_id"], data["name"], data["arguments"], data["prompt"]
        )

    def _on_approval_answered(self, event: SessionEvent) -> None:
        if self._awaiting:
            self._awaiting.pop(event.data["call_id"], None)

    def _on_turn_start(self, event: SessionEvent) -> None:
        self._opened(event.turn)

    def _opened(self, turn: int | None) -> None:
        self.turns = turn or self.turns + 1
        self._open_turn = turn
        self._turn_usage = {}

    def _on_turn_end(self, event: SessionEvent) -> None:
        self._open_turn = None

    def append(self, type_: str, data: FrozenDict, turn: int | None) -> SessionEvent:
        """Append one event whose ``data`` is already frozen JSON; returns it."""
        log = self._log
        event = _event(len(log) + 1, type_, turn, data)
        log.append(event)
        # A chunk (most appends) and a request header change neither the history nor the
        # calls: no entry in the table.
        apply = _APPLY.get(type_)
        if apply is not None:
            apply(self, event)
        if SessionEventAppended in self._listened and (
            self._announce.everyone or self.id in self._announce.owners
        ):
            self._announce.publish(_appended(self.id, event))
        wake = self._wake
        if wake is not None:
            self._wake = None  # once: a reader that parks again sets it again
            wake()
        return event

    # A step's request header, reply anchor, tool calls and results, and a turn's start,
    # claimed messages and end, are appended as their parts, as a chunk is: the event, and
    # its frozen data, are made when something reads the entry (or at once, for a listener:
    # ``_announce_last``), and are the ones ``append`` would have made. What the session
    # derives from the event is derived from the parts, by the fold an eager event goes
    # through.

    def append_request_header(
        self, turn: int, step: int, config: FrozenDict, adapter_defaults: tuple[str, ...],
        messages: int, cache_prefix: int, rewritten: bool, after_error: FrozenDict | None,
        queued_seconds: float | None,
    ) -> int:
        """Append the ``request/header`` of ``step`` (see :func:`_log.request_header`);
        returns its seq."""
        log = self._log
        log.append((
            _log.REQUEST_HEADER, turn, step, config, adapter_defaults,
            messages, cache_prefix, rewritten, after_error, queued_seconds,
        ))
        self._announce_last()
        return len(log)

    def append_reply(
        self, turn: int, step: int, content: str, reasoning: str | None,
        signature: str | None, tool_calls: tuple[ToolCall, ...], seqs: tuple[int, ...],
        finish_reason: str | None, usage: FrozenDict | None, renamed: tuple[FrozenDict, ...],
        blocks: tuple[FrozenDict, ...], output: JSON,
    ) -> int:
        """Append the ``assistant/message`` anchoring a completed (not interrupted) reply
        (see :func:`_log.assistant_message`); returns its seq."""
        log = self._log
        # What a run's result reads is at _REPLY_CONTENT, _REPLY_USAGE and _REPLY_OUTPUT.
        log.append((
            _log.ASSISTANT_MESSAGE, turn, step, content, reasoning,
            signature, tool_calls, seqs, finish_reason, usage, False, renamed, blocks, output,
        ))
        seq = len(log)
        self._anchored(
            seq, content, reasoning or None, signature, tool_calls, usage, blocks, False
        )
        self._announce_last()
        return seq

    def append_turn_start(self, turn: int) -> int:
        """Append the ``turn/start`` of ``turn``; returns its seq."""
        log = self._log
        log.append((_log.TURN_START, turn, turn))
        self._opened(turn)
        self._announce_last()
        return len(log)

    def append_claimed(
        self, type_: str, message_id: str, content: Any, source: JSON, turn: int
    ) -> int:
        """Append a claimed ``user/message`` or ``steering/message`` (``type_``); returns
        its seq."""
        log = self._log
        log.append((type_, turn, message_id, content, source))
        seq = len(log)
        self._prompted(seq, content)
        self._announce_last()
        return seq

    def append_turn_end(
        self, turn: int, reason: str, cause: str | None, error: FrozenDict | None,
        usage: FrozenDict | None, detail: str | None, output: tuple[FrozenDict, str] | None,
    ) -> int:
        """Append the ``turn/end`` of ``turn`` (see :func:`_log.turn_end`); returns its seq."""
        log = self._log
        log.append((_log.TURN_END, turn, turn, reason, cause, error, usage,
                    detail, output))
        self._open_turn = None
        self._announce_last()
        return len(log)

    def append_tool_call(self, call: ToolCall, turn: int) -> int:
        """Append the ``tool/call`` of ``call``; returns its seq."""
        log = self._log
        log.append((_log.TOOL_CALL, turn, call))
        self._call_logged(call.id)
        self._announce_last()
        return len(log)

    def append_tool_result(
        self, call: ToolCall, content: str, is_error: bool, error_code: str | None, turn: int
    ) -> int:
        """Append the ``tool/result`` of ``call`` with text ``content`` already checked as
        storable as it is (no repair to note); returns its seq."""
        log = self._log
        log.append((_log.TOOL_RESULT, turn, call.id, call.name, content, is_error, error_code))
        seq = len(log)
        self._answered(seq, call.id, call.name, content, bool(is_error))
        self._announce_last()
        return seq

    def _announce_last(self) -> None:
        """After the entry just appended as its parts is folded: a listener takes its event
        now (made as a read would make it, and kept in the log), and a parked reader wakes."""
        if SessionEventAppended in self._listened and (
            self._announce.everyone or self.id in self._announce.owners
        ):
            log = self._log
            event = _settle(log, self._runs(), len(log) - 1)
            self._announce.publish(_appended(self.id, event))
        wake = self._wake
        if wake is not None:
            self._wake = None  # once: a reader that parks again sets it again
            wake()

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
                if event.type == "turn/start":
                    # A stored turn/start without a number opens no new one.
                    if event.turn is not None:
                        self.turns = max(self.turns, event.turn)
                    self._open(event)
                else:
                    apply = _APPLY.get(event.type)
                    if apply is not None:
                        apply(self, event)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                raise PersistenceError(
                    f"session {self.id!r}: stored event seq {event.seq} ({event.type}) is "
                    f"malformed: {type(exc).__name__}: {exc}"
                ) from None
            self._log.append(event)

    def __repr__(self) -> str:
        return f"<Session {self.id!r} events={len(self._log)}>"


# What folding an event into a session does, by its type; a type not here (a chunk, a
# request header, a compaction's note) changes nothing the session derives.
_APPLY: dict[str, Callable[[Session, SessionEvent], None]] = {
    "user/message": Session._on_user,
    "steering/message": Session._on_user,
    "assistant/message": Session._on_assistant,
    "tool/call": Session._on_tool_call,
    "tool/result": Session._on_tool_result,
    "tool/approval-requested": Session._on_approval_requested,
    "tool/approval-answered": Session._on_approval_answered,
    "turn/start": Session._on_turn_start,
    "turn/end": Session._on_turn_end,
    "history/replaced": Session._replace,
}


@attrs.frozen(slots=True)
class CrashPoint:
    """Where a crash left a session's open turn: its number, the step it cut, the visible
    chunks of a stream with no anchor yet, and whether the model's last reply in it was a
    complete answer (nothing left to do but close the turn)."""

    turn: int
    step: int | None
    cut: tuple[SessionEvent, ...]
    answered: bool


def crash_point(session: Session) -> CrashPoint | None:
    """The open turn a crash left in ``session``'s log, or None when every turn is closed."""
    open_turn: int | None = None
    cut: list[SessionEvent] = []  # visible chunks of a stream with no anchor yet
    step = None
    answered = False
    for event in session.events:
        kind = event.type
        if kind == "turn/start":
            open_turn, cut, answered = event.turn, [], False
        elif kind == "turn/end":
            open_turn, cut = None, []
        elif kind == "request/header":
            cut, step, answered = [], event.data.get("step"), False
        elif kind == "assistant/chunk":
            if event.data.get("kind") in ("text", "reasoning"):
                cut.append(event)
        elif kind == "assistant/message":
            cut = []
            answered = not event.data.get("tool_calls") and not event.data.get("interrupted")
        elif kind in ("user/message", "steering/message", "tool/result"):
            answered = False
    if open_turn is None:
        return None
    return CrashPoint(open_turn, step, tuple(cut), answered and not cut)


def _keep_cut_stream(session: Session, point: CrashPoint) -> None:
    # A stream cut by the crash keeps what the user saw, as a cancelled one does.
    cut = point.cut
    if not cut:
        return
    session.append(
        _log.ASSISTANT_MESSAGE,
        _log.assistant_message(
            step=point.step,
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
        point.turn,
    )


def _answer_interrupted(
    session: Session, turn: int, call: ToolCall, logged: bool, code: str, text: str
) -> None:
    if not logged:
        session.append(_log.TOOL_CALL, _log.tool_call(call), turn)
    session.append(
        _log.TOOL_RESULT, _log.tool_result(call, text, is_error=True, error_code=code), turn
    )


def recover_crashed_turn(session: Session) -> None:
    """Close a turn a crash left open, so the history is valid for every provider.

    A stream cut by the crash keeps what the user saw, as a cancelled one does: an
    ``interrupted`` anchor citing its text and reasoning chunks. Calls without a result get a
    synthetic ``INTERRUPTED`` result, except calls parked for approval: they stay unanswered
    and pending. Then ``turn/end`` records ``aborted`` (``suspended`` when calls await
    approval) with cause ``crash``.
    """
    point = crash_point(session)
    if point is None:
        return
    open_turn = point.turn
    _keep_cut_stream(session, point)
    awaiting = {p.call_id for p in session.awaiting_approval}
    for call, logged in session.unanswered:
        if call.id in awaiting:
            continue  # still the person's to answer: pending again once resumed
        _answer_interrupted(session, open_turn, call, logged, "INTERRUPTED",
                            "Error: the process stopped before this call finished")
    reason = "suspended" if awaiting else "aborted"
    session.append(_log.TURN_END, _log.turn_end(open_turn, reason, cause="crash"), open_turn)


INTERRUPTED_BY_CRASH: Final = "INTERRUPTED_BY_CRASH"
CUT_BY_CRASH: Final = (
    "Your previous reply was cut off when the process running this conversation stopped."
    " Continue from where it stopped."
)


def interrupted_by_crash(call: ToolCall) -> ToolResult:
    """The answer to a call a crash cut that is not run again (its tool is not idempotent)."""
    return ToolResult.error(
        INTERRUPTED_BY_CRASH,
        f"the process stopped while {call.name!r} ran, and it was not run again (it is not"
        " idempotent): it may or may not have taken effect",
    )


@attrs.frozen(slots=True)
class Continuation:
    """A crashed turn taken up again: the calls to run again, and where its steps go on."""

    turn: int
    step: int
    # Every call the crash left without a result, in the model's order, with whether its
    # tool/call is logged; those in ``interrupted`` are answered INTERRUPTED_BY_CRASH, the
    # others (idempotent) run again.
    calls: tuple[tuple[ToolCall, bool], ...]
    interrupted: frozenset[str]
    answered: bool


def continue_crashed_turn(
    session: Session, idempotent: Callable[[str], bool]
) -> Continuation | None:
    """Take up the turn a crash left open: record ``turn/resumed`` at the crash point and
    keep a cut stream's seen prefix as interrupted. Returns the calls without a result: the
    driver runs again those whose tool is ``idempotent(name)`` and answers the others
    ``INTERRUPTED_BY_CRASH`` (so the model can decide), in the model's order. None when no
    turn is open."""
    point = crash_point(session)
    if point is None:
        return None
    after = session.last_seq
    unanswered = tuple(session.unanswered)
    rerun = tuple((c, logged) for c, logged in unanswered if idempotent(c.name))
    again = {c.id for c, _ in rerun}
    lost = tuple((c, logged) for c, logged in unanswered if c.id not in again)
    session.append(
        _log.TURN_RESUMED,
        _log.turn_resumed(
            point.turn, after, point.step, tuple(c.id for c, _ in rerun),
            tuple(c.id for c, _ in lost),
        ),
        point.turn,
    )
    _keep_cut_stream(session, point)
    if point.cut:
        # Two assistant replies in a row are refused by some providers: the model is told,
        # between them, why its reply stops short.
        session.append(
            _log.STEERING_MESSAGE,
            _log.claimed_message(
                new_message_id(), CUT_BY_CRASH, FrozenDict(kind="crashed-turn")
            ),
            point.turn,
        )
    return Continuation(
        point.turn, point.step or 0, unanswered, frozenset(c.id for c, _ in lost),
        point.answered,
    )
