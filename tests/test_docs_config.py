"""Every TOML block of the docs is a config agentloop loads; the PostgreSQL page's code runs.

A page that shows configuration shows one that works: each fenced ``toml`` block of README.md
and docs/*.md is written to a file and loaded with ``load_config``. The Python blocks of
docs/postgres.md run here without a server (they do nothing then) and against a real one in
test_postgres.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop import load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def toml_blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for n, body in enumerate(re.findall(r"```toml\n(.*?)```", page.read_text(), re.DOTALL)):
            found.append((page.name, n, body))
    return found


def test_the_postgres_page_shows_its_configuration() -> None:
    assert [name for name, _, _ in toml_blocks()].count("postgres.md") >= 2


@pytest.mark.parametrize(("page", "n", "body"), toml_blocks(),
                         ids=[f"{p}-{n}" for p, n, _ in toml_blocks()])
def test_a_toml_block_of_the_docs_loads(tmp_path: Path, page: str, n: int, body: str) -> None:
    path = tmp_path / "agentloop.toml"
    path.write_text(body)
    load_config(path)


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.DOTALL)


@pytest.mark.slow
def test_the_postgres_page_code_runs_without_a_server() -> None:
    [block] = python_blocks("postgres.md")
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
