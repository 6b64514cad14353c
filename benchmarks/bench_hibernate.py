"""Hibernation figures: memory per hibernated agent, and the wake latency.

    python benchmarks/bench_hibernate.py memory 1000 10000 100000
    python benchmarks/bench_hibernate.py wake 1000 100000
    python benchmarks/bench_hibernate.py            # memory 1000 10000, wake 1000

``memory N``: N agents in one runtime on a fresh SQLite file, each created with a 2-message
conversation (``seed``), asked to hibernate (``Agent.hibernate``) and waited for until every
one has (``agent/hibernated``). The figure is the traced Python memory (``tracemalloc``)
still allocated then, above what was allocated before the first agent, divided by N: the
handle (every one is held, as an owner holds them), the agent, its lifecycle, the registries'
entries and the store's bookkeeping, everything the process keeps per idle session. The
largest allocation sites are printed beside it.

``wake N``: N such sessions stored and hibernated, then 200 of them, picked at random, woken
one at a time by a follow-up; the figure is the time from ``followup()`` to the model being
called (the session reloaded from SQLite, the actor started, the turn opened, the request
assembled), p50 and p99.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio.testing

import agentloop
from agentloop import events as ev
from agentloop.testing import Finish, FunctionModel, TextDelta

OPTIONS = agentloop.AgentOptions(provider="bench", model="m")
SEED = (
    {"type": "user/message", "data": {"message_id": "m1", "content": "hello", "source": None}},
    {"type": "assistant/message", "data": {"content": "hi, how can I help?"}},
)
WAKES = 200
BATCH = 200
TOP = int(os.environ.get("BENCH_TOP", "8"))


class Called:
    """When the model was last called (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.at = 0.0
        self.event = trio.Event()

    async def stream(self, request: object) -> AsyncIterator[object]:
        self.at = time.perf_counter()
        self.event.set()
        yield TextDelta("ok")
        yield Finish("stop")


async def _hibernated(rt: agentloop.Context, n: int, label: str) -> list[agentloop.AgentHandle]:
    """``n`` agents with a 2-message conversation, every one hibernated."""
    rested = 0
    all_rested = trio.Event()

    def counted(e: ev.AgentHibernated) -> None:
        nonlocal rested
        rested += 1
        if rested == n:
            all_rested.set()

    stop = rt.events.on(ev.AgentHibernated, counted)
    handles: list[agentloop.AgentHandle] = []

    async def create(i: int) -> None:
        handles.append(await rt.agents.create(
            session_id=f"{label}-{i}", agent_options=OPTIONS, seed=SEED
        ))

    # Many creations at once, so the store's round trips overlap.
    for first in range(0, n, BATCH):
        async with trio.open_nursery() as nursery:
            for i in range(first, min(n, first + BATCH)):
                nursery.start_soon(create, i)
    # Each actor must be parked before it can be asked (it starts on the next tick).
    await trio.testing.wait_all_tasks_blocked()
    for handle in handles:
        if not handle.agent.hibernate():
            raise RuntimeError(f"{handle.agent.id} cannot hibernate ({handle.agent.status})")
    await all_rested.wait()
    # The actors' tasks end right after they announce it.
    await trio.testing.wait_all_tasks_blocked()
    stop()
    return handles


def _config(db: str) -> dict[str, Any]:
    return {"persistence": {"backend": "sqlite", "path": db}}


def _scratch() -> tempfile.TemporaryDirectory[str]:
    """Where the store goes: a memory filesystem when there is one, so setting up 100,000
    sessions is not 300,000 disk syncs (what is measured is memory and the wake's reads)."""
    shm = "/dev/shm"
    return tempfile.TemporaryDirectory(dir=shm if os.path.isdir(shm) else None)


async def memory(n: int) -> None:
    with _scratch() as tmp:
        async with agentloop.open_runtime(_config(os.path.join(tmp, "s.db"))) as rt:
            rt.llm.register("bench", FunctionModel(Called().stream))  # type: ignore[arg-type]
            gc.collect()
            tracemalloc.start(3)
            before = tracemalloc.get_traced_memory()[0]
            started = time.perf_counter()
            handles = await _hibernated(rt, n, "mem")
            took = time.perf_counter() - started
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
            snapshot = tracemalloc.take_snapshot()
            tracemalloc.stop()
            assert all(h.agent.status == "hibernated" for h in handles)
            per = (after - before) / n
            print(f"memory per hibernated agent, {n:,} agents: {per:,.0f} B "
                  f"(set up in {took:.1f} s under tracemalloc)")
            top = snapshot.statistics("lineno")[:TOP]
            for stat in top:
                frame = stat.traceback[0]
                where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
                print(f"    {stat.size / n:8.0f} B/agent  {where}")
            sys.stdout.flush()
            for handle in handles:
                await handle.aclose()  # a hibernated agent is disposed without a wake


async def wake(n: int) -> None:
    with _scratch() as tmp:
        async with agentloop.open_runtime(_config(os.path.join(tmp, "s.db"))) as rt:
            called = Called()
            rt.llm.register("bench", FunctionModel(called.stream))  # type: ignore[arg-type]
            started = time.perf_counter()
            handles = await _hibernated(rt, n, "wake")
            took = time.perf_counter() - started
            picked = random.Random(0).sample(handles, min(WAKES, n))
            latencies = []
            for handle in picked:
                called.event = trio.Event()
                sent = time.perf_counter()
                handle.agent.followup("again")
                await called.event.wait()
                latencies.append(called.at - sent)
                await handle.agent.wait_idle()
            ms = sorted(x * 1000 for x in latencies)
            p50 = statistics.median(ms)
            p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
            print(f"wake (followup to model call), {n:,} stored sessions, {len(ms)} wakes: "
                  f"p50 {p50:.2f} ms, p99 {p99:.2f} ms (set up in {took:.1f} s)")
            sys.stdout.flush()
            for handle in handles:
                await handle.aclose()


def main(argv: list[str]) -> None:
    if not argv:
        argv = ["memory", "1000", "10000", "wake", "1000"]
    kind = None
    for arg in argv:
        if arg in ("memory", "wake"):
            kind = arg
            continue
        if kind is None:
            raise SystemExit(__doc__)
        trio.run(memory if kind == "memory" else wake, int(arg))


if __name__ == "__main__":
    main(sys.argv[1:])
