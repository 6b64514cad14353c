"""Run handles: one follow-up and the turn that claims it, read back from the durable log."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS
from hypothesis import given
from hypothesis import strategies as st

import agentloop
from agentloop.events import (
    AgentPreStep,
    AgentStatus,
    AgentTurnEnd,
    InboxClaimed,
    InboxDiscarded,
    SessionEventAppended,
    SessionFlush,
)
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta, reply


async def _agent(rt: agentloop.Context, session_id: str = "s1") -> agentloop.AgentHandle:
    return await rt.agents.create(session_id=session_id, agent_options=OPTIONS)


def _turn_slice(agent: agentloop.Agent, turn: int | None) -> list[agentloop.SessionEvent]:
    return [e for e in agent.session.events if e.turn == turn]


class Gated:
    """A model that streams ``first``, then waits for ``gate`` before finishing each call."""

    def __init__(self, first: str = "partial ", rest: str = "answer") -> None:
        self.gate = trio.Event()
        self.calls = 0
        self.first, self.rest = first, rest
        self.model = FunctionModel(self._stream)

    async def _stream(self, request: Any) -> AsyncIterator[Any]:
        self.calls += 1
        yield TextDelta(self.first)
        await self.gate.wait()
        yield TextDelta(self.rest)
        yield Finish("stop")


async def test_text_reasoning_events_and_result(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(reply("two plus three is five", reasoning="add them up",
                    usage={"input_tokens": 7, "output_tokens": 5}))
    async with await _agent(rt) as h, h.agent.run("What is 2 + 3?", source={"ui": 1}) as run:
        assert run.message_id is not None
        deltas = [d async for d in run.text()]
        thoughts = [d async for d in run.reasoning()]
        events = [e async for e in run.events()]
        result = await run.result()
    assert deltas == ["two ", "plus ", "three ", "is ", "five"]
    assert thoughts == ["add ", "them ", "up"]
    assert events == _turn_slice(h.agent, 1)
    assert (events[0].type, events[-1].type) == ("turn/start", "turn/end")
    [claim] = [e for e in events if e.type == "user/message"]
    assert claim.data["message_id"] == run.message_id
    assert claim.data["source"] == {"ui": 1}
    assert result == agentloop.RunResult(
        "two plus three is five", None, "completed", 1,
        agentloop.FrozenDict(input_tokens=7, output_tokens=5),
    )
    assert run.turn == 1 and run.done


async def test_usage_is_summed_over_the_turns_model_calls(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    @rt.tools.tool()
    async def ping() -> str:
        """Answer pong."""
        return "pong"

    model.add(
        reply(tool_calls=[("ping", {})], usage={"in": 3, "out": 1, "detail": {"cached": 2}}),
        reply("done", usage={"in": 5, "out": 2, "detail": {"cached": 1}, "model": "x"}),
    )
    async with await _agent(rt) as h:
        result = await h.agent.ask("ping it")
    assert result.text == "done"
    assert result.usage == {"in": 8, "out": 3, "detail": {"cached": 3}}


async def test_no_usage_reads_none(rt: agentloop.Context, model: ScriptedModel) -> None:
    model.add("hi")
    async with await _agent(rt) as h:
        assert (await h.agent.ask("hello")).usage is None


async def test_two_runs_queued_back_to_back_see_only_their_own_turn(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add("first answer", "second answer")
    async with await _agent(rt) as h:
        agent = h.agent
        async with agent.run("one") as a, agent.run("two") as b:
            # Read the second first: it waits through the whole first turn.
            b_text = "".join([d async for d in b.text()])
            a_events = [e async for e in a.events()]
            b_events = [e async for e in b.events()]
        assert b_text == "second answer"
        assert a_events == _turn_slice(agent, 1)
        assert b_events == _turn_slice(agent, 2)
        assert (await a.result()).text == "first answer"
        assert (await b.result()).turn == 2


async def test_a_turn_cancelled_from_outside_ends_the_run_aborted(rt: agentloop.Context) -> None:
    gated = Gated()
    rt.llm.register("scripted", gated.model)
    async with await _agent(rt) as h:
        async with h.agent.run("go") as run:
            async for delta in run.text():
                assert delta == "partial "
                assert h.agent.cancel()
            result = await run.result()
        assert (result.reason, result.turn, result.text) == ("aborted", 1, "partial ")
        [end] = [e for e in h.agent.session.events if e.type == "turn/end"]
        assert end.data["cause"] == "user"


async def test_leaving_early_cancels_that_turn_and_nothing_else(rt: agentloop.Context) -> None:
    gated = Gated()
    rt.llm.register("scripted", gated.model)
    async with await _agent(rt) as h:
        agent = h.agent
        async with agent.run("first") as run:
            later = agent.followup("later")
            async for _ in run.text():
                break  # leave while the model is still streaming
        result = await run.result()
        assert (result.reason, result.turn) == ("aborted", 1)
        ends = [e for e in agent.session.events if e.type == "turn/end"]
        assert [e.data.get("cause") for e in ends] == ["run"]
        # The later follow-up is still queued and runs once the gate opens.
        gated.gate.set()
        await agent.wait_idle()
        [claim2] = [e for e in agent.session.events
                    if e.type == "user/message" and e.data["message_id"] == later]
        assert claim2.turn == 2
        assert [e.data["reason"] for e in agent.session.events if e.type == "turn/end"] == [
            "aborted", "completed",
        ]


async def test_leaving_while_pending_removes_the_message(rt: agentloop.Context) -> None:
    gated = Gated()
    rt.llm.register("scripted", gated.model)
    async with await _agent(rt) as h:
        agent = h.agent
        async with agent.run("busy") as busy:
            await trio.testing.wait_all_tasks_blocked()  # the busy turn is streaming
            async with agent.run("never mind") as waiting:
                assert [m.id for m in agent.inbox.next_turn] == [waiting.message_id]
            assert agent.inbox.next_turn == ()
            assert await waiting.result() == agentloop.RunResult("", None, "aborted", None, None)
            assert [e async for e in waiting.events()] == []
            gated.gate.set()
            result = await busy.result()
        assert (result.reason, result.text) == ("completed", "partial answer")
        await agent.wait_idle()
        assert gated.calls == 1
        assert not any(e.data.get("message_id") == waiting.message_id
                       for e in agent.session.events)


async def test_leaving_with_an_exception_cancels_too(rt: agentloop.Context) -> None:
    gated = Gated()
    rt.llm.register("scripted", gated.model)
    async with await _agent(rt) as h:
        run = h.agent.run("go")

        async def leave_with_an_error() -> None:
            async with run:
                async for _ in run.text():
                    raise KeyError("client went away")

        with pytest.raises(KeyError):
            await leave_with_an_error()
        assert (await run.result()).reason == "aborted"


async def test_a_failed_turn_raises_turn_failed(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(agentloop.ProviderError("slow down", status=429, code="rate_limit", retry_after=2))
    async with await _agent(rt) as h:
        async with h.agent.run("hi") as run:
            events = [e async for e in run.events()]
            with pytest.raises(agentloop.TurnFailed) as info:
                await run.result()
        assert events[-1].data["reason"] == "error"
        failed = info.value
        assert isinstance(failed, agentloop.AgentLoopError)
        assert (failed.reason, failed.turn) == ("error", 1)
        assert isinstance(failed.error, agentloop.ProviderError)
        assert (failed.error.status, failed.error.code, failed.error.retry_after) == (
            429, "rate_limit", 2.0,
        )
        assert failed.data == events[-1].data["error"]
        # ask raises the same way, and the agent carries on.
        model.add(agentloop.ProviderError("down", status=503))
        with pytest.raises(agentloop.TurnFailed):
            await h.agent.ask("again")
        model.add("fine")
        assert (await h.agent.ask("and now?")).text == "fine"


async def test_a_failing_hook_is_a_turn_failed_with_its_data(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    def boom(event: AgentPreStep) -> None:
        raise RuntimeError("hook broke")

    rt.events.on(AgentPreStep, boom)
    async with await _agent(rt) as h:
        with pytest.raises(agentloop.TurnFailed) as info:
            await h.agent.ask("hi")
    assert info.value.error == {"type": "RuntimeError", "message": "hook broke"}


async def test_other_reasons_are_results(rt: agentloop.Context, model: ScriptedModel) -> None:
    model.add(reply("cut", finish="max_tokens"))
    async with await _agent(rt) as h:
        assert (await h.agent.ask("long")).reason == "max-tokens"
        stop = rt.events.on(AgentPreStep, lambda e: agentloop.Reject())
        result = await h.agent.ask("refused")
        stop()
        assert (result.reason, result.turn, result.text) == ("rejected", 2, "")


async def test_disposal_ends_the_running_turn_and_drops_the_pending_one(
    rt: agentloop.Context,
) -> None:
    gated = Gated()
    rt.llm.register("scripted", gated.model)
    h = await _agent(rt)
    async with h.agent.run("running") as running, h.agent.run("queued") as queued:
        async for _ in running.text():
            await h.aclose()
        assert await queued.result() == agentloop.RunResult("", None, "disposed", None, None)
        result = await running.result()
    assert (result.reason, result.turn) == ("disposed", 1)
    with pytest.raises(agentloop.AgentDisposed):
        async with h.agent.run("too late"):
            pass


async def test_an_output_type_that_is_not_an_object_is_refused(rt: agentloop.Context) -> None:
    async with await _agent(rt) as h:
        with pytest.raises(TypeError, match="must describe a JSON object"):
            h.agent.run("x", output_type=int)
        with pytest.raises(TypeError, match="must describe a JSON object"):
            await h.agent.ask("x", output_type=list[int])
        assert h.agent.inbox.next_turn == ()


async def test_a_run_must_be_entered(rt: agentloop.Context) -> None:
    async with await _agent(rt) as h:
        run = h.agent.run("x")
        with pytest.raises(RuntimeError, match="enter the run"):
            await run.result()
        with pytest.raises(TypeError, match="no public constructor"):
            agentloop.Run(h.agent, "x", None)  # type: ignore[call-arg]


async def test_events_can_be_read_after_the_block_and_twice(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add("hello world")
    async with await _agent(rt) as h:
        async with h.agent.run("hi") as run:
            await run.result()
        first = [e async for e in run.events()]
        second = [e async for e in run.events()]
        assert first == second == _turn_slice(h.agent, 1)


async def test_a_steer_during_the_turn_belongs_to_it(rt: agentloop.Context) -> None:
    gated = Gated()
    rt.llm.register("scripted", gated.model)
    async with await _agent(rt) as h:
        async with h.agent.run("go") as run:
            async for _ in run.text():
                if not gated.gate.is_set():
                    h.agent.steer("also this")
                    gated.gate.set()
            events = [e async for e in run.events()]
        assert [e.type for e in events].count("steering/message") == 1
        assert events == _turn_slice(h.agent, 1)
        assert gated.calls == 2


async def test_the_result_waits_for_the_flush(rt: agentloop.Context, model: ScriptedModel) -> None:
    stored = trio.Event()

    async def slow_store(event: SessionFlush) -> None:
        await stored.wait()

    rt.events.on(SessionFlush, slow_store)
    model.add("hi")
    async with await _agent(rt) as h:
        async with h.agent.run("hello") as run:
            events = [e async for e in run.events()]
            assert events[-1].type == "turn/end"
            await trio.testing.wait_all_tasks_blocked()
            assert not run.done  # logged, not yet stored
            stored.set()
        assert (await run.result()).reason == "completed"
        assert run.done


async def test_a_flush_outlasting_its_grace_still_resolves(
    rt: agentloop.Context, model: ScriptedModel, autojump_clock: trio.testing.MockClock
) -> None:
    async def stuck_store(event: SessionFlush) -> None:
        await trio.sleep_forever()

    rt.events.on(SessionFlush, stuck_store)
    model.add("one", "two")
    async with await _agent(rt) as h:
        with trio.fail_after(300):
            async with h.agent.run("a") as first, h.agent.run("b") as second:
                assert (await first.result()).text == "one"
                assert (await second.result()).text == "two"


async def test_a_failing_turn_end_hook_does_not_hide_the_end(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    def broken(event: AgentTurnEnd) -> None:
        raise RuntimeError("observer bug")

    rt.events.on(AgentTurnEnd, broken, priority=100)
    model.add("fine")
    async with await _agent(rt) as h:
        assert (await h.agent.ask("x")).text == "fine"


@pytest.mark.skipif(
    bool(os.environ.get("AGENTLOOP_INVARIANTS")),
    reason="counts the bus's registrations, and the invariant companion adds its own",
)
async def test_nothing_stays_registered_once_runs_are_over(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    watched = (SessionEventAppended, InboxClaimed, InboxDiscarded, AgentTurnEnd, AgentStatus)
    model.add("a", "b")
    async with await _agent(rt) as h:
        bus = rt._services.bus
        async with h.agent.run("one") as run:
            [e async for e in run.events()]
        async with h.agent.run("two"):
            pass
        assert not any(bus.has_listeners(cls) for cls in watched)
        await h.agent.wait_idle()


async def test_runs_on_many_agents_each_see_their_own(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(*[f"answer {i}" for i in range(6)])
    handles = [await _agent(rt, f"a{i}") for i in range(3)]
    results: dict[str, list[str]] = {}

    async def ask_twice(h: agentloop.AgentHandle) -> None:
        for q in ("x", "y"):
            async with h.agent.run(q) as run:
                text = "".join([d async for d in run.text()])
                assert [e async for e in run.events()] == _turn_slice(h.agent, run.turn)
            results.setdefault(h.agent.id, []).append(text)

    async with trio.open_nursery() as nursery:
        for h in handles:
            nursery.start_soon(ask_twice, h)
    for h in handles:
        await h.aclose()
    assert sorted(t for texts in results.values() for t in texts) == [
        f"answer {i}" for i in range(6)
    ]


# --- the property ----------------------------------------------------------------------------

Op = tuple[str, int]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("run"), st.integers(-1, 12)),  # leave after n events (-1: never)
        st.tuples(st.just("steer"), st.just(0)),
        st.tuples(st.just("cancel"), st.just(0)),
        st.tuples(st.just("settle"), st.just(0)),
        st.tuples(st.just("tick"), st.integers(0, 3)),
    ),
    max_size=14,
)
REPLIES = st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=6)


def _scripted_stream(replies: list[tuple[int, bool]]) -> Callable[[Any], AsyncIterator[Any]]:
    calls = 0

    async def stream(request: Any) -> AsyncIterator[Any]:
        nonlocal calls
        words, fails = replies[calls % len(replies)]
        calls += 1
        for i in range(words):
            await trio.sleep(0.1)  # model time, jumped over by the MockClock
            yield TextDelta(f"w{i} ")
        if fails:
            raise agentloop.ProviderError("scripted failure", status=500)
        yield Finish("stop")

    return stream


@pytest.mark.slow
@given(ops=OPS, replies=REPLIES)
def test_every_run_reads_exactly_its_turn(ops: list[Op], replies: list[tuple[int, bool]]) -> None:
    outcomes: list[tuple[agentloop.Run, list[agentloop.SessionEvent], int, object]] = []

    async def reader(agent: agentloop.Agent, leave_after: int, i: int) -> None:
        seen: list[agentloop.SessionEvent] = []
        async with agent.run(f"q{i}") as run:
            async for event in run.events():
                if len(seen) == leave_after:
                    break
                seen.append(event)
        outcome: object
        try:
            outcome = await run.result()
        except agentloop.TurnFailed as failed:
            outcome = failed
        outcomes.append((run, seen, leave_after, outcome))

    async def main() -> None:
        async with agentloop.open_runtime() as rt:
            rt.llm.register("scripted", FunctionModel(_scripted_stream(replies)))
            h = await _agent(rt)
            agent = h.agent
            # Every result resolves, well before the MockClock's hour is up.
            with trio.fail_after(3600):
                async with h, trio.open_nursery() as nursery:
                    await _drive(agent, nursery)
                    await agent.wait_idle()
            _check(agent)

    async def _drive(agent: agentloop.Agent, nursery: trio.Nursery) -> None:
        for i, (op, arg) in enumerate(ops):
            if op == "run":
                nursery.start_soon(reader, agent, arg, i)
                await trio.lowlevel.checkpoint()
            elif op == "steer":
                agent.steer(f"steer {i}")
            elif op == "cancel":
                agent.cancel()
            elif op == "settle":
                await trio.testing.wait_all_tasks_blocked()
            else:
                await trio.sleep(0.1 * arg)

    def _check(agent: agentloop.Agent) -> None:
        log = agent.session.events
        claims = {e.data["message_id"]: e for e in log if e.type == "user/message"}
        ends = {e.turn: e for e in log if e.type == "turn/end"}
        runs = [o for o in ops if o[0] == "run"]
        assert len(outcomes) == len(runs)
        exited_turns = set()
        for run, seen, leave_after, outcome in outcomes:
            claim = claims.get(run.message_id)
            if claim is None:
                assert run.turn is None and seen == []
                assert isinstance(outcome, agentloop.RunResult)
                assert outcome.reason == "aborted" and outcome.turn is None
                continue
            assert run.turn == claim.turn
            whole = [e for e in log if e.turn == claim.turn]
            if leave_after < 0 or leave_after >= len(whole):
                assert seen == whole
            else:
                assert seen == whole[:leave_after]
                exited_turns.add(claim.turn)
            end = ends[claim.turn]
            if end.data["reason"] == "error":
                assert isinstance(outcome, agentloop.TurnFailed)
                assert outcome.turn == claim.turn
            else:
                assert isinstance(outcome, agentloop.RunResult)
                assert (outcome.reason, outcome.turn) == (end.data["reason"], claim.turn)
        # Leaving a run cancels its own turn, never another.
        for turn, end in ends.items():
            if end.data.get("cause") == "run":
                assert turn in exited_turns

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
