"""How many examples the race kit's default strategies need to find each planted core bug.

``tests/test_kit_mutants.py`` hunts each mutant once, derandomized, within 300 examples. This
script hunts each one from ``--seeds`` different hypothesis seeds (300 examples each, no
shrinking) and prints, per mutant, how many seeds found it and the median and largest number
of examples that took: how far each mutant is from the budget, not one lucky draw.

    python benchmarks/bench_kit_mutants.py [--seeds 10] [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from agentloop.testing import run_race
from agentloop.testing import strategies as als

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_kit_mutants import BUDGET, MUTANTS, planted


def examples_to_find(mutants: Any, seed: int) -> int | None:
    tried = [0]
    found: list[int] = []

    @hypothesis_seed(seed)
    @settings(max_examples=BUDGET, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(ops=als.operations(), script=als.model_scripts(), seed=als.seeds())
    def search(ops: list[Any], script: list[Any], seed: int) -> None:
        tried[0] += 1
        try:
            run_race(ops, script=script, seed=seed)
        except AssertionError:
            found.append(tried[0])
            raise

    with planted(mutants), contextlib.suppress(AssertionError):
        search()
    return found[0] if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    logging.getLogger("agentloop").setLevel(logging.CRITICAL)
    print(f"{'found':>7} {'median':>6} {'max':>5}  mutant (examples to find it, {BUDGET} at most)")
    for name, mutants in MUTANTS.items():
        if args.only not in name:
            continue
        started = time.perf_counter()
        runs = [examples_to_find(mutants, s) for s in range(args.seeds)]
        hits = [r for r in runs if r is not None]
        median = f"{statistics.median(hits):.0f}" if hits else "-"
        print(f"{len(hits):>3}/{args.seeds:<3} {median:>6} {max(hits, default=0):>5}  {name} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
