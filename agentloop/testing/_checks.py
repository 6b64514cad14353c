"""Checkers for logs, histories and inbox fates: facts that hold whatever the interleaving.

Each raises ``AssertionError`` naming the offending seq or message, what was found and what was
expected, with the neighbouring entries quoted, so a failing race can be read without a debugger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .._events import Event, InboxClaimed, InboxDiscarded, InboxInserted
from .._inbox import Inbox
from .._model import InboxMessage, Message, SessionEvent

if TYPE_CHECKING:
    from .._context import Context
    from .._session import Session

__all__ = ["check_log", "check_history", "check_inbox", "record_events"]

# Events that belong to a turn: they carry its number and never appear between turns.
_IN_TURN = frozenset({
    "user/message", "steering/message", "request/header", "assistant/chunk",
    "assistant/message", "tool/call", "tool/result",
})
_APPROVAL = "tool/approval-requested"


def _show_event(e: SessionEvent) -> str:
    keys = ("call_id", "name", "step", "kind", "reason", "message_id", "source_event_seqs")
    shown = {k: e.data[k] for k in keys if k in e.data}
    details = ", ".join(f"{k}={v!r}" for k, v in shown.items())
    return f"seq {e.seq} {e.type} (turn {e.turn}){': ' + details if details else ''}"


def _around(events: Sequence[SessionEvent], index: int, width: int = 3) -> str:
    lo, hi = max(0, index - width), min(len(events), index + width + 1)
    lines = [("  > " if i == index else "    ") + _show_event(events[i]) for i in range(lo, hi)]
    return "\n".join(lines)


def check_log(
    session: Session | Sequence[SessionEvent],
    *,
    quiescent: bool = True,
    disposed_at: int | None = None,
) -> None:
    """Check a session's durable log (a :class:`~agentloop.Session` or its events).

    - seqs run 1, 2, 3, ... with no gap or repeat;
    - turns are numbered 1, 2, 3, ..., each ``turn/start`` closed by one ``turn/end`` of the
      same number before the next opens, and turn-scoped events (messages, chunks, anchors,
      tool calls and results) lie inside an open turn and carry its number;
    - each ``tool/call`` has at most one ``tool/result``, after it, and results come in the
      order of their calls (calls parked for approval may be answered later);
    - every ``assistant/message`` anchor's ``source_event_seqs`` name earlier
      ``assistant/chunk`` events of the same turn and step, each cited by one anchor only;
    - every ``tool/call`` is a call of an earlier ``assistant/message`` of its turn, and its
      result lies in that same turn (a call parked for approval may be answered in a later
      one);
    - with ``quiescent`` (the default: the agent is idle or disposed) the last turn is closed
      and every call not awaiting approval has its result, including calls an anchor made
      that were never logged as ``tool/call``;
    - with ``disposed_at`` (the log's length when its agent was disposed) nothing follows it.
    """
    events: Sequence[SessionEvent] = (
        session if isinstance(session, Sequence) else session.events
    )
    walk = _LogWalk(events)
    for i, e in enumerate(events):
        walk.seq(i, e)
        walk.turn(i, e)
        walk.tool(i, e)
        walk.anchor(i, e)
    if quiescent and events:
        walk.quiescent()
    _check_calls(events, quiescent=quiescent, fail=walk.fail)
    if disposed_at is not None and len(events) > disposed_at:
        walk.fail(disposed_at, f"seq {events[disposed_at].seq} ({events[disposed_at].type}) "
                               f"was appended after the agent was disposed at seq "
                               f"{disposed_at}; expected nothing after disposal")


class _LogWalk:
    """What :func:`check_log` remembers while it walks a log, one method per group of rules."""

    def __init__(self, events: Sequence[SessionEvent]) -> None:
        self.events = events
        self.open_turn: int | None = None
        self.last_turn = 0
        self.calls: dict[str, int] = {}  # call_id -> index of its tool/call
        self.answered: dict[str, int] = {}
        self.parked: set[str] = set()
        self.order: list[str] = []  # calls in log order, for the result-order rule
        self.chunks: dict[int, tuple[int | None, Any]] = {}  # seq -> (turn, step) of a chunk
        self.cited: dict[int, int] = {}  # chunk seq -> anchor seq

    def fail(self, index: int, message: str) -> None:
        raise AssertionError(f"{message}\n{_around(self.events, index)}")

    def seq(self, i: int, e: SessionEvent) -> None:
        if e.seq != i + 1:
            self.fail(i, f"event #{i + 1} of the log has seq {e.seq}, expected seq {i + 1}: "
                         "seqs must run from 1 without gaps or repeats")

    def turn(self, i: int, e: SessionEvent) -> None:
        """Turns open and close in order; turn-scoped events lie inside their turn."""
        open_turn = self.open_turn
        if e.type == "turn/start":
            if open_turn is not None:
                self.fail(i, f"seq {e.seq}: turn {e.turn} starts while turn {open_turn} is "
                             f"still open; expected a turn/end of turn {open_turn} first")
            if e.turn != self.last_turn + 1:
                self.fail(i, f"seq {e.seq}: turn/start numbers its turn {e.turn}, expected "
                             f"turn {self.last_turn + 1} (turns are numbered 1, 2, 3, ... per "
                             "session)")
            self.open_turn = e.turn
            self.last_turn = e.turn if e.turn is not None else self.last_turn
        elif e.type == "turn/end":
            if open_turn is None:
                self.fail(i, f"seq {e.seq}: turn/end of turn {e.turn} while no turn is open; "
                             "expected a turn/start before it")
            if e.turn != open_turn:
                self.fail(i, f"seq {e.seq}: turn/end says turn {e.turn}, but turn {open_turn} "
                             "is the one open")
            self.open_turn = None
        elif e.type in _IN_TURN:
            if open_turn is None:
                self.fail(i, f"seq {e.seq}: {e.type} outside any turn; expected it between a "
                             "turn/start and its turn/end")
            if e.turn is not None and e.turn != open_turn:
                self.fail(i, f"seq {e.seq}: {e.type} says turn {e.turn} inside turn "
                             f"{open_turn}")

    def tool(self, i: int, e: SessionEvent) -> None:
        """Each call once; at most one result per call, after it, in call order."""
        if e.type == "tool/call":
            cid = e.data.get("call_id")
            if not isinstance(cid, str):
                self.fail(i, f"seq {e.seq}: tool/call without a call_id")
            assert isinstance(cid, str)
            if cid in self.calls:
                self.fail(i, f"seq {e.seq}: call_id {cid!r} is called a second time (first at "
                             f"seq {self.events[self.calls[cid]].seq}); expected each call "
                             "once")
            self.calls[cid] = i
            self.order.append(cid)
        elif e.type == _APPROVAL:
            cid = e.data.get("call_id")
            if isinstance(cid, str):
                self.parked.add(cid)
        elif e.type == "tool/result":
            self.result(i, e)

    def result(self, i: int, e: SessionEvent) -> None:
        cid = e.data.get("call_id")
        if cid not in self.calls:
            self.fail(i, f"seq {e.seq}: tool/result for call_id {cid!r}, which has no earlier "
                         "tool/call; expected the call to be logged before its result")
        assert isinstance(cid, str)
        if cid in self.answered:
            self.fail(i, f"seq {e.seq}: a second tool/result for call_id {cid!r} (the first "
                         f"is seq {self.events[self.answered[cid]].seq}); expected exactly "
                         "one")
        if cid not in self.parked:
            waiting = self.waiting()
            if waiting and waiting[0] != cid:
                self.fail(i, f"seq {e.seq}: the result of {cid!r} comes before the result of "
                             f"{waiting[0]!r}, which was called first (seq "
                             f"{self.events[self.calls[waiting[0]]].seq}); results must keep "
                             "call order")
        self.answered[cid] = i

    def waiting(self) -> list[str]:
        """Calls without a result that are not parked for approval, in call order."""
        return [c for c in self.order if c not in self.answered and c not in self.parked]

    def anchor(self, i: int, e: SessionEvent) -> None:
        """An anchor cites earlier chunks of its own turn and step, each chunk once."""
        if e.type == "assistant/chunk":
            self.chunks[e.seq] = (e.turn, e.data.get("step"))
            return
        if e.type != "assistant/message":
            return
        events, step = self.events, e.data.get("step")
        for source in e.data.get("source_event_seqs", ()) or ():
            if source not in self.chunks:
                kind = (
                    events[source - 1].type if isinstance(source, int)
                    and 0 < source <= len(events) else "no such event"
                )
                self.fail(i, f"seq {e.seq}: the anchor cites seq {source!r} as a source, "
                             f"which is not an earlier assistant/chunk ({kind})")
            turn, chunk_step = self.chunks[source]
            if (turn, chunk_step) != (e.turn, step):
                self.fail(i, f"seq {e.seq}: the anchor of turn {e.turn} step {step} cites "
                             f"chunk seq {source}, which belongs to turn {turn} step "
                             f"{chunk_step}")
            if source in self.cited:
                self.fail(i, f"seq {e.seq}: the anchor cites chunk seq {source}, already "
                             f"cited by the anchor at seq {self.cited[source]}")
            self.cited[source] = e.seq

    def quiescent(self) -> None:
        """An idle agent's log: the last turn closed, every call not parked answered."""
        events = self.events
        end = len(events) - 1
        if self.open_turn is not None:
            self.fail(end, f"turn {self.open_turn} is still open at the end of the log (seq "
                           f"{events[end].seq}); expected a turn/end once the agent is idle")
        missing = self.waiting()
        if missing:
            first = self.calls[missing[0]]
            self.fail(first, f"call_id {missing[0]!r} (seq {events[first].seq}) never got a "
                             "tool/result; expected every call answered by the end of its "
                             "turn")


def _check_calls(
    events: Sequence[SessionEvent], *, quiescent: bool, fail: Callable[[int, str], None]
) -> None:
    """Calls against the anchors that made them: logged calls were made, results stay in
    their call's turn, and at quiescence every call an anchor made is answered."""
    made: dict[str, tuple[int, int | None]] = {}  # call id -> (index of its anchor, turn)
    parked: set[str] = set()
    answered: set[str] = set()
    for i, e in enumerate(events):
        cid = e.data.get("call_id")
        if e.type == "assistant/message":
            for call in e.data.get("tool_calls", ()) or ():
                if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                    made.setdefault(call["id"], (i, e.turn))
        elif e.type == _APPROVAL and isinstance(cid, str):
            parked.add(cid)
        elif e.type == "tool/call" and cid not in made:
            fail(i, f"seq {e.seq}: tool/call {cid!r} is not a call of any earlier "
                    "assistant/message; expected calls only as a model made them")
        elif e.type == "tool/result" and isinstance(cid, str):
            answered.add(cid)
            turn = made[cid][1] if cid in made else e.turn
            if cid not in parked and turn != e.turn:
                fail(i, f"seq {e.seq}: the result of {cid!r} comes in turn {e.turn}, but the "
                        f"call was made in turn {turn}; expected it answered in its own turn "
                        "(only calls parked for approval wait for a later one)")
    if quiescent:
        for cid, (i, _turn) in made.items():
            if cid not in answered and cid not in parked:
                fail(i, f"call_id {cid!r} of the anchor at seq {events[i].seq} never got a "
                        "tool/result; expected every call the model made answered by the "
                        "end of its turn")


def _show_message(m: Message) -> str:
    parts: list[str] = [m.role]
    if m.text:
        text = m.text if len(m.text) <= 40 else m.text[:37] + "..."
        parts.append(repr(text))
    if m.tool_calls:
        parts.append("calls " + ", ".join(f"{c.name}#{c.id}" for c in m.tool_calls))
    if m.tool_call_id is not None:
        parts.append(f"answers {m.tool_call_id!r}")
    if m.interrupted:
        parts.append("(interrupted)")
    return " ".join(parts)


def check_history(
    messages: Sequence[Message], provider: Literal["openai", "anthropic"] = "openai"
) -> None:
    """Check that ``provider`` would accept ``messages`` (a derived history) as sent.

    Both providers: every ``tool`` message answers a call of the assistant message before it,
    all of that message's calls are answered before any other message, each exactly once; no
    assistant message is empty (no text, no reasoning and no tool calls). ``"anthropic"`` also
    requires that the history starts with a user message and that roles alternate: tool
    results travel as the user's turn and consecutive user messages are merged into one, but
    two assistant messages in a row are refused; a user message with empty content and an
    empty text block anywhere are refused too. ``"openai"`` refuses an empty list of content
    parts (an assistant message carrying tool calls aside).
    """
    if provider not in ("openai", "anthropic"):
        raise ValueError(f"provider must be 'openai' or 'anthropic', got {provider!r}")

    def fail(index: int, message: str) -> None:
        lo, hi = max(0, index - 3), min(len(messages), index + 4)
        around = "\n".join(
            ("  > " if i == index else "    ") + f"#{i} " + _show_message(messages[i])
            for i in range(lo, hi)
        )
        raise AssertionError(f"{provider} would refuse this history: {message}\n{around}")

    waiting: list[str] = []
    called_at = -1
    seen: set[str] = set()
    previous: str | None = None  # the role the provider sees, for alternation
    for i, m in enumerate(messages):
        problem = _content_problem(m, provider)
        if problem is not None:
            fail(i, f"message #{i} {problem}")
        if m.role == "tool":
            if m.tool_call_id not in waiting:
                why = (
                    "already answered" if m.tool_call_id in seen
                    else "not a call of the assistant message before it"
                )
                fail(i, f"message #{i} is a tool result for {m.tool_call_id!r}, {why}; "
                        "expected results only for the calls of the latest assistant message")
            assert m.tool_call_id is not None
            waiting.remove(m.tool_call_id)
            seen.add(m.tool_call_id)
            previous = "user"
            continue
        if waiting:
            fail(i, f"message #{i} ({m.role}) comes while the calls {waiting} of message "
                    f"#{called_at} are unanswered; expected their tool results first")
        if m.role == "assistant":
            if not m.text and not m.tool_calls and not m.reasoning:
                fail(i, f"message #{i} is an empty assistant message (no text, no tool "
                        "calls); expected it to be left out of the history")
            if provider == "anthropic" and previous == "assistant":
                fail(i, f"message #{i} is an assistant message right after another "
                        "assistant message; expected a user message between them")
            if provider == "anthropic" and previous is None:
                fail(i, f"message #{i} opens the history as an assistant message; expected "
                        "the first message to be the user's")
            ids = [c.id for c in m.tool_calls]
            if len(set(ids)) != len(ids):
                fail(i, f"message #{i} repeats a tool call id: {ids}")
            reused = [c for c in ids if c in seen]
            if reused:
                fail(i, f"message #{i} reuses the tool call id {reused[0]!r} of an earlier "
                        "call; expected ids unique in the history")
            waiting, called_at = ids, i
            previous = "assistant"
        else:
            previous = "user"
    if waiting:
        fail(called_at, f"the calls {waiting} of message #{called_at} are never answered; "
                        "expected a tool result for each before the history ends")


def _content_problem(m: Message, provider: str) -> str | None:
    """What ``provider`` refuses in one message's content, if anything."""
    parts = m.content if isinstance(m.content, tuple) else ()
    if provider == "openai":
        if isinstance(m.content, tuple) and not parts and not m.tool_calls:
            return "has an empty list of content parts; expected text or at least one part"
        return None
    if m.role == "user" and not parts and not m.content:
        return "is a user message with empty content; expected some text or parts"
    for part in parts:
        if isinstance(part, Mapping) and part.get("type") == "text" and not part.get("text"):
            return "has an empty text block; expected every text block to hold text"
    return None


def check_inbox(
    events: Iterable[object], *, pending: Inbox | Iterable[InboxMessage | str] = ()
) -> None:
    """Check that every accepted inbox message had exactly one fate.

    ``events`` are the bus events a test recorded (see :func:`record_events`): every
    :class:`~agentloop.events.InboxInserted` must be followed by exactly one
    :class:`~agentloop.events.InboxClaimed` or :class:`~agentloop.events.InboxDiscarded` of
    the same message, or the message must still be pending (``pending``: an agent's
    ``inbox``, or messages or ids; give the inboxes of every agent the events cover). A claim
    or discard of a message never accepted, a second acceptance of an id, and a pending
    message never accepted fail too. Other
    events are ignored, so a recording of everything can be passed as it is.
    """
    if isinstance(pending, Inbox):
        still_items: Iterable[InboxMessage | str] = (*pending.next_turn, *pending.next_step)
    else:
        still_items = pending
    still = {m if isinstance(m, str) else m.id for m in still_items}
    accepted: dict[tuple[str, str], int] = {}  # (agent, message id) -> index of its event
    key: tuple[str, str]
    fates: dict[tuple[str, str], tuple[str, int]] = {}
    recorded = list(events)

    def name(e: object) -> str:
        return getattr(type(e), "name", type(e).__name__)

    def fail(index: int, message: str) -> None:
        lo, hi = max(0, index - 3), min(len(recorded), index + 4)
        lines = []
        for i in range(lo, hi):
            e = recorded[i]
            msg = getattr(e, "message", None)
            mid = f" {msg.id!r}" if isinstance(msg, InboxMessage) else ""
            lines.append(("  > " if i == index else "    ")
                         + f"#{i} {name(e)}{mid} agent {getattr(e, 'agent_id', '?')!r}")
        raise AssertionError(message + "\n" + "\n".join(lines))

    for i, e in enumerate(recorded):
        if not isinstance(e, (InboxInserted, InboxClaimed, InboxDiscarded)):
            continue
        key = (e.agent_id, e.message.id)
        what = "claimed" if isinstance(e, InboxClaimed) else "discarded"
        if isinstance(e, InboxInserted):
            if key in accepted:
                fail(i, f"event #{i}: message {key[1]!r} of agent {key[0]!r} is accepted a "
                        f"second time (first at event #{accepted[key]}); expected unique ids")
            accepted[key] = i
        elif key not in accepted:
            fail(i, f"event #{i}: message {key[1]!r} of agent {key[0]!r} is {what} but was "
                    "never accepted; expected an agent/inbox/inserted before it")
        elif key in fates:
            before, at = fates[key]
            fail(i, f"event #{i}: message {key[1]!r} of agent {key[0]!r} is {what} after it "
                    f"was already {before} at event #{at}; expected exactly one fate")
        else:
            fates[key] = (what, i)
    ever = {mid for _agent, mid in accepted}
    for mid in sorted(still - ever):
        fail(len(recorded) - 1, f"message {mid!r} is pending but was never accepted; expected "
                                "an agent/inbox/inserted for every pending message")
    for key, i in accepted.items():
        if key not in fates and key[1] not in still:
            fail(i, f"message {key[1]!r} of agent {key[0]!r} (accepted at event #{i}) was "
                    "never claimed or discarded and is not pending; expected exactly one fate")
        if key in fates and key[1] in still:
            what, at = fates[key]
            fail(at, f"message {key[1]!r} of agent {key[0]!r} was {what} at event #{at} but "
                     "is still pending")


def record_events(ctx: Context, *classes: type[Event]) -> list[Any]:
    """Record every event of ``classes`` (default: the inbox events) as it is emitted.

    The handlers are plain functions, so they see each control event at the moment it
    happens; they are removed with ``ctx``'s scope. Feed the list to :func:`check_inbox`.
    """
    out: list[Any] = []
    append: Callable[[Any], None] = out.append
    for cls in classes or (InboxInserted, InboxClaimed, InboxDiscarded):
        ctx.events.on(cls, append)
    return out
