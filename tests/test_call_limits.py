"""Shared model-call limits: ``[providers.NAME] max_concurrent_calls`` and
``max_calls_per_minute`` (and ``[providers.NAME.models.MODEL]``), per runtime, fair (FIFO
among the waiting agents), cancellable while waiting, and recorded as ``queued_seconds``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
from conftest import of_type

import agentloop
from agentloop import ConfigError
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta, check_log


def limited(**provider: Any) -> dict[str, Any]:
    return {"providers": {"scripted": provider}}


def options(model: str = "m") -> agentloop.AgentOptions:
    return agentloop.AgentOptions(provider="scripted", model=model)


class Recorder:
    """A model whose every call lasts ``seconds`` (of trio's clock) and is recorded: who
    started when, and the most calls ever in flight at once."""

    def __init__(self, seconds: float = 1.0, steps: int = 1) -> None:
        self.seconds = seconds
        self.steps = steps
        self.starts: list[tuple[str, float]] = []
        self.in_flight = 0
        self.peak = 0
        self.model = FunctionModel(self.fn)

    async def fn(self, request: LLMRequest) -> AsyncIterator[Any]:
        self.starts.append((request.session_id or "", trio.current_time()))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await trio.sleep(self.seconds)
        finally:
            self.in_flight -= 1
        calls_so_far = sum(1 for m in request.messages if m.role == "assistant")
        if calls_so_far + 1 < self.steps:
            yield ToolCallDelta(0, id=f"c{calls_so_far}", name="noop", arguments="{}")
            yield Finish("tool_calls")
        else:
            yield TextDelta("done")
            yield Finish("stop")


async def run_agents(
    config: dict[str, Any], recorder: Recorder, ids: list[str], models: list[str] | None = None,
) -> list[agentloop.Agent]:
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("scripted", recorder.model)

        @rt.tools.tool(concurrency="parallel")
        async def noop() -> str:
            """Do nothing."""
            return "ok"

        agents = []
        for i, sid in enumerate(ids):
            handle = await rt.agents.create(
                session_id=sid, agent_options=options(models[i] if models else "m")
            )
            agents.append(handle.agent)
        for agent in agents:
            agent.followup("go")
        with trio.fail_after(100_000):
            for agent in agents:
                await agent.wait_idle()
        return agents


# --- config ----------------------------------------------------------------------------------


def test_limits_are_read_from_the_provider_tables() -> None:
    config = agentloop.load_config({"providers": {
        "scripted": {"max_concurrent_calls": 2, "max_calls_per_minute": 30,
                     "models": {"m": {"max_concurrent_calls": 1}}},
        "remote": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1",
                   "max_calls_per_minute": 5},
    }})
    scripted = config.providers["scripted"]
    assert (scripted.max_concurrent_calls, scripted.max_calls_per_minute) == (2, 30)
    assert scripted.models["m"].max_concurrent_calls == 1
    assert not scripted.has_adapter
    assert config.providers["remote"].has_adapter


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"max_concurrent_calls": 0}, "providers.scripted.max_concurrent_calls"),
        ({"max_concurrent_calls": True}, "providers.scripted.max_concurrent_calls"),
        ({"max_calls_per_minute": "10"}, "providers.scripted.max_calls_per_minute"),
        ({"models": {"m": {"max_calls_per_minute": -1}}},
         "providers.scripted.models.m.max_calls_per_minute"),
        ({"models": {"m": {"max_calls": 1}}}, "providers.scripted.models.m.max_calls"),
        ({"kind": "openai", "max_concurrent_calls": 2}, "providers.scripted.base_url"),
        ({"base_url": "http://127.0.0.1:9/v1", "max_concurrent_calls": 2},
         "providers.scripted.kind"),
        ({}, "providers.scripted.kind"),
    ],
)
def test_a_bad_limit_is_refused_by_name(table: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        agentloop.load_config({"providers": {"scripted": table}})


# --- enforcement -----------------------------------------------------------------------------


async def test_concurrent_calls_are_limited_across_every_agent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(seconds=1.0, steps=2)
    ids = [f"a{i}" for i in range(6)]
    agents = await run_agents(limited(max_concurrent_calls=2), recorder, ids)
    assert recorder.peak == 2
    assert len(recorder.starts) == 12
    for agent in agents:
        assert of_type(agent, "turn/end")[-1].data["reason"] == "completed"
        check_log(agent.session)


async def test_waiting_agents_are_served_in_order_and_none_starves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One slot, eight agents that each want five calls: a slot that frees goes to the agent
    # that has waited longest, so every round serves every agent once, in the same order.
    recorder = Recorder(seconds=1.0, steps=5)
    ids = [f"a{i}" for i in range(8)]
    await run_agents(limited(max_concurrent_calls=1), recorder, ids)
    order = [who for who, _ in recorder.starts]
    assert len(order) == 40
    first = order[:8]
    assert sorted(first) == ids
    assert order == first * 5
    # One at a time, back to back: the slot never idles while someone waits.
    assert [t for _, t in recorder.starts] == [float(i) for i in range(40)]


async def test_queued_seconds_is_recorded_only_when_a_call_waited(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(seconds=5.0)
    agents = await run_agents(limited(max_concurrent_calls=1), recorder, ["a", "b"])
    served_first = recorder.starts[0][0]
    for agent in agents:
        (header,) = of_type(agent, "request/header")
        if agent.id == served_first:
            assert "queued_seconds" not in header.data
        else:
            assert header.data["queued_seconds"] == pytest.approx(5.0)


async def test_calls_per_minute_wait_for_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(seconds=0.0, steps=5)
    (agent,) = await run_agents(limited(max_calls_per_minute=2), recorder, ["a"])
    starts = [t for _, t in recorder.starts]
    assert starts == pytest.approx([0.0, 0.0, 60.0, 60.0, 120.0], abs=1e-6)
    queued = [h.data.get("queued_seconds") for h in of_type(agent, "request/header")]
    assert queued[:2] == [None, None]
    assert queued[2] == pytest.approx(60.0, abs=1e-6)
    assert queued[4] == pytest.approx(60.0, abs=1e-6)


async def test_a_route_limit_holds_one_model_and_not_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(seconds=1.0)
    config = limited(models={"slow": {"max_concurrent_calls": 1}})
    ids = ["s1", "s2", "s3", "f1", "f2", "f3"]
    models = ["slow"] * 3 + ["fast"] * 3
    await run_agents(config, recorder, ids, models)
    at = dict(recorder.starts)
    assert sorted(at[s] for s in ("s1", "s2", "s3")) == [0.0, 1.0, 2.0]
    assert [at[f] for f in ("f1", "f2", "f3")] == [0.0, 0.0, 0.0]


async def test_the_provider_and_route_limits_both_apply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(seconds=1.0)
    config = limited(max_concurrent_calls=2, models={"slow": {"max_concurrent_calls": 1}})
    ids = ["s1", "s2", "f1", "f2"]
    await run_agents(config, recorder, ids, ["slow", "slow", "fast", "fast"])
    assert recorder.peak == 2
    at = dict(recorder.starts)
    # Which agents the first two slots go to depends on the scheduler; the slow route never
    # runs two calls at once, whichever it was.
    assert abs(at["s1"] - at["s2"]) >= 1.0
    assert max(at.values()) <= 2.0


async def test_runtimes_do_not_share_their_limits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first, second = Recorder(seconds=1.0), Recorder(seconds=1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_agents, limited(max_concurrent_calls=1), first, ["a"])
        nursery.start_soon(run_agents, limited(max_concurrent_calls=1), second, ["b"])
    assert first.starts[0][1] == second.starts[0][1] == 0.0


async def test_no_limits_no_wait(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder(seconds=1.0)
    agents = await run_agents({}, recorder, ["a", "b", "c"])
    assert recorder.peak == 3
    for agent in agents:
        assert "queued_seconds" not in of_type(agent, "request/header")[0].data


# --- cancellation ------------------------------------------------------------------------------


async def test_a_cancel_while_queued_ends_the_turn_and_leaks_no_slot() -> None:
    release = trio.Event()
    started: list[str] = []

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        started.append(request.session_id or "")
        if request.session_id == "a":
            await release.wait()
        yield TextDelta("done")
        yield Finish("stop")

    async with agentloop.open_runtime(limited(max_concurrent_calls=1)) as rt:
        rt.llm.register("scripted", FunctionModel(fn))
        a, b, c = [
            (await rt.agents.create(session_id=sid, agent_options=options())).agent
            for sid in ("a", "b", "c")
        ]
        with trio.fail_after(10):
            a.followup("go")
            await trio.testing.wait_all_tasks_blocked()
            b.followup("go")
            await trio.testing.wait_all_tasks_blocked()
            c.followup("go")
            await trio.testing.wait_all_tasks_blocked()
            assert started == ["a"]
            assert b.cancel()
            await b.wait_idle()
            # b's queued call never started: no header, and the turn is closed cleanly.
            assert of_type(b, "request/header") == []
            assert of_type(b, "turn/end")[-1].data["reason"] == "aborted"
            check_log(b.session)
            release.set()
            await a.wait_idle()
            await c.wait_idle()
            assert started == ["a", "c"]
            # The cancelled waiter took nothing: b's next call gets the free slot at once.
            b.followup("again")
            await b.wait_idle()
            assert started == ["a", "c", "b"]
            assert "queued_seconds" not in of_type(b, "request/header")[-1].data
            assert of_type(c, "request/header")[0].data["queued_seconds"] >= 0


async def test_many_agents_of_uneven_calls_are_served_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Twenty agents, three slots, calls of uneven length: whoever started waiting earlier
    # starts its call no later (FIFO), and every agent finishes all its calls.
    durations = [0.5 + (i * 7 % 5) * 0.3 for i in range(20)]
    starts: list[tuple[str, float]] = []

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        who = request.session_id or ""
        starts.append((who, trio.current_time()))
        await trio.sleep(durations[int(who[1:])])
        done = sum(1 for m in request.messages if m.role == "assistant")
        if done < 3:
            yield ToolCallDelta(0, id=f"c{done}", name="noop", arguments="{}")
            yield Finish("tool_calls")
        else:
            yield TextDelta("done")
            yield Finish("stop")

    recorder = Recorder()
    recorder.model = FunctionModel(fn)
    agents = await run_agents(limited(max_concurrent_calls=3), recorder, [
        f"a{i}" for i in range(20)
    ])
    calls: list[tuple[float, float]] = []  # (started waiting, started)
    for agent in agents:
        mine = [t for who, t in starts if who == agent.id]
        headers = of_type(agent, "request/header")
        assert len(mine) == len(headers) == 4
        for started, header in zip(mine, headers, strict=True):
            calls.append((started - header.data.get("queued_seconds", 0.0), started))
    for waited_a, started_a in calls:
        for waited_b, started_b in calls:
            if waited_a < waited_b - 1e-9:
                assert started_a <= started_b + 1e-9
    assert max(started - waited for waited, started in calls) < 10


async def test_a_waiter_granted_and_cancelled_in_one_tick_hands_the_slot_on() -> None:
    from agentloop._limits import CallLimits, Limit

    limits = CallLimits({("p", None): Limit(max_concurrent_calls=1)})
    release_first, _ = await limits.acquire("p", "m")
    order: list[str] = []
    scope = trio.CancelScope()

    async def wait(name: str, cancel: trio.CancelScope | None = None) -> None:
        with cancel if cancel is not None else trio.CancelScope():
            release, queued = await limits.acquire("p", "m")
            try:
                # As a model call does: the slot is held in a try/finally from here on.
                await trio.lowlevel.checkpoint()
                order.append(name)
                assert queued is not None
            finally:
                release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "cancelled", scope)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, "next")
        await trio.testing.wait_all_tasks_blocked()
        # The slot goes to the first waiter, which is cancelled before it can use it.
        release_first()
        scope.cancel()
    assert order == ["next"]
    # Nothing is held: a fresh call goes straight through.
    release, queued = await limits.acquire("p", "m")
    assert queued is None
    release()
