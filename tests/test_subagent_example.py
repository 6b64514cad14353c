"""The sub-agent example runs: two children work in parallel and the parent sums them up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_subagents_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "subagents.py")],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0] == "+ parent"
    children = [line.split()[1] for line in lines if line.startswith("  + sub-")]
    assert len(children) == 2
    # Both children run before either finishes: the two delegations overlap.
    running = [lines.index(f"    {c}: running") for c in children]
    idle = [lines.index(f"    {c}: idle") for c in children]
    assert max(running) < min(idle)
    # Each child is gone before the parent turns idle, and the answer holds both results.
    assert all(lines.index(f"  - {c}") < lines.index("  parent: idle") for c in children)
    assert "My helpers say: 2, 3 and 5. / Jupiter." in lines
    # The tree's observer saw each child's answer in that child's log.
    answered = sorted(line.split()[0] for line in lines if " answered: " in line)
    assert answered == sorted(children)
    assert {line.split(" answered: ")[1] for line in lines if " answered: " in line} == {
        "2, 3 and 5.", "Jupiter.",
    }
    assert lines[-1] == "- parent"
