"""What every peer benchmark shares: the workload sizes, timing, tracing and the result line.

Each ``bench_*.py`` in this folder runs one workload in its own process and prints one line
``RESULT {json}`` that ``run.py`` collects. The workloads (see ``benchmarks/README.md``):

- **W1**: one turn of ``STEPS`` steps; each step streams ``CHUNKS`` text chunks of
  ``CHUNK_SIZE`` characters and makes one call of a trivial ``noop`` tool; the last step
  answers without a tool. Figure: microseconds per step, median of ``runs`` turns after a
  warm-up turn.
- **W2**: ``CONCURRENT`` independent runs started at once in one process, each a turn of the
  W1 shape with ``W2_STEPS`` steps; the agents a framework needs are made before the clock.
  Figures: the wall time from the start to the last run's end (median of ``W2_BATCHES``
  batches after a smaller warm-up batch), divided per run (ms) and per step (us); then, in a
  pass of its own (``tracemalloc`` slows everything down), the peak traced Python bytes per
  run of one more batch, its agents included.
- **W3**: ``IDLE`` agents, each with its own 2-message conversation, held idle and ready for
  the next turn. Figure: traced Python bytes (``tracemalloc``) per agent.
- **W4**: the W1 turn on conversations seeded with ``HISTORY`` (10 and 1,000) messages,
  interleaved. Figures: microseconds per step at each size and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

STEPS = 50
CHUNKS = 10
CHUNK_SIZE = 5
TEXT = "abcde" * CHUNKS
PIECES = [TEXT[i : i + CHUNK_SIZE] for i in range(0, len(TEXT), CHUNK_SIZE)]
RUNS = 5
CONCURRENT = 500
W2_STEPS = 5
W2_BATCHES = 3
W2_WARMUP = 50
IDLE = 2000
HISTORY = (10, 1000)

QUICK_STEPS = 5
QUICK_RUNS = 2
QUICK_CONCURRENT = 20
QUICK_W2_STEPS = 3
QUICK_W2_BATCHES = 1
QUICK_IDLE = 50
QUICK_HISTORY = (10, 50)


class Sizes:
    """The sizes one process runs with (``--quick`` shrinks every one of them)."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.steps = QUICK_STEPS if quick else STEPS
        self.runs = QUICK_RUNS if quick else RUNS
        self.concurrent = QUICK_CONCURRENT if quick else CONCURRENT
        self.w2_steps = QUICK_W2_STEPS if quick else W2_STEPS
        self.w2_batches = QUICK_W2_BATCHES if quick else W2_BATCHES
        self.idle = QUICK_IDLE if quick else IDLE
        self.history = QUICK_HISTORY if quick else HISTORY


def parse_args(entries: list[str]) -> tuple[str, str, Sizes]:
    """``--entry NAME --workload w1|w2|w3|w4 [--quick]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry", choices=entries, default=entries[0])
    parser.add_argument("--workload", choices=["w1", "w2", "w3", "w4"], required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    return args.entry, args.workload, Sizes(args.quick)


def report(**figures: Any) -> None:
    print("RESULT " + json.dumps(figures), flush=True)


def history_roles(messages: int) -> list[str]:
    """Alternating user/assistant roles of a seeded conversation, oldest first."""
    return ["user" if i % 2 == 0 else "assistant" for i in range(messages)]


def history_text(index: int) -> str:
    """The content of seeded message ``index``: about the size of a short chat message."""
    return f"message {index} " * 10


Turn = Callable[[], Awaitable[int | None]]


async def timed(turn: Turn) -> int:
    """Nanoseconds of one turn: the turn's own figure when it returns one (it then times only
    the turn, not the setting up of a fresh agent for it), else the wall time of the call."""
    gc.collect()
    start = time.perf_counter_ns()
    own = await turn()
    return own if own is not None else time.perf_counter_ns() - start


async def time_turns(turn: Turn, sizes: Sizes) -> list[float]:
    """Microseconds per step of ``sizes.runs`` turns, after one warm-up turn."""
    await turn()
    return [await timed(turn) / sizes.steps / 1000 for _ in range(sizes.runs)]


async def time_histories(make_turn: Callable[[int], Turn], sizes: Sizes) -> dict[str, Any]:
    """W4: the W1 turn at each history size, interleaved, medians and their ratio.

    ``make_turn(messages)`` returns a turn that starts from a conversation of that many
    messages; building that conversation is not timed (see :func:`timed`).
    """
    small, large = sizes.history
    turns = {small: make_turn(small), large: make_turn(large)}
    for t in turns.values():
        await t()
    runs: dict[int, list[float]] = {small: [], large: []}
    for _ in range(sizes.runs):
        for size, t in turns.items():
            runs[size].append(await timed(t) / sizes.steps / 1000)
    a, b = statistics.median(runs[small]), statistics.median(runs[large])
    return {"small": small, "large": large, "small_us": a, "large_us": b, "ratio": b / a}


Batch = Callable[[int], Awaitable[int | None]]


async def time_concurrent(batch: Batch, sizes: Sizes) -> dict[str, Any]:
    """W2: ``batch(n)`` starts ``n`` runs at once and returns when all of them ended.

    Like a turn (see :func:`timed`), a batch may return its own nanoseconds, to leave out
    making its agents and closing them. A warm-up batch of ``W2_WARMUP`` runs (a full one
    would double the time of the slowest peers for nothing: the code paths are warm after a
    few runs), ``sizes.w2_batches`` timed ones of ``sizes.concurrent``, then one more under
    ``tracemalloc`` for the peak traced bytes above the level before it.
    """
    n = sizes.concurrent
    await batch(min(W2_WARMUP, n))
    walls = [await timed(lambda: batch(n)) for _ in range(sizes.w2_batches)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    await batch(n)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"runs": n, "steps": sizes.w2_steps, "wall_ms": [w / 1e6 for w in walls],
            "peak_bytes_per_run": (peak - before) / n}


def traced_bytes_per(count: int, build: Callable[[], object]) -> float:
    """Traced bytes per object kept alive by ``build()`` (which makes ``count`` of them)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept
    return used / count


async def atraced_bytes_per(count: int, build: Callable[[], Awaitable[object]],
                            settle: Callable[[], Awaitable[None]]) -> tuple[float, object]:
    """As :func:`traced_bytes_per`, for objects built by a coroutine; ``settle()`` runs before
    the second reading (to let started tasks park). Returns the figure and what was built, so
    the caller decides when it is released."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = await build()
    await settle()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / count, kept


def versions(*dists: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "working tree"
    return out
