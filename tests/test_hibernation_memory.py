"""What an idle or hibernated agent keeps, and the lazily made parts staying invisible.

An agent's own scope (``handle.ctx``) is made the first time anyone uses it, so the many
agents that never register anything keep none; a hibernated agent keeps a marker for call
settings its options give. These tests pin the memory figure, then check that nobody can tell
a scope made late from one made at creation: it owns what is registered through it, closes
with its agent, and reads closed after a disposal (or an owner's close) that came first.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS
from test_hibernation import asleep, config, guarded_rm, runtime

import agentloop
from agentloop import events as ev
from agentloop.testing import reply

SEED = (
    {"type": "user/message", "data": {"message_id": "m1", "content": "hello", "source": None}},
    {"type": "assistant/message", "data": {"content": "hi, how can I help?"}},
)
# The goal is 1 KB per hibernated agent (benchmarks/bench_hibernate.py measures it at 1,000
# and more: 982 B); 400 agents carry more of the registries' table growth each (1,100 B).
# The bound still fails for a scope made at creation again (+300 B) or the tree before
# (2,000 B).
PER_AGENT = 1250


async def _hibernated(rt: agentloop.Context, label: str, n: int) -> list[agentloop.AgentHandle]:
    rested = 0
    all_rested = trio.Event()

    def counted(_e: ev.AgentHibernated) -> None:
        nonlocal rested
        rested += 1
        if rested == n:
            all_rested.set()

    stop = rt.events.on(ev.AgentHibernated, counted)
    handles = [
        await rt.agents.create(session_id=f"{label}{i}", agent_options=OPTIONS, seed=SEED)
        for i in range(n)
    ]
    await trio.testing.wait_all_tasks_blocked()
    assert all(h.agent.hibernate() for h in handles)
    with trio.fail_after(30):
        await all_rested.wait()
    await trio.testing.wait_all_tasks_blocked()
    stop()
    return handles


async def test_a_hibernated_agent_keeps_at_most_about_a_kilobyte(tmp_path: Path) -> None:
    n = 400
    async with agentloop.open_runtime(config(tmp_path / "s.db", None)) as rt:
        warm = await _hibernated(rt, "warm", 20)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            handles = await _hibernated(rt, "m", n)
            gc.collect()
            per = (tracemalloc.get_traced_memory()[0] - before) / n
        finally:
            tracemalloc.stop()
        assert all(h.agent.status == "hibernated" for h in handles)
        assert per <= PER_AGENT, f"{per:.0f} B per hibernated agent"
        for handle in handles + warm:
            await handle.aclose()


async def test_a_scope_first_used_after_creation_owns_what_it_registers(
    tmp_path: Path,
) -> None:
    async with runtime(tmp_path / "s.db") as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        seen: list[Any] = []
        # Used while hibernated: reading ctx does not wake the agent.
        handle.ctx.events.on(ev.AgentWoken, seen.append)
        assert handle.agent.status == "hibernated"
        assert handle.ctx is handle.ctx
        assert not handle.ctx.closed
        assert handle.agent.wake()
        assert [e.agent_id for e in seen] == ["s1"]
        await handle.aclose()
        assert handle.ctx.closed
        # Its registration went with it.
        model.add(reply("again"))
        again = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
        assert again.agent.wake() is False  # awake: nothing for the old hook to see
        again.agent.followup("two")
        await again.agent.wait_idle()
        assert len(seen) == 1
        await again.aclose()


@pytest.mark.parametrize("asleep_first", [False, True])
async def test_a_scope_never_used_reads_closed_after_the_disposal(
    tmp_path: Path, asleep_first: bool
) -> None:
    async with runtime(tmp_path / "s.db", after=0.01 if asleep_first else None) as (
        rt, model, watch
    ):
        if asleep_first:
            handle = await asleep(rt, model, watch)
        else:
            handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        await handle.aclose()
        ctx = handle.ctx
        assert ctx.closed and ctx.agent_id == "s1" and ctx.name == "agent:s1"
        with pytest.raises(agentloop.ScopeClosed):
            ctx.events.on(ev.AgentStatus, print)
        assert handle.ctx is ctx


async def test_an_owner_closed_before_the_scope_was_used(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db", after=None) as (rt, _model, _watch):
        owner = rt.child("plugin:owner")
        handle = await owner.agents.create(session_id="s1", agent_options=OPTIONS)
        await owner.aclose()
        assert handle.agent.status == "disposed"
        assert handle.ctx.closed
        assert rt.agents.get("s1") is None


async def test_a_scope_used_while_its_disposal_runs(tmp_path: Path) -> None:
    """The first use of the scope races the disposal: what it registers is undone by the
    time the handle's ``aclose`` returns, or refused."""
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, _watch):
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        heard: list[Any] = []
        registered: list[bool] = []

        async def use() -> None:
            try:
                handle.ctx.events.on(ev.AgentStatus, heard.append)
                registered.append(True)
            except agentloop.ScopeClosed:
                registered.append(False)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.aclose)
            nursery.start_soon(use)
        assert handle.ctx.closed
        assert registered in ([True], [False])
        heard.clear()
        model.add(reply("hi"))
        other = await rt.agents.create(session_id="s2", agent_options=OPTIONS)
        other.agent.followup("go")
        await other.agent.wait_idle()
        assert heard == []
        await other.aclose()


async def test_a_same_id_contender_in_setup_finds_its_own_scope(tmp_path: Path) -> None:
    """Two creations of one id at once: each setup's scope belongs to its own agent (told
    apart by the scope, which is made for the setup)."""
    async with runtime(tmp_path / "s.db", after=None) as (rt, _model, _watch):
        owners: list[Any] = []

        async def setup(ctx: agentloop.Context) -> None:
            owners.append((ctx, rt.agents.current()))
            await trio.testing.wait_all_tasks_blocked()

        results: list[Any] = []

        async def create() -> None:
            try:
                results.append(await rt.agents.create(
                    session_id="s1", agent_options=OPTIONS, setup=setup
                ))
            except agentloop.SessionIdInUse as exc:
                results.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(create)
            nursery.start_soon(create)
        [handle] = [r for r in results if isinstance(r, agentloop.AgentHandle)]
        assert handle.ctx in [ctx for ctx, _ in owners]
        await handle.aclose()


async def test_a_resumed_agent_keeps_its_stored_call_settings_across_a_hibernation(
    tmp_path: Path,
) -> None:
    """A resumed agent goes on with its last request's settings, not those its options
    give: it keeps them while hibernated (only options-given settings are left out)."""
    db = tmp_path / "s.db"
    async with runtime(db) as (rt, model, watch):
        model.add(reply("first"))
        first = await rt.agents.create(
            session_id="s1", agent_options=agentloop.AgentOptions(provider="scripted",
                                                                  model="chosen"),
        )
        first.agent.followup("one")
        await first.agent.wait_idle()
        await first.aclose()
        again = await rt.agents.resume(
            resume_session_id="s1", agent_options=agentloop.AgentOptions(provider="scripted")
        )
        # It never ran a step here before it sleeps.
        assert again.agent.hibernate()
        await watch.hibernated("s1")
        model.add(reply("second"))
        again.agent.followup("two")
        await again.agent.wait_idle()
        assert [r.config.model for r in model.requests] == ["chosen", "chosen"]
        # One that never ran anywhere goes on with what its options give.
        model.add(reply("third"))
        fresh = await rt.agents.create(session_id="s2", agent_options=OPTIONS)
        assert fresh.agent.hibernate()
        await watch.hibernated("s2")
        fresh.agent.followup("three")
        await fresh.agent.wait_idle()
        assert model.requests[-1].config == agentloop.CallConfig(
            provider=OPTIONS.provider, model=OPTIONS.model
        )
        await again.aclose()
        await fresh.aclose()


async def test_an_approval_answered_before_any_turn_of_a_resumed_agent(tmp_path: Path) -> None:
    """A resumed agent's tool runner (and its approvals) is made by the first answer."""
    db = tmp_path / "s.db"
    async with runtime(db, after=None) as (rt, model, _watch):
        ran: list[str] = []

        guarded_rm(rt, ran)
        model.add(reply("", tool_calls=[("rm", {"path": "/x"}, "c1")]))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        handle.agent.followup("clean up")
        with trio.fail_after(10):
            await handle.agent.wait_idle()
        assert [p.call_id for p in handle.agent.pending_approvals] == ["c1"]
        await handle.aclose()
        again = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
        assert [p.call_id for p in again.agent.pending_approvals] == ["c1"]
        assert not again.agent.deny("c2")
        model.add(reply("all done"))
        assert again.agent.approve("c1")
        assert not again.agent.approve("c1")  # answered once
        with trio.fail_after(10):
            await again.agent.wait_idle()
        assert ran == ["/x"]
        assert again.agent.pending_approvals == ()
        await again.aclose()
