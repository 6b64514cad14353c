"""The cycle collector's share of the yardstick's workloads: how many objects a step leaves
for it, how often it runs, and the time spent in it, for agentloop and the bare trio loop.

    python benchmarks/bench_gc.py [--reps 3] [--agents 500]

W1 is one 50-step turn of a fresh agent (10 streamed chunks and one tool call a step, the
yardstick's turn), W2 ``--agents`` runs of two steps at once, each on an agent of its own
made before the timer; the floor runs the same turns as plain trio code
(``bench_instructions.py``'s loops). As in the yardstick, the collector runs a full
collection before each timed repetition and is then left to its thresholds, so what is
counted is what a run itself makes it do. Figures are medians over ``--reps`` repetitions,
after one untimed.

"Tracked per step" is the growth of the collector's young generation over a W1 turn with
the collector paused, divided by the steps: the objects a step leaves alive that the
collector must visit (CPython starts a young collection every 700 of them). A runtime whose
session log records every chunk keeps an event and its data per chunk; the figure says how
many such objects a step costs, and the time columns what they cost.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from bench_instructions import STEPS, add, agentloop_model, direct, floor_turn

import agentloop


class Collections:
    """Counts collections by generation and the time spent in them while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.count: Counter[int] = Counter()
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.on:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._started

    async def timed(self, run: Callable[[], Awaitable[None]]) -> tuple[float, Counter[int], float]:
        """Wall seconds of ``run``, the collections it caused and the seconds spent in them."""
        gc.collect()
        self.count, self.seconds, self.on = Counter(), 0.0, True
        start = time.perf_counter()
        try:
            await run()
        finally:
            self.on = False
        return time.perf_counter() - start, self.count, self.seconds


OPTIONS = agentloop.AgentOptions(provider="bench", model="zero-latency")


def row(name: str, walls: list[float], counts: list[Counter[int]], spent: list[float],
        unit: float, per: str) -> str:
    wall = statistics.median(walls) * unit
    young = statistics.median(c[0] for c in counts)
    older = statistics.median(c[1] + c[2] for c in counts)
    share = statistics.median(s / w for s, w in zip(spent, walls, strict=True))
    return (f"{name:22s} {wall:8.1f} {per}   collections: {young:4.0f} young, {older:3.0f} older"
            f"   in them: {statistics.median(spent) * unit:7.2f} {per} ({share:5.1%})")


async def main(reps: int, agents: int) -> None:
    collections = Collections()
    gc.callbacks.append(collections)
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(add, concurrency="parallel")
        rt.llm.register("bench", agentloop_model(STEPS))

        async def w1_turn(index: int) -> Callable[[], Awaitable[None]]:
            handle = await rt.agents.create(session_id=f"w1-{index}", agent_options=OPTIONS)
            await handle.__aenter__()

            async def run() -> None:
                try:
                    handle.agent.followup("go")
                    await handle.agent.wait_idle()
                finally:
                    await handle.__aexit__(None, None, None)

            return run

        # Objects a step leaves to the collector: the young generation's growth over a turn.
        run = await w1_turn(-1)
        gc.collect()
        gc.disable()
        try:
            before = gc.get_count()[0]
            await run()
            tracked = (gc.get_count()[0] - before) / STEPS
            kinds = Counter(type(o).__name__ for o in gc.get_objects(generation=0))
        finally:
            gc.enable()
        ours: list[tuple[float, Counter[int], float]] = []
        floor: list[tuple[float, Counter[int], float]] = []
        for rep in range(reps + 1):
            mine = await collections.timed(await w1_turn(rep))
            bare = await collections.timed(lambda: floor_turn("go", direct))
            if rep:
                ours.append(mine)
                floor.append(bare)

    print(f"W1 (one {STEPS}-step turn), per step:")
    for name, got in (("agentloop", ours), ("floor (bare trio)", floor)):
        walls, counts, spent = (list(x) for x in zip(*got, strict=True))
        print("  " + row(name, walls, counts, spent, 1e6 / STEPS, "us"))
    top = ", ".join(f"{n / STEPS:.1f} {k}" for k, n in kinds.most_common(4))
    print(f"  tracked objects a step leaves alive: {tracked:.1f} ({top}, ...)")

    w2_ours: list[tuple[float, Counter[int], float]] = []
    w2_floor: list[tuple[float, Counter[int], float]] = []
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(add, concurrency="parallel")
        rt.llm.register("bench", agentloop_model(None))
        for rep in range(reps + 1):
            handles = [await rt.agents.create(session_id=f"w2-{rep}-{i}", agent_options=OPTIONS)
                       for i in range(agents)]

            async def everyone(handles: list[Any] = handles) -> None:
                for h in handles:
                    h.agent.followup("go")
                for h in handles:
                    await h.agent.wait_idle()

            async def bare() -> None:
                async with trio.open_nursery() as nursery:
                    for _ in range(agents):
                        nursery.start_soon(floor_turn, "go", direct, 2)

            mine = await collections.timed(everyone)
            plain = await collections.timed(bare)
            async with trio.open_nursery() as nursery:
                for h in handles:
                    nursery.start_soon(h.aclose)
            if rep:
                w2_ours.append(mine)
                w2_floor.append(plain)
    gc.callbacks.remove(collections)
    print(f"W2 ({agents} two-step runs at once), per repetition:")
    for name, got in (("agentloop", w2_ours), ("floor (bare trio)", w2_floor)):
        walls, counts, spent = (list(x) for x in zip(*got, strict=True))
        print("  " + row(name, walls, counts, spent, 1e3, "ms"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--agents", type=int, default=500)
    args = parser.parse_args()
    trio.run(main, args.reps, args.agents)
