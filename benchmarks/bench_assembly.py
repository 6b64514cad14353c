"""Request assembly figures: per-step cost with the invariant companion, and after compaction.

    python benchmarks/bench_assembly.py [--quick]

The same 50-step turn as ``bench_core.py steps`` (10 text chunks and one tool call per step),
on sessions seeded with 10 and with 1,000 messages, and on the 1,000-message session after one
``replace_history`` has shadowed all but its last two messages; each with and without the
``invariants`` companion. Best of 5 runs, microseconds per step. Printed, never asserted.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Sequence

import agentloop_invariants
import trio
from bench_core import OPTIONS, STEPS, script, seed_history

import agentloop
from agentloop.testing import ScriptedModel

QUICK = "--quick" in sys.argv
RUNS = 1 if QUICK else 5
CASES: Sequence[tuple[str, int, bool]] = (
    ("10 messages", 10, False),
    ("1,000 messages", 1000, False),
    ("1,000 messages, compacted", 1000, True),
)


async def timed_turn(rt: agentloop.Context, session_id: str, history: int, compact: bool) -> int:
    model = ScriptedModel(script())
    unregister = rt.llm.register("scripted", model)
    handle = await rt.agents.create(
        session_id=session_id, agent_options=OPTIONS, seed=seed_history(history) or None
    )
    async with handle:
        agent = handle.agent
        session = agent.session
        if compact:
            last = session.events[-1].seq
            session.replace_history(
                1, last - 2, [agentloop.Message("user", "summary of what came before")]
            )
            assert len(session.messages()) < 10, len(session.messages())
        gc.collect()
        start = time.perf_counter_ns()
        agent.followup("go")
        await agent.wait_idle()
        elapsed = time.perf_counter_ns() - start
        assert model.remaining == 0, "the turn did not take every step"
    unregister()
    return elapsed


async def figures(companion: bool) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {label: [] for label, _, _ in CASES}
    async with agentloop.open_runtime() as rt:
        checker = agentloop_invariants.install(rt) if companion else None
        await timed_turn(rt, "warmup", 10, False)
        for run in range(RUNS):
            for label, history, compact in CASES:
                ns = await timed_turn(rt, f"s{run}-{history}-{compact}", history, compact)
                out[label].append(ns / STEPS / 1000)
        if checker is not None:
            assert checker.violations == [], checker.violations
            assert checker.checked > 0
    return out


async def main() -> None:
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}; "
          f"{STEPS}-step turn, best of {RUNS}, us per step")
    for companion in (False, True):
        rows = await figures(companion)
        title = "with the invariant companion" if companion else "without a companion"
        print(f"\n{title}")
        for label, values in rows.items():
            print(f"  {label:<28} {min(values):8.1f}  (median {statistics.median(values):.1f})")


if __name__ == "__main__":
    trio.run(main)
