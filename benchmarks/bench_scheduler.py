"""The tool scheduler: 50 parallel calls in one step, bound 10, on the real clock.

    python benchmarks/bench_scheduler.py [--cpu-clock]

Times the tool phase of a step (from ``agent/step-result`` to ``agent/turn-continuation``,
both emitted on the driver around ``run_tool_calls``) for 50 calls of 10 ms and for 50 calls
of 0 ms, next to a bare trio pool (50 tasks behind a ``CapacityLimiter(10)``) doing the same;
then 50 calls of 0 ms with three arguments (a string, an int sent as ``3.0``, an enum), so that
parsing, validating and coercing the arguments are in the per-call figure too.
"""

from __future__ import annotations

import enum
import gc
import statistics
import sys
import time
from typing import Any

import trio

import agentloop
from agentloop._events import AgentStepResult, AgentTurnContinuation
from agentloop._settings import MAX_PARALLEL_TOOL_CALLS
from agentloop.testing import ScriptedModel, reply

CALLS = 50
BOUND = 10
SLEEP = 0.010
RUNS = 3
# --cpu-clock: the process's CPU time instead of the wall clock, for a machine shared with
# other work (time spent descheduled is then not counted; the 10 ms rows read low).
CLOCK = time.process_time_ns if "--cpu-clock" in sys.argv else time.perf_counter_ns
OPTIONS = agentloop.AgentOptions(provider="scripted", model="bench")


# The arguments of the "with arguments" rows: a string, a number a float must become an int
# for, and an enum, so that parsing, validation and coercion are all in the figure.
ARGUMENTS = {"path": "src/agentloop/_scheduler.py", "count": 3.0, "mode": "read"}


class Mode(enum.Enum):
    READ = "read"
    WRITE = "write"


async def tool_phase_ns(
    rt: agentloop.Context, tool: str, session_id: str, arguments: dict[str, Any] | None = None
) -> tuple[int, int]:
    """(tool-phase ns, peak concurrency) of one step that makes CALLS calls to ``tool``."""
    marks: list[int] = []
    on_result = rt.events.on(AgentStepResult, lambda e: marks.append(CLOCK()))
    on_cont = rt.events.on(AgentTurnContinuation, lambda e: marks.append(CLOCK()))
    model = ScriptedModel([reply(tool_calls=[(tool, arguments or {})] * CALLS), reply("done")])
    unregister = rt.llm.register("scripted", model)
    tracker.reset()
    handle = await rt.agents.create(session_id=session_id, agent_options=OPTIONS)
    async with handle:
        agent = handle.agent
        gc.collect()
        agent.followup("go")
        await agent.wait_idle()
        results = [e for e in agent.session.events if e.type == "tool/result"]
        assert len(results) == CALLS
        assert not any(e.data["is_error"] for e in results)
    unregister()
    on_result()
    on_cont()
    # marks: step 1 result, step 1 continuation, step 2 result, step 2 continuation
    return marks[1] - marks[0], tracker.peak


class Tracker:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.running = 0
        self.peak = 0

    async def run(self, seconds: float) -> str:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await trio.sleep(seconds)
        finally:
            self.running -= 1
        return "ok"


tracker = Tracker()


async def bare_pool_ns(seconds: float) -> int:
    """The same work with trio alone: CALLS tasks sharing BOUND slots, results in a list."""
    limiter = trio.CapacityLimiter(BOUND)
    results: list[str | None] = [None] * CALLS

    async def call(i: int) -> None:
        async with limiter:
            await trio.sleep(seconds)
            results[i] = "ok"

    gc.collect()
    start = CLOCK()
    async with trio.open_nursery() as nursery:
        for i in range(CALLS):
            nursery.start_soon(call, i)
    return CLOCK() - start


async def main() -> None:
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}: {CALLS} parallel calls in "
          f"one step, bound {BOUND}, best of {RUNS} (median)")
    async with agentloop.open_runtime() as rt:
        rt.settings.set(MAX_PARALLEL_TOOL_CALLS, BOUND)

        async def sleep10() -> str:
            """Sleep 10 ms."""
            return await tracker.run(SLEEP)

        async def sleep0() -> str:
            """Yield once."""
            return await tracker.run(0)

        async def sleep0_args(path: str, count: int = 1, mode: Mode = Mode.READ) -> str:
            """Yield once, with arguments.

            Args:
                path: a path.
                count: how many.
                mode: how.
            """
            assert isinstance(count, int)
            assert isinstance(mode, Mode)
            return await tracker.run(0)

        rt.tools.tool(sleep10, concurrency="parallel")
        rt.tools.tool(sleep0, concurrency="parallel")
        rt.tools.tool(sleep0_args, concurrency="parallel")

        await tool_phase_ns(rt, "sleep0", "warmup")
        rows = []
        for tool, seconds, arguments in (
            ("sleep10", SLEEP, None), ("sleep0", 0.0, None), ("sleep0_args", 0.0, ARGUMENTS),
        ):
            phases, peaks = [], []
            for run in range(RUNS):
                ns, peak = await tool_phase_ns(rt, tool, f"{tool}-{run}", arguments)
                phases.append(ns)
                peaks.append(peak)
            bare = [await bare_pool_ns(seconds) for _ in range(RUNS)]
            rows.append((tool, seconds, phases, max(peaks), bare))

    ideal_ms = CALLS / BOUND * SLEEP * 1e3
    for tool, seconds, phases, peak, bare in rows:
        best, median = min(phases) / 1e6, statistics.median(phases) / 1e6
        print(f"\n{CALLS} x {seconds * 1e3:.0f} ms ({tool}), peak concurrency {peak}:")
        print(f"  agentloop tool phase: {best:7.2f} ms  ({median:.2f})")
        print(f"  bare trio pool:       {min(bare) / 1e6:7.2f} ms  "
              f"({statistics.median(bare) / 1e6:.2f})")
        if seconds:
            print(f"  ideal:                {ideal_ms:7.2f} ms; over ideal: "
                  f"{best - ideal_ms:.2f} ms ({(best - ideal_ms) / CALLS * 1e3:.0f} us per call)")
        else:
            per_call = min(phases) / CALLS / 1e3
            bare_per_call = min(bare) / CALLS / 1e3
            print(f"  per call:             {per_call:7.1f} us (bare trio pool "
                  f"{bare_per_call:.1f} us): scheduler overhead")


if __name__ == "__main__":
    trio.run(main)
