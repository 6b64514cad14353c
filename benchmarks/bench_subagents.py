"""Sub-agent figures: the cost of one child, and a parent with 1,000 live children.

    python benchmarks/bench_subagents.py [--quick] [child|wide ...]

``child``: from inside a parent's tool call, ``ctx.subagents.run`` one turn of a fresh child on
a zero-latency model, again and again: spawn (lineage, setup, publication in the parent's
nursery) + the turn + disposal to quiescence, in µs per child, over runs of 100 and 4,000
children, with the objects still alive per child after the run (flat cost needs zero). The
model's record of requests is cleared after each child: ``FunctionModel`` keeps every request
it receives, and each request's history snapshot keeps its whole child session alive, which
is the test double's growth, not the runtime's (``--keep-requests`` measures it). ``wide``:
one tool call spawns 1,000 children that each answer one turn and stay alive; then the parent
is closed, which disposes them all first. Figures are printed, never asserted. ``--quick``
only checks that the script still works.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import AsyncIterator

import trio

import agentloop
from agentloop import _agents
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

QUICK = "--quick" in sys.argv
KEEP_REQUESTS = "--keep-requests" in sys.argv
RUNS = 1 if QUICK else 5
CHILDREN = 20 if QUICK else 1000
OPTIONS = agentloop.AgentOptions(provider="fn", model="bench")


async def answer(request: LLMRequest) -> AsyncIterator[TextDelta | ToolCallDelta | Finish]:
    """Zero latency: the top-level agent calls ``work`` once; everyone else answers at once."""
    if request.session_id == "parent" and request.messages[-1].role == "user":
        yield ToolCallDelta(0, id="call_0", name="work", arguments="{}")
        yield Finish("tool_calls")
        return
    yield TextDelta("ok")
    yield Finish("stop")


def allow_children(rt: agentloop.Context, n: int) -> None:
    try:
        rt.settings.set(_agents.MAX_CHILDREN, n)
    except agentloop.SettingsError:
        # Until the setting is registered with ctx.settings its default is the only value.
        _agents._LIMIT_DEFAULTS[_agents.MAX_CHILDREN] = n


async def child_cost(n: int) -> tuple[float, float]:
    """µs per child: spawn + one turn + dispose, sequentially inside one tool call; and the
    objects each child left alive."""
    elapsed = 0.0
    retained = 0.0
    async with agentloop.open_runtime() as rt:
        model = FunctionModel(answer)
        rt.llm.register("fn", model)

        @rt.tools.tool()
        async def work() -> str:
            """Delegate ``n`` times."""
            nonlocal elapsed, retained
            await rt.subagents.run("warm-up")
            model.requests.clear()
            gc.collect()
            before = len(gc.get_objects())
            start = time.perf_counter()
            for _ in range(n):
                await rt.subagents.run("task")
                if not KEEP_REQUESTS:
                    model.requests.clear()
            elapsed = time.perf_counter() - start
            gc.collect()
            retained = (len(gc.get_objects()) - before) / n
            return "done"

        handle = await rt.agents.create(session_id="parent", agent_options=OPTIONS)
        async with handle:
            await handle.agent.ask("go")
    return elapsed / n * 1e6, retained


async def wide(n: int) -> tuple[float, float, float]:
    """Seconds to spawn ``n`` children that each run a turn, and to dispose them with the
    parent; and µs per child overall."""
    spawned = 0.0
    async with agentloop.open_runtime() as rt:
        rt.llm.register("fn", FunctionModel(answer))
        allow_children(rt, n)
        kept: list[agentloop.AgentHandle] = []

        @rt.tools.tool()
        async def work() -> str:
            """Spawn ``n`` children."""
            nonlocal spawned
            start = time.perf_counter()
            kept.extend([await rt.subagents.spawn("task") for _ in range(n)])
            for handle in kept:
                await handle.agent.wait_idle()
            spawned = time.perf_counter() - start
            return "done"

        parent = await rt.agents.create(session_id="parent", agent_options=OPTIONS)
        await parent.agent.ask("go")
        assert len(rt.agents.list()) == n + 1
        start = time.perf_counter()
        await parent.aclose()
        closed = time.perf_counter() - start
        assert rt.agents.list() == []
    return spawned, closed, (spawned + closed) / n * 1e6


def main() -> None:
    which = [a for a in sys.argv[1:] if not a.startswith("--")] or ["child", "wide"]
    if "child" in which:
        for n in (20,) if QUICK else (100, 4000):
            figures = [trio.run(child_cost, n) for _ in range(RUNS)]
            per = statistics.median(f[0] for f in figures)
            kept = statistics.median(f[1] for f in figures)
            print(f"child: spawn + run + dispose, {per:.0f} µs per child, {kept:.1f} objects "
                  f"left alive per child (median of {RUNS} runs of {n}"
                  f"{', requests kept' if KEEP_REQUESTS else ''})")
    if "wide" in which:
        results = [trio.run(wide, CHILDREN) for _ in range(RUNS)]
        spawned = statistics.median(r[0] for r in results)
        closed = statistics.median(r[1] for r in results)
        per = statistics.median(r[2] for r in results)
        print(f"wide: {CHILDREN} children under one parent: spawn + one turn each "
              f"{spawned * 1e3:.0f} ms, disposal with the parent {closed * 1e3:.0f} ms, "
              f"{per:.0f} µs per child (median of {RUNS})")


if __name__ == "__main__":
    main()
