"""A closed agent is freed as soon as nothing refers to it: no part of it refers back.

An agent's parts that called back into it (its lifecycle, its tool runner's hooks, its
approvals) made every closed agent a reference cycle, so its session (the whole log and
history) stayed in memory until Python's cyclic collector happened to run: for an agent that
lived long enough to reach the oldest generation, until a full collection, which a server
holding many agents runs rarely. These tests close agents in each way they end and check
that the collector has nothing of them left to find.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import OPTIONS
from test_hibernation import asleep, runtime

import agentloop
from agentloop import events as ev
from agentloop.testing import ScriptedModel, reply


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cyclic collector paused: what reference counting alone does not free stays."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def cyclic_leftovers() -> list[str]:
    """The runtime's objects that only the cyclic collector could free, by type."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({
            type(o).__qualname__ for o in gc.garbage
            if type(o).__module__.startswith("agentloop")
        })
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def _never_ran(rt: agentloop.Context, model: ScriptedModel) -> agentloop.AgentHandle:
    return await rt.agents.create(session_id="s", agent_options=OPTIONS)


async def _ran_a_tool(rt: agentloop.Context, model: ScriptedModel) -> agentloop.AgentHandle:
    @rt.tools.tool
    async def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: one.
            b: the other.
        """
        return a + b

    model.add(reply("", tool_calls=[("add", {"a": 1, "b": 2})]), "three")
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    assert (await handle.agent.ask("add")).text == "three"
    return handle


async def _suspended(rt: agentloop.Context, model: ScriptedModel) -> agentloop.AgentHandle:
    async def ask(e: ev.ToolPreExecute) -> agentloop.Ask:
        return agentloop.Ask("may I?")

    @rt.tools.tool
    async def act() -> str:
        """Act."""
        return "done"

    rt.events.on(ev.ToolPreExecute, ask)
    model.add(reply("", tool_calls=[("act", {})]), "after")
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    handle.agent.followup("go")
    await handle.agent.wait_idle()
    assert [p.call_id for p in handle.agent.pending_approvals]
    return handle


async def _answered_then_closed(
    rt: agentloop.Context, model: ScriptedModel
) -> agentloop.AgentHandle:
    handle = await _suspended(rt, model)
    agent = handle.agent
    agent.approve(agent.pending_approvals[0].call_id)
    return handle


async def _cancelled(rt: agentloop.Context, model: ScriptedModel) -> agentloop.AgentHandle:
    model.add(reply("never finished", chunk_size=1))
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    handle.agent.followup("go")
    await trio.testing.wait_all_tasks_blocked()
    handle.agent.cancel()
    await handle.agent.wait_idle()
    return handle


async def _with_a_sub_agent(
    rt: agentloop.Context, model: ScriptedModel
) -> agentloop.AgentHandle:
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    child = await handle.ctx.agents.create(session_id="s.child", agent_options=OPTIONS)
    model.add("from the child")
    assert (await child.agent.ask("hi")).text == "from the child"
    return handle


ENDINGS: dict[str, Callable[[agentloop.Context, ScriptedModel],
                            Awaitable[agentloop.AgentHandle]]] = {
    "never ran": _never_ran,
    "ran a tool call": _ran_a_tool,
    "closed awaiting approval": _suspended,
    "answered, then closed": _answered_then_closed,
    "cancelled mid-turn": _cancelled,
    "with a sub-agent": _with_a_sub_agent,
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_closed_agent_leaves_nothing_for_the_collector(
    collector_off: None, ending: str
) -> None:
    async with agentloop.open_runtime() as rt:
        model = ScriptedModel()
        rt.llm.register("scripted", model)
        handle = await ENDINGS[ending](rt, model)
        await handle.aclose()
        assert handle.agent.status == "disposed"
        del handle
        await trio.testing.wait_all_tasks_blocked()
        assert cyclic_leftovers() == []


@pytest.mark.parametrize("hibernated", [False, True], ids=["awake", "hibernated"])
async def test_a_stored_agent_closed_leaves_nothing_for_the_collector(
    collector_off: None, tmp_path: Path, hibernated: bool
) -> None:
    # With a store, every step and the disposal flush the log through the runtime's
    # services; a hibernated agent is disposed without an actor.
    async with runtime(tmp_path / "s.db", 0.01 if hibernated else None) as (rt, model, watch):
        if hibernated:
            handle = await asleep(rt, model, watch)
        else:
            handle = await _ran_a_tool(rt, model)
        await handle.aclose()
        assert handle.agent.status == "disposed"
        del handle
        await trio.testing.wait_all_tasks_blocked()
        assert cyclic_leftovers() == []


async def test_a_closed_agent_still_answers_what_it_held(collector_off: None) -> None:
    # Closing lets go of what called back into the agent, not of what it reports.
    async with agentloop.open_runtime() as rt:
        model = ScriptedModel()
        rt.llm.register("scripted", model)
        handle = await _answered_then_closed(rt, model)
        agent = handle.agent
        pending = agent.pending_approvals
        await handle.aclose()
        assert agent.status == "disposed"
        assert agent.pending_approvals == pending
        assert [e.type for e in agent.session.events][-1] == "turn/end"
        await agent.wait_idle()  # a disposed agent is settled
        with pytest.raises(agentloop.AgentDisposed):
            agent.followup("more")
        await handle.aclose()  # closing again is a no-op
