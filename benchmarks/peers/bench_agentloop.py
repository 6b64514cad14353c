"""agentloop (the working tree) on the peer workloads, with ``FunctionModel`` or ``ScriptedModel``.

``run.py`` puts the repository root first on ``PYTHONPATH``, so this measures the tree as it
is, not an installed copy. Both test doubles stream without any network; the function model
checkpoints once per text chunk, as every fake model in this folder does, and the scripted one
once per part (12 per step), as ``benchmarks/bench_core.py`` measures it.

W2 runs ``CONCURRENT`` agents of one runtime, each answering one ``agent.ask`` in a task of one
nursery. The agents are created before the clock and closed after it. Their function model is
one for all of them, so it answers from the request (a final answer once it carries the tool
results of all earlier steps); the scripted entry gives each agent a route and a
``ScriptedModel`` of its own, since a scripted reply list is consumed in call order.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import _common as c
import trio
import trio.testing

import agentloop
from agentloop.testing import (
    Finish,
    FunctionModel,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    reply,
)

OPTIONS = agentloop.AgentOptions(provider="bench", model="bench")


def make_model(entry: str, steps: int) -> Any:
    if entry == "scripted":
        with_call = reply(c.TEXT, tool_calls=[("noop", {})], chunk_size=c.CHUNK_SIZE)
        return ScriptedModel([with_call] * (steps - 1) + [reply(c.TEXT, chunk_size=c.CHUNK_SIZE)])
    calls = 0

    async def stream(request: Any) -> AsyncIterator[Any]:
        nonlocal calls
        calls += 1
        for piece in c.PIECES:
            await trio.lowlevel.checkpoint()
            yield TextDelta(piece)
        if calls % steps:
            yield ToolCallDelta(0, id=f"call_{calls}", name="noop", arguments="{}")
            yield Finish("tool_calls")
        else:
            yield Finish("stop")

    return FunctionModel(stream)


def shared_model(steps: int) -> FunctionModel:
    async def stream(request: Any) -> AsyncIterator[Any]:
        done = sum(1 for m in request.messages if m.role == "tool")
        for piece in c.PIECES:
            await trio.lowlevel.checkpoint()
            yield TextDelta(piece)
        if done < steps - 1:
            yield ToolCallDelta(0, id=f"call_{done}", name="noop", arguments="{}")
            yield Finish("tool_calls")
        else:
            yield Finish("stop")

    return FunctionModel(stream)


def seed(messages: int) -> list[dict[str, Any]] | None:
    """A stored log of completed turns, one user and one assistant message each."""
    events: list[dict[str, Any]] = []
    for turn in range(1, messages // 2 + 1):
        events += [
            {"type": "turn/start", "turn": turn, "data": {"turn": turn}},
            {"type": "user/message", "turn": turn,
             "data": {"message_id": f"m{turn}", "content": c.history_text(2 * turn - 2),
                      "source": None}},
            {"type": "assistant/message", "turn": turn,
             "data": {"step": 1, "content": c.history_text(2 * turn - 1), "reasoning": None,
                      "reasoning_signature": None, "tool_calls": [], "source_event_seqs": [],
                      "finish_reason": "stop", "usage": None, "interrupted": False}},
            {"type": "turn/end", "turn": turn, "data": {"turn": turn, "reason": "completed"}},
        ]
    return events or None


async def noop() -> str:
    """Do nothing."""
    return "ok"


async def main(entry: str, workload: str, sizes: c.Sizes) -> None:
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(noop, concurrency="parallel")
        made = 0

        def turn_on(history: int) -> c.Turn:
            async def turn() -> int:
                nonlocal made
                made += 1
                unregister = rt.llm.register("bench", make_model(entry, sizes.steps))
                handle = await rt.agents.create(
                    session_id=f"s{made}", agent_options=OPTIONS, seed=seed(history)
                )
                async with handle:
                    agent = handle.agent
                    start = time.perf_counter_ns()
                    agent.followup("go")
                    await agent.wait_idle()
                    elapsed = time.perf_counter_ns() - start
                    assert agent.session.events[-1].data["reason"] == "completed"
                unregister()
                return elapsed

            return turn

        async def batch(n: int) -> int:
            nonlocal made
            made += 1
            steps = sizes.w2_steps
            if entry == "scripted":
                routes = [f"bench-{made}-{i}" for i in range(n)]
                unregister = [rt.llm.register(r, make_model(entry, steps)) for r in routes]
            else:
                routes = [f"bench-{made}"] * n
                unregister = [rt.llm.register(routes[0], shared_model(steps))]
            handles = [
                await rt.agents.create(
                    session_id=f"w2-{made}-{i}",
                    agent_options=agentloop.AgentOptions(provider=route, model="bench"),
                )
                for i, route in enumerate(routes)
            ]
            results: list[agentloop.RunResult] = []

            async def ask(agent: agentloop.Agent) -> None:
                results.append(await agent.ask("go"))

            start = time.perf_counter_ns()
            async with trio.open_nursery() as nursery:
                for handle in handles:
                    nursery.start_soon(ask, handle.agent)
            elapsed = time.perf_counter_ns() - start
            assert len(results) == n, len(results)
            assert all(r.reason == "completed" and r.text == c.TEXT for r in results), results[0]
            tools = [e for e in handles[-1].agent.session.events if e.type == "tool/result"]
            assert len(tools) == steps - 1, len(tools)
            async with trio.open_nursery() as nursery:
                for handle in handles:
                    nursery.start_soon(handle.aclose)
            for disposer in unregister:
                disposer()
            return elapsed

        if workload == "w1":
            c.report(us_per_step=await c.time_turns(turn_on(0), sizes))
        elif workload == "w2":
            c.report(**await c.time_concurrent(batch, sizes))
        elif workload == "w4":
            c.report(**await c.time_histories(turn_on, sizes))
        else:
            rt.llm.register("bench", make_model(entry, sizes.steps))
            conversation = seed(2)

            async def build() -> object:
                return [
                    await rt.agents.create(session_id=f"idle-{i}", agent_options=OPTIONS,
                                           seed=conversation)
                    for i in range(sizes.idle)
                ]

            await (await rt.agents.create(session_id="warm", agent_options=OPTIONS,
                                          seed=conversation)).aclose()
            figure, kept = await c.atraced_bytes_per(
                sizes.idle, build, trio.testing.wait_all_tasks_blocked
            )
            assert isinstance(kept, list)
            assert all(len(h.agent.session.messages()) == 2 for h in kept)
            c.report(bytes_per_agent=figure)
    c.report(versions={**c.versions("trio"), "agentloop": f"{agentloop.__version__} (tree)"})


if __name__ == "__main__":
    entry, workload, sizes = c.parse_args(["function", "scripted"])
    trio.run(main, entry, workload, sizes)
