"""The Python blocks of ``docs/observability.md`` and ``docs/inspector.md`` run as written.

Each runs in a process of its own: the observability example sets OpenTelemetry's global
tracer provider, which a process can set only once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("observability.md", "inspector.md")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(name: str) -> list[str]:
    return BLOCK.findall((ROOT / "docs" / name).read_text())


def run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("name", DOCS)
def test_every_python_block_runs(name: str) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the examples need opentelemetry-sdk")
    for code in blocks(name):
        run(code)


def test_the_observability_example_prints_the_spans_it_says() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the example needs opentelemetry-sdk")
    [code] = blocks("observability.md")
    lines = run(code).splitlines()
    assert sorted(lines) == sorted([
        "invoke_agent s1 invoke_agent", "chat demo chat", "execute_tool add execute_tool",
        "chat demo chat",
    ])
