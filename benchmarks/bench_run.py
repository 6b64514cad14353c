"""Per-step cost of reading a turn through a run handle, against the same turn read by nobody.

    python benchmarks/bench_run.py [--quick] [--runs N] [--cpu-clock]

One 50-step turn on the ``ScriptedModel`` (each step 10 text chunks and one trivial parallel
tool call, the shape of ``bench_core.py steps``), driven five ways on fresh agents of one
runtime, interleaved: ``followup`` + ``wait_idle`` with no reader; ``woken``, the same beside a
task that is woken by every append as a reader is and does nothing else (the floor under a
reader); ``agent.ask`` (a run with no reader: the bus handler alone); ``agent.run`` iterating
``run.events()``; and ``agent.run`` iterating ``run.text()``. The figure is the wall time
(``--cpu-clock``: the process's CPU time, steadier on a shared machine) from the prompt to
the end of the turn, divided by 50, best of N; the target is at most 15% over the bare turn.
Beside it, trio's own floor: what waking one parked task at each of a loop's checkpoints
costs, per wake (a reader is woken at most once per checkpoint of the driver, about ten
times per step here). Printed, never asserted.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable

import trio

import agentloop
from agentloop.testing import Reply, ScriptedModel, reply

STEPS = 50
CHUNKS = 10
TEXT = "abcde" * CHUNKS
QUICK = "--quick" in sys.argv
RUNS = 1 if QUICK else int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 7
# --cpu-clock: the process's CPU time, not the wall clock, for a machine shared with other work.
CLOCK = time.process_time_ns if "--cpu-clock" in sys.argv else time.perf_counter_ns
OPTIONS = agentloop.AgentOptions(provider="scripted", model="bench")


def script() -> list[Reply]:
    with_call = reply(TEXT, tool_calls=[("noop", {})], chunk_size=5)
    return [with_call] * (STEPS - 1) + [reply(TEXT, chunk_size=5)]


Way = Callable[[agentloop.Agent], Awaitable[int]]


async def bare(agent: agentloop.Agent) -> int:
    agent.followup("go")
    await agent.wait_idle()
    return len(agent.session.events)


async def ask(agent: agentloop.Agent) -> int:
    return 1 if (await agent.ask("go")).turn else 0


async def events(agent: agentloop.Agent) -> int:
    seen = 0
    async with agent.run("go") as run:
        async for _ in run.events():
            seen += 1
    return seen


async def text(agent: agentloop.Agent) -> int:
    seen = 0
    async with agent.run("go") as run:
        async for _ in run.text():
            seen += 1
    await run.result()
    return seen


async def woken(agent: agentloop.Agent) -> int:
    """The bare turn beside a task that is woken by every append, as a reader is, and does
    nothing else: what the wakes alone cost, the floor under ``events``."""
    waiting: list[trio.lowlevel.Task] = []
    wakes = 0

    def wake() -> None:
        nonlocal wakes
        if waiting:
            wakes += 1
            trio.lowlevel.reschedule(waiting.pop())

    def abort(_: object) -> trio.lowlevel.Abort:
        waiting.clear()
        return trio.lowlevel.Abort.SUCCEEDED

    async def parked() -> None:
        while True:
            waiting.append(trio.lowlevel.current_task())
            await trio.lowlevel.wait_task_rescheduled(abort)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(parked)
        await trio.lowlevel.checkpoint()
        agent.session._wake = wake  # the hook a run's readers are woken through
        try:
            agent.followup("go")
            await agent.wait_idle()
        finally:
            agent.session._wake = None
            nursery.cancel_scope.cancel()
    return wakes


async def trio_wake_cost(n: int = 1000 if QUICK else 20000) -> float:
    """Microseconds that waking one parked task adds to a checkpoint."""
    lot = trio.lowlevel.ParkingLot()
    done = False

    async def reader() -> None:
        while not done:
            await lot.park()

    async def loop(wake: bool) -> int:
        start = CLOCK()
        for _ in range(n):
            if wake and lot:
                lot.unpark_all()
            await trio.lowlevel.checkpoint()
        return CLOCK() - start

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.lowlevel.checkpoint()
        alone, woken = await loop(False), await loop(True)
        done = True
        lot.unpark_all()
    return (woken - alone) / n / 1000


async def timed(rt: agentloop.Context, model: ScriptedModel, way: Way, n: int) -> float:
    model.add(*script())
    handle = await rt.agents.create(session_id=f"bench-{way.__name__}-{n}", agent_options=OPTIONS)
    async with handle:
        start = CLOCK()
        count = await way(handle.agent)
        elapsed = CLOCK() - start
        assert count > 0
        assert handle.agent.session.events[-1].data["reason"] == "completed"
    return elapsed / STEPS / 1000


async def main() -> None:
    async with agentloop.open_runtime() as rt:
        model = ScriptedModel()
        rt.llm.register("scripted", model)

        @rt.tools.tool(concurrency="parallel")
        async def noop() -> str:
            """Do nothing."""
            return "ok"

        ways: list[Way] = [bare, woken, ask, events, text]
        for way in ways:  # warm-up
            await timed(rt, model, way, -1)
        best = {way.__name__: float("inf") for way in ways}
        for n in range(RUNS):
            for way in ways:
                best[way.__name__] = min(best[way.__name__], await timed(rt, model, way, n))
    floor = min([await trio_wake_cost() for _ in range(3)])
    base = best["bare"]
    print(f"per step, {STEPS}-step turn, {CHUNKS} chunks + 1 tool call per step, best of {RUNS}")
    for name, figure in best.items():
        print(f"  {name:<7} {figure:8.1f} us   {figure / base:5.3f}x")
    print("target: run.events() at most 1.15x the bare turn "
          "(woken: a task woken per append that does nothing else)")
    print(f"trio floor: waking a parked reader at a checkpoint costs {floor:.1f} us per wake")


if __name__ == "__main__":
    trio.run(main)
