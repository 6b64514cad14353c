"""The typed, scoped event bus: hook modes, ordering, scopes and subscriptions."""

from __future__ import annotations

import attrs
import pytest
import trio

import agentloop
from agentloop import events as ev
from agentloop._bus import EventBus


def request(config: agentloop.CallConfig) -> ev.AgentRequest:
    return ev.AgentRequest("a", 1, 1, config, "", (), ())


async def test_waterfall_passes_each_replacement_on() -> None:
    bus = EventBus()
    seen: list[str | None] = []

    def first(e: ev.AgentRequest) -> agentloop.CallConfig:
        seen.append(e.config.model)
        return attrs.evolve(e.config, model="b")

    async def second(e: ev.AgentRequest) -> None:
        seen.append(e.config.model)  # returning None keeps the value

    def third(e: ev.AgentRequest) -> agentloop.CallConfig:
        seen.append(e.config.model)
        return attrs.evolve(e.config, model=f"{e.config.model}c")

    for h in (first, second, third):
        bus.on(ev.AgentRequest, h)
    result = await bus.emit(request(agentloop.CallConfig(model="a")))
    assert seen == ["a", "b", "b"]
    assert result.model == "bc"


async def test_decision_stops_at_the_first_answer_and_priority_orders() -> None:
    bus = EventBus()
    calls: list[str] = []

    def low(e: object) -> object:
        calls.append("low")
        return agentloop.Reject("low")

    def high(e: object) -> object:
        calls.append("high")
        return None

    def mid(e: object) -> object:
        calls.append("mid")
        return agentloop.Reject("mid")

    bus.on(ev.AgentPreStep, low)
    bus.on(ev.AgentPreStep, high, priority=10)
    bus.on(ev.AgentPreStep, mid, priority=5)
    decision = await bus.emit(ev.AgentPreStep("a", 1, 1, ()))
    assert calls == ["high", "mid"]
    assert decision == agentloop.Reject("mid")


async def test_notify_ignores_results_and_no_handlers_is_cheap_and_none() -> None:
    bus = EventBus()
    assert not bus.has_listeners(ev.AgentStepResult)
    assert await bus.emit(ev.AgentStepResult("a", 1, 1, "stop", "", ())) is None
    assert (await bus.emit(request(agentloop.CallConfig(model="x")))).model == "x"


async def test_disposer_is_idempotent_and_exact() -> None:
    bus = EventBus()
    out: list[int] = []
    d1 = bus.on(ev.AgentStatus, lambda e: out.append(1))
    bus.on(ev.AgentStatus, lambda e: out.append(2))
    d1()
    d1()
    bus.emit_nowait(ev.AgentStatus("a", "running", "idle"))
    assert out == [2]
    assert d1.disposed


def test_async_handlers_are_refused_for_synchronous_events() -> None:
    bus = EventBus()

    async def handler(e: object) -> None: ...

    with pytest.raises(TypeError, match="subscribe"):
        bus.on(ev.AgentStatus, handler)
    with pytest.raises(TypeError, match="not an agentloop event"):
        bus.on(int, lambda e: None)  # type: ignore[arg-type]


async def test_a_failing_hook_propagates() -> None:
    bus = EventBus()

    def boom(e: object) -> None:
        raise RuntimeError("hook bug")

    bus.on(ev.AgentPreStep, boom)
    with pytest.raises(RuntimeError, match="hook bug"):
        await bus.emit(ev.AgentPreStep("a", 1, 1, ()))


async def test_registrations_are_undone_when_the_scope_closes(rt) -> None:
    scope = rt.child("plugin:x")
    seen: list[str] = []
    scope.events.on(ev.AgentStatus, lambda e: seen.append(e.status))

    async def tool() -> str:
        return ""

    scope.tools.register(agentloop.Tool("t", "T.", {"type": "object"}, tool))
    scope.llm.register("p", agentloop.testing.ScriptedModel())
    await scope.aclose()
    assert rt.tools.get("t") is None
    assert rt.llm.adapter("p") is None
    rt._services.bus.emit_nowait(ev.AgentStatus("a", "running", "idle"))
    assert seen == []
    with pytest.raises(RuntimeError, match="closed"):
        scope.events.on(ev.AgentStatus, lambda e: None)


async def test_subscription_receives_in_order_without_blocking_the_emitter() -> None:
    bus = EventBus()
    async with bus.subscribe((ev.AgentStatus, ev.AgentCreated)) as rx:
        for i in range(100):
            bus.emit_nowait(ev.AgentStatus(f"a{i}", "running", "idle"))
        bus.emit_nowait(ev.AgentCreated("z"))
        assert rx.statistics().current_buffer_used == 101
        got = [await rx.receive() for _ in range(101)]
    assert [g.agent_id for g in got] == [f"a{i}" for i in range(100)] + ["z"]
    with pytest.raises(trio.EndOfChannel):
        await rx.receive()


async def test_a_slow_subscriber_is_told_it_lagged() -> None:
    bus = EventBus()
    async with bus.subscribe(ev.AgentStatus, capacity=3) as rx:
        for i in range(10):
            bus.emit_nowait(ev.AgentStatus(f"a{i}", "running", "idle"))
        first = [await rx.receive() for _ in range(3)]
        marker = await rx.receive()
        bus.emit_nowait(ev.AgentStatus("after", "running", "idle"))
        assert (await rx.receive()).agent_id == "after"
    assert [f.agent_id for f in first] == ["a0", "a1", "a2"]
    assert marker == agentloop.Lagged(7)


async def test_subscribers_wake_on_the_next_event() -> None:
    bus = EventBus()
    got: list[str] = []
    async with bus.subscribe(ev.AgentCreated) as rx, trio.open_nursery() as nursery:

        async def reader() -> None:
            got.append((await rx.receive()).agent_id)

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        bus.emit_nowait(ev.AgentCreated("x"))
    assert got == ["x"]


async def test_a_failing_synchronous_observer_is_isolated(rt, model, caplog) -> None:
    def broken(e: ev.AgentStatus) -> None:
        raise RuntimeError("observer bug")

    rt.events.on(ev.AgentStatus, broken)
    model.add("ok")
    handle = await rt.agents.create(session_id="s", agent_options=agentloop.AgentOptions(
        provider="scripted", model="m"))
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    assert handle.agent.session.events[-1].data["reason"] == "completed"
    assert "observer bug" in caplog.text


async def test_an_async_handler_of_a_control_event_observes_in_order(rt, model) -> None:
    seen: list[tuple[str, str]] = []
    done = trio.Event()

    async def on_status(e: ev.AgentStatus) -> None:
        await trio.lowlevel.checkpoint()  # the emitter never waits for an async observer
        seen.append((e.previous, e.status))
        if e.status == "idle":
            done.set()

    disposer = rt.events.on(ev.AgentStatus, on_status)
    model.add("ok")
    handle = await rt.agents.create(session_id="s", agent_options=agentloop.AgentOptions(
        provider="scripted", model="m"))
    handle.agent.followup("x")
    with trio.fail_after(5):
        await done.wait()
    assert seen == [("idle", "running"), ("running", "idle")]
    disposer()
    model.add("again")
    handle.agent.followup("y")
    await handle.agent.wait_idle()
    await trio.testing.wait_all_tasks_blocked()
    assert len(seen) == 2
