"""``ctx.subagents.subscribe_tree``: one observer follows a parent and all its descendants."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

import agentloop
from agentloop import AgentOptions, Context, TreeEvent
from agentloop.events import SessionCreated
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

OPTIONS = AgentOptions(provider="fn", model="m")
Part = TextDelta | ToolCallDelta | Finish


def depth_of(rt: Context, request: LLMRequest) -> int:
    session = rt.sessions.get(request.session_id)
    assert session is not None
    depth = session.meta.get("depth", 0)
    assert isinstance(depth, int)
    return depth


def delegating_model(rt: Context, levels: int = 2) -> FunctionModel:
    """Agents above depth ``levels`` call ``delegate`` once, then sum up; the deepest answer."""

    async def fn(request: LLMRequest) -> AsyncIterator[Part]:
        depth = depth_of(rt, request)
        last = request.messages[-1]
        if depth < levels and last.role == "user" and request.session_id != "bystander":
            yield ToolCallDelta(0, id=f"call_{depth}", name="delegate",
                                arguments=json.dumps({"task": f"level {depth + 1}"}))
            yield Finish("tool_calls")
            return
        yield TextDelta(f"answer from depth {depth}")
        yield Finish("stop")

    return FunctionModel(fn)


def install_delegate(rt: Context, kept: list[agentloop.AgentHandle] | None = None) -> None:
    @rt.tools.tool()
    async def delegate(task: str) -> str:
        """Delegate a task.

        Args:
            task: the task.
        """
        if kept is not None:
            handle = await rt.subagents.spawn()
            kept.append(handle)
            return (await handle.agent.ask(task)).text
        return (await rt.subagents.run(task)).text


def drain(rx: trio.MemoryReceiveChannel[TreeEvent]) -> list[TreeEvent]:
    out: list[TreeEvent] = []
    while True:
        try:
            out.append(rx.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


def by_session(items: list[TreeEvent]) -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = {}
    for item in items:
        seqs.setdefault(item.session_id, []).append(item.event.seq)
    return seqs


async def test_a_tree_subscription_follows_every_descendant_losslessly_and_in_order(
    rt: Context,
) -> None:
    rt.llm.register("fn", delegating_model(rt))
    install_delegate(rt)
    logs: dict[str, agentloop.Session] = {}

    def created(e: SessionCreated) -> None:
        session = rt.sessions.get(e.session_id)
        assert session is not None
        logs[e.session_id] = session

    rt.events.on(SessionCreated, created)
    root = await rt.agents.create(session_id="root", agent_options=OPTIONS)
    bystander = await rt.agents.create(session_id="bystander", agent_options=OPTIONS)
    await root.agent.ask("warm up")  # before the subscription: not delivered
    logs.clear()
    already = root.agent.session.last_seq
    async with rt.subagents.subscribe_tree("root") as rx:
        # Nobody reads while the tree works: the backlog is kept, nothing is dropped.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(root.agent.ask, "go")
            nursery.start_soon(bystander.agent.ask, "not in the tree")
        got = drain(rx)
    with pytest.raises(trio.EndOfChannel):
        await rx.receive()

    seqs = by_session(got)
    child, grandchild = (s for s in logs.values() if s.id not in ("root", "bystander"))
    if child.meta["depth"] == 2:
        child, grandchild = grandchild, child
    assert set(seqs) == {"root", child.id, grandchild.id}
    # Live sessions from the moment of subscribing; children created later from seq 1; each
    # in seq order with none missing.
    assert seqs["root"] == list(range(already + 1, root.agent.session.last_seq + 1))
    for session in (child, grandchild):
        assert seqs[session.id] == list(range(1, session.last_seq + 1))
        assert [i.event for i in got if i.session_id == session.id] == list(session.events)
    lineage = {(i.session_id, i.parent_session_id, i.depth) for i in got}
    assert lineage == {("root", None, 0), (child.id, "root", 1), (grandchild.id, child.id, 2)}
    # One emission order across sessions: the grandchild's turn runs inside the child's,
    # which runs inside the root's.
    order = [(i.session_id, i.event.type) for i in got if i.event.type.startswith("turn/")]
    assert order == [
        ("root", "turn/start"), (child.id, "turn/start"), (grandchild.id, "turn/start"),
        (grandchild.id, "turn/end"), (child.id, "turn/end"), ("root", "turn/end"),
    ]
    await root.aclose()
    await bystander.aclose()


async def test_a_seeded_child_is_delivered_from_its_seed(rt: Context) -> None:
    rt.llm.register("fn", delegating_model(rt, levels=0))
    seed = [{"type": "user/message", "turn": 1,
             "data": {"message_id": "m0", "content": "earlier", "source": None}}]
    spawned: list[agentloop.AgentHandle] = []

    async def setup(ctx: Context) -> None:
        await trio.lowlevel.checkpoint()
        spawned.append(await ctx.subagents.spawn(seed=seed, session_id="forked"))

    async with rt.subagents.subscribe_tree("parent") as rx:
        handle = await rt.agents.create(session_id="parent", agent_options=OPTIONS, setup=setup)
        await spawned[0].agent.ask("and now")
        got = drain(rx)
    forked = spawned[0].agent.session
    assert [i.event for i in got if i.session_id == "forked"] == list(forked.events)
    assert got[0].event.type == "user/message" and got[0].event.data["content"] == "earlier"
    await handle.aclose()


async def test_a_tree_subscription_defaults_to_the_calling_agent_and_ends_with_its_scope(
    rt: Context,
) -> None:
    rt.llm.register("fn", delegating_model(rt, levels=1))
    install_delegate(rt)
    channels: list[trio.MemoryReceiveChannel[TreeEvent]] = []
    ready = trio.Event()

    async def setup(ctx: Context) -> None:
        async def follow(task_status: trio.TaskStatus[None]) -> None:
            # Opened from the agent's own scope, with no id: that agent's tree.
            async with ctx.subagents.subscribe_tree() as rx:
                channels.append(rx)
                task_status.started()
                await trio.sleep_forever()

        await rt._services.system_nursery.start(follow)
        ready.set()

    handle = await rt.agents.create(session_id="me", agent_options=OPTIONS, setup=setup)
    await ready.wait()
    await handle.agent.ask("go")
    [rx] = channels
    got = drain(rx)
    assert {i.session_id for i in got} >= {"me"} and len({i.session_id for i in got}) == 2
    await handle.aclose()
    # The agent's scope closed: the channel ends once what was queued is read.
    drain(rx)
    with trio.fail_after(1):
        with pytest.raises(trio.EndOfChannel):
            await rx.receive()
    with pytest.raises(ValueError, match="needs the session_id"):
        rt.subagents.subscribe_tree()
    with pytest.raises(agentloop.InvalidContent):
        rt.subagents.subscribe_tree("../nope")


async def test_a_child_that_leaves_and_is_resumed_is_not_delivered_twice(
    tmp_path: Path,
) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("fn", delegating_model(rt, levels=1))
        kept: list[agentloop.AgentHandle] = []
        install_delegate(rt, kept)
        root = await rt.agents.create(session_id="root", agent_options=OPTIONS)
        async with rt.subagents.subscribe_tree("root") as rx:
            await root.agent.ask("go")
            [child] = kept
            child_id = child.agent.id
            await child.aclose()
            # Resumed elsewhere in the program, it is still the root's child.
            again = await rt.agents.resume(resume_session_id=child_id, agent_options=OPTIONS)
            await again.agent.ask("once more")
            got = drain(rx)
        seqs = by_session(got)
        assert seqs[child_id] == list(range(1, again.agent.session.last_seq + 1))
        await again.aclose()
        await root.aclose()


async def test_tree_events_are_frozen_values() -> None:
    event = agentloop.SessionEvent(1, "turn/start", 1, agentloop.FrozenDict(turn=1))
    item = TreeEvent("s", None, 0, event)
    assert item == TreeEvent("s", None, 0, event)
    with pytest.raises(AttributeError):
        item.depth = 1  # type: ignore[misc]
