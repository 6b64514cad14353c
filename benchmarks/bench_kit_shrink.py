"""How long hypothesis takes to shrink a race the kit found, on the kit's defaults.

A usage meter with a lost update across an await (the first example of docs/testing.md) is
hunted with ``operations()``, ``model_scripts()`` and ``seeds()`` and every hypothesis phase
but the database. Until a first failure is seen the property runs only lists of exactly
``--start`` operations (10), so that shrinking starts from a failure of that size. For each of
``--runs`` hypothesis seeds it prints how many examples found the first failure, then how long
shrinking took (the figure), how many examples it ran, and the shrunk list.

    python benchmarks/bench_kit_shrink.py [--start 10] [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from typing import Any

import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from agentloop.events import ToolPreExecute
from agentloop.testing import run_race
from agentloop.testing import strategies as als


class UsageMeter:
    """Counts every tool call that reaches ``tools/pre-execute``, losing updates."""

    def __init__(self) -> None:
        self.calls = 0

    async def plugin(self, ctx: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        ctx.events.on(ToolPreExecute, self.count)
        task_status.started()

    async def count(self, event: ToolPreExecute) -> None:
        calls = self.calls
        await trio.sleep(0.1)  # an audit request: another agent's hook runs meanwhile
        self.calls = calls + 1


def hunt(start: int, seed: int) -> dict[str, Any]:
    seen: dict[str, Any] = {"examples": 0, "first": None, "first_at": None, "last": None,
                            "failures": 0}

    @hypothesis_seed(seed)
    @settings(max_examples=1000, database=None, deadline=None,
              phases=[Phase.generate, Phase.target, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(ops=als.operations(), script=als.model_scripts(), seed=als.seeds())
    def test_the_meter_counts_every_call(ops: list[Any], script: list[Any], seed: int) -> None:
        seen["examples"] += 1
        if seen["first"] is None and len(ops) != start:
            return
        meter = UsageMeter()
        entered: list[str] = []

        def build(ctx: Any) -> None:
            ctx.events.on(ToolPreExecute, lambda e: entered.append(e.call.id), priority=1)

        def check(race: Any) -> None:
            assert meter.calls == len(entered), f"counted {meter.calls} of {len(entered)}"

        try:
            run_race(ops, script=script, seed=seed, build=build, plugins=[meter.plugin],
                     check=check)
        except AssertionError:
            seen["failures"] += 1
            if seen["first"] is None:
                seen["first"], seen["first_at"] = (ops, script, seed), time.perf_counter()
                seen["first_examples"] = seen["examples"]
            seen["last"] = (ops, script, seed)
            raise

    started = time.perf_counter()
    with contextlib.suppress(AssertionError):
        test_the_meter_counts_every_call()
    seen["end"] = time.perf_counter()
    seen["started"] = started
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=10, help="operations in the first failure")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("agentloop").setLevel(logging.CRITICAL)
    times: list[float] = []
    for run in range(args.runs):
        seen = hunt(args.start, run)
        if seen["first"] is None:
            print(f"run {run}: no failure within 1000 examples")
            continue
        times.append(seen["end"] - seen["first_at"])
        first_ops, _, _ = seen["first"]
        ops, script, seed = seen["last"]
        print(f"run {run}: first failure after {seen['first_examples']} examples "
              f"({seen['first_at'] - seen['started']:.1f} s), {len(first_ops)} operations; "
              f"shrinking: {seen['end'] - seen['first_at']:.1f} s, "
              f"{seen['examples'] - seen['first_examples']} examples, "
              f"{seen['failures']} failing; shrunk to {len(ops)} operations:")
        print(f"    {ops!r}, script={script!r}, seed={seed}")
    if times:
        median = sorted(times)[len(times) // 2]
        print(f"shrinking a {args.start}-operation failure: median {median:.1f} s, "
              f"max {max(times):.1f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
