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

Last, up to 200 agents with a 100-message history each run a turn and are closed and let
go: the memory they keep until the collector runs says whether a closed agent is freed at
once (nothing of the runtime refers to it, nor does any of its parts) or waits, with its
whole session, for a collection that finds it.
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
import trio.testing
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


Measured = tuple[float, Counter[int], float]


def report(title: str, rows: list[tuple[str, list[Measured]]], unit: float, per: str) -> None:
    print(title)
    for name, got in rows:
        walls, counts, spent = (list(x) for x in zip(*got, strict=True))
        print("  " + row(name, walls, counts, spent, unit, per))


async def w1(collections: Collections, reps: int) -> None:
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(add, concurrency="parallel")
        model = agentloop_model(STEPS)
        rt.llm.register("bench", model)

        async def turn(index: int, measure: Callable[[Callable[[], Awaitable[None]]], Any]) -> Any:
            # As the yardstick times it: from the follow-up to the idle agent, the agent made
            # before and closed after.
            async with await rt.agents.create(session_id=f"w1-{index}", agent_options=OPTIONS) as h:

                async def run() -> None:
                    h.agent.followup("go")
                    await h.agent.wait_idle()

                got = await measure(run)
            model.requests.clear()  # the test model's record of each request, as the yardstick
            return got

        async def young_growth(run: Callable[[], Awaitable[None]]) -> tuple[int, Counter[str]]:
            gc.collect()
            gc.disable()
            try:
                before = gc.get_count()[0]
                await run()
                kinds = Counter(type(o).__name__ for o in gc.get_objects(generation=0))
                return gc.get_count()[0] - before, kinds
            finally:
                gc.enable()

        await turn(-1, young_growth)  # the runtime's first turn builds what later ones reuse
        grown, kinds = await turn(0, young_growth)
        ours: list[Measured] = []
        floor: list[Measured] = []
        for rep in range(reps + 1):
            mine = await turn(rep + 1, collections.timed)
            bare = await collections.timed(lambda: floor_turn("go", direct))
            if rep:
                ours.append(mine)
                floor.append(bare)
    report(f"W1 (one {STEPS}-step turn), per step:",
           [("agentloop", ours), ("floor (bare trio)", floor)], 1e6 / STEPS, "us")
    top = ", ".join(f"{n / STEPS:.1f} {k}" for k, n in kinds.most_common(5))
    # Two of them a step are the test model's record of the request (its LLMRequest and the
    # history view in it), kept until the turn is over.
    print(f"  tracked objects a step leaves alive: {grown / STEPS:.1f} ({top}, ...)")


async def w2(collections: Collections, reps: int, agents: int) -> None:
    ours: list[Measured] = []
    floor: list[Measured] = []
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(add, concurrency="parallel")
        model = agentloop_model(None)
        rt.llm.register("bench", model)
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

            try:
                mine = await collections.timed(everyone)
                plain = await collections.timed(bare)
            finally:
                async with trio.open_nursery() as nursery:
                    for h in handles:
                        nursery.start_soon(h.aclose)
                model.requests.clear()
            if rep:
                ours.append(mine)
                floor.append(plain)
    report(f"W2 ({agents} two-step runs at once), per repetition:",
           [("agentloop", ours), ("floor (bare trio)", floor)], 1e3, "ms")


def _history(messages: int) -> list[dict[str, Any]]:
    """A seed of ``messages`` messages in completed turns, each a few hundred characters."""
    seed: list[dict[str, Any]] = []
    for turn in range(1, messages // 2 + 1):
        seed += [
            {"type": "turn/start", "turn": turn, "data": {}},
            {"type": "user/message", "turn": turn,
             "data": {"message_id": f"m{turn}", "content": f"question {turn} " * 20}},
            {"type": "assistant/message", "turn": turn,
             "data": {"content": f"answer {turn} " * 40}},
            {"type": "turn/end", "turn": turn, "data": {"reason": "completed"}},
        ]
    return seed


async def closed(agents: int, messages: int = 100) -> None:
    """What closed agents keep in memory once nothing refers to them, before and after a
    full collection: agents made with a history, run for one turn, closed and let go."""
    import tracemalloc

    async with agentloop.open_runtime() as rt:
        rt.tools.tool(add, concurrency="parallel")
        model = agentloop_model(None)
        rt.llm.register("bench", model)
        seed = _history(messages)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            handles = [
                await rt.agents.create(session_id=f"c-{i}", agent_options=OPTIONS, seed=seed)
                for i in range(agents)
            ]
            for h in handles:
                h.agent.followup("go")
            for h in handles:
                await h.agent.wait_idle()
            live = tracemalloc.get_traced_memory()[0] - base
            model.requests.clear()
            async with trio.open_nursery() as nursery:
                for h in handles:
                    nursery.start_soon(h.aclose)
            del handles, h
            await trio.testing.wait_all_tasks_blocked()
            # What reference counting alone did not free waits for the collector: for agents
            # old enough to be in its oldest generation, for a full collection.
            kept = tracemalloc.get_traced_memory()[0] - base
            found = gc.collect()
            after = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
    print(f"closed agents ({agents}, each with {messages} messages and one turn run):")
    print(f"  held while live: {live / agents:9,.0f} B an agent")
    print(f"  once closed and let go, before the collector runs: {kept / agents:9,.0f} B an"
          f" agent; a full collection then finds {found / agents:.1f} objects an agent and"
          f" leaves {after / agents:,.0f} B")


async def main(reps: int, agents: int) -> None:
    collections = Collections()
    gc.callbacks.append(collections)
    try:
        await w1(collections, reps)
        await w2(collections, reps, agents)
    finally:
        gc.callbacks.remove(collections)
    await closed(min(agents, 200))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--agents", type=int, default=500)
    args = parser.parse_args()
    trio.run(main, args.reps, args.agents)
