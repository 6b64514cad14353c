"""Hibernation: an idle agent of a persisted session releases its actor, channels and log, and
any input reloads it from the store, in order, nothing lost (contract section 12).

Every test but the timing and no-store ones runs on a real SQLite file and the real clock,
waiting for ``agent/hibernated`` and ``agent/woken`` as events, never for time.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS, kill_when_ready, turn_ends
from hypothesis import HealthCheck, given, settings

import agentloop
from agentloop import events as ev
from agentloop.testing import ScriptedModel, check_log, reply, run_race
from agentloop.testing import strategies as als

CHILD = Path(__file__).with_name("hibernate_child.py")


def config(db: Path, after: float | None = 0.01) -> dict[str, Any]:
    cfg: dict[str, Any] = {"persistence": {"backend": "sqlite", "path": str(db)}}
    if after is not None:
        cfg["settings"] = {"agent-loop": {"hibernate_after_seconds": after}}
    return cfg


def stored(db: Path, session_id: str) -> list[tuple[int, str, Any]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT seq, type, data FROM events WHERE session_id = ? ORDER BY seq", (session_id,)
        ).fetchall()
    return [(seq, type_, json.loads(data)) for seq, type_, data in rows]


def as_rows(events: Any) -> list[tuple[int, str, Any]]:
    return [(e.seq, e.type, json.loads(json.dumps(e.data))) for e in events]


def prompts(agent: agentloop.Agent) -> list[Any]:
    return [
        e.data["content"] for e in agent.session.events
        if e.type in ("user/message", "steering/message")
    ]


class Watch:
    """The hibernation events of a runtime, and a way to wait for the n-th of one kind."""

    def __init__(self, rt: agentloop.Context) -> None:
        self.seen: list[ev.AgentHibernated | ev.AgentWoken] = []
        self.statuses: list[str] = []
        self._changed = trio.Event()
        rt.events.on(ev.AgentHibernated, self._add)
        rt.events.on(ev.AgentWoken, self._add)
        rt.events.on(ev.AgentStatus, lambda e: self.statuses.append(e.status))

    def _add(self, e: ev.AgentHibernated | ev.AgentWoken) -> None:
        self.seen.append(e)
        self._changed.set()
        self._changed = trio.Event()

    def count(self, kind: type[Any], agent_id: str) -> int:
        return sum(isinstance(e, kind) and e.agent_id == agent_id for e in self.seen)

    async def hibernated(self, agent_id: str, n: int = 1) -> None:
        with trio.fail_after(10):
            while self.count(ev.AgentHibernated, agent_id) < n:
                await self._changed.wait()


@contextlib.asynccontextmanager
async def runtime(db: Path, after: float | None = 0.01) -> AsyncIterator[
    tuple[agentloop.Context, ScriptedModel, Watch]
]:
    async with agentloop.open_runtime(config(db, after)) as rt:
        model = ScriptedModel()
        rt.llm.register("scripted", model)
        yield rt, model, Watch(rt)


async def asleep(
    rt: agentloop.Context, model: ScriptedModel, watch: Watch, sid: str = "s1"
) -> agentloop.AgentHandle:
    """An agent that ran one turn and hibernated."""
    model.add(reply("first"))
    handle = await rt.agents.create(session_id=sid, agent_options=OPTIONS)
    handle.agent.followup("one")
    await watch.hibernated(sid)
    assert handle.agent.status == "hibernated"
    return handle


# --- hibernating ------------------------------------------------------------------------------


async def test_an_idle_agent_hibernates_after_the_setting(tmp_path: Path, mock_clock: Any) -> None:
    db = tmp_path / "s.db"
    async with runtime(db, after=10) as (rt, model, watch):
        model.add(reply("first"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        agent = handle.agent
        agent.followup("one")
        await agent.wait_idle()
        mock_clock.jump(9.5)
        await trio.testing.wait_all_tasks_blocked()
        assert agent.status == "idle"
        assert watch.seen == []
        before = as_rows(agent.session.events)
        mock_clock.jump(1)
        await watch.hibernated("s1")
        assert agent.status == "hibernated"
        assert watch.statuses[-1] == "hibernated"
        [rested] = watch.seen
        assert rested == ev.AgentHibernated("s1", before[-1][0])
        # The handle and the registry keep the same agent; its log lives in the store only.
        assert rt.agents.get("s1") is agent
        assert rt.agents.list() == [agent]
        assert rt.sessions.get("s1") is None
        assert agent.inbox == agentloop.Inbox((), ())
        assert stored(db, "s1") == before


async def test_without_persistence_it_never_hibernates(autojump_clock: Any) -> None:
    cfg = {"settings": {"agent-loop": {"hibernate_after_seconds": 1}}}
    async with agentloop.open_runtime(cfg) as rt:
        rt.llm.register("scripted", ScriptedModel(["hi"]))
        rested: list[Any] = []
        rt.events.on(ev.AgentHibernated, rested.append)
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        handle.agent.followup("one")
        await handle.agent.wait_idle()
        await trio.sleep(1000)
        assert handle.agent.status == "idle"
        assert handle.agent.hibernate() is False
        assert rested == []


async def test_unset_it_never_hibernates(tmp_path: Path, autojump_clock: Any) -> None:
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        model.add(reply("first"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        handle.agent.followup("one")
        await handle.agent.wait_idle()
        await trio.sleep(1000)
        assert handle.agent.status == "idle"
        assert watch.seen == []


async def test_a_busy_agent_or_pending_input_does_not_hibernate(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        model.add(reply("first"), reply("second"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        agent = handle.agent
        agent.followup("one")
        assert agent.status == "running"
        assert agent.hibernate() is False
        await agent.wait_idle()
        # Injected input is in memory only: the agent keeps it, awake, for its next turn.
        agent.inject("a note")
        assert agent.hibernate() is False
        agent.followup("two")
        await agent.wait_idle()
        assert prompts(agent) == ["one", "a note", "two"]
        assert watch.seen == []


# --- waking -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["followup", "steer", "send", "run"])
async def test_input_wakes_it_in_order_with_nothing_lost(tmp_path: Path, how: str) -> None:
    db = tmp_path / "s.db"
    async with runtime(db) as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        agent = handle.agent
        model.add(reply("second"))
        if how == "run":
            async with agent.run("two") as run:
                result = await run.result()
            assert result.text == "second"
        else:
            getattr(agent, how)("two")
            # Woken synchronously: the input is in the live inbox and its turn admitted.
            assert agent.status == "running"
            await agent.wait_idle()
        woken = [e for e in watch.seen if isinstance(e, ev.AgentWoken)]
        assert woken == [ev.AgentWoken("s1", 6, "send")]
        assert prompts(agent) == ["one", "two"]
        assert turn_ends(agent) == ["completed", "completed"]
        check_log(agent.session.events)
        await watch.hibernated("s1", 2)
        assert stored(db, "s1") == as_rows(agent.session.events)


async def test_an_injection_wakes_it_and_waits_for_the_next_turn(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db") as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        agent = handle.agent
        agent.inject("a note")
        assert agent.status == "idle"
        assert [m.content for m in agent.inbox.next_step] == ["a note"]
        model.add(reply("second"))
        agent.followup("two")
        await agent.wait_idle()
        assert prompts(agent) == ["one", "a note", "two"]


async def test_routed_input_wakes_it(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db") as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        model.add(reply("second"))
        await rt.sessions.send("s1", "two")
        await handle.agent.wait_idle()
        assert prompts(handle.agent) == ["one", "two"]
        assert watch.count(ev.AgentWoken, "s1") == 1


async def test_reading_the_session_wakes_it(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with runtime(db) as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        agent = handle.agent
        session = agent.session
        assert agent.status == "idle"
        assert watch.seen[-1] == ev.AgentWoken("s1", 6, "session")
        assert rt.sessions.get("s1") is session
        assert as_rows(session.events) == stored(db, "s1")
        assert [m.role for m in session.messages()] == ["user", "assistant"]
        # Its actor is back: it takes input as before, and hibernates again when idle.
        model.add(reply("second"))
        agent.followup("two")
        await agent.wait_idle()
        assert agent.session is session
        assert prompts(agent) == ["one", "two"]
        await watch.hibernated("s1", 2)


async def test_wake_without_input(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        model.add(reply("first"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        agent = handle.agent
        agent.followup("one")
        await agent.wait_idle()
        assert agent.wake() is False  # awake
        assert agent.hibernate() is True
        await watch.hibernated("s1")
        assert agent.wake() is True
        assert agent.wake() is False
        assert agent.status == "idle"
        assert watch.seen[-1] == ev.AgentWoken("s1", 6, "wake")


# --- races ------------------------------------------------------------------------------------


async def test_a_send_while_it_goes_to_sleep_keeps_it_awake(tmp_path: Path) -> None:
    """Input that arrives while the actor stores its log (the last await before it lets go)
    is taken by a turn; the agent hibernates only later, idle again."""
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        model.add(reply("first"), reply("second"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        agent = handle.agent
        agent.followup("one")
        await agent.wait_idle()
        armed = [True]

        async def mid_flush(e: ev.SessionFlush) -> None:
            if armed and agent.status == "idle":
                armed.clear()
                agent.followup("two")

        rt.events.on(ev.SessionFlush, mid_flush)
        assert agent.hibernate() is True
        with trio.fail_after(10):
            while armed:
                await trio.testing.wait_all_tasks_blocked()
        await agent.wait_idle()
        assert watch.seen == []
        assert prompts(agent) == ["one", "two"]
        assert agent.hibernate() is True
        await watch.hibernated("s1")


async def test_a_send_in_the_same_tick_as_the_request_wins(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        model.add(reply("first"), reply("second"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        agent = handle.agent
        agent.followup("one")
        await agent.wait_idle()
        assert agent.hibernate() is True
        agent.followup("two")
        await agent.wait_idle()
        assert agent.status == "idle"
        assert prompts(agent) == ["one", "two"]
        assert watch.seen == []


async def test_two_wakes_at_once(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db") as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        agent = handle.agent
        model.add(reply("second"), reply("third"))
        woke: list[bool] = []
        ids: list[str] = []

        async def wake() -> None:
            woke.append(agent.wake())

        async def send(text: str) -> None:
            ids.append(agent.followup(text))

        async with trio.open_nursery() as nursery:
            # All four run in one scheduling batch, before any actor starts.
            nursery.start_soon(wake)
            nursery.start_soon(send, "two")
            nursery.start_soon(wake)
            nursery.start_soon(send, "three")
        assert sorted(woke) == [False, False] or sorted(woke) == [False, True]
        assert watch.count(ev.AgentWoken, "s1") == 1
        await agent.wait_idle()
        assert prompts(agent) == ["one", "two", "three"] or prompts(agent) == [
            "one", "three", "two"
        ]
        claimed = [e.data["message_id"] for e in agent.session.events
                   if e.type == "user/message"][1:]
        assert claimed == ids  # the order they were sent in
        check_log(agent.session.events)


async def test_disposal_of_a_hibernated_agent_needs_no_wake(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with runtime(db) as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        agent = handle.agent
        disposed: list[Any] = []
        rt.events.on(ev.AgentDisposed, disposed.append)
        rt.events.on(ev.SessionDisposed, disposed.append)
        await handle.aclose()
        assert agent.status == "disposed"
        assert watch.count(ev.AgentWoken, "s1") == 0
        assert disposed == [ev.AgentDisposed("s1"), ev.SessionDisposed("s1")]
        assert rt.agents.get("s1") is None
        with pytest.raises(agentloop.AgentDisposed):
            agent.followup("too late")
        # Its log is still readable (from the store, without a wake), and its lease is free:
        # a resume takes it over at once.
        assert as_rows(agent.session.events) == stored(db, "s1")
        assert watch.count(ev.AgentWoken, "s1") == 0
        model.add(reply("second"))
        again = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
        again.agent.followup("two")
        await again.agent.wait_idle()
        assert prompts(again.agent) == ["one", "two"]
        await again.aclose()


@pytest.mark.parametrize("how", ["input", "wake"])
async def test_disposal_during_a_wake(tmp_path: Path, how: str) -> None:
    """A disposal right after the wake, before the restarted actor ran: the input is
    discarded as any disposal discards it, the log stays valid, the lease is released."""
    db = tmp_path / "s.db"
    async with runtime(db) as (rt, model, watch):
        handle = await asleep(rt, model, watch)
        agent = handle.agent
        model.add(reply("never"))
        if how == "input":
            agent.followup("two")
        else:
            assert agent.wake() is True
        await handle.aclose()
        assert agent.status == "disposed"
        assert watch.count(ev.AgentWoken, "s1") == 1
        assert rt.agents.get("s1") is None
        rows = stored(db, "s1")
        assert rows == as_rows(agent.session.events)
        check_log(agent.session.events)
        assert turn_ends(agent) == ["completed"]
        assert len(model.requests) == 1
        again = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
        await again.aclose()


def guarded_rm(rt: agentloop.Context, ran: list[str]) -> None:
    """An ``rm`` tool that asks for approval; each path it removes goes to ``ran``."""

    @rt.tools.tool
    async def rm(path: str) -> str:
        """Remove a path."""
        ran.append(path)
        return f"removed {path}"

    rt.events.on(
        ev.ToolPreExecute, lambda e: agentloop.Ask("sure?") if e.call.name == "rm" else None
    )


async def test_approval_answered_while_hibernated(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    ran: list[str] = []
    async with runtime(db) as (rt, model, watch):

        guarded_rm(rt, ran)
        model.add(reply("", tool_calls=[("rm", {"path": "/x"}, "c1")]), reply("all done"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        handle.agent.followup("clean up")
        await handle.agent.wait_idle()
        # Closed while the call waits: the turn is suspended in the log, the call pending.
        await handle.aclose()
        handle = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
        agent = handle.agent
        assert [p.call_id for p in agent.pending_approvals] == ["c1"]
        await watch.hibernated("s1")
        assert agent.approve("c1") is True
        woken = [e for e in watch.seen if isinstance(e, ev.AgentWoken)]
        assert [e.cause for e in woken] == ["approval"]
        await agent.wait_idle()
        assert ran == ["/x"]
        assert turn_ends(agent) == ["suspended", "completed"]
        assert agent.session.events[-2].data["content"] == "all done"
        check_log(agent.session.events)
        await handle.aclose()


# --- crashes ----------------------------------------------------------------------------------


async def test_a_process_killed_while_its_agent_hibernates_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    await kill_when_ready([sys.executable, str(CHILD), str(db)], tmp_path / "child.log")
    before = stored(db, "sleepy")
    assert [t for _, t, _ in before][-1] == "turn/end"
    async with runtime(db) as (rt, model, watch):
        model.add(reply("second"))
        # The dead process's lease lapses with it.
        handle = await rt.agents.resume(resume_session_id="sleepy", agent_options=OPTIONS)
        agent = handle.agent
        assert as_rows(agent.session.events) == before
        agent.followup("and now?")
        await agent.wait_idle()
        assert prompts(agent) == ["remember this", "and now?"]
        assert turn_ends(agent) == ["completed", "completed"]
        await watch.hibernated("sleepy")
        await handle.aclose()


def test_the_kit_crash_while_hibernated() -> None:
    run_race(
        [als.Followup(0), als.Advance(6.0), als.Hibernate(0), als.Hibernate(1), als.Advance(1.0),
         als.Crash(), als.Followup(0, "after the crash")],
        config={"settings": {"agent-loop": {"hibernate_after_seconds": 3.0}}},
    )


def test_the_kit_sub_agent_hibernated_after_the_crash_wakes_in_the_dying_runtime() -> None:
    """Found by the property: a sub-agent spawned after the crash point hibernated in the
    dying runtime, whose store had kept nothing of it, and its wake found no session. The
    dying runtime reads its own later writes back; only what came before the crash is
    resumed."""
    run_race(
        [als.When(point="tool-start", op=als.Spawn(text="hi")), als.Crash(appends=1),
         als.Spawn(text="hi"), als.Advance(seconds=40.0)],
        script=[als.CallTools(names=("fast", "slow"), text=""),
                als.Stall(seconds=2.0, text="thinking it over"),
                als.CallTools(names=("guarded",), text=""), als.Say(text="ok")],
        config={"settings": {"agent-loop": {"hibernate_after_seconds": 2.0}}},
    )


# --- the property -----------------------------------------------------------------------------

_KINDS = (*(k for k in als.DEFAULT_KINDS if k != "subscribe"), "hibernate", "wake")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=als.operations(kinds=_KINDS, max_size=14), seed=als.seeds())
def test_random_operations_with_hibernation(ops: list[Any], seed: int) -> None:
    """The kit's lifecycle checks (logs, histories, inboxes: every input taken once, in
    order; leases; refusals and statuses) over random operations, with agents hibernating
    after 2 s of idleness and on request, and woken by whatever comes."""
    run_race(ops, config={"settings": {"agent-loop": {"hibernate_after_seconds": 2.0}}},
             seed=seed)


async def test_a_parent_stays_awake_while_it_has_sub_agents(tmp_path: Path) -> None:
    """A child's actor runs in its parent's nursery, a hibernated child's too when it wakes:
    the parent hibernates only once it has no live sub-agent."""
    async with runtime(tmp_path / "s.db") as (rt, model, watch):
        handle = await asleep(rt, model, watch, "parent")
        model.add(reply("child's answer"), reply("child again"))
        child = await handle.ctx.subagents.spawn("work")
        await watch.hibernated(child.agent.id)
        assert handle.agent.status == "idle"  # woken for its child, kept awake by it
        assert handle.agent.hibernate() is False
        child.agent.followup("more")
        await child.agent.wait_idle()
        assert prompts(child.agent) == ["work", "more"]
        await child.aclose()
        assert handle.agent.hibernate() is True
        await watch.hibernated("parent", 2)


async def one_turn(rt: agentloop.Context, model: ScriptedModel) -> agentloop.Agent:
    """An agent of session ``s1`` that ran one turn and is idle (awake)."""
    model.add(reply("first"))
    handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
    handle.agent.followup("one")
    await handle.agent.wait_idle()
    return handle.agent


async def test_a_tree_subscription_follows_a_hibernated_root_after_its_wake(
    tmp_path: Path,
) -> None:
    # A wake announces no SessionCreated: the tree must still deliver the woken turn.
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        agent = await one_turn(rt, model)
        assert agent.hibernate() is True
        await watch.hibernated("s1")
        async with rt.subagents.subscribe_tree("s1") as rx:
            model.add(reply("second"))
            agent.followup("two")
            await agent.wait_idle()
            await trio.testing.wait_all_tasks_blocked()
            got = []
            with contextlib.suppress(trio.WouldBlock):
                while True:
                    got.append(rx.receive_nowait())
            new = [e.seq for e in agent.session.events if e.seq > 6]
            assert new, "the woken turn logged events"
            assert [t.event.seq for t in got] == new


async def test_input_from_a_status_handler_orders_hibernated_before_woken(
    tmp_path: Path,
) -> None:
    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        agent = await one_turn(rt, model)
        sent: list[str] = []

        def on_status(e: ev.AgentStatus) -> None:
            if e.status == "hibernated" and not sent:
                sent.append(agent.followup("two"))

        rt.events.on(ev.AgentStatus, on_status)
        model.add(reply("second"))
        assert agent.hibernate() is True
        await watch.hibernated("s1")
        await agent.wait_idle()
        kinds = [type(e).__name__ for e in watch.seen]
        assert kinds == ["AgentHibernated", "AgentWoken"], kinds
        assert agent.status == "idle"


async def test_the_inspectors_listing_leaves_a_hibernated_agent_asleep(tmp_path: Path) -> None:
    from agentloop._cli_ui import Inspector

    async with runtime(tmp_path / "s.db", after=None) as (rt, model, watch):
        agent = await one_turn(rt, model)
        assert agent.hibernate() is True
        await watch.hibernated("s1")
        [row] = await Inspector(rt, token="t").sessions()
        assert (row["id"], row["live"], row["status"]) == ("s1", True, "hibernated")
        assert agent.status == "hibernated"
        assert [type(e).__name__ for e in watch.seen] == ["AgentHibernated"]
