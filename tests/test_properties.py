"""Hypothesis properties over lifecycle and inbox races (a fresh trio.run per example)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio
import trio.testing
from conftest import OPTIONS, check_history_valid, check_log_invariants
from hypothesis import given
from hypothesis import strategies as st

import agentloop
from agentloop import events as ev
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

LEGAL = {("idle", "running"), ("running", "idle"), ("idle", "disposed"), ("running", "disposed")}


def paced_model(data: st.DataObject) -> FunctionModel:
    """Streams a few chunks with virtual pauses, sometimes ending in parallel/exclusive calls."""

    async def fn(request: agentloop.llm.LLMRequest) -> AsyncIterator[Any]:
        plan = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=3), label="chunks")
        for pause in plan:
            await trio.sleep(pause)
            yield TextDelta(f"c{pause} ")
        if len(request.messages) < 8 and data.draw(st.booleans(), label="tools"):
            n = data.draw(st.integers(1, 3), label="ncalls")
            for i in range(n):
                name = data.draw(st.sampled_from(["fast", "slow", "excl"]), label="tool")
                yield ToolCallDelta(i, id=f"c{len(request.messages)}_{i}", name=name,
                                    arguments="{}")
            yield Finish("tool_calls")
        else:
            yield Finish("stop")

    return FunctionModel(fn)


def register_tools(rt: agentloop.Context) -> None:
    @rt.tools.tool(concurrency="parallel")
    async def fast() -> str:
        """Fast."""
        await trio.sleep(1)
        return "fast"

    @rt.tools.tool(concurrency="parallel")
    async def slow() -> str:
        """Slow."""
        await trio.sleep(5)
        return "slow"

    @rt.tools.tool
    async def excl() -> str:
        """Exclusive."""
        await trio.sleep(2)
        return "excl"


INBOX_ACTIONS = ["followup", "steer", "inject", "edit", "remove", "cancel", "cancel_keep",
                 "advance", "settle"]


@given(st.data())
def test_every_accepted_message_has_exactly_one_fate(data: st.DataObject) -> None:
    async def main() -> None:
        async with agentloop.open_runtime() as rt:
            rt.llm.register("scripted", paced_model(data))
            register_tools(rt)
            handle = await rt.agents.create(session_id="p", agent_options=OPTIONS)
            agent = handle.agent
            accepted: list[str] = []
            claimed: list[str] = []
            discarded: list[str] = []
            splices: list[ev.InboxSpliced] = []
            transitions: list[tuple[str, str]] = []
            rt.events.on(ev.InboxClaimed, lambda e: claimed.append(e.message.id))
            rt.events.on(ev.InboxDiscarded, lambda e: discarded.append(e.message.id))
            rt.events.on(ev.InboxSpliced, splices.append)
            rt.events.on(ev.AgentStatus, lambda e: transitions.append((e.previous, e.status)))

            def check_projection() -> None:
                for target, pending in (("next-turn", agent.inbox.next_turn),
                                        ("next-step", agent.inbox.next_step)):
                    replayed: list[agentloop.InboxMessage] = []
                    for s in splices:
                        if s.list == target:
                            replayed[s.index: s.index + s.delete_count] = list(s.inserted)
                    assert tuple(replayed) == pending

            steps = data.draw(st.integers(1, 14), label="steps")
            for i in range(steps):
                action = data.draw(st.sampled_from(INBOX_ACTIONS), label="action")
                pending = [*agent.inbox.next_turn, *agent.inbox.next_step]
                if action in ("followup", "steer", "inject"):
                    accepted.append(getattr(agent, action)(f"{action} {i}"))
                elif action == "edit" and pending:
                    agent.edit(data.draw(st.sampled_from(pending)).id, f"edited {i}")
                elif action == "remove" and pending:
                    assert agent.remove(data.draw(st.sampled_from(pending)).id)
                elif action == "cancel":
                    agent.cancel()
                elif action == "cancel_keep":
                    agent.cancel(keep_inbox=True)
                elif action == "advance":
                    await trio.sleep(data.draw(st.integers(0, 4), label="dt"))
                else:
                    await trio.testing.wait_all_tasks_blocked()
                check_projection()
            with trio.fail_after(10_000):
                await agent.wait_idle()
            check_projection()
            still = [m.id for m in (*agent.inbox.next_turn, *agent.inbox.next_step)]
            for mid in accepted:
                fates = claimed.count(mid) + discarded.count(mid) + still.count(mid)
                assert fates == 1, (mid, claimed, discarded, still)
            logged = [e.data["message_id"] for e in agent.session.events
                      if e.type in ("user/message", "steering/message")]
            assert logged == claimed
            assert set(transitions) <= LEGAL
            check_log_invariants(agent.session.events)
            check_history_valid(agent.session.messages())
            await handle.aclose()
            check_log_invariants(agent.session.events)
            check_history_valid(agent.session.messages())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


LIFECYCLE_ACTIONS = ["create", "create_failing", "create_cancelled", "send", "cancel",
                     "close", "close_owner", "advance"]


@given(st.data())
def test_lifecycle_interleavings_keep_the_registry_and_pairing_sound(data: st.DataObject) -> None:
    trace: list[tuple[str, str]] = []
    logs: dict[int, agentloop.Session] = {}

    async def main() -> None:
        async with trio.open_nursery() as outer:
            async with agentloop.open_runtime() as rt:
                rt.llm.register("scripted", paced_model(data))
                register_tools(rt)
                for cls in (ev.AgentCreated, ev.AgentDisposed, ev.AgentStatus,
                            ev.InboxInserted, ev.InboxClaimed):
                    rt.events.on(cls, lambda e, name=cls.name: trace.append((name, e.agent_id)))
                rt.events.on(ev.SessionEventAppended,
                             lambda e: trace.append(("session/event", e.session_id)))
                owners = [rt.child("owner-a"), rt.child("owner-b")]
                handles: list[agentloop.AgentHandle] = []

                async def create(owner: agentloop.Context, sid: str, mode: str) -> None:
                    async def setup(ctx: agentloop.Context) -> None:
                        await trio.sleep(data.draw(st.integers(0, 2), label="setup_dt"))
                        if mode == "create_failing":
                            raise ValueError("setup failed")

                    try:
                        with trio.move_on_after(1 if mode == "create_cancelled" else 1e9):
                            h = await owner.agents.create(session_id=sid, agent_options=OPTIONS,
                                                          setup=setup)
                            handles.append(h)
                            logs[id(h.agent)] = h.agent.session
                    except (ValueError, agentloop.SessionIdInUse, agentloop.RuntimeClosed,
                            agentloop.AgentDisposed, RuntimeError):
                        pass

                steps = data.draw(st.integers(1, 12), label="steps")
                for _ in range(steps):
                    action = data.draw(st.sampled_from(LIFECYCLE_ACTIONS), label="action")
                    live = [h for h in handles if h.agent.status != "disposed"]
                    if action.startswith("create"):
                        owner = data.draw(st.sampled_from(owners))
                        sid = data.draw(st.sampled_from(["x", "y"]), label="sid")
                        outer.start_soon(create, owner, sid, action)
                    elif action == "send" and live:
                        data.draw(st.sampled_from(live)).agent.followup("hi")
                    elif action == "cancel" and live:
                        data.draw(st.sampled_from(live)).agent.cancel()
                    elif action == "close" and handles:
                        outer.start_soon(data.draw(st.sampled_from(handles)).aclose)
                    elif action == "close_owner":
                        outer.start_soon(data.draw(st.sampled_from(owners)).aclose)
                    else:
                        await trio.sleep(data.draw(st.integers(0, 3), label="dt"))
                    ids = [a.id for a in rt.agents.list()]
                    assert len(ids) == len(set(ids))
            assert rt._runtime.agents == {} and rt._runtime.sessions == {}
        # every created agent was disposed exactly once, and nothing followed its disposal
        created: dict[str, int] = {}
        for name, who in trace:
            if name == "agent/created":
                created[who] = created.get(who, 0) + 1
                assert created[who] == 1, f"{who} published twice while live"
            elif name == "agent/disposed":
                assert created.get(who) == 1, f"{who} disposed without being created"
                created[who] = 0
            else:
                assert created.get(who) == 1, f"{name} for {who} outside its lifetime"
        assert all(n == 0 for n in created.values())
        for session in logs.values():
            check_log_invariants(session.events)
            check_history_valid(session.messages())
        assert trio.lowlevel.current_root_task() is not None
        assert len(trio.lowlevel.current_task().child_nurseries) == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
