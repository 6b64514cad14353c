"""Six plugins with one lifecycle bug each, from ``docs/testing.md``, as a user would test them.

Each property uses only the kit's defaults (``operations()``, ``model_scripts()``, ``seeds()``
and ``run_race``'s defaults). On the racy plugin it must fail within 300 examples, naming the
operations and the seed; on the fixed plugin the same property must pass. The usage meter of
the page's first example (a lost update across an await) joins them with a property on the
defaults too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from agentloop.events import ToolPreExecute
from agentloop.testing import run_race
from agentloop.testing import strategies as als

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
KINDS = ("budget", "workspaces", "desk", "drafts", "helpers")


def examples() -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL):
        head = re.match(r"# example: (\w+) (racy|property|fix)\n", block)
        if head:
            found[(head[1], head[2])] = block
    return found


# The hunts here need no shrinking: finding the failure within the budget is what is tested.
settings.register_profile("kit-plugins", settings.get_profile("ci"), phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _no_shrinking() -> Iterator[None]:
    before = settings.default
    settings.load_profile("kit-plugins")
    yield
    settings.register_profile("kit-plugins-before", before)
    settings.load_profile("kit-plugins-before")


def namespace(name: str, *parts: str) -> dict[str, Any]:
    code = examples()
    ns: dict[str, Any] = {"__name__": f"docs_testing_{name}"}
    for part in parts:
        exec(compile(code[(name, part)], f"{DOC}:{name}-{part}", "exec"), ns)
    return ns


def the_property(ns: dict[str, Any]) -> Any:
    [test] = [v for k, v in ns.items() if k.startswith("test_") and callable(v)]
    return test


pytestmark = pytest.mark.usefixtures("quiet_agentloop")


def test_the_page_has_every_kind_racy_property_and_fix() -> None:
    code = examples()
    for kind in KINDS:
        for part in ("racy", "property", "fix"):
            assert (kind, part) in code, (kind, part)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_defaults_find_the_racy_plugin(kind: str) -> None:
    test = the_property(namespace(kind, "racy", "property"))
    with pytest.raises(AssertionError) as info:
        test()
    report = str(info.value)
    assert "run_race failed" in report and "seed=" in report, report


# The budget's fix passes since the core race the kit found (a keep-inbox cancel landing
# between a steer's admission and the driver taking the turn stranded the steer) was fixed; the
# drafts' fix since ``race.sessions`` shows a session resumed after a close once (its two
# Session objects made every message of it count twice).
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_fixed_plugin_passes(kind: str) -> None:
    the_property(namespace(kind, "racy", "property", "fix"))()


def _meter_property(meter_class: type[Any]) -> Any:
    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate])
    @given(ops=als.operations(), script=als.model_scripts(), seed=als.seeds())
    def test_the_meter_counts_every_call(ops: Any, script: Any, seed: int) -> None:
        meter = meter_class()
        entered: list[str] = []

        def build(ctx: Any) -> None:
            ctx.events.on(ToolPreExecute, lambda e: entered.append(e.call.id), priority=1)

        def check(race: Any) -> None:
            assert meter.calls == len(entered), f"counted {meter.calls} of {len(entered)}"

        run_race(ops, script=script, seed=seed, build=build, plugins=[meter.plugin],
                 check=check)

    return test_the_meter_counts_every_call


def _meter(fixed: bool) -> type[Any]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    ns: dict[str, Any] = {"__name__": "docs_testing_meter"}
    for i in (0, 2) if fixed else (0,):
        exec(compile(blocks[i], f"{DOC}:block{i}", "exec"), ns)
    meter: type[Any] = ns["UsageMeter"]
    return meter


@pytest.mark.slow
def test_the_defaults_find_the_lost_update_of_the_meter() -> None:
    with pytest.raises(AssertionError, match=r"counted \d+ of \d+"):
        _meter_property(_meter(fixed=False))()


@pytest.mark.slow
def test_the_fixed_meter_passes_on_the_defaults() -> None:
    _meter_property(_meter(fixed=True))()
