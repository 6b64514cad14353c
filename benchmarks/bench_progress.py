"""What ``agentloop.report_progress`` costs a tool that reports 10,000 times a second.

    python benchmarks/bench_progress.py [--quick] [--runs N] [--seconds S] [--cpu-clock]

One turn calls one tool that does S seconds of CPU work (default 0.5; a loop calibrated at
the start) in slices of 100 microseconds, yielding to trio after each slice, as a tool that
processes items one by one would. The variants differ only in what the tool does after each slice:

- ``baseline``: nothing (no ``report_progress`` call);
- ``no reader``: ``report_progress(...)`` with nobody listening;
- ``run.progress()``: the same, read by an ``async for`` over the run's progress;
- ``subscriber``: read by an ``events.subscribe(ToolProgress)`` task as fast as it can;
- ``stalled``: a subscriber that reads nothing until the turn is over.

A second figure isolates the reporting itself: what one ``report_progress`` call costs in a
tight loop, with a subscriber listening and with nobody, and that cost at 10,000 a second as a
share of the tool's time (steady where the turn times are noisy). The first figure is the
turn's wall time (with ``--cpu-clock``, this process's CPU time: steadier on
a shared machine) against the baseline's, best of N runs each, interleaved.
The target is at most +10%: reports are paced per call (a burst, then about 30 a second, the
latest always delivered), so the readers run a few dozen times a second whatever the rate.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

import agentloop
from agentloop.events import ToolProgress
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

SLICE = 0.0001  # 100 us of work between two reports: 10,000 reports a second
OPTIONS = agentloop.AgentOptions(provider="scripted", model="bench")
VARIANTS = ("baseline", "no reader", "run.progress()", "subscriber", "stalled")


async def model(request: LLMRequest) -> AsyncIterator[Any]:
    if request.messages[-1].role == "user":
        yield ToolCallDelta(0, id="c1", name="work", arguments="{}")
        yield Finish("tool_calls")
    else:
        yield TextDelta("done")
        yield Finish("stop")


def spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def calibrate() -> int:
    """Iterations of :func:`spin` that take one ``SLICE`` of CPU here: a fixed amount of
    work, so that a busy machine stretches every variant alike."""
    n = 1000
    while True:
        start = time.process_time()
        spin(n)
        took = time.process_time() - start
        if took > 0.02:
            return max(1, int(n * SLICE / took))
        n *= 2


async def one_turn(variant: str, seconds: float, per_slice: int, clock: Any) -> tuple[float, int]:
    """The turn's time on ``clock``, and how many reports its reader saw."""
    slices = int(seconds / SLICE)
    seen = 0
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", FunctionModel(model))
        report = variant != "baseline"

        @rt.tools.tool
        async def work() -> str:
            """Work through the items."""
            for i in range(slices):
                spin(per_slice)
                if report:
                    agentloop.report_progress(f"item {i}", fraction=(i + 1) / slices)
                await trio.lowlevel.checkpoint()
            return "ok"

        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        stall = trio.Event()

        async def subscriber(task_status: trio.TaskStatus[None]) -> None:
            nonlocal seen
            async with rt.events.subscribe(ToolProgress) as rx:
                task_status.started()
                if variant == "stalled":
                    await stall.wait()
                async for _ in rx:
                    seen += 1

        async with trio.open_nursery() as nursery:
            if variant in ("subscriber", "stalled"):
                await nursery.start(subscriber)
            start = clock()
            async with handle.agent.run("go") as run:
                if variant == "run.progress()":
                    async for _ in run.progress():
                        seen += 1
                await run.result()
            wall = clock() - start
            stall.set()
            nursery.cancel_scope.cancel()
    return wall, seen


async def per_report(n: int) -> tuple[float, float]:
    """Microseconds one ``report_progress`` costs inside a tool, with a subscriber listening
    (so every report goes through the pacing), and with nobody listening."""
    costs: list[float] = []
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", FunctionModel(model))

        @rt.tools.tool
        async def work() -> str:
            """Report in a tight loop."""
            for _ in range(2):
                start = time.perf_counter()
                for i in range(n):
                    agentloop.report_progress("item", fraction=i / n)
                costs.append((time.perf_counter() - start) / n * 1e6)
                await trio.lowlevel.checkpoint()
            return "ok"

        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        async with rt.events.subscribe(ToolProgress):
            await handle.agent.ask("go")
        listening = min(costs)
        costs.clear()
        await handle.agent.ask("again")
        return listening, min(costs)


async def main(runs: int, seconds: float, cpu_clock: bool) -> None:
    clock = time.process_time if cpu_clock else time.perf_counter
    per_slice = calibrate()
    best = dict.fromkeys(VARIANTS, float("inf"))
    seen = dict.fromkeys(VARIANTS, 0)
    await one_turn("no reader", seconds / 5, per_slice, clock)  # warm-up
    for _ in range(runs):
        for variant in VARIANTS:
            wall, count = await one_turn(variant, seconds, per_slice, clock)
            best[variant] = min(best[variant], wall)
            seen[variant] = count
    reports = int(seconds / SLICE)
    print(f"report_progress: one tool, {reports:,} reports in {seconds:g} s of work "
          f"({1 / SLICE:,.0f} a second), best of {runs}, "
          f"{'CPU time of this process' if cpu_clock else 'wall time'}")
    base = best["baseline"]
    print("| variant | turn (ms) | vs baseline | reports read |")
    print("| --- | --- | --- | --- |")
    for variant in VARIANTS:
        wall = best[variant]
        print(f"| {variant} | {wall * 1000:.1f} | {(wall / base - 1) * 100:+.1f}% | "
              f"{seen[variant] if variant not in ('baseline', 'no reader') else '-'} |")
    listening, alone = await per_report(20_000 if runs > 1 else 2_000)
    print(f"one report_progress call: {listening:.2f} us with a subscriber listening, "
          f"{alone:.2f} us with nobody; at 10,000 a second that is "
          f"{listening * 1e4 / 1e6 * 100:.1f}% of the tool's time")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short run of each")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time the turn in this process's CPU time (a shared machine)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 0.05
    trio.run(main, args.runs, args.seconds, args.cpu_clock)
