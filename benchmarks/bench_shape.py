"""What the design card's shape alone costs a step, timed: the yardstick's bare trio floor
against the same loop in the shape (an actor task fed by a channel, each tool call in a task
of its own that the actor waits for), interleaved in one process.

    python benchmarks/bench_shape.py [--rounds 15]

The loops are ``bench_instructions.py``'s, which counts their instructions; this times them,
so the figure reads beside the yardstick's W1 ratio: a runtime that keeps the shape cannot
read below the shape's ratio, and what it spends above it is its own. No agentloop code
runs here. Each round times 3 turns of 50 steps of each loop, after one turn of warm-up,
with a collection before each timing; the figures are medians over the rounds.

Then the same for the yardstick's W2: 500 two-step turns at once, the floor's as 500 tasks of
one nursery, the shape's as 500 actors made (and parked on their channels) before the timer,
each sent its prompt and then waited for in turn, as the yardstick waits for its agents.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Awaitable, Callable

import trio
from bench_instructions import (
    STEPS,
    floor_turns,
    floor_w2_seconds,
    shape_turns,
    shape_w2_seconds,
)

TURNS = 3
AGENTS = 500  # W2's concurrent runs


async def per_step(loop: Callable[[int], Awaitable[None]]) -> float:
    """Microseconds a step of ``loop``, over ``TURNS`` turns after a warm-up turn."""
    await loop(1)
    gc.collect()
    start = time.perf_counter()
    await loop(TURNS)
    return (time.perf_counter() - start) / (TURNS * STEPS) * 1e6


async def main(rounds: int) -> None:
    floor: list[float] = []
    shape: list[float] = []
    ratios: list[float] = []
    for _ in range(rounds):
        f = await per_step(floor_turns)
        s = await per_step(shape_turns)
        floor.append(f)
        shape.append(s)
        ratios.append(s / f)
    print(f"floor (bare trio)    {statistics.median(floor):6.2f} us per step")
    print(f"floor in the shape   {statistics.median(shape):6.2f} us per step "
          f"({statistics.median(ratios):.2f}x the floor, median of {rounds} rounds)")
    floor, shape, ratios = [], [], []
    await floor_w2_seconds(AGENTS)  # warm-up
    await shape_w2_seconds(AGENTS)
    for _ in range(rounds):
        gc.collect()
        f = await floor_w2_seconds(AGENTS) * 1e3
        gc.collect()
        s = await shape_w2_seconds(AGENTS) * 1e3
        floor.append(f)
        shape.append(s)
        ratios.append(s / f)
    print(f"W2 floor (bare trio)  {statistics.median(floor):6.2f} ms per {AGENTS} runs")
    print(f"W2 floor in the shape {statistics.median(shape):6.2f} ms per {AGENTS} runs "
          f"({statistics.median(ratios):.2f}x the floor, median of {rounds} rounds)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    trio.run(main, parser.parse_args().rounds)
