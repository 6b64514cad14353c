"""Request assembly: pre-step replacement, whole-request rewrites, history replacement,
cache prefixes, usage accounting and the turn-stopping points."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import agentloop_invariants
import attrs
import pytest
import trio
from conftest import OPTIONS, of_type
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentloop
from agentloop import FrozenDict, InvalidContent, Message, Replace, Session
from agentloop import events as ev
from agentloop._bus import EventBus
from agentloop.llm import LLMRequest
from agentloop.testing import (
    Finish,
    FunctionModel,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    check_history,
    check_log,
    reply,
)


async def start(rt: agentloop.Context, sid: str = "s1") -> agentloop.Agent:
    handle = await rt.agents.create(session_id=sid, agent_options=OPTIONS)
    return handle.agent


async def turn(agent: agentloop.Agent, prompt: str) -> None:
    agent.followup(prompt)
    with trio.fail_after(10):
        await agent.wait_idle()


def reloaded(session: Session) -> Session:
    fresh = Session(session.id, session.meta, EventBus())
    fresh.load(list(session.events))
    return fresh


def headers(agent: agentloop.Agent) -> list[FrozenDict]:
    return [e.data for e in of_type(agent, "request/header")]


def register_add(rt: agentloop.Context) -> None:
    @rt.tools.tool
    async def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b


# --- agent/pre-step Replace -------------------------------------------------------------------


async def test_pre_step_replace_is_what_the_step_sends_and_is_durable(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(reply("first"), reply("second"))
    agent = await start(rt)
    await turn(agent, "one")
    replacement = (Message("user", "a summary of everything"),)

    def pre_step(e: ev.AgentPreStep) -> Replace | None:
        return Replace(replacement) if e.turn == 2 else None

    rt.events.on(ev.AgentPreStep, pre_step)
    await turn(agent, "two")
    assert list(model.requests[1].messages) == list(replacement)
    assert [m.text for m in agent.session.messages()] == ["a summary of everything", "second"]
    (replaced,) = of_type(agent, "history/replaced")
    assert replaced.data["reason"] == "pre-step"
    assert replaced.turn == 2
    assert list(reloaded(agent.session).messages()) == list(agent.session.messages())
    check_log(agent.session)


async def test_pre_step_replace_that_unpairs_a_call_ends_the_turn_error(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(reply("never sent"))
    agent = await start(rt)
    orphan = Message("tool", "3", tool_call_id="nope", name="add")
    rt.events.on(ev.AgentPreStep, lambda e: Replace([Message("user", "q"), orphan]))
    await turn(agent, "one")
    assert of_type(agent, "turn/end")[0].data["reason"] == "error"
    assert of_type(agent, "history/replaced") == []
    assert model.requests == []


# --- agent/request: the whole proposal ----------------------------------------------------------


async def test_a_replaced_request_is_sent_and_described_by_the_header(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(reply("ok"))
    agent = await start(rt)
    seen: list[agentloop.llm.LLMRequest] = []

    def rewrite(e: ev.AgentRequest) -> agentloop.llm.LLMRequest:
        seen.append(e.request)
        return attrs.evolve(
            e.request,
            system="rewritten system",
            messages=(Message("user", "injected"), *e.request.messages),
            config=attrs.evolve(e.request.config, model="m2"),
        )

    def later(e: ev.AgentRequest) -> agentloop.CallConfig:
        # A later handler sees the replaced request and may still return only a config.
        assert e.system == "rewritten system"
        return attrs.evolve(e.config, max_tokens=7)

    rt.events.on(ev.AgentRequest, rewrite, priority=1)
    rt.events.on(ev.AgentRequest, later)
    await turn(agent, "hi")
    (sent,) = model.requests
    assert sent.system == "rewritten system"
    assert [m.text for m in sent.messages] == ["injected", "hi"]
    assert (sent.config.model, sent.config.max_tokens) == ("m2", 7)
    assert seen[0].config.model == "m"
    (header,) = headers(agent)
    assert (header["model"], header["messages"], header["rewritten"]) == ("m2", 2, True)
    assert header["config"]["max_tokens"] == 7
    # The rewrite was for that call only: the history is the session's own.
    assert [m.text for m in agent.session.messages()] == ["hi", "ok"]


async def test_a_handler_returning_something_else_fails_the_turn(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(reply("never"))
    agent = await start(rt)
    rt.events.on(ev.AgentRequest, lambda e: "not a config")
    await turn(agent, "hi")
    assert of_type(agent, "turn/end")[0].data["reason"] == "error"
    assert model.requests == []


# --- replace_history ---------------------------------------------------------------------------


async def test_replace_history_shadows_the_seqs_and_survives_resume(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    register_add(rt)
    model.add(
        reply("adding", tool_calls=[("add", {"a": 1, "b": 2}, "c1")]), reply("3"),
        reply("second answer"), reply("third answer"),
    )
    agent = await start(rt)
    await turn(agent, "first")
    await turn(agent, "second")
    session = agent.session
    before = session.messages()
    assert [m.role for m in before] == ["user", "assistant", "tool", "assistant", "user",
                                        "assistant"]
    # Everything before the second prompt: the first turn, tool call and result included.
    cut = session.seq_of(4)
    summary = Message("user", "summary of turn one")
    session.replace_history(1, cut - 1, [summary])
    assert [m.text for m in session.messages()] == [
        "summary of turn one", "second", "second answer"
    ]
    # A snapshot taken before the replacement still shows what it showed.
    assert [m.role for m in before] == ["user", "assistant", "tool", "assistant", "user",
                                        "assistant"]
    assert session.seq_of(0) == cut - 1
    await turn(agent, "third")
    sent = model.requests[-1].messages
    assert [m.text for m in sent] == [
        "summary of turn one", "second", "second answer", "third"
    ]
    check_history(session.messages(), "anthropic")
    check_log(session)
    again = reloaded(session)
    assert list(again.messages()) == list(session.messages())
    assert [again.seq_of(i) for i in range(len(again.messages()))] == [
        session.seq_of(i) for i in range(len(session.messages()))
    ]
    # The replacement is honoured by the next request of a resumed agent too.
    assert list(again.messages())[:3] == list(sent)[:3]


async def test_replace_history_refuses_to_split_a_call_from_its_result(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    register_add(rt)
    model.add(reply("adding", tool_calls=[("add", {"a": 1, "b": 2}, "c1")]), reply("3"))
    agent = await start(rt)
    await turn(agent, "first")
    session = agent.session
    events = len(session.events)
    assistant_seq, tool_seq = session.seq_of(1), session.seq_of(2)
    with pytest.raises(InvalidContent, match=r"result for tool call 'c1' without its call"):
        session.replace_history(1, assistant_seq, [Message("user", "s")])
    with pytest.raises(InvalidContent, match=r"leave the tool calls \['c1'\] unanswered"):
        session.replace_history(tool_seq, tool_seq, [Message("user", "s")])
    with pytest.raises(InvalidContent, match="not a range"):
        session.replace_history(5, 2, [])
    with pytest.raises(InvalidContent, match="not a Message"):
        session.replace_history(1, 1, ["text"])  # type: ignore[list-item]
    assert len(session.events) == events
    # Replacing the call together with its result is fine.
    session.replace_history(assistant_seq, tool_seq, [Message("assistant", "added: 3")])
    assert [m.role for m in session.messages()] == ["user", "assistant", "assistant"]


async def test_a_later_replacement_can_shadow_an_earlier_one(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(reply("a1"), reply("a2"), reply("a3"))
    agent = await start(rt)
    for prompt in ("p1", "p2", "p3"):
        await turn(agent, prompt)
    session = agent.session
    session.replace_history(1, session.seq_of(2) - 1, [Message("user", "s1")])
    assert [m.text for m in session.messages()] == ["s1", "p2", "a2", "p3", "a3"]
    session.replace_history(1, session.seq_of(3) - 1, [Message("user", "s2")])
    assert [m.text for m in session.messages()] == ["s2", "p3", "a3"]
    assert list(reloaded(session).messages()) == list(session.messages())


# --- cache_prefix ------------------------------------------------------------------------------


async def test_cache_prefix_grows_and_drops_to_zero_after_a_compaction(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    register_add(rt)
    model.add(
        reply("adding", tool_calls=[("add", {"a": 1, "b": 2}, "c1")]), reply("3"),
        reply("two"), reply("three"),
    )
    agent = await start(rt)
    await turn(agent, "first")
    await turn(agent, "second")
    prefixes = [(h["messages"], h["cache_prefix"]) for h in headers(agent)]
    # The first request on the route shares nothing; each next one extends the previous.
    assert prefixes == [(1, 0), (3, 1), (5, 3)]
    session = agent.session
    session.replace_history(1, session.seq_of(4) - 1, [Message("user", "summary")])
    await turn(agent, "third")
    assert (headers(agent)[-1]["messages"], headers(agent)[-1]["cache_prefix"]) == (4, 0)


async def test_cache_prefix_is_per_route(rt: agentloop.Context, model: ScriptedModel) -> None:
    model.add(reply("one"), reply("two"), reply("three"))
    agent = await start(rt)
    routes = iter(["m", "other", "m"])
    rt.events.on(ev.AgentRequest, lambda e: attrs.evolve(e.config, model=next(routes)))
    for prompt in ("p1", "p2", "p3"):
        await turn(agent, prompt)
    assert [h["cache_prefix"] for h in headers(agent)] == [0, 0, 1]


# --- usage -------------------------------------------------------------------------------------


async def test_turn_end_sums_usage_and_the_session_totals_it(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    register_add(rt)
    model.add(
        reply("adding", tool_calls=[("add", {"a": 1, "b": 2}, "c1")],
              usage={"input_tokens": 10, "output_tokens": 2, "cache_read_tokens": 4,
                     "prompt_tokens_extra": 99}),
        reply("3", usage={"input_tokens": 14, "output_tokens": 1, "reasoning_tokens": 5}),
        reply("no usage reported"),
    )
    agent = await start(rt)
    await turn(agent, "first")
    await turn(agent, "second")
    ends = [e.data for e in of_type(agent, "turn/end")]
    assert ends[0]["usage"] == {
        "input_tokens": 24, "output_tokens": 3, "cache_read_tokens": 4, "reasoning_tokens": 5
    }
    assert "usage" not in ends[1]  # no call reported any
    assert agent.session.usage == ends[0]["usage"]
    summary_usage = FrozenDict(input_tokens=100, output_tokens=20, cache_write_tokens=7)
    session = agent.session
    session.replace_history(
        1, session.seq_of(4) - 1, [Message("user", "s")], usage=summary_usage
    )
    expected = {"input_tokens": 124, "output_tokens": 23, "cache_read_tokens": 4,
                "reasoning_tokens": 5, "cache_write_tokens": 7}
    assert session.usage == expected
    assert reloaded(session).usage == expected


# --- agent/turn-stopping -----------------------------------------------------------------------


async def test_turn_stopping_is_asked_before_each_step_and_after_tools(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    register_add(rt)
    model.add(
        reply("adding", tool_calls=[("add", {"a": 1, "b": 2}, "c1"), ("add", {"a": 2, "b": 2})],
              usage={"input_tokens": 5, "output_tokens": 1}),
        reply("3"),
    )
    agent = await start(rt)
    points: list[tuple[str, int, int, int, int]] = []

    def stopping(e: ev.AgentTurnStopping) -> None:
        points.append(
            (e.point, e.step, e.steps, e.tool_calls, int(e.usage.get("input_tokens", 0)))
        )

    rt.events.on(ev.AgentTurnStopping, stopping)
    await turn(agent, "hi")
    assert points == [
        ("pre-step", 1, 0, 0, 0), ("post-tools", 1, 1, 2, 5), ("pre-step", 2, 1, 2, 5)
    ]


async def test_a_stop_ends_the_turn_aborted_with_its_cause(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    register_add(rt)
    model.add(reply("adding", tool_calls=[("add", {"a": 1, "b": 2})]), reply("never"))
    agent = await start(rt)

    def stopping(e: ev.AgentTurnStopping) -> agentloop.Stop | None:
        return agentloop.Stop("policy", "enough") if e.point == "post-tools" else None

    rt.events.on(ev.AgentTurnStopping, stopping)
    await turn(agent, "hi")
    end = of_type(agent, "turn/end")[0].data
    assert (end["reason"], end["cause"], end["detail"]) == ("aborted", "policy", "enough")
    assert len(model.requests) == 1
    check_log(agent.session)
    check_history(agent.session.messages())


# --- property: random turns, tool calls, cancels and replacements ------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 3)),
        st.tuples(st.just("cancel"), st.integers(0, 2)),
        st.tuples(st.just("compact"), st.integers(0, 1000)),
        st.tuples(st.just("unpair"), st.integers(0, 1000)),
    ),
    max_size=12,
)


def check_round_trip(session: Session) -> None:
    again = reloaded(session)
    assert list(again.messages()) == list(session.messages())
    n = len(session.messages())
    assert [again.seq_of(i) for i in range(n)] == [session.seq_of(i) for i in range(n)]
    assert again.usage == session.usage


async def run_ops(ops: list[tuple[str, int]]) -> None:
    plan: dict[str, Any] = {"calls": 0, "stall": False}
    stalled = trio.Event()

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        last = request.messages[-1] if request.messages else None
        if last is not None and last.role == "tool":
            yield TextDelta("done")
            yield Finish("stop", {"input_tokens": 2, "output_tokens": 1})
            return
        if plan["stall"]:
            yield TextDelta("partial")
            stalled.set()
            await trio.sleep_forever()
        for i in range(plan["calls"]):
            yield ToolCallDelta(i, id="call", name="add", arguments='{"a": 1, "b": 2}')
        if plan["calls"]:
            yield Finish("tool_calls", {"input_tokens": 3})
        else:
            yield TextDelta("answer")
            yield Finish("stop", {"output_tokens": 1})

    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", FunctionModel(fn))
        register_add(rt)
        checker = agentloop_invariants.install(rt)
        agent = await start(rt)
        session = agent.session
        summaries = 0
        for kind, arg in ops:
            if kind == "turn":
                plan.update(calls=arg, stall=False)
                await turn(agent, f"turn with {arg} calls")
            elif kind == "cancel":
                plan.update(calls=arg, stall=True)
                stalled = trio.Event()
                agent.followup("to be cancelled")
                with trio.fail_after(10):
                    await stalled.wait()
                    agent.cancel()
                    await agent.wait_idle()
            else:
                messages = session.messages()
                cuts = [
                    i for i in range(1, len(messages))
                    if messages[i].role == "user" and session.seq_of(i - 1) < session.seq_of(i)
                ]
                if kind == "compact" and cuts:
                    cut = cuts[arg % len(cuts)]
                    summaries += 1
                    before = list(messages)
                    session.replace_history(
                        1, session.seq_of(cut) - 1, [Message("user", f"summary {summaries}")]
                    )
                    assert list(session.messages()) == [
                        Message("user", f"summary {summaries}"), *before[cut:]
                    ]
                    # The snapshot taken before is unchanged.
                    assert list(messages) == before
                elif kind == "unpair":
                    paired = [i for i, m in enumerate(messages) if m.tool_calls]
                    if paired:
                        i = paired[arg % len(paired)]
                        seq = session.seq_of(i)
                        with pytest.raises(InvalidContent, match="replace_history refused"):
                            session.replace_history(seq, seq, [Message("user", "x")])
            check_history(session.messages())
            check_round_trip(session)
        check_log(session)
        if any(kind == "turn" for kind, _ in ops):
            assert session.usage
        assert checker.violations == []
        assert checker.checked == len(of_type(agent, "request/header"))


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_turns_cancels_and_replacements_keep_the_history_valid(
    ops: list[tuple[str, int]],
) -> None:
    trio.run(run_ops, ops)


# --- the invariant companion -------------------------------------------------------------------


async def test_the_companion_explains_every_request_from_the_log(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    checker = agentloop_invariants.install(rt)
    if not os.environ.get("AGENTLOOP_INVARIANTS"):  # else the run's own companion is it
        assert rt.invariants is checker and rt.child("elsewhere").invariants is checker
    register_add(rt)
    model.add(
        reply("adding", tool_calls=[("add", {"a": 1, "b": 2}, "c1")]), reply("3"),
        reply("two"), reply("three"), reply("four"),
    )
    agent = await start(rt)
    await turn(agent, "first")
    await turn(agent, "second")
    agent.session.replace_history(1, agent.session.seq_of(4) - 1, [Message("user", "sum")])
    rt.events.on(ev.AgentPreStep, lambda e: Replace([Message("user", "fresh")])
                 if e.turn == 4 else None)
    await turn(agent, "third")
    await turn(agent, "fourth")
    assert checker.checked == 5
    assert checker.violations == []
    assert checker.last_request(agent.id) is model.requests[-1]


async def test_the_companion_reports_a_request_the_log_does_not_explain(
    rt: agentloop.Context, model: ScriptedModel, caplog: pytest.LogCaptureFixture
) -> None:
    checker = agentloop_invariants.install(rt)
    seen: list[ev.InvariantViolated] = []
    rt.events.on(ev.InvariantViolated, seen.append)
    model.add(reply("one"), reply("two"))

    def forge(e: ev.LlmStream) -> None:
        # Shows the companion a request the log never had, in place of the real one.
        if e.request.turn == 2:
            sent = e.request
            forged = attrs.evolve(
                sent, messages=(*sent.messages[:-1], Message("user", "forged"))
            )
            checker.on_stream(ev.LlmStream(e.agent_id, forged, True))

    rt.events.on(ev.LlmStream, forge, priority=2_000_000)
    agent = await start(rt)
    with caplog.at_level(logging.ERROR, logger="agentloop.invariants"):
        await turn(agent, "first")
        assert seen == []
        await turn(agent, "second")
    (violation,) = seen
    assert violation.seq == of_type(agent, "request/header")[-1].seq
    assert "message #2" in violation.diff and "forged" in violation.diff
    assert checker.violations == [violation]
    # Forged on purpose: not a failure of the run the suite may be making with the companion.
    for found in checker.violations:
        agentloop_invariants.SEEN.remove(found)
    assert any("differs from the log" in r.getMessage() for r in caplog.records)


async def test_the_invariants_plugin_is_reachable_as_ctx_invariants() -> None:
    async with agentloop.open_runtime({"plugins": ["invariants"]}) as rt:
        assert rt.invariants is not None
        assert rt.invariants.violations == []
    if not os.environ.get("AGENTLOOP_INVARIANTS"):
        async with agentloop.open_runtime() as rt:
            assert rt.invariants is None
