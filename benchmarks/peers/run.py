"""Run the peer benchmarks interleaved, in fresh processes, and print the table of medians.

    python benchmarks/peers/run.py [--rounds N] [--quick] [--json PATH] [--only NAME ...]

Run it with the interpreter of the virtualenv that holds the ``bench`` extra (see
``benchmarks/README.md``, "Beside the peers"). Every (entry, workload) pair runs in a process
of its own, one process at a time; each round runs every workload over every entry, the order
of the entries rotated by one each round, so no entry always runs first or after the same
neighbour. An entry whose packages are not importable is skipped with a note. The agentloop
entries import the working tree (the repository root goes first on ``PYTHONPATH``).

Figures: W1 is the median over rounds of each process's median microseconds per step; W2 the
median over rounds of each process's median wall time of a batch of concurrent runs, shown per
run (ms) and per step (us), with the median peak traced bytes per run; W3 the median over
rounds of traced bytes per idle agent; W4 the median over rounds of each process's
ratio of per-step time at 1,000 to 10 messages. Ratios are to the bare trio floor of the same
run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FLOOR = "bare trio"
WORKLOADS = ("w1", "w2", "w3", "w4")


class Entry:
    def __init__(self, label: str, script: str, entry: str | None, probe: str) -> None:
        self.label = label
        self.script = script
        self.entry = entry
        self.probe = probe

    def argv(self, python: str, workload: str, quick: bool) -> list[str]:
        out = [python, str(HERE / self.script), "--workload", workload]
        if self.entry:
            out += ["--entry", self.entry]
        return out + (["--quick"] if quick else [])


ENTRIES = [
    Entry(FLOOR, "bench_floor.py", "trio", "trio"),
    Entry("bare asyncio", "bench_floor.py", "asyncio", "trio"),
    Entry("agentloop (FunctionModel)", "bench_agentloop.py", "function", "agentloop.testing"),
    Entry("agentloop (ScriptedModel)", "bench_agentloop.py", "scripted", "agentloop.testing"),
    Entry("AutoGen AgentChat", "bench_autogen.py", None, "autogen_agentchat"),
    Entry("LangGraph", "bench_langgraph.py", None, "langgraph"),
    Entry("pydantic-ai", "bench_pydantic_ai.py", None, "pydantic_ai"),
    Entry("OpenAI Agents SDK", "bench_openai_agents.py", None, "agents"),
]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    # Traced memory and timings must not depend on whether bytecode was cached before.
    env.pop("PYTHONDEVMODE", None)
    env.pop("PYTHONTRACEMALLOC", None)
    return env


def available(python: str, entry: Entry, env: dict[str, str]) -> str | None:
    """``None`` when the entry can run, else why not."""
    done = subprocess.run([python, "-c", f"import {entry.probe}"], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or ["import failed"])[-1]


def run_one(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    result: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT "):]))
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        result["error"] = f"exit {done.returncode}: {tail}"
    return result


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version()}


def summarise(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for label, by_workload in raw.items():
        row: dict[str, Any] = {"errors": []}
        for workload, results in by_workload.items():
            good = [r for r in results if "error" not in r]
            row["errors"] += [f"{workload}: {r['error']}" for r in results if "error" in r]
            if not good:
                continue
            row.setdefault("versions", good[0].get("versions", {}))
            if workload == "w1":
                row["w1_us"] = statistics.median(
                    statistics.median(r["us_per_step"]) for r in good)
                row["w1_rounds"] = [statistics.median(r["us_per_step"]) for r in good]
            elif workload == "w2":
                walls = [statistics.median(r["wall_ms"]) for r in good]
                runs, steps = good[0]["runs"], good[0]["steps"]
                row["w2_wall_ms"] = statistics.median(walls)
                row["w2_rounds"] = walls
                row["w2_size"] = [runs, steps]
                row["w2_ms_per_run"] = row["w2_wall_ms"] / runs
                row["w2_us_per_step"] = row["w2_wall_ms"] * 1000 / (runs * steps)
                row["w2_peak_bytes"] = statistics.median(r["peak_bytes_per_run"] for r in good)
            elif workload == "w3":
                row["w3_bytes"] = statistics.median(r["bytes_per_agent"] for r in good)
                row["w3_rounds"] = [r["bytes_per_agent"] for r in good]
            else:
                row["w4_ratio"] = statistics.median(r["ratio"] for r in good)
                row["w4_small_us"] = statistics.median(r["small_us"] for r in good)
                row["w4_large_us"] = statistics.median(r["large_us"] for r in good)
                row["w4_sizes"] = [good[0]["small"], good[0]["large"]]
        out[label] = row
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    floor = rows.get(FLOOR, {})
    w1_floor, w3_floor = floor.get("w1_us"), floor.get("w3_bytes")
    w2_floor = floor.get("w2_us_per_step")
    sizes = next((r["w4_sizes"] for r in rows.values() if "w4_sizes" in r), [10, 1000])
    runs = next((r["w2_size"][0] for r in rows.values() if "w2_size" in r), 500)
    lines = [
        (f"| Entry | W1 us/step | W1 / floor | W2 ms/run ({runs:,} at once) | W2 us/step "
         f"| W2 / floor | W2 peak KB/run | W3 KB/agent | W3 / floor "
         f"| W4 {sizes[1]:,} / {sizes[0]} msgs |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cell(value: float | None, fmt: str, unit: str = "") -> str:
        return "n/a" if value is None else format(value, fmt) + unit

    for label, row in rows.items():
        w1, w3, w4 = row.get("w1_us"), row.get("w3_bytes"), row.get("w4_ratio")
        w2, w2_run, w2_peak = (row.get("w2_us_per_step"), row.get("w2_ms_per_run"),
                               row.get("w2_peak_bytes"))
        lines.append(
            f"| {label} | {cell(w1, ',.1f')} "
            f"| {cell(w1 / w1_floor if w1 and w1_floor else None, ',.1f', 'x')} "
            f"| {cell(w2_run, ',.2f')} | {cell(w2, ',.1f')} "
            f"| {cell(w2 / w2_floor if w2 and w2_floor else None, ',.1f', 'x')} "
            f"| {cell(w2_peak / 1024 if w2_peak else None, ',.1f')} "
            f"| {cell(w3 / 1024 if w3 else None, '.2f')} "
            f"| {cell(w3 / w3_floor if w3 and w3_floor else None, '.1f', 'x')} "
            f"| {cell(w4, '.2f', 'x')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks, not figures")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for the entries (default: this one)")
    parser.add_argument("--only", nargs="*", default=None, metavar="LABEL",
                        help="run only the entries whose label contains one of these")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    args = parser.parse_args()

    env = child_env()
    entries = [e for e in ENTRIES if e.label == FLOOR or not args.only
               or any(o.lower() in e.label.lower() for o in args.only)]
    skipped: dict[str, str] = {}
    for e in list(entries):
        why = available(args.python, e, env)
        if why is not None:
            skipped[e.label] = why
            entries.remove(e)
    for label, why in skipped.items():
        print(f"skipped {label}: {why}", file=sys.stderr)

    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        e.label: {w: [] for w in args.workloads} for e in entries
    }
    t0 = time.monotonic()
    for r in range(args.rounds):
        order = entries[r % len(entries):] + entries[: r % len(entries)]
        for workload in args.workloads:
            for e in order:
                result = run_one(e.argv(args.python, workload, args.quick), env, args.timeout)
                raw[e.label][workload].append(result)
                if "error" in result:
                    print(f"round {r + 1} {workload} {e.label}: {result['error']}",
                          file=sys.stderr)
        print(f"round {r + 1}/{args.rounds} done ({time.monotonic() - t0:.0f} s)",
              file=sys.stderr)

    rows = summarise(raw)
    info = machine()
    load_after = os.getloadavg()
    print(f"\n{info['cpu']}, {info['cpus']} cpus, Python {info['python']}; "
          f"{started:%Y-%m-%d %H:%M} UTC; {args.rounds} rounds"
          f"{' (quick sizes)' if args.quick else ''}; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    print(table(rows))
    print()
    for label, row in rows.items():
        versions = ", ".join(f"{k} {v}" for k, v in row.get("versions", {}).items()
                             if k != "python")
        print(f"- {label}: {versions or 'standard library only'}")
        for error in row["errors"]:
            print(f"  error: {error}")
    for label, why in skipped.items():
        print(f"- {label}: skipped ({why})")

    if args.json is not None:
        args.json.write_text(json.dumps({
            "date": f"{started:%Y-%m-%d %H:%M} UTC", "machine": info, "rounds": args.rounds,
            "quick": args.quick, "load_average": [load_before[0], load_after[0]],
            "floor": FLOOR, "results": rows, "skipped": skipped,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
