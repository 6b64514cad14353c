"""What ``agentloop.report_progress`` costs a tool that reports 10,000 times a second.

    python benchmarks/bench_progress.py [--quick] [--runs N] [--seconds S]

One turn calls one tool that does S seconds of CPU work (default 0.5) in slices of 100
microseconds, yielding to trio after each slice, as a tool that processes items one by one
would. The variants differ only in what the tool does after each slice:

- ``baseline``: nothing (no ``report_progress`` call);
- ``no reader``: ``report_progress(...)`` with nobody listening;
- ``run.progress()``: the same, read by an ``async for`` over the run's progress;
- ``subscriber``: read by an ``events.subscribe(ToolProgress)`` task as fast as it can;
- ``stalled``: a subscriber that reads nothing until the turn is over.

The figure is the turn's wall time against the baseline's, best of N runs each, interleaved.
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


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def one_turn(variant: str, seconds: float) -> tuple[float, int]:
    """The turn's wall time, and how many reports its reader saw."""
    slices = int(seconds / SLICE)
    seen = 0
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", FunctionModel(model))
        report = variant != "baseline"

        @rt.tools.tool
        async def work() -> str:
            """Work through the items."""
            for i in range(slices):
                busy(SLICE)
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
            start = time.perf_counter()
            async with handle.agent.run("go") as run:
                if variant == "run.progress()":
                    async for _ in run.progress():
                        seen += 1
                await run.result()
            wall = time.perf_counter() - start
            stall.set()
            nursery.cancel_scope.cancel()
    return wall, seen


async def main(runs: int, seconds: float) -> None:
    best = dict.fromkeys(VARIANTS, float("inf"))
    seen = dict.fromkeys(VARIANTS, 0)
    await one_turn("no reader", seconds / 5)  # warm-up
    for _ in range(runs):
        for variant in VARIANTS:
            wall, count = await one_turn(variant, seconds)
            best[variant] = min(best[variant], wall)
            seen[variant] = count
    reports = int(seconds / SLICE)
    print(f"report_progress: one tool, {reports:,} reports in {seconds:g} s of work "
          f"({1 / SLICE:,.0f} a second), best of {runs}")
    base = best["baseline"]
    print("| variant | turn (ms) | vs baseline | reports read |")
    print("| --- | --- | --- | --- |")
    for variant in VARIANTS:
        wall = best[variant]
        print(f"| {variant} | {wall * 1000:.1f} | {(wall / base - 1) * 100:+.1f}% | "
              f"{seen[variant] if variant not in ('baseline', 'no reader') else '-'} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short run of each")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 0.05
    trio.run(main, args.runs, args.seconds)
