"""The README's examples run, and the quick start in the README is the example file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quick_start_is_the_example_file() -> None:
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "quickstart.py").read_text()
    body = example.split('"""\n\n', 1)[1]
    assert f"```python\n{body}```" in readme


def test_quick_start_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0] == "Let me add those. 2 + 3 = 5."
    assert lines[1] == "completed in turn 1"
    assert "turn/end {'turn': 1, 'reason': 'completed'}" in out
    assert lines[-1] == "3 + 4 = 7."
