"""The benchmark scripts still run: each once, in its quick mode, in a process of its own.

Nothing here reads a figure (figures are the scripts' business, not the suite's); a script
that raises, prints nothing or loses a section fails. The peers are not installed here, so
the peer runner is run on the agentloop entry and its floor only, and on two of its workloads
(W4 runs the same turn as W1), to keep the file to a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

pytestmark = pytest.mark.slow


def run_script(*argv: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bench_core_quick_runs_every_benchmark() -> None:
    out = run_script(str(BENCHMARKS / "bench_core.py"), "--quick")
    for section in ("per-step overhead", "per-step cost vs history",
                    "memory per idle agent actor", "emit cost"):
        assert section in out, out
    assert "best of 1" in out, "--quick did not shrink the repetitions"


def test_profile_step_quick_prints_the_top_functions_per_step() -> None:
    out = run_script(str(BENCHMARKS / "profile_step.py"), "--quick")
    assert "one 3-step turn" in out, out
    assert "calls per step" in out, out
    rows = out.split("function\n", 1)[1].strip().splitlines()
    assert len(rows) == 5, out
    # The turn's own driver shows among the functions it spent time in, per step.
    assert "agentloop/" in out, out


def test_peer_runner_quick_on_the_agentloop_entry() -> None:
    out = run_script(str(BENCHMARKS / "peers" / "run.py"), "--quick", "--rounds", "1",
                     "--only", "FunctionModel", "--workloads", "w1", "w3")
    table = [line for line in out.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table[2:]]
    assert [row[0] for row in rows] == ["bare trio", "agentloop (FunctionModel)"], out
    for row in rows:
        # W1, its ratio, W3 and its ratio are figures; W4 was not run.
        assert all(cell.rstrip("x").replace(",", "").replace(".", "").isdigit()
                   for cell in row[1:5]), row
        assert row[5] == "n/a", row
    assert "error" not in out, out
