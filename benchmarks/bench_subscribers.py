"""Per-step cost of durable subscribers: a 50-step turn with 0, 1 and 10 of them.

    python benchmarks/bench_subscribers.py [--runs N] [--subscribers 0,1,10]

Each subscriber is ``async with ctx.events.subscribe(SessionEventAppended) as rx`` in a task of
its own. Three ways of reading are measured: a plain ``async for event in rx`` (one trip through
the scheduler per wake-up); ``async for`` followed by draining what is already queued with
``rx.receive_nowait()``; and ``stalled``, subscribers that read nothing until the turn is over,
which leaves only what the emitting driver pays. The turn is the one of ``bench_core.py steps``:
each step streams 10 text chunks and calls one parallel ``noop`` tool. The clock stops once the
agent is idle and every reading subscriber has seen the turn's ``turn/end`` (stalled ones are
drained and checked afterwards, off the clock). A fourth way, ``elsewhere``, reads another
session: ``ctx.sessions.tail`` of an idle agent beside the timed one, which should cost the
timed turn nothing. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence

import trio

import agentloop
from agentloop.events import SessionEventAppended
from agentloop.testing import Reply, ScriptedModel, reply

STEPS = 50
TEXT = "abcde" * 10
OPTIONS = agentloop.AgentOptions(provider="scripted", model="bench")


def script() -> list[Reply]:
    with_call = reply(TEXT, tool_calls=[("noop", {})], chunk_size=5)
    return [with_call] * (STEPS - 1) + [reply(TEXT, chunk_size=5)]


async def subscriber(
    rt: agentloop.Context,
    mode: str,
    ready: trio.Event,
    stall: trio.Event,
    done: trio.Event,
    counted: list[int],
) -> None:
    seen = 0
    async with rt.events.subscribe(SessionEventAppended) as rx:
        ready.set()
        if mode == "stalled":
            await stall.wait()
        async for event in rx:
            seen += 1
            if event.event.type == "turn/end":
                break
            if mode == "nowait":
                ended = False
                while True:
                    try:
                        event = rx.receive_nowait()
                    except trio.WouldBlock:
                        break
                    seen += 1
                    if event.event.type == "turn/end":
                        ended = True
                        break
                if ended:
                    break
    counted.append(seen)
    done.set()


async def tail_elsewhere(
    rt: agentloop.Context, session_id: str, ready: trio.Event, stall: trio.Event,
    done: trio.Event, counted: list[int],
) -> None:
    """Follow another, idle session until ``stall`` is set: its seeded events, then
    nothing."""
    async with rt.sessions.tail(session_id, from_seq=1) as tail:
        async for _ in tail:
            ready.set()  # the tail listens once its first event is read
            break
        await stall.wait()
    counted.append(0)
    done.set()


SEED = [
    {"type": "turn/start", "turn": 1, "data": {"turn": 1}},
    {"type": "turn/end", "turn": 1, "data": {"turn": 1, "reason": "completed"}},
]


async def timed_turn(rt: agentloop.Context, session_id: str, subscribers: int, mode: str) -> float:
    """Microseconds per step of one STEPS-step turn with ``subscribers`` durable subscribers."""
    model = ScriptedModel(script())
    unregister = rt.llm.register("scripted", model)
    handle = await rt.agents.create(session_id=session_id, agent_options=OPTIONS)
    other = await rt.agents.create(session_id=f"{session_id}-other", seed=SEED)
    counted: list[int] = []
    stall = trio.Event()
    async with handle, other, trio.open_nursery() as nursery:
        dones = []
        for _ in range(subscribers):
            ready, done = trio.Event(), trio.Event()
            if mode == "elsewhere":
                nursery.start_soon(tail_elsewhere, rt, other.agent.id, ready, stall, done, counted)
            else:
                nursery.start_soon(subscriber, rt, mode, ready, stall, done, counted)
            await ready.wait()
            dones.append(done)
        agent = handle.agent
        gc.collect()
        start = time.perf_counter_ns()
        agent.followup("go")
        await agent.wait_idle()
        if mode not in ("stalled", "elsewhere"):
            for done in dones:
                await done.wait()
        elapsed = time.perf_counter_ns() - start
        stall.set()
        for done in dones:
            await done.wait()
        assert model.remaining == 0, "the turn did not take every step"
        events = len(agent.session.events)
    want = 0 if mode == "elsewhere" else events
    assert counted == [want] * subscribers, (counted, events)
    unregister()
    return elapsed / STEPS / 1000


async def main(counts: Sequence[int], runs: int) -> None:
    print(f"python {sys.version.split()[0]} on {sys.platform}, {os.cpu_count()} cpus, "
          f"trio {trio.__version__}")
    async with agentloop.open_runtime() as rt:

        async def noop() -> str:
            """Do nothing."""
            return "ok"

        rt.tools.tool(noop, concurrency="parallel")
        await timed_turn(rt, "warmup", 1, "async-for")
        results: dict[tuple[int, str], list[float]] = {}
        for run in range(runs):
            for mode in ("async-for", "nowait", "stalled", "elsewhere"):
                for n in counts:
                    if n == 0 and mode != "async-for":
                        continue
                    us = await timed_turn(rt, f"s{n}-{mode}-{run}", n, mode)
                    results.setdefault((n, mode), []).append(us)
    base = min(results[(0, "async-for")]) if (0, "async-for") in results else None
    print(f"\n{STEPS}-step turn, 10 text chunks + 1 parallel tool call per step, best of {runs}")
    for (n, mode), values in sorted(results.items()):
        best = min(values)
        ratio = f"  {best / base:5.2f}x" if base else ""
        label = (
            "no subscriber" if n == 0
            else f"{n:2d} tail(s) on another session" if mode == "elsewhere"
            else f"{n:2d} subscriber(s), {mode}"
        )
        print(f"  {label:<32} {best:8.1f} us/step  (median {statistics.median(values):.1f})"
              f"{ratio}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--subscribers", default="0,1,10",
                        help="comma-separated subscriber counts (default 0,1,10)")
    args = parser.parse_args()
    trio.run(main, [int(n) for n in args.subscribers.split(",")], args.runs)
