"""A step's streamed chunks kept as their parts in the log until something reads them.

A session keeps each ``assistant/chunk`` of kind "text" as its delta alone, and each of
kind "tool_call" as its four parts, while nothing listens to appends, and makes the event
when the entry is read. Every way of reading the
log must give the event an eager log would have held, whenever it reads and whatever else
was appended between: a property drives a session directly, against a plain list of the
events an eager log holds; the turns below it go through a real agent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

import agentloop
from agentloop import FrozenDict, SessionEvent, ToolCall
from agentloop._bus import EventBus
from agentloop._session import Session
from agentloop.events import SessionEventAppended
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

CHUNK = "assistant/chunk"


def text_event(seq: int, turn: int, step: int, delta: str) -> SessionEvent:
    return SessionEvent(seq, CHUNK, turn, FrozenDict(step=step, kind="text", delta=delta))


def call_event(
    seq: int, turn: int, step: int, parts: tuple[int, str | None, str | None, str]
) -> SessionEvent:
    index, call_id, name, arguments = parts
    delta = FrozenDict(index=index, id=call_id, name=name, arguments=arguments)
    return SessionEvent(seq, CHUNK, turn, FrozenDict(step=step, kind="tool_call", delta=delta))


# The operations both properties below draw from: a step's text writer, a text chunk, and
# the reads and listeners that must not change what the log says.
writer = st.tuples(st.just("writer"), st.integers(1, 4), st.integers(1, 3))
text = st.tuples(st.just("text"), st.text(min_size=1, max_size=3))
read = st.tuples(st.just("read"), st.integers(-40, 40))
iterate = st.tuples(st.just("iterate"),)
# A listener on every session's appends, on this one's ("s"), or on another's only.
listen = st.tuples(st.just("listen"), st.booleans(), st.sampled_from([None, "s", "other"]))


class Ear:
    """A handler on appends that a script turns on and off, and the events it heard."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.heard: list[SessionEvent] = []
        self.stop: Any = None
        self.hears = False  # whether it listens to session "s"

    def listen(self, on: bool, scope: str | None = None) -> None:
        if on and self.stop is None:
            self.stop = self.bus.on(
                SessionEventAppended, lambda e: self.heard.append(e.event), agent_id=scope
            )
            self.hears = scope in (None, "s")
        elif not on and self.stop is not None:
            self.stop()
            self.stop = None
            self.hears = False


def assert_read(session: Session, want: list[SessionEvent], i: int) -> None:
    if -len(want) <= i < len(want):
        assert session.events[i] == want[i]


ops = st.lists(
    st.one_of(
        writer,
        text,
        st.tuples(st.just("call"), st.tuples(
            st.integers(0, 2), st.none() | st.just("call_1"), st.none() | st.just("add"),
            st.sampled_from(["", '{"a"', ": 1}", "{}"]),
        )),
        st.tuples(st.just("other"), st.sampled_from(["turn/start", "turn/end", "request/header"])),
        read,
        st.tuples(st.just("slice"), st.integers(-40, 40), st.integers(-40, 40),
                  st.sampled_from([None, 1, 2, -1, -3])),
        st.tuples(st.just("event_at"), st.integers(0, 40)),
        iterate,
        st.tuples(st.just("open_turn"),),
        listen,
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_read_of_the_log_gives_the_events_an_eager_log_holds(
    script: list[tuple[Any, ...]],
) -> None:
    bus = EventBus()
    session = Session("s", FrozenDict(), bus)
    ear = Ear(bus)
    want: list[SessionEvent] = []  # what a log that made every event at once would hold
    write = None
    step = turn = 0
    open_turn: int | None = None
    for op in script:
        kind = op[0]
        if kind == "writer":
            _, step, turn = op
            write = session.text_writer(step, turn)
        elif kind == "text" and write is not None:
            assert write(op[1]) == len(want) + 1
            want.append(text_event(len(want) + 1, turn, step, op[1]))
        elif kind == "call" and write is not None:
            assert session.append_call_chunk(*op[1]) == len(want) + 1
            want.append(call_event(len(want) + 1, turn, step, op[1]))
        elif kind == "other":
            t = op[1]
            n = len(want) + 1
            data = FrozenDict(turn=n) if t.startswith("turn/") else FrozenDict(step=step)
            assert session.append(t, data, n) == SessionEvent(n, t, n, data)
            want.append(SessionEvent(n, t, n, data))
            if t == "turn/start":
                open_turn = n
            elif t == "turn/end":
                open_turn = None
        elif kind == "read":
            assert_read(session, want, op[1])
        elif kind == "slice":
            s = slice(op[1], op[2], op[3])
            assert list(session.events[s]) == want[s]
        elif kind == "event_at":
            i = op[1]
            assert session.event_at(i) == (want[i] if i < len(want) else None)
        elif kind == "iterate":
            assert list(session.events) == want
        elif kind == "open_turn":
            assert session.open_turn() == open_turn
        elif kind == "listen":
            ear.listen(op[1], op[2])
        assert len(session.events) == session.last_seq == len(want)
    assert list(session.events) == want
    # What was published while something listened is the log's own event, not a copy.
    for event in ear.heard:
        assert session.events[event.seq - 1] is event
    # A read keeps the event it made: a second read gives the same object.
    assert all(a is b for a, b in zip(session.events, session.events, strict=True))


def header_data(
    step: int, config: FrozenDict, messages: int, cache_prefix: int, rewritten: bool,
    after_error: FrozenDict | None, queued: float | None,
) -> FrozenDict:
    optional = {
        "rewritten": True if rewritten else None, "after_error": after_error,
        "queued_seconds": queued,
    }
    return FrozenDict(
        step=step, provider=config["provider"], model=config["model"], config=config,
        adapter_defaults=(), messages=messages, cache_prefix=cache_prefix,
        **{key: value for key, value in optional.items() if value is not None},
    )


CONFIG = FrozenDict(provider="p", model="m", extra=FrozenDict())
CALLS = [ToolCall(f"call_{k}", "add", FrozenDict(a=k)) for k in range(3)]

step_ops = st.lists(
    st.one_of(
        writer,
        text,
        st.tuples(st.just("header"), st.integers(1, 4), st.integers(0, 9), st.integers(0, 9),
                  st.booleans(), st.none() | st.just(FrozenDict(attempt=1)),
                  st.none() | st.floats(0, 2)),
        st.tuples(st.just("anchor"), st.integers(0, 2)),
        st.tuples(st.just("reply"), st.lists(st.integers(0, 2), max_size=2, unique=True),
                  st.sampled_from(["", "hi"]), st.sampled_from([None, "", "hmm"]),
                  st.none() | st.just("sig"), st.none() | st.just(FrozenDict(input_tokens=3)),
                  st.sampled_from([(), (FrozenDict(type="thinking", thinking="hmm"),)]),
                  st.sampled_from([(), (FrozenDict(id="call_0", original_id="c"),)]),
                  st.none() | st.just(FrozenDict(answer=1))),
        st.tuples(st.just("call"), st.integers(0, 2)),
        st.tuples(st.just("result"), st.integers(0, 2), st.sampled_from(["2", "", "Error: x"]),
                  st.booleans(), st.none() | st.just("TOOL_ERROR")),
        st.tuples(st.just("turn/start"),),
        st.tuples(st.just("claimed"), st.sampled_from(["user/message", "steering/message"]),
                  st.sampled_from(["go", ("part",)]), st.none() | st.just(FrozenDict(via="x"))),
        st.tuples(st.just("turn/end"), st.sampled_from(["completed", "aborted"]),
                  st.none() | st.just("user"), st.none() | st.just(FrozenDict(type="E")),
                  st.none() | st.just(FrozenDict(input_tokens=1)), st.sampled_from([None, "", "d"]),
                  st.none() | st.just((FrozenDict(type="object"), "answer"))),
        read,
        iterate,
        listen,
        st.tuples(st.just("close"), st.integers(1, 3), st.integers(0, 50)),
        st.tuples(st.just("text_at"), st.integers(0, 50), st.integers(1, 3)),
    ),
    max_size=50,
)


def closing(
    events: list[SessionEvent], turn: int, start: int
) -> tuple[str, Any, dict[str, int] | None, SessionEvent | None]:
    """What a run's result reads of ``turn``, folded over its made events one by one."""
    text, output, usage = "", None, None
    for event in events[start:]:
        if event.turn != turn:
            continue
        if event.type == "assistant/message":
            text = event.data["content"] or ""
            output = event.data.get("output", output)
            if event.data["usage"] is not None:
                usage = usage or {}
                for key, value in event.data["usage"].items():
                    usage[key] = usage.get(key, 0) + value
        elif event.type == "turn/end":
            return text, output, usage, event
    return text, output, usage, None


@settings(max_examples=300, deadline=None)
@given(step_ops)
# A chunk of an earlier step, of another turn than the latest one's: its own turn is found.
@example([("writer", 1, 1), ("text", "a"), ("writer", 1, 2), ("text", "b"),
          ("text_at", 0, 1), ("text_at", 0, 2), ("text_at", 1, 1), ("text_at", 1, 2)])
# A text chunk and a turn's end read by a text reader, each kept as parts and made at once.
@example([("text", "a"), ("turn/end", "completed", None, None, None, None, None),
          ("listen", True, None), ("text", "b"), ("turn/end", "completed", None, None, None,
                                                  None, None),
          *[("text_at", i, t) for i in range(4) for t in (1, 2)]])
def test_a_steps_header_reply_calls_and_results_read_as_an_eager_log_holds_them(
    script: list[tuple[Any, ...]],
) -> None:
    """A turn's start and end, its claimed messages, and each step's request header, reply
    anchor, tool calls and results are kept as their parts while nothing listens, as chunks
    are: every read gives the event an eager log holds, and what the session derives from
    them (history, unanswered calls, usage, the open turn) is what a session that folded the
    eager events derives."""
    bus = EventBus()
    session = Session("s", FrozenDict(), bus)
    ear = Ear(bus)
    want: list[SessionEvent] = []
    heard: list[int] = []  # the seqs appended while something listened
    step = turn = 1
    for op in script:
        kind, n = op[0], len(want) + 1
        if kind == "writer":
            _, step, turn = op
            session.text_writer(step, turn)
        elif kind == "text":
            session.text_writer(step, turn)(op[1])
            want.append(text_event(n, turn, step, op[1]))
        elif kind == "header":
            _, step, messages, prefix, rewritten, after, queued = op
            assert session.append_request_header(
                turn, step, CONFIG, (), messages, prefix, rewritten, after, queued
            ) == n
            data = header_data(step, CONFIG, messages, prefix, rewritten, after, queued)
            want.append(SessionEvent(n, "request/header", turn, data))
        elif kind == "anchor":
            call = CALLS[op[1]]
            data = FrozenDict(
                step=step, content="", reasoning=None, reasoning_signature=None,
                tool_calls=(FrozenDict(id=call.id, name=call.name, arguments=call.arguments),),
                source_event_seqs=(), finish_reason="tool_calls", usage=None,
                interrupted=False,
            )
            session.append("assistant/message", data, turn)
            want.append(SessionEvent(n, "assistant/message", turn, data))
        elif kind == "turn/start":
            turn = session.turns + 1
            assert session.append_turn_start(turn) == n
            want.append(SessionEvent(n, "turn/start", turn, FrozenDict(turn=turn)))
        elif kind == "claimed":
            _, type_, content, source = op
            assert session.append_claimed(type_, f"m{n}", content, source, turn) == n
            data = FrozenDict(message_id=f"m{n}", content=content, source=source)
            want.append(SessionEvent(n, type_, turn, data))
        elif kind == "turn/end":
            _, reason, cause, error, usage, detail, output = op
            assert session.append_turn_end(
                turn, reason, cause, error, usage, detail, output
            ) == n
            ended: dict[str, Any] = {"turn": turn, "reason": reason}
            for key, value in (("cause", cause), ("error", error), ("usage", usage)):
                if value is not None:
                    ended[key] = value
            if detail:
                ended["detail"] = detail
            if output is not None:
                ended["output_schema"], ended["output_name"] = output
            want.append(SessionEvent(n, "turn/end", turn, FrozenDict(ended)))
        elif kind == "reply":
            _, picked, content, reasoning, sig, usage, blocks, renamed, output = op
            calls = tuple(CALLS[k] for k in picked)
            assert session.append_reply(
                turn, step, content, reasoning, sig, calls, (1, 2), "stop", usage, renamed,
                blocks, output,
            ) == n
            fields: dict[str, Any] = {
                "step": step, "content": content, "reasoning": reasoning,
                "reasoning_signature": sig,
                "tool_calls": tuple(
                    FrozenDict(id=c.id, name=c.name, arguments=c.arguments) for c in calls
                ),
                "source_event_seqs": (1, 2), "finish_reason": "stop", "usage": usage,
                "interrupted": False,
            }
            if blocks:
                fields["reasoning_blocks"] = blocks
            if output is not None:
                fields["output"] = output
            if renamed:
                fields["renamed_tool_call_ids"] = renamed
            want.append(SessionEvent(n, "assistant/message", turn, FrozenDict(fields)))
        elif kind == "call":
            call = CALLS[op[1]]
            assert session.append_tool_call(call, turn) == n
            data = FrozenDict(call_id=call.id, name=call.name, arguments=call.arguments)
            want.append(SessionEvent(n, "tool/call", turn, data))
        elif kind == "result":
            _, k, content, is_error, code = op
            call = CALLS[k]
            assert session.append_tool_result(call, content, is_error, code, turn) == n
            data = FrozenDict(
                call_id=call.id, name=call.name, content=content, is_error=is_error,
                error_code=code,
            )
            want.append(SessionEvent(n, "tool/result", turn, data))
        elif kind == "read":
            assert_read(session, want, op[1])
        elif kind == "iterate":
            assert list(session.events) == want
        elif kind == "listen":
            ear.listen(op[1], op[2])
        elif kind == "close":
            # A run's result: read from the entries as they are kept, without making them.
            _, of, start = op
            start %= len(want) + 1
            assert session.turn_close(of, start) == closing(want, of, start)
        elif kind == "text_at":
            # A reader of a turn's text: a delta, something to pass over, or its end.
            _, i, of = op
            i %= len(want) + 1
            got = session.text_at(i, of)
            event = want[i] if i < len(want) else None
            mine = event is not None and event.turn == of
            if got is None:
                assert event is None or (mine and event.type == "turn/end")
            elif got:
                assert mine and event.type == CHUNK and event.data["kind"] == "text"
                assert event.data["delta"] == got
            else:
                assert event is not None and not (mine and event.type == "turn/end")
                assert not (mine and event.type == CHUNK and event.data["kind"] == "text")
        assert session.last_seq == len(want)
        if ear.hears and kind not in (
            "writer", "read", "iterate", "listen", "close", "text_at"
        ):
            heard.append(len(want))
    assert list(session.events) == want
    # A listener heard each event appended while it listened, once, as the log holds it.
    assert [e.seq for e in ear.heard] == heard
    assert all(session.events[e.seq - 1] is e for e in ear.heard)
    # The same events folded one by one, as a stored log is.
    eager = Session("s", FrozenDict(), EventBus())
    eager.load(want)
    assert list(session.messages()) == list(eager.messages())
    assert session.unanswered == eager.unanswered
    assert session.usage == eager.usage
    assert session.turn_usage == eager.turn_usage
    assert (session.turns, session.open_turn()) == (eager.turns, eager.open_turn())
    assert session.unique_call_id("call_0", set()) == eager.unique_call_id("call_0", set())


def test_a_log_read_while_it_grows_sees_the_appends_that_follow() -> None:
    session = Session("s", FrozenDict(), EventBus())
    write = session.text_writer(1, 1)
    write("a")
    seen = []
    for event in session.events:
        seen.append(event)
        if len(seen) == 1:
            write("b")
    assert seen == [text_event(1, 1, 1, "a"), text_event(2, 1, 1, "b")]


def model_of(
    chunks: list[str], reads: list[list[SessionEvent]], session_of: list[Session]
) -> FunctionModel:
    """Streams ``chunks`` then a tool call on the first step and ``chunks`` on the second,
    reading the whole log of ``session_of[0]`` back after every other chunk."""

    async def stream(request: LLMRequest) -> AsyncIterator[Any]:
        await trio.lowlevel.checkpoint()
        for i, c in enumerate(chunks):
            if i % 2:
                reads.append(list(session_of[0].events))
            yield TextDelta(c)
        if request.step == 1:
            yield ToolCallDelta(0, id=f"call_{request.step}", name="add", arguments='{"a": 1}')
            yield Finish("tool_calls")
        else:
            yield Finish("stop")

    return FunctionModel(stream)


async def add(a: int) -> int:
    """Add one.

    Args:
        a: the number.
    """
    return a + 1


async def run_turn(
    rt: agentloop.Context, session_id: str, *, subscribe_after: int | None
) -> tuple[list[SessionEvent], list[SessionEvent], list[list[SessionEvent]]]:
    """One two-step turn; a subscriber joins after ``subscribe_after`` events (None: none).
    Returns the log, what the subscriber received, and the model's reads of the log."""
    reads: list[list[SessionEvent]] = []
    chunks = ["tok0 ", "t\u00e9 ", "\U0001f600", "tok3 ", "tok4 "]
    session_of: list[Session] = []
    model = model_of(chunks, reads, session_of)
    rt.llm.register(session_id, model)
    handle = await rt.agents.create(
        session_id=session_id, agent_options=agentloop.AgentOptions(provider=session_id, model="m")
    )
    session_of.append(handle.agent.session)
    received: list[SessionEvent] = []
    async with handle, trio.open_nursery() as nursery:
        if subscribe_after is not None:

            async def subscriber(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                session = handle.agent.session
                while len(session.events) < subscribe_after:
                    await trio.lowlevel.checkpoint()
                async with rt.events.subscribe(SessionEventAppended) as rx:
                    task_status.started()
                    async for e in rx:
                        received.append(e.event)
                        if e.event.type == "turn/end":
                            return

            nursery.start_soon(subscriber)
        with trio.fail_after(10):
            handle.agent.followup("go")
            await handle.agent.wait_idle()
        log = list(handle.agent.session.events)
    return log, received, reads


async def test_a_turns_log_is_the_same_read_late_read_early_or_published(
    rt: agentloop.Context,
) -> None:
    rt.tools.tool(add, concurrency="parallel")
    quiet, _, reads = await run_turn(rt, "quiet", subscribe_after=None)
    assert [e.type for e in quiet].count(CHUNK) == 11  # ten of text, one of the call
    # Every read the model made mid-stream is a prefix of the final log.
    assert reads and all(r == quiet[: len(r)] for r in reads)
    for join in (0, 5, 12):
        heard, received, _ = await run_turn(rt, f"heard{join}", subscribe_after=join)
        # Only the session ids differ between the runs: compare what the log says.
        assert [(e.seq, e.type, e.turn) for e in heard] == [(e.seq, e.type, e.turn) for e in quiet]
        assert [e.data.get("delta") for e in heard] == [e.data.get("delta") for e in quiet]
        assert received == heard[len(heard) - len(received):]
        assert received[-1].type == "turn/end"
    anchor = next(e for e in quiet if e.type == "assistant/message")
    sources = [quiet[s - 1] for s in anchor.data["source_event_seqs"]]
    assert "".join(e.data["delta"] for e in sources if e.data["kind"] == "text") == (
        anchor.data["content"]
    )


def test_a_turn_with_a_text_chunk_open_at_a_crash_point_is_found() -> None:
    """``open_turn`` reads back over text entries to the turn they are in."""
    from agentloop._session import crash_point

    bus = EventBus()
    session = Session("crash", FrozenDict(), bus)
    session.append("turn/start", FrozenDict(turn=1), 1)
    session.append("user/message", FrozenDict(message_id="m", content="go", source=None), 1)
    write = session.text_writer(1, 1)
    write("half an ans")
    assert session.open_turn() == 1
    point = crash_point(session)
    assert point is not None and point.turn == 1
    assert [e.data["delta"] for e in point.cut] == ["half an ans"]


def test_a_session_read_and_written_is_freed_without_the_cycle_collector() -> None:
    """Its log view holds the session's lists, not the session: no cycle keeps it."""
    import gc

    def alive() -> int:
        return sum(type(o) is Session for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = alive()
        session = Session("s", FrozenDict(), EventBus())
        write = session.text_writer(1, 1)
        write("a")
        session.append_call_chunk(0, "call_1", "add", "{}")
        assert [e.seq for e in session.events] == [1, 2]
        assert session.event_at(1) is not None
        del session, write
        assert alive() == before
    finally:
        gc.enable()
