"""Throughput and latency of the SQLite session store.

    python benchmarks/bench_sqlite.py [DIRECTORY]

The database files go to DIRECTORY (default: a fresh temporary directory), so point it at the
disk you care about: fsync cost dominates flush latency.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio
from agentloop_sqlite import SqliteSessionStore

from agentloop._json import FrozenDict, freeze
from agentloop._model import SessionEvent

META = FrozenDict(cwd="/bench")


def small_event(seq: int, turn: int) -> SessionEvent:
    return SessionEvent(seq, "message/delta", turn, FrozenDict(text="hello world", i=seq))


def turn_event(seq: int, turn: int) -> SessionEvent:
    data = freeze(
        {
            "role": "assistant",
            "content": [{"type": "text", "text": f"answer number {seq} " * 8}],
            "tool_calls": [{"id": f"call_{seq}", "name": "read", "arguments": {"path": "a.py"}}],
            "usage": {"input_tokens": 1200 + seq, "output_tokens": 300},
        }
    )
    assert isinstance(data, FrozenDict)
    return SessionEvent(seq, "turn/start" if seq % 20 == 1 else "message", turn, data)


async def bench_appends(directory: Path) -> None:
    n = 100_000
    async with SqliteSessionStore(directory / "appends.db") as store:
        await store.create("s", META)
        events = [small_event(seq, seq // 20 + 1) for seq in range(1, n + 1)]
        start = time.perf_counter()
        for e in events:
            store.append("s", e)
        queued = time.perf_counter()
        await store.flush("s", n)
        done = time.perf_counter()
    print(f"appends: {n:,} small events, one flush at the end")
    print(f"  append() calls:           {n / (queued - start):>12,.0f} /s")
    print(f"  committed (incl. flush):  {n / (done - start):>12,.0f} /s")
    print(f"  transactions:             {store.stats.transactions:>12,}")


async def bench_flush_latency(directory: Path) -> None:
    turns, per_turn = 200, 20
    latencies = []
    async with SqliteSessionStore(directory / "flush.db") as store:
        await store.create("s", META)
        seq = 0
        for turn in range(1, turns + 1):
            for _ in range(per_turn):
                seq += 1
                store.append("s", turn_event(seq, turn))
            start = time.perf_counter()
            await store.flush("s", seq)
            latencies.append(time.perf_counter() - start)
    cuts = statistics.quantiles(latencies, n=100)
    print(f"flush latency: {turns} turns of {per_turn} events each")
    print(f"  p50: {cuts[49] * 1e3:7.2f} ms")
    print(f"  p99: {cuts[98] * 1e3:7.2f} ms")
    print(f"  max: {max(latencies) * 1e3:7.2f} ms")


async def bench_load(directory: Path) -> None:
    n = 10_000
    path = directory / "load.db"
    async with SqliteSessionStore(path) as store:
        await store.create("s", META)
        for seq in range(1, n + 1):
            store.append("s", turn_event(seq, seq // 20 + 1))
        await store.flush("s", n)
    times = []
    for _ in range(5):
        async with SqliteSessionStore(path) as store:
            start = time.perf_counter()
            loaded = await store.load("s")
            times.append(time.perf_counter() - start)
        assert len(loaded.events) == n
    print(f"load: one session of {n:,} events (~{path.stat().st_size / 1e6:.1f} MB file)")
    print(f"  best: {min(times) * 1e3:7.1f} ms   median: {statistics.median(times) * 1e3:7.1f} ms")


async def main(directory: Path) -> None:
    print(f"database directory: {directory}")
    await bench_appends(directory)
    await bench_flush_latency(directory)
    await bench_load(directory)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        trio.run(main, Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-sqlite-") as tmp:
            trio.run(main, Path(tmp))
