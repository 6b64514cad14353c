"""``agentloop.testing``: each checker against broken logs, histories and inbox records, and
the doubles, the network block, race runs and stream record/replay against real parts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import loopback
import pytest
import trio
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import agentloop
from agentloop import events as ev
from agentloop._json import FrozenDict, freeze
from agentloop._schema import validate_arguments
from agentloop.llm import OpenAIChatAdapter
from agentloop.testing import (
    Race,
    TestModel,
    block_network,
    check_history,
    check_inbox,
    check_log,
    example_arguments,
    record_events,
    record_stream,
    replay_stream,
    run_race,
)
from agentloop.testing import strategies as als

# --- building logs --------------------------------------------------------------------------


def E(seq: int, type_: str, turn: int | None, /, **data: Any) -> agentloop.SessionEvent:
    frozen = freeze(data)
    assert isinstance(frozen, FrozenDict)
    return agentloop.SessionEvent(seq, type_, turn, frozen)


def renumber(events: Sequence[agentloop.SessionEvent]) -> list[agentloop.SessionEvent]:
    return [attrs.evolve(e, seq=i + 1) for i, e in enumerate(events)]


def turn_events(turn: int, first: int, calls: Sequence[str] = ()) -> list[agentloop.SessionEvent]:
    """A complete turn from seq ``first``: a prompt, a chunked anchor, its calls answered."""
    s = first
    out = [E(s, "turn/start", turn, turn=turn),
           E(s + 1, "user/message", turn, message_id=f"m{turn}", content="hi", source=None),
           E(s + 2, "request/header", turn, step=1),
           E(s + 3, "assistant/chunk", turn, step=1, kind="text", delta="ok "),
           E(s + 4, "assistant/chunk", turn, step=1, kind="text", delta="then"),
           E(s + 5, "assistant/message", turn, step=1, content="ok then",
             source_event_seqs=[s + 3, s + 4],
             tool_calls=[{"id": c, "name": "t", "arguments": {}} for c in calls])]
    s += 6
    for c in calls:
        out.append(E(s, "tool/call", turn, call_id=c, name="t", arguments={}))
        s += 1
    for c in calls:
        out.append(E(s, "tool/result", turn, call_id=c, name="t", content="r", is_error=False))
        s += 1
    out.append(E(s, "turn/end", turn, turn=turn, reason="completed"))
    return out


def good_log() -> list[agentloop.SessionEvent]:
    first = turn_events(1, 1, ["a", "b"])
    return first + turn_events(2, len(first) + 1, ["c"])


def test_a_well_formed_log_passes() -> None:
    check_log(good_log())


def broken(message: str, events: Sequence[agentloop.SessionEvent], **kwargs: Any) -> str:
    with pytest.raises(AssertionError) as info:
        check_log(events, **kwargs)
    text = str(info.value)
    assert message in text, text
    return text


def test_a_seq_gap_names_the_event_and_the_expected_seq() -> None:
    log = good_log()
    del log[3]
    text = broken("event #4 of the log has seq 5, expected seq 4", log)
    assert "  > seq 5 assistant/chunk" in text  # the offending event is pointed at


def test_a_repeated_seq_is_refused() -> None:
    log = good_log()
    log.insert(3, log[2])
    broken("has seq 3, expected seq 4", log)


def test_a_turn_opened_inside_another() -> None:
    log = good_log()
    end = next(i for i, e in enumerate(log) if e.type == "turn/end")
    broken("turn 2 starts while turn 1 is still open", renumber(log[:end] + log[end + 1:]))


def test_a_turn_end_of_another_turn() -> None:
    log = good_log()
    log[-1] = attrs.evolve(log[-1], turn=7)
    broken("turn/end says turn 7, but turn 2 is the one open", log)


def test_turn_numbers_must_count_up_from_one() -> None:
    log = [attrs.evolve(e, turn=3 if e.turn == 1 else e.turn) for e in turn_events(1, 1)]
    broken("numbers its turn 3, expected turn 1", log)


def test_an_event_outside_any_turn() -> None:
    log = good_log()
    end = next(i for i, e in enumerate(log) if e.type == "turn/end")
    broken("tool/call outside any turn", renumber([*log[: end + 1], log[7], *log[end + 1:]]))


def test_a_result_without_its_call() -> None:
    log = turn_events(1, 1, ["a"])
    call = next(i for i, e in enumerate(log) if e.type == "tool/call")
    broken("tool/result for call_id 'a', which has no earlier tool/call",
           renumber(log[:call] + log[call + 1:]))


def test_a_second_result_for_one_call() -> None:
    log = turn_events(1, 1, ["a"])
    result = next(i for i, e in enumerate(log) if e.type == "tool/result")
    broken("a second tool/result for call_id 'a'", renumber(log[:result + 1] + log[result:]))


def test_a_call_made_twice() -> None:
    log = turn_events(1, 1, ["a"])
    call = next(i for i, e in enumerate(log) if e.type == "tool/call")
    broken("call_id 'a' is called a second time", renumber(log[:call + 1] + log[call:]))


def test_results_out_of_call_order() -> None:
    log = turn_events(1, 1, ["a", "b"])
    i = next(i for i, e in enumerate(log) if e.type == "tool/result")
    log[i], log[i + 1] = log[i + 1], log[i]
    broken("the result of 'b' comes before the result of 'a'", renumber(log))


def test_a_call_parked_for_approval_may_be_answered_later() -> None:
    log = turn_events(1, 1, ["a", "b"])
    i = next(i for i, e in enumerate(log) if e.type == "tool/result")
    parked = E(0, "tool/approval-requested", 1, call_id="a", name="t", arguments={}, prompt="?")
    log[i], log[i + 1] = log[i + 1], log[i]
    check_log(renumber([*log[:i], parked, *log[i:]]))


def test_an_unanswered_call_at_quiescence() -> None:
    log = turn_events(1, 1, ["a"])
    i = next(i for i, e in enumerate(log) if e.type == "tool/result")
    broken("call_id 'a' (seq 7) never got a tool/result", renumber(log[:i] + log[i + 1:]))


def test_an_open_turn_is_fine_unless_quiescent() -> None:
    log = turn_events(1, 1)[:-1]
    check_log(log, quiescent=False)
    broken("turn 1 is still open at the end of the log", log)


def test_an_anchor_citing_something_that_is_not_a_chunk() -> None:
    log = good_log()
    log[5] = attrs.evolve(log[5], data=log[5].data | {"source_event_seqs": (4, 3)})
    broken("cites seq 3 as a source, which is not an earlier assistant/chunk (request/header)",
           log)


def test_an_anchor_citing_a_chunk_of_another_step() -> None:
    log = good_log()
    log[4] = attrs.evolve(log[4], data=log[4].data | {"step": 2})
    broken("the anchor of turn 1 step 1 cites chunk seq 5, which belongs to turn 1 step 2", log)


def test_a_chunk_cited_by_two_anchors() -> None:
    log = good_log()
    anchor = next(e for e in log if e.type == "assistant/message" and e.turn == 2)
    log[anchor.seq - 1] = attrs.evolve(anchor, data=anchor.data | {"source_event_seqs": (4,)})
    broken("which belongs to turn 1 step 1", log)
    first = next(e for e in log if e.type == "assistant/message")
    again = E(0, "assistant/message", 1, step=1, content="", source_event_seqs=[4])
    log = turn_events(1, 1)
    broken("already cited by the anchor at seq 6",
           renumber([*log[: first.seq], again, *log[first.seq:]]))


def test_nothing_may_follow_disposal() -> None:
    log = good_log()
    check_log(log, disposed_at=len(log))
    broken(f"was appended after the agent was disposed at seq {len(log) - 1}", log,
           disposed_at=len(log) - 1)


# Valid logs of any shape, and mutations each of which must be caught.
calls_st = st.lists(st.lists(st.sampled_from("abcdef"), max_size=3, unique=True),
                    min_size=1, max_size=4)


def log_of(plan: list[list[str]]) -> list[agentloop.SessionEvent]:
    out: list[agentloop.SessionEvent] = []
    for t, calls in enumerate(plan, start=1):
        out.extend(turn_events(t, len(out) + 1, [f"{c}{t}" for c in calls]))
    return out


@pytest.mark.slow
@settings(max_examples=examples(10))
@given(plan=calls_st, data=st.data())
def test_check_log_accepts_valid_logs_and_catches_each_mutation(
    plan: list[list[str]], data: st.DataObject
) -> None:
    log = log_of(plan)
    check_log(log)
    kinds = ["turn/end", "turn/start", "tool/result", "tool/call", "assistant/chunk"]
    kind = data.draw(st.sampled_from([k for k in kinds if any(e.type == k for e in log)]))
    at = data.draw(st.sampled_from([i for i, e in enumerate(log) if e.type == kind]))
    # A repeated chunk is only an uncited chunk (as a failed call leaves), which is valid.
    how = data.draw(st.sampled_from(["drop"] if kind == "assistant/chunk" else ["drop", "repeat"]))
    mutated = log[:at] + log[at + 1:] if how == "drop" else log[:at + 1] + log[at:]
    with pytest.raises(AssertionError, match=r"seq \d+"):
        check_log(renumber(mutated))


# --- histories ------------------------------------------------------------------------------

U = agentloop.Message("user", "hi")


def A(text: str = "ok", *calls: str) -> agentloop.Message:
    return agentloop.Message("assistant", text, tool_calls=tuple(
        agentloop.ToolCall(c, "t", FrozenDict()) for c in calls))


def T(call: str) -> agentloop.Message:
    return agentloop.Message("tool", "r", tool_call_id=call, name="t")


GOOD = [U, A("", "a", "b"), T("a"), T("b"), A("done"), U, A("again")]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_valid_history_passes(provider: Any) -> None:
    check_history(GOOD, provider)


@pytest.mark.parametrize(("history", "message"), [
    ([U, A("", "a"), U], "message #2 (user) comes while the calls ['a'] of message #1"),
    ([U, A("", "a"), T("b")], "tool result for 'b', not a call of the assistant message"),
    ([U, A("", "a"), T("a"), T("a")], "tool result for 'a', already answered"),
    ([U, T("a")], "tool result for 'a', not a call"),
    ([U, A("")], "message #1 is an empty assistant message"),
    ([U, A("", "a")], "the calls ['a'] of message #1 are never answered"),
    ([U, A("", "a", "a"), T("a"), T("a")], "repeats a tool call id"),
    ([U, A("", "a"), T("a"), A("", "a"), T("a")], "reuses the tool call id 'a'"),
])
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_histories_no_provider_accepts(history: list[agentloop.Message], message: str,
                                       provider: Any) -> None:
    with pytest.raises(AssertionError, match=f"{provider} would refuse") as info:
        check_history(history, provider)
    assert message in str(info.value)
    assert "  > #" in str(info.value)  # the offending message is pointed at


def test_anthropic_wants_alternation_and_a_user_first() -> None:
    check_history([U, A("one"), A("two")], "openai")
    with pytest.raises(AssertionError, match="right after another assistant message"):
        check_history([U, A("one"), A("two")], "anthropic")
    check_history([A("hello"), U], "openai")
    with pytest.raises(AssertionError, match="opens the history as an assistant message"):
        check_history([A("hello"), U], "anthropic")
    check_history([U, U, A("merged users are fine")], "anthropic")
    with pytest.raises(ValueError, match="provider"):
        check_history(GOOD, "gemini")  # type: ignore[arg-type]


@pytest.mark.slow
@settings(max_examples=examples(10))
@given(plan=calls_st, data=st.data())
def test_check_history_catches_a_lost_or_moved_tool_result(
    plan: list[list[str]], data: st.DataObject
) -> None:
    history: list[agentloop.Message] = []
    for t, calls in enumerate(plan):
        ids = [f"{c}{t}" for c in calls]
        history += [U, A("x", *ids), *[T(c) for c in ids], *([A("done")] if ids else [])]
    check_history(history, "openai")
    check_history(history, "anthropic")
    tools = [i for i, m in enumerate(history) if m.role == "tool"]
    if not tools:
        return
    at = data.draw(st.sampled_from(tools))
    how = data.draw(st.sampled_from(["drop", "before-call", "repeat"]))
    if how == "drop":
        mutated = history[:at] + history[at + 1:]
    elif how == "repeat":
        mutated = history[:at + 1] + history[at:]
    else:
        call = max(i for i in range(at) if history[i].role == "assistant")
        mutated = [*history[:call], history[at], *history[call:at], *history[at + 1:]]
    with pytest.raises(AssertionError, match=r"message #\d+"):
        check_history(mutated, data.draw(st.sampled_from(["openai", "anthropic"])))


# --- inbox fates ----------------------------------------------------------------------------


def msg(mid: str) -> agentloop.InboxMessage:
    return agentloop.InboxMessage(agentloop.MessageId(mid), "hi")


def ins(mid: str) -> ev.InboxInserted:
    return ev.InboxInserted("a", "next-turn", msg(mid))


def claim(mid: str) -> ev.InboxClaimed:
    return ev.InboxClaimed("a", msg(mid), 1)


def drop(mid: str) -> ev.InboxDiscarded:
    return ev.InboxDiscarded("a", "next-turn", msg(mid))


def test_every_message_with_one_fate_passes() -> None:
    check_inbox([ins("1"), ins("2"), ins("3"), claim("1"), drop("2"), "noise"], pending=["3"])


@pytest.mark.parametrize(("events", "pending", "message"), [
    ([ins("1")], [], "message '1' of agent 'a' (accepted at event #0) was never claimed"),
    ([ins("1"), claim("1"), claim("1")], [], "is claimed after it was already claimed"),
    ([ins("1"), claim("1"), drop("1")], [], "is discarded after it was already claimed"),
    ([claim("1")], [], "is claimed but was never accepted"),
    ([ins("1"), ins("1"), claim("1")], [], "is accepted a second time"),
    ([ins("1"), claim("1")], ["1"], "was claimed at event #1 but is still pending"),
])
def test_inbox_records_without_exactly_one_fate(
    events: list[Any], pending: list[str], message: str
) -> None:
    with pytest.raises(AssertionError) as info:
        check_inbox(events, pending=pending)
    assert message in str(info.value)


async def test_check_inbox_reads_a_live_recording_and_an_inbox(autojump_clock: Any) -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("t", TestModel())
        recorded = record_events(rt)
        async with await rt.agents.create(
            session_id="s", agent_options=agentloop.AgentOptions(provider="t", model="m")
        ) as handle:
            handle.agent.followup("one")
            handle.agent.inject("later")
            await handle.agent.wait_idle()
            handle.agent.inject("still pending")
            check_inbox(recorded, pending=handle.agent.inbox)
            with pytest.raises(AssertionError, match="never claimed or discarded"):
                check_inbox(recorded)


# --- TestModel and example arguments --------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {
        "mode": {"enum": ["fast", "slow"]},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 2},
        "maybe": {"anyOf": [{"type": "null"}, {"type": "number", "exclusiveMinimum": 1}]},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}},
                  "required": ["flag"]},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x"}]},
    }, "required": ["mode", "tags", "inner"]},
    {"type": "object", "properties": {"s": {"type": ["string", "null"], "maxLength": 0}}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_example_arguments_fit_their_schema(schema: dict[str, Any]) -> None:
    value = example_arguments(schema)
    assert validate_arguments(schema, value) == []


async def test_test_model_calls_every_visible_tool_once_then_answers(autojump_clock: Any) -> None:
    ran: list[tuple[str, dict[str, Any]]] = []
    async with agentloop.open_runtime() as rt:
        model = TestModel()
        rt.llm.register("t", model)
        for i, schema in enumerate(SCHEMAS):
            async def run(_i: int = i, **arguments: Any) -> str:
                ran.append((f"tool{_i}", arguments))
                return f"result {_i}"

            rt.tools.register(agentloop.Tool(f"tool{i}", "A tool.", schema, run))
        async with await rt.agents.create(
            session_id="s", agent_options=agentloop.AgentOptions(provider="t", model="m")
        ) as handle:
            handle.agent.followup("go")
            await handle.agent.wait_idle()
            events = handle.agent.session.events
            check_log(events)
            check_history(handle.agent.session.messages(), "anthropic")
    assert sorted(name for name, _ in ran) == ["tool0", "tool1", "tool2"]
    results = [e for e in events if e.type == "tool/result"]
    assert [r.data["is_error"] for r in results] == [False] * 3
    answer = [e for e in events if e.type == "assistant/message"][-1].data["content"]
    assert json.loads(answer) == {"tool0": "result 0", "tool1": "result 1", "tool2": "result 2"}
    assert len(model.requests) == 2


def test_test_model_is_not_collected_as_a_test_class() -> None:
    assert TestModel.__test__ is False


@pytest.mark.slow
def test_importing_the_kit_does_not_import_hypothesis() -> None:
    code = ("import sys, agentloop.testing; assert 'hypothesis' not in sys.modules; "
            "import agentloop.testing.strategies; assert 'hypothesis' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- block_network --------------------------------------------------------------------------


async def test_block_network_refuses_a_real_request_and_names_it() -> None:
    adapter = OpenAIChatAdapter("https://api.example.invalid/v1", api_key="sk-test-123456")
    with block_network(), pytest.raises(agentloop.ProviderError) as info:
        await loopback.collect(adapter, loopback.make_request())
    assert info.value.code == "network_blocked"
    assert "https://api.example.invalid/v1/chat/completions" in str(info.value)
    assert "sk-test" not in str(info.value)


async def test_block_network_reaches_agents_started_before_it() -> None:
    fixture = loopback.replay_fixture("openai-chat-text-with-usage.sse")
    async with loopback.serve(fixture) as srv, agentloop.open_runtime() as rt:
        rt.llm.register("real", OpenAIChatAdapter(srv.url, api_key="sk-test-123456"))
        options = agentloop.AgentOptions(provider="real", model="m")
        async with await rt.agents.create(session_id="s", agent_options=options) as h:
            with block_network():
                h.agent.followup("hi")
                await h.agent.wait_idle()
            ends = [e.data for e in h.agent.session.events if e.type == "turn/end"]
            assert ends[-1]["reason"] == "error"
            assert srv.requests == []  # refused before anything left the process
            h.agent.followup("hi")  # outside the block the same adapter works
            await h.agent.wait_idle()
            ends = [e.data for e in h.agent.session.events if e.type == "turn/end"]
            assert ends[-1]["reason"] == "completed"
            assert len(srv.requests) == 1


async def test_block_network_can_allow_loopback() -> None:
    async with loopback.serve(loopback.replay_fixture("openai-chat-text-with-usage.sse")) as srv:
        adapter = OpenAIChatAdapter(srv.url, api_key="sk-test-123456")
        with block_network(allow=["127.0.0.1"]):
            parts = await loopback.collect(adapter, loopback.make_request())
            with block_network(), pytest.raises(agentloop.ProviderError, match="blocked"):
                await loopback.collect(adapter, loopback.make_request())
    assert isinstance(parts[-1], agentloop.testing.Finish)


# --- stream record and replay ---------------------------------------------------------------

KEY = "sk-live-abcdefghijklmnop1234"


async def test_a_recorded_exchange_replays_byte_for_byte_without_its_keys(
    tmp_path: Path,
) -> None:
    body = loopback.fixture("openai-chat-tool-call.sse")

    async def provider(request: loopback.Request, stream: trio.SocketStream) -> None:
        assert request.headers["authorization"] == f"Bearer {KEY}"
        await loopback.start_stream(stream)
        for i in range(0, len(body), 37):  # the chunking must survive the round trip
            await stream.send_all(body[i:i + 37])
        await stream.send_all(f"data: {{\"echo\": \"{KEY}\"}}\n\n".encode())

    file = tmp_path / "exchange.json"
    request = loopback.make_request()
    async with loopback.serve(provider) as upstream, record_stream(upstream.url, file) as proxy:
        adapter = OpenAIChatAdapter(proxy.url, api_key=KEY)
        live = await loopback.collect(adapter, request)
    saved = file.read_text()
    assert KEY not in saved
    assert "<scrubbed>" in saved
    async with replay_stream(file) as replay:
        with block_network(allow=["127.0.0.1"]):
            replayed = await loopback.collect(OpenAIChatAdapter(replay.url), request)
    assert replayed == live
    (exchange,) = replay.exchanges
    assert b"".join(exchange.chunks).startswith(body)
    assert exchange.chunks == agentloop.testing.Recording.load(file).exchanges[0].chunks
    assert b"<scrubbed>" in exchange.body and KEY.encode() not in exchange.body
    assert json.loads(exchange.request_body) == json.loads(upstream.requests[0].body)


async def test_a_replay_beyond_the_recording_is_an_error(tmp_path: Path) -> None:
    file = tmp_path / "exchange.json"
    fixture = loopback.replay_fixture("openai-chat-text-with-usage.sse")
    async with loopback.serve(fixture) as up, record_stream(up.url, file) as proxy:
        await loopback.collect(OpenAIChatAdapter(proxy.url), loopback.make_request())
    async with replay_stream(file) as replay:
        adapter = OpenAIChatAdapter(replay.url)
        await loopback.collect(adapter, loopback.make_request())
        with pytest.raises(agentloop.ProviderError) as info:
            await loopback.collect(adapter, loopback.make_request())
    assert info.value.status == 599


# --- run_race -------------------------------------------------------------------------------


@attrs.frozen
class Explode:
    async def apply(self, race: Race) -> None:
        raise RuntimeError("my operation broke")


def test_a_failing_check_raises_with_the_operations_listed() -> None:
    ops = [als.Followup(0, "hi"), als.Advance(3.0)]

    def check(ctx: agentloop.Context, handles: Sequence[agentloop.AgentHandle]) -> None:
        assert len(handles[0].agent.session.events) == 0, "expected an empty log"

    with pytest.raises(AssertionError) as info:
        run_race(ops, check=check)
    report = str(info.value)
    assert "expected an empty log" in report
    assert "        Followup(agent=0, text='hi')," in report
    assert "        Advance(seconds=3.0),\n    ], script=" in report
    assert "seed=0)" in report


def test_an_operation_that_raises_is_reported_where_it_failed() -> None:
    with pytest.raises(AssertionError) as info:
        run_race([als.Followup(0), Explode(), als.Settle()])
    report = str(info.value)
    assert "RuntimeError: my operation broke" in report
    assert "        Explode(),  # <- failed here" in report


def test_an_async_check_sees_the_built_handles() -> None:
    seen: list[str] = []

    async def build(ctx: agentloop.Context) -> list[agentloop.AgentHandle]:
        ctx.llm.register("race", TestModel(text="fine"))
        return [await ctx.agents.create(
            session_id="mine", agent_options=agentloop.AgentOptions(provider="race", model="m"))]

    async def check(ctx: agentloop.Context, handles: Sequence[agentloop.AgentHandle]) -> None:
        await trio.lowlevel.checkpoint()
        seen.extend(e.type for e in handles[0].agent.session.events)

    run_race([als.Followup(0), als.Steer(0)], build=build, check=check, kit_tools=False)
    assert seen[0] == "turn/start" and seen[-1] == "turn/end"


def test_the_built_in_checks_catch_a_broken_log() -> None:
    """A plugin that appends to the log behind the runtime's back is caught by check_log."""

    def build(ctx: agentloop.Context) -> None:
        def forge(e: ev.AgentTurnEnd) -> None:
            agent = ctx.agents.get(e.agent_id)
            assert agent is not None
            agent.session.append("tool/result", FrozenDict(call_id="ghost", name="t",
                                                           content="x"), None)

        ctx.events.on(ev.AgentTurnEnd, forge)

    with pytest.raises(AssertionError, match="tool/result outside any turn"):
        run_race([als.Followup(0)], build=build)


@given(ops=als.operations(kinds=("settle",), extra=[st.just(Explode())], min_size=5))
def test_operations_accept_users_own_strategies(ops: list[als.Operation]) -> None:
    assert all(isinstance(op, (als.Settle, Explode)) for op in ops)


def test_an_unknown_operation_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown operation kind 'dance'"):
        als.operations(kinds=("dance",))


def test_exit_leaves_the_runtime_with_the_turn_in_flight() -> None:
    sessions: list[agentloop.Session] = []

    def check(ctx: agentloop.Context, handles: Sequence[agentloop.AgentHandle]) -> None:
        sessions.extend(h.agent.session for h in handles)
        assert handles[0].agent.status == "running"

    run_race([als.Followup(0), als.Exit(), als.Followup(1)], check=check,
             script=[als.Stall(5.0, "slow words")])
    first, second = sessions
    assert [e.data["reason"] for e in first.events if e.type == "turn/end"] == ["disposed"]
    assert len(second.events) == 0  # the operation after the exit was skipped


def test_spawn_adds_a_sub_agent_only_where_the_runtime_has_them() -> None:
    counts: list[int] = []

    def check(ctx: agentloop.Context, handles: Sequence[agentloop.AgentHandle]) -> None:
        has_subagents = getattr(ctx, "subagents", None) is not None
        counts.extend([len(handles), 3 if has_subagents else 2])

    run_race([als.Spawn("a task"), als.Settle()], check=check)
    assert counts[0] == counts[1]


async def test_recording_an_unreachable_upstream_is_a_gateway_error(tmp_path: Path) -> None:
    port = await loopback.unused_port()
    file = tmp_path / "exchange.json"
    async with record_stream(f"http://127.0.0.1:{port}/v1", file) as proxy:
        with pytest.raises(agentloop.ProviderError) as info:
            await loopback.collect(OpenAIChatAdapter(proxy.url), loopback.make_request())
    assert info.value.status == 502
    assert json.loads(file.read_text())["exchanges"] == []
