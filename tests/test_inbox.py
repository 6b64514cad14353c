"""Inbox, steering and cancellation: nothing lost, nothing duplicated, nothing leaked."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from conftest import OPTIONS, check_history_valid, check_log_invariants, of_type, turn_ends

import agentloop
from agentloop import events as ev
from agentloop.testing import (
    Finish,
    FunctionModel,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    reply,
)


async def new_agent(rt: agentloop.Context, sid: str = "a") -> agentloop.Agent:
    return (await rt.agents.create(session_id=sid, agent_options=OPTIONS)).agent


class Gate:
    """A model whose stream pauses until released: lets a test act mid-stream."""

    def __init__(self, chunks: tuple[str, ...] = ("one ", "two ")) -> None:
        self.chunks = chunks
        self.release = trio.Event()
        self.streaming = trio.Event()
        self.calls = 0

    async def __call__(self, request: object) -> AsyncIterator[object]:
        self.calls += 1
        for c in self.chunks:
            yield TextDelta(c)
        self.streaming.set()
        await self.release.wait()
        yield Finish("stop")


def replay(splices: list[ev.InboxSpliced], target: str) -> list[str]:
    items: list[str] = []
    for s in splices:
        if s.list == target:
            items[s.index : s.index + s.delete_count] = [m.id for m in s.inserted]
    return items


async def test_splices_replay_to_the_projection_and_precede_the_change(rt, model) -> None:
    agent = await new_agent(rt)
    splices: list[ev.InboxSpliced] = []
    snapshots: list[tuple[int, int]] = []

    def on_splice(e: ev.InboxSpliced) -> None:
        splices.append(e)
        # published before the projection changes: removed values are still readable
        snapshots.append((len(agent.inbox.next_turn), len(agent.inbox.next_step)))

    rt.events.on(ev.InboxSpliced, on_splice)
    inserted: list[str] = []
    discarded: list[tuple[str, str]] = []
    rt.events.on(ev.InboxInserted, lambda e: inserted.append(e.message.id))
    rt.events.on(ev.InboxDiscarded, lambda e: discarded.append((e.message.id, e.outcome)))
    a = agent.inject("context a")
    b = agent.inject("context b")
    assert agent.status == "idle"  # inject never wakes
    assert agent.edit(b, "context b2")
    assert agent.remove(a)
    assert not agent.remove(a)
    assert replay(splices, "next-step") == [m.id for m in agent.inbox.next_step] == [b]
    assert agent.inbox.next_step[0].content == "context b2"
    assert inserted == [a, b]
    assert discarded == [(a, "canceled")]
    assert splices[-1].outcome == "canceled" and snapshots[-1] == (0, 2)


async def test_turn_boundary_claims_all_next_step_and_one_prompt(rt, model) -> None:
    model.add("first", "second")
    agent = await new_agent(rt)
    claimed: list[tuple[str, int]] = []
    rt.events.on(ev.InboxClaimed, lambda e: claimed.append((e.message.content, e.turn)))
    agent.inject("ctx1")
    agent.inject("ctx2")
    agent.followup("p1")
    agent.followup("p2")
    await agent.wait_idle()
    kinds = [(e.type, e.data["content"], e.turn) for e in agent.session.events
             if e.type in ("user/message", "steering/message")]
    assert kinds == [
        ("steering/message", "ctx1", 1), ("steering/message", "ctx2", 1),
        ("user/message", "p1", 1), ("user/message", "p2", 2),
    ]
    assert claimed == [("ctx1", 1), ("ctx2", 1), ("p1", 1), ("p2", 2)]
    assert turn_ends(agent) == ["completed", "completed"]


async def test_steer_lands_at_the_next_step_without_cancelling_tools(rt, model) -> None:
    started = trio.Event()
    finish = trio.Event()

    @rt.tools.tool(concurrency="parallel")
    async def work(n: int) -> str:
        """Work."""
        started.set()
        await finish.wait()
        return f"done {n}"

    model.add(reply("", tool_calls=[("work", {"n": 1}), ("work", {"n": 2})]), "after steer")
    agent = await new_agent(rt)
    agent.followup("go")
    await started.wait()
    agent.steer("also do X")
    finish.set()
    await agent.wait_idle()
    results = [e.data["content"] for e in of_type(agent, "tool/result")]
    assert results == ["done 1", "done 2"]
    steering = of_type(agent, "steering/message")
    assert [e.turn for e in steering] == [1]
    assert turn_ends(agent) == ["completed"]
    # the steering message is in the second request, after the tool results
    roles = [m.role for m in model.requests[1].messages]
    assert roles == ["user", "assistant", "tool", "tool", "user"]


async def test_input_inserted_after_a_rejected_claim_stays_pending(rt, model) -> None:
    agent = await new_agent(rt)

    def gate(e: ev.AgentPreStep) -> object:
        agent.inject("late context")
        return agentloop.Reject("no")

    rt.events.on(ev.AgentPreStep, gate)
    agent.followup("p")
    await agent.wait_idle()
    assert turn_ends(agent) == ["rejected"]
    assert [m.content for m in agent.inbox.next_step] == ["late context"]
    assert agent.inbox.next_turn == ()


async def test_idle_cancel_is_a_noop(rt, model) -> None:
    agent = await new_agent(rt)
    agent.inject("kept")
    assert agent.cancel() is False
    assert [m.content for m in agent.inbox.next_step] == ["kept"]


async def test_cancel_right_after_send_discards_and_blips(rt, model) -> None:
    agent = await new_agent(rt)
    statuses: list[str] = []
    rt.events.on(ev.AgentStatus, lambda e: statuses.append(e.status))
    agent.followup("never runs")
    assert agent.status == "running"
    assert agent.cancel() is True
    await agent.wait_idle()
    assert statuses == ["running", "idle"]
    assert agent.session.events == [] or list(agent.session.events) == []
    assert model.requests == []


async def test_wake_while_idle_always_opens_a_boundary(rt, model) -> None:
    agent = await new_agent(rt)
    statuses: list[str] = []
    rt.events.on(ev.AgentStatus, lambda e: statuses.append(e.status))
    mid = agent.followup("removed before the claim")
    agent.remove(mid)
    await agent.wait_idle()
    assert statuses == ["running", "idle"]
    assert list(agent.session.events) == []


async def test_cancel_mid_stream_keeps_what_the_user_saw(rt) -> None:
    gate = Gate()
    rt.llm.register("scripted", FunctionModel(gate))
    agent = await new_agent(rt)
    agent.followup("tell me")
    await gate.streaming.wait()
    agent.followup("queued")
    assert agent.cancel() is True
    await agent.wait_idle()
    anchors = of_type(agent, "assistant/message")
    assert len(anchors) == 1 and anchors[0].data["interrupted"] is True
    chunk_seqs = tuple(e.seq for e in of_type(agent, "assistant/chunk"))
    assert anchors[0].data["source_event_seqs"] == chunk_seqs
    end = of_type(agent, "turn/end")[0].data
    assert (end["reason"], end["cause"]) == ("aborted", "user")
    history = agent.session.messages()
    assert history[-1].interrupted and history[-1].text == "one two "
    assert agent.inbox.next_turn == ()  # cleared by the cancel
    assert gate.calls == 1  # a cancel never leaks onto a later prompt


async def cancelled_mid_stream(rt: agentloop.Context, *parts: object) -> agentloop.Agent:
    """An agent whose reply streams ``parts`` and then stalls, cancelled there."""
    streaming = trio.Event()

    async def stream(request: object) -> AsyncIterator[object]:
        for part in parts:
            yield part
        streaming.set()
        await trio.sleep_forever()
        yield Finish("stop")

    rt.llm.register("scripted", FunctionModel(stream))
    agent = await new_agent(rt)
    agent.followup("go")
    await streaming.wait()
    assert agent.cancel() is True
    await agent.wait_idle()
    return agent


async def test_an_interrupted_anchor_cites_the_text_and_reasoning_seen_not_call_fragments(
    rt,
) -> None:
    agent = await cancelled_mid_stream(
        rt, ReasoningDelta("thinking "), TextDelta("one "),
        ToolCallDelta(0, id="c1", name="add", arguments='{"a": '), TextDelta("two "),
    )
    chunks = of_type(agent, "assistant/chunk")
    seen = tuple(e.seq for e in chunks if e.data["kind"] != "tool_call")
    assert len(seen) == 3 and len(chunks) == 4
    anchor = of_type(agent, "assistant/message")[0].data
    assert anchor["interrupted"] is True and anchor["source_event_seqs"] == seen
    assert (anchor["content"], anchor["reasoning"]) == ("one two ", "thinking ")
    assert anchor["tool_calls"] == ()


async def test_cancelled_prefix_reaches_the_next_request(rt) -> None:
    gate = Gate()
    model = FunctionModel(gate)
    rt.llm.register("scripted", model)
    agent = await new_agent(rt)
    agent.followup("first")
    await gate.streaming.wait()
    agent.cancel()
    await agent.wait_idle()
    gate.release.set()
    agent.followup("second")
    await agent.wait_idle()
    texts = [(m.role, m.text, m.interrupted) for m in model.requests[1].messages]
    assert texts == [("user", "first", False), ("assistant", "one two ", True),
                     ("user", "second", False)]
    assert turn_ends(agent) == ["aborted", "completed"]


async def test_tool_only_partial_stream_appends_no_anchor(rt) -> None:
    agent = await cancelled_mid_stream(rt, ToolCallDelta(0, id="c", name="x", arguments="{"))
    assert of_type(agent, "assistant/message") == []
    assert of_type(agent, "tool/call") == []
    check_history_valid(agent.session.messages())


async def test_wake_latch_replays_input_sent_during_convergence(rt) -> None:
    gate = Gate()
    rt.llm.register("scripted", FunctionModel(gate))
    agent = await new_agent(rt)
    flushing = trio.Event()
    release_flush = trio.Event()

    async def slow_flush(e: ev.SessionFlush) -> None:
        flushing.set()
        await release_flush.wait()

    rt.events.on(ev.SessionFlush, slow_flush)
    agent.followup("first")
    await gate.streaming.wait()
    agent.cancel()
    await flushing.wait()  # the driver is converging: turn/end appended, flush pending
    gate.release.set()
    agent.followup("sent after the cancel")
    release_flush.set()
    await agent.wait_idle()
    assert turn_ends(agent) == ["aborted", "completed"]
    prompts = [e.data["content"] for e in of_type(agent, "user/message")]
    assert prompts == ["first", "sent after the cancel"]


async def test_cancel_keep_inbox_runs_queued_prompts_afterwards(rt) -> None:
    gate = Gate()
    rt.llm.register("scripted", FunctionModel(gate))
    agent = await new_agent(rt)
    agent.followup("first")
    await gate.streaming.wait()
    agent.followup("second")
    assert agent.cancel(keep_inbox=True) is True
    gate.release.set()
    await agent.wait_idle()
    assert turn_ends(agent) == ["aborted", "completed"]
    assert [e.data["content"] for e in of_type(agent, "user/message")] == ["first", "second"]


async def test_cancel_cause_is_recorded(rt) -> None:
    gate = Gate()
    rt.llm.register("scripted", FunctionModel(gate))
    agent = await new_agent(rt)
    agent.followup("x")
    await gate.streaming.wait()
    assert agent.cancel("parent")
    assert agent.cancel("again") is False  # no further effect
    await agent.wait_idle()
    assert of_type(agent, "turn/end")[0].data["cause"] == "parent"


async def test_cancel_during_tools_drains_started_and_aborts_the_rest(rt, model) -> None:
    started = trio.Event()

    @rt.tools.tool(concurrency="parallel")
    async def quick() -> str:
        """Quick."""
        return "quick done"

    @rt.tools.tool
    async def blocker() -> str:
        """Blocks until cancelled."""
        started.set()
        await trio.sleep_forever()
        return "never"

    model.add(reply("", tool_calls=[("quick", {}, "c1"), ("blocker", {}, "c2"),
                                    ("quick", {}, "c3"), ("quick", {}, "c4")]))
    agent = await new_agent(rt)
    agent.followup("go")
    await started.wait()
    agent.cancel()
    await agent.wait_idle()
    results = {e.data["call_id"]: e.data for e in of_type(agent, "tool/result")}
    assert results["c1"]["content"] == "quick done"
    assert results["c2"]["error_code"] == "ABORTED"
    for cid in ("c3", "c4"):
        assert results[cid]["error_code"] == "ABORTED_BEFORE_DISPATCH"
        assert results[cid]["content"] == "Error: tool call aborted before dispatch"
    assert [e.data["call_id"] for e in of_type(agent, "tool/result")] == ["c1", "c2", "c3", "c4"]
    check_log_invariants(agent.session.events)
    check_history_valid(agent.session.messages())
    assert turn_ends(agent) == ["aborted"]


async def test_disposal_mid_turn_ends_disposed_and_discards_pending(rt) -> None:
    gate = Gate()
    rt.llm.register("scripted", FunctionModel(gate))
    handle = await rt.agents.create(session_id="d", agent_options=OPTIONS)
    agent = handle.agent
    discarded: list[str] = []
    rt.events.on(ev.InboxDiscarded, lambda e: discarded.append(e.outcome))
    agent.followup("x")
    await gate.streaming.wait()
    agent.inject("idle injection")
    await handle.aclose()
    assert turn_ends(agent) == ["disposed"]
    assert discarded == ["disposed"]
    assert agent.status == "disposed"
    with pytest.raises(agentloop.AgentDisposed):
        agent.followup("too late")


async def test_claimed_messages_are_never_lost_or_duplicated(rt, model) -> None:
    model.add(*["r"] * 5)
    agent = await new_agent(rt)
    ids = [agent.followup(f"p{i}") for i in range(5)]
    await agent.wait_idle()
    logged = [e.data["message_id"] for e in of_type(agent, "user/message")]
    assert logged == ids
    assert len({*ids}) == 5


async def test_subscriber_sees_inbox_events_in_order(rt, model) -> None:
    model.add("r")
    agent = await new_agent(rt)
    async with rt.events.subscribe((ev.InboxInserted, ev.InboxClaimed)) as rx:
        agent.followup("hello")
        await agent.wait_idle()
        first = await rx.receive()
        second = await rx.receive()
    assert isinstance(first, ev.InboxInserted) and isinstance(second, ev.InboxClaimed)
    assert first.message is second.message  # one accepted record, shared


async def test_wait_idle_with_all_tasks_blocked(rt, model) -> None:
    model.add("r")
    agent = await new_agent(rt)
    agent.followup("x")
    await trio.testing.wait_all_tasks_blocked()
    assert agent.status == "idle"
    assert turn_ends(agent) == ["completed"]


async def test_an_injection_does_not_extend_a_turn_and_waits_for_the_next(rt, model) -> None:
    model.add("first answer", "second answer")
    agent = await new_agent(rt)

    def inject_once(e: ev.AgentStepResult) -> None:
        if e.turn == 1:
            agent.inject("context for later")

    rt.events.on(ev.AgentStepResult, inject_once)
    agent.followup("one")
    await agent.wait_idle()
    assert turn_ends(agent) == ["completed"]
    assert len(model.requests) == 1  # the injection did not cause another model call
    assert [m.content for m in agent.inbox.next_step] == ["context for later"]
    agent.followup("two")
    await agent.wait_idle()
    claimed = [(e.type, e.data["content"], e.turn) for e in agent.session.events
               if e.type in ("user/message", "steering/message")]
    assert claimed[-2:] == [("steering/message", "context for later", 2),
                            ("user/message", "two", 2)]


async def test_an_edited_steer_still_continues_the_turn(rt, model) -> None:
    model.add("first", "after steering")
    agent = await new_agent(rt)

    def steer_once(e: ev.AgentStepResult) -> None:
        if e.step == 1:
            mid = agent.steer("go left")
            agent.edit(mid, "go right")

    rt.events.on(ev.AgentStepResult, steer_once)
    agent.followup("start")
    await agent.wait_idle()
    assert len(model.requests) == 2
    assert model.requests[1].messages[-1].text == "go right"
    assert turn_ends(agent) == ["completed"]
