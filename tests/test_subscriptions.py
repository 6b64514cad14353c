"""``ctx.events.subscribe``: lossless durable delivery, bounded control delivery, scoping, ends.

Durable events reach a subscriber however far behind it is; control events are bounded by
``capacity`` with a ``Lagged`` marker in place of what was missed. Guards are ``fail_after``;
under the autojump clock they count virtual seconds, so a hang fails at once.
"""

from __future__ import annotations

import logging
import os
from typing import TypeVar, assert_type

import pytest
import trio
import trio.testing
from conftest import OPTIONS, check_log_invariants

import agentloop
from agentloop import FrozenDict
from agentloop import events as ev
from agentloop._session import Session
from agentloop.testing import ScriptedModel

BIG = 200_000
T = TypeVar("T")


def owner(e: object) -> str | None:
    return getattr(e, "session_id", None) or getattr(e, "agent_id", None)


def status(agent_id: str) -> ev.AgentStatus:
    return ev.AgentStatus(agent_id, "running", "idle")


def appender(rt: agentloop.Context, session_id: str) -> Session:
    """A session on the runtime's bus: each ``append`` emits one ``SessionEventAppended``."""
    return Session(session_id, agentloop.FrozenDict(), rt._services.bus)


def drain(rx: trio.MemoryReceiveChannel[T]) -> list[T]:
    """Everything queued, taken without a checkpoint."""
    out: list[T] = []
    while True:
        try:
            out.append(rx.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


async def turns(rt: agentloop.Context, model: ScriptedModel,
                session_id: str, count: int) -> agentloop.Agent:
    """A new agent that runs ``count`` one-step turns of five text chunks each."""
    model.add(*[agentloop.testing.reply("abcdefghij", chunk_size=2)] * count)
    handle = await rt.agents.create(session_id=session_id, agent_options=OPTIONS)
    for _ in range(count):
        handle.agent.followup("go")
        await handle.agent.wait_idle()
    return handle.agent


# --- the channel ----------------------------------------------------------------------------


async def test_every_form_yields_a_memory_receive_channel(rt: agentloop.Context) -> None:
    async with rt.events.subscribe(ev.SessionEventAppended) as durable:
        assert_type(durable, trio.MemoryReceiveChannel[ev.SessionEventAppended])
        assert isinstance(durable, trio.MemoryReceiveChannel)
    async with rt.events.subscribe(ev.AgentStatus, ev.AgentCreated, capacity=8) as both:
        assert_type(
            both, trio.MemoryReceiveChannel[ev.AgentStatus | ev.AgentCreated | agentloop.Lagged]
        )
        assert isinstance(both, trio.MemoryReceiveChannel)
    async with rt.events.subscribe((ev.AgentStatus, ev.AgentCreated)) as tupled:
        assert isinstance(tupled, trio.MemoryReceiveChannel)
        rt.events.emit_nowait(ev.AgentCreated("x"))
        rt.events.emit_nowait(status("y"))
        assert [type(e) for e in drain(tupled)] == [ev.AgentCreated, ev.AgentStatus]
    with pytest.raises(TypeError, match="not an agentloop event"):
        async with rt.events.subscribe(ev.AgentStatus, int):  # type: ignore[type-var]
            pass
    with pytest.raises(ValueError, match="capacity"):
        async with rt.events.subscribe(ev.AgentStatus, capacity=0):
            pass


async def test_leaving_the_block_ends_the_channel(
    rt: agentloop.Context, autojump_clock: trio.testing.MockClock
) -> None:
    bus = rt._services.bus
    got: list[str] = []
    ended = trio.Event()

    async def reader(rx: trio.MemoryReceiveChannel[ev.AgentCreated | agentloop.Lagged]) -> None:
        async for e in rx:
            assert isinstance(e, ev.AgentCreated)
            got.append(e.agent_id)
        ended.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async with rt.events.subscribe(ev.AgentCreated) as rx:
                nursery.start_soon(reader, rx)
                await trio.testing.wait_all_tasks_blocked()
                rt.events.emit_nowait(ev.AgentCreated("a"))
                rt.events.emit_nowait(ev.AgentCreated("b"))
                await trio.testing.wait_all_tasks_blocked()
                assert not ended.is_set()
            assert not bus.has_listeners(ev.AgentCreated)
            await ended.wait()
    assert got == ["a", "b"]

    # What was queued before the exit can still be read; then the channel ends.
    async with rt.events.subscribe(ev.AgentCreated) as rx:
        rt.events.emit_nowait(ev.AgentCreated("late"))
    rt.events.emit_nowait(ev.AgentCreated("after the exit"))
    assert (await rx.receive()) == ev.AgentCreated("late")
    with pytest.raises(trio.EndOfChannel):
        await rx.receive()


# --- durable: lossless ----------------------------------------------------------------------


@pytest.mark.slow
async def test_a_stalled_durable_subscriber_loses_nothing(rt: agentloop.Context) -> None:
    session = appender(rt, "big")
    # capacity bounds control events only: durable ones ignore it.
    async with rt.events.subscribe(ev.SessionEventAppended, capacity=1) as rx:
        for i in range(BIG):
            session.append("note/tick", FrozenDict(i=i), None)
        assert rx.statistics().current_buffer_used == BIG
        first = [await rx.receive() for _ in range(3)]
        rest = drain(rx)
    got = first + rest
    assert len(got) == BIG
    assert all(isinstance(e, ev.SessionEventAppended) for e in got)
    assert [e.event.seq for e in got] == list(range(1, BIG + 1))
    assert [e.event for e in got] == list(session.events)


async def test_a_durable_subscriber_of_a_live_turn_gets_the_whole_log(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    async with rt.events.subscribe(ev.SessionEventAppended) as rx:
        agent = await turns(rt, model, "s", 4)
        got = drain(rx)
    assert [e.event for e in got] == list(agent.session.events)
    check_log_invariants(agent.session.events)


async def test_durable_events_keep_each_sessions_seq_order_in_emission_order(
    rt: agentloop.Context,
) -> None:
    a, b = appender(rt, "a"), appender(rt, "b")
    order = "abbabaaabbbbba"
    async with rt.events.subscribe(ev.SessionEventAppended) as rx:
        for name in order:
            (a if name == "a" else b).append("note/tick", FrozenDict(), None)
        got = drain(rx)
    assert "".join(e.session_id for e in got) == order
    for name in "ab":
        seqs = [e.event.seq for e in got if e.session_id == name]
        assert seqs == list(range(1, order.count(name) + 1))


@pytest.mark.slow
async def test_a_slow_async_observer_of_durable_events_sees_every_one_in_order(
    rt: agentloop.Context, autojump_clock: trio.testing.MockClock
) -> None:
    session = appender(rt, "observed")
    count = 70_000  # past the 65,536 a control observer would keep
    gate = trio.Event()
    seen: list[int] = []
    done = trio.Event()

    async def observer(e: ev.SessionEventAppended) -> None:
        await gate.wait()  # stalled while the whole backlog is emitted
        if e.event.seq % 1000 == 0:
            await trio.sleep(0.5)  # and slow while it works through it
        await trio.lowlevel.checkpoint()
        seen.append(e.event.seq)
        if len(seen) == count:
            done.set()

    rt.events.on(ev.SessionEventAppended, observer)
    for i in range(count):
        session.append("note/tick", FrozenDict(i=i), None)
    await trio.testing.wait_all_tasks_blocked()
    assert seen == []
    gate.set()
    with trio.fail_after(count // 1000 * 0.5 + 10):
        await done.wait()
    assert seen == list(range(1, count + 1))


@pytest.mark.slow
async def test_an_async_observer_of_a_control_event_is_told_what_it_missed(
    rt: agentloop.Context, caplog: pytest.LogCaptureFixture
) -> None:
    gate = trio.Event()
    seen: list[str] = []

    async def observer(e: ev.AgentStatus) -> None:
        await gate.wait()
        seen.append(e.agent_id)

    rt.events.on(ev.AgentStatus, observer)
    await trio.testing.wait_all_tasks_blocked()
    emitted = 65_536 + 100
    for i in range(emitted):
        rt.events.emit_nowait(status(f"a{i}"))
    gate.set()
    with caplog.at_level(logging.WARNING, logger="agentloop"), trio.fail_after(30):
        await trio.testing.wait_all_tasks_blocked()
    # The first event went straight to the parked observer; the next 65,536 were queued.
    assert len(seen) == 65_537
    assert seen == [f"a{i}" for i in range(65_537)]
    assert "observer task" in caplog.text
    assert f"missed {emitted - 65_537} events" in caplog.text


# --- control: bounded -----------------------------------------------------------------------


async def test_a_slow_control_subscriber_gets_one_lagged_in_place_of_what_it_missed(
    rt: agentloop.Context,
) -> None:
    async with rt.events.subscribe(ev.AgentStatus, capacity=4) as rx:
        for i in range(10):
            rt.events.emit_nowait(status(f"a{i}"))
        kept = [await rx.receive() for _ in range(4)]
        # Told without waiting for another event.
        assert await rx.receive() == agentloop.Lagged(6)
        rt.events.emit_nowait(status("next"))
        assert await rx.receive() == status("next")
    assert kept == [status(f"a{i}") for i in range(4)]


async def test_a_stalled_control_subscriber_stays_bounded(rt: agentloop.Context) -> None:
    capacity, bursts, per_burst = 4, 50, 10
    async with rt.events.subscribe(ev.AgentStatus, capacity=capacity) as rx:
        for burst in range(bursts):
            for i in range(per_burst):
                rt.events.emit_nowait(status(f"{burst}.{i}"))
            await trio.testing.wait_all_tasks_blocked()
            assert rx.statistics().current_buffer_used <= capacity + 1
        first = drain(rx)
        rt.events.emit_nowait(status("next"))
        second = drain(rx)
    # The unread marker counts every later burst too: a reader that drains is told of all.
    assert first == [*(status(f"0.{i}") for i in range(capacity)),
                     agentloop.Lagged(bursts * per_burst - capacity)]
    assert second == [status("next")]


async def test_a_mixed_subscription_drops_only_control_events(rt: agentloop.Context) -> None:
    session = appender(rt, "s")
    async with rt.events.subscribe(ev.AgentStatus, ev.SessionEventAppended, capacity=2) as rx:
        rt.events.emit_nowait(status("s1"))
        rt.events.emit_nowait(status("s2"))
        rt.events.emit_nowait(status("s3"))
        d1 = session.append("note/tick", FrozenDict(), None)
        rt.events.emit_nowait(status("s4"))
        d2 = session.append("note/tick", FrozenDict(), None)
        await trio.testing.wait_all_tasks_blocked()
        got = drain(rx)
    assert got == [
        status("s1"), status("s2"),
        agentloop.Lagged(1), ev.SessionEventAppended("s", d1),
        agentloop.Lagged(1), ev.SessionEventAppended("s", d2),
    ]


# --- scope and exits ------------------------------------------------------------------------


async def test_a_subscription_in_an_agents_scope_sees_only_that_agent(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    scopes: list[agentloop.Context] = []

    async def setup(ctx: agentloop.Context) -> None:
        scopes.append(ctx)

    model.add("one", "two")
    mine = await rt.agents.create(session_id="mine", agent_options=OPTIONS, setup=setup)
    other = await rt.agents.create(session_id="other", agent_options=OPTIONS)
    classes = (ev.SessionEventAppended, ev.AgentStatus)
    async with scopes[0].events.subscribe(classes) as scoped, rt.events.subscribe(classes) as all_:
        mine.agent.followup("x")
        other.agent.followup("y")
        await mine.agent.wait_idle()
        await other.agent.wait_idle()
        scoped_got, all_got = drain(scoped), drain(all_)
    assert {owner(e) for e in scoped_got} == {"mine"}
    assert {owner(e) for e in all_got} == {"mine", "other"}
    mine_in_all = [e for e in all_got if owner(e) == "mine"]
    assert any(isinstance(e, ev.AgentStatus) for e in mine_in_all)
    assert any(isinstance(e, ev.SessionEventAppended) for e in mine_in_all)
    assert scoped_got == mine_in_all


@pytest.mark.skipif(
    bool(os.environ.get("AGENTLOOP_INVARIANTS")),
    reason="counts the bus's registrations, and the invariant companion adds its own",
)
async def test_a_subscriber_leaving_mid_turn_does_not_disturb_the_emitter(
    rt: agentloop.Context, model: ScriptedModel, autojump_clock: trio.testing.MockClock
) -> None:
    bus = rt._services.bus
    left = trio.Event()
    partial: list[object] = []

    async def quitter() -> None:
        async with rt.events.subscribe(ev.SessionEventAppended) as rx:
            async for e in rx:
                partial.append(e)
                if len(partial) == 5:
                    break
        left.set()

    async def closer() -> None:
        async with rt.events.subscribe(ev.SessionEventAppended) as rx:
            await rx.receive()
            await rx.aclose()
            await finished.wait()
            # Still inside the block, but the bus let go of it at its first send after the close.
            detached.append(rx.statistics().open_send_channels == 0)

    finished = trio.Event()
    detached: list[bool] = []
    with trio.fail_after(10):
        async with rt.events.subscribe(ev.SessionEventAppended) as witness:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(quitter)
                nursery.start_soon(closer)
                await trio.testing.wait_all_tasks_blocked()
                agent = await turns(rt, model, "s", 3)
                finished.set()
            assert left.is_set()
            got = drain(witness)
    assert detached == [True]
    assert not bus.has_listeners(ev.SessionEventAppended)
    assert len(partial) == 5
    assert [e.event for e in got] == list(agent.session.events)
    check_log_invariants(agent.session.events)
    assert agent.session.events[-1].data["reason"] == "completed"
