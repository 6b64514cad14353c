"""The race kit's mutation score: lifecycle bugs fixed in the core, planted back one at a time.

Each mutant rewrites one function of the runtime (its code object, so every reference sees
it) back to the buggy behaviour a fix removed. For each, ``run_race`` on the kit's default
strategies (operations, model scripts, scheduler seeds) must find a failing example within
300 examples, the failure must come from the kit's checkers, the printed seed must replay it
exactly, and the same example must pass once the fix is back. The kill rate is printed; it
must be 100%.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from agentloop import _agent, _agents, _bus, _inbox, _scheduler, _session
from agentloop.testing import run_race
from agentloop.testing import strategies as als

BUDGET = 300


@attrs.frozen
class Mutant:
    """``module.qualname`` with each ``old`` snippet of its source replaced by ``new``."""

    name: str
    module: Any
    qualname: str
    edits: tuple[tuple[str, str], ...]


def _function(m: Mutant) -> Any:
    owner: Any = m.module
    *path, leaf = m.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = owner.__dict__[leaf] if isinstance(owner, type) else getattr(owner, leaf)
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _source(m: Mutant) -> str:
    """The function's source, read from its module's ``.py`` file: the compiled build keeps
    the file beside its extension, whose functions have no source of their own."""
    fn = _function(m)
    if inspect.isfunction(fn):
        return textwrap.dedent(inspect.getsource(fn))
    name = m.module.__name__.rsplit(".", 1)[-1]
    text = Path(m.module.__file__).with_name(f"{name}.py").read_text()
    node: Any = ast.parse(text)
    for part in m.qualname.split("."):
        node = next(n for n in node.body if getattr(n, "name", None) == part)
    return textwrap.dedent(ast.get_source_segment(text, node, padded=True) or "")


@contextlib.contextmanager
def planted(mutants: tuple[Mutant, ...]) -> Iterator[None]:
    """Swap in the mutated code of each function for the block (every caller sees it)."""
    saved: list[tuple[Any, Any]] = []
    compiled = [m.module.__name__ for m in mutants if not inspect.isfunction(_function(m))]
    if compiled:
        pytest.skip(f"{', '.join(sorted(set(compiled)))} compiled (mypyc): its functions "
                    f"have no code to swap a mutant into")
    try:
        for m in mutants:
            fn = _function(m)
            source = textwrap.dedent(inspect.getsource(fn))
            for old, new in m.edits:
                assert old in source, f"{m.name}: {old!r} is no longer in {m.qualname}"
                source = source.replace(old, new)
            namespace: dict[str, Any] = {}
            exec(compile(source, f"<mutant {m.name}>", "exec"), fn.__globals__, namespace)
            saved.append((fn, fn.__code__))
            fn.__code__ = namespace[fn.__name__].__code__
        yield
    finally:
        for fn, code in saved:
            fn.__code__ = code


OFF = "if False:"

MUTANTS: dict[str, tuple[Mutant, ...]] = {
    "stranded steer (a keep-inbox cancel drops the wake a kept steer needs)": (
        Mutant("steer", _agent, "Agent.cancel", (
            ("self._wake_flag = keep_inbox and bool(self._inbox.waking)",
             "self._wake_flag = False"),
        )),
        # The driver's own look at pending steers (a cancel before the turn began) goes too.
        Mutant("steer-drive", _agent, "Agent._drive", (
            ("if self._wake_flag or inbox.next_turn or inbox.waking:",
             "if self._wake_flag or inbox.next_turn:"),
        )),
    ),
    "a tool body started after its turn's cancel": (
        Mutant("start", _scheduler, "_Run._start", (
            ("if scope is not None and scope.cancel_called:", OFF),
        )),
        Mutant("execute", _scheduler, "_Run._execute", (
            ("await trio.lowlevel.checkpoint_if_cancelled()", "pass"),
        )),
    ),
    "approve and cancel in one tick start the body": (
        Mutant("execute", _scheduler, "_Run._execute", (
            ("await trio.lowlevel.checkpoint_if_cancelled()", "pass"),
        )),
    ),
    "a turn left open by a disposal past the grace": (
        Mutant("turn", _agent, "Agent._turn", ((
            (
                "        turn.reason = \"suspended\" if self._session.awaiting_approval "
                "else \"disposed\"\n"
                "        with trio.CancelScope(shield=True):\n"
                "            await self._close_turn(turn)\n"
                "        raise"
            ),
            "        raise",
        ),)),
    ),
    "same-id contenders not arbitrated: the loser's rollback takes the winner's lease": (
        Mutant("claim", _agents, "Creation._claim_lease", (
            ("while (held := leases.get(session_id)) is not None:", "while False:"),
        )),
    ),
    "status lags disposal (it reads disposed only once the actor ends)": (
        Mutant("stop", _agent, "Agent._stop", (
            ('self._set_status("disposed")', "pass"),
        )),
    ),
    "a lost Lagged marker": (
        Mutant("mark", _bus, "_Feed._mark", (("self.put(marker)", "pass"),)),
    ),
    "a cancelled turn that finished its work ends completed": (
        Mutant("precedence", _agent, "Agent._turn", (
            ('if _cancel_called(cancel) and turn.reason != "error":', OFF),
        )),
    ),
    "a cancel that keeps the steers it should discard": (
        Mutant("discard", _inbox, "InboxState.discard_all", (
            ("for target in TARGETS:", 'for target in ("next-turn",):'),
        )),
    ),
    "a removed message that never reports its fate": (
        Mutant("remove", _inbox, "InboxState.discard", (
            ("if bus.has_listeners(InboxDiscarded):",
             'if outcome != "canceled" and bus.has_listeners(InboxDiscarded):'),
        )),
    ),
    "input sent during a turn's last step is never run (the latch is ignored)": (
        Mutant("latch", _agent, "Agent._drive", (
            ("if self._wake_flag or inbox.next_turn or inbox.waking:", "if inbox.next_turn:"),
        )),
    ),
    "a crash leaves the resumed turn open": (
        Mutant("recover", _session, "recover_crashed_turn", (
            ('    """\n', '    """\n    return\n'),
        )),
    ),
    # Reached through a slow agent/step-result hook with a stop inside it (the strategies'
    # held pattern), or a close armed at the step result.
    "calls left unanswered when a turn ends between the anchor and the tools": (
        Mutant("close", _scheduler, "close_unanswered", (
            ("awaiting = ", "return\n    awaiting = "),
        )),
    ),
}

ANCHORED = MUTANTS["calls left unanswered when a turn ends between the anchor and the tools"]


def test_calls_left_unanswered_are_caught_by_a_slow_step_result_hook() -> None:
    ops = [als.Hold("step-result", 2.0), als.Followup(0), als.Advance(0.5), als.Cancel(0)]
    script = [als.CallTools(("fast", "slow"))]
    with planted(ANCHORED), pytest.raises(AssertionError, match="never got a tool/result"):
        run_race(ops, script=script)
    run_race(ops, script=script)


def _same(report: str) -> str:
    # Message ids are fresh uuids in every run; everything else must read the same.
    return re.sub(r"msg_[0-9a-f]+", "msg_*", report)


def hunt(mutants: tuple[Mutant, ...]) -> tuple[int, int, str, Callable[[], None]] | None:
    """Search the defaults for a failure under ``mutants``: (examples, seed, report, replay)."""
    tried = [0]
    found: list[tuple[int, int, str, Callable[[], None]]] = []

    @settings(max_examples=BUDGET, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(ops=als.operations(), script=als.model_scripts(), seed=als.seeds())
    def search(ops: list[Any], script: list[Any], seed: int) -> None:
        tried[0] += 1
        try:
            run_race(ops, script=script, seed=seed)
        except AssertionError as exc:
            found.append((tried[0], seed, str(exc),
                          lambda: run_race(ops, script=script, seed=seed)))
            raise

    with planted(mutants), contextlib.suppress(AssertionError):
        search()
    return found[0] if found else None


pytestmark = pytest.mark.usefixtures("quiet_agentloop")


def test_each_mutant_is_planted_where_the_fix_is() -> None:
    for name, mutants in MUTANTS.items():
        for m in mutants:
            source = _source(m)
            for old, _new in m.edits:
                assert old in source, (name, old)
    assert len(MUTANTS) >= 13


_CLEAN = "AGENTLOOP_MUTANTS_CLEAN_PROCESS"


@pytest.mark.slow
def test_the_default_strategies_kill_every_mutant(capsys: pytest.CaptureFixture[str]) -> None:
    if not os.environ.get(_CLEAN):
        # Measured in a process of its own: hypothesis draws some integers from constants it
        # reads in the project's own modules the process has imported, so which examples one
        # derandomized search meets depends on what other test modules import. The score is
        # of the kit's defaults; bench_kit_mutants.py measures them over many seeds.
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow",
             f"{__file__}::test_the_default_strategies_kill_every_mutant"],
            env={**os.environ, _CLEAN: "1"}, capture_output=True, text=True, check=False,
        )
        with capsys.disabled():
            print(done.stdout[-3000:])
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
        return
    started = time.monotonic()
    killed: dict[str, int] = {}
    survivors: list[str] = []
    for name, mutants in MUTANTS.items():
        found = hunt(mutants)
        if found is None:
            survivors.append(name)
            continue
        examples, seed, report, replay = found
        assert report.startswith("run_race failed: AssertionError"), (name, report)
        with planted(mutants), pytest.raises(AssertionError) as again:
            replay()
        assert _same(str(again.value)) == _same(report), f"{name}: seed {seed} did not replay"
        replay()  # the fixed runtime passes the very same example
        killed[name] = examples
    rate = len(killed) / len(MUTANTS)
    with capsys.disabled():
        print(f"\nkit mutation score: {len(killed)}/{len(MUTANTS)} killed ({rate:.0%}) in "
              f"{time.monotonic() - started:.0f} s")
        for name, examples in killed.items():
            print(f"  {examples:>4} examples  {name}")
        for name in survivors:
            print(f"     survived  {name}")
    assert not survivors, f"mutants the kit did not find within {BUDGET} examples: {survivors}"
