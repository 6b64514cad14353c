"""The worked example of ``docs/testing.md`` is executed as written: its property fails on the
racy plugin and passes on the fixed one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

# Slow: the worked examples run hypothesis searches in subprocesses.
pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


def test_the_page_has_the_racy_plugin_the_property_and_the_fix() -> None:
    found = blocks()
    assert "self.calls = calls + 1" in found[0]
    assert "def test_the_meter_counts_every_call" in found[1]
    assert "self.calls += 1" in found[2]


def run_example(*which: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "docs_testing"}
    code = blocks()
    for i in which:
        exec(compile(code[i], f"{DOC}:block{i}", "exec"), namespace)
    return namespace


def test_the_race_in_the_racy_plugin_is_caught() -> None:
    namespace = run_example(0, 1)
    with pytest.raises(AssertionError) as info:
        namespace["test_the_meter_counts_every_call"]()
    report = str(info.value)
    assert re.search(r"the meter counted (\d+) of (\d+) calls", report), report
    assert "replay:" in report and "Followup(" in report and "seed=" in report


def test_the_fixed_plugin_passes() -> None:
    namespace = run_example(0, 1, 2)
    namespace["test_the_meter_counts_every_call"]()


def test_the_race_test_on_the_defaults_runs() -> None:
    [block] = [b for b in blocks() if "def test_every_turn_ends_and_every_call_is_answered" in b]
    namespace: dict[str, Any] = {"__name__": "docs_testing_defaults"}
    exec(compile(block, f"{DOC}:defaults", "exec"), namespace)
