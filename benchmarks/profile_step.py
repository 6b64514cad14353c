"""Where one agentloop step goes: the top functions of a W1 turn, per step.

    python benchmarks/profile_step.py [--model function|scripted] [--top N] [--steps N]
                                      [--sort tottime|cumtime|ncalls] [--cpu-clock] [--quick]

Profiles (cProfile) one turn of the peer benchmarks' W1 workload (each step streams 10 text
chunks and calls one trivial tool; the last step answers without a tool) on the working tree,
after a warm-up turn, and prints the functions sorted by their own time. Every figure is
divided by the number of steps: calls per step, microseconds of own and cumulative time per
step. The header compares the calls per step with the bare trio loop doing the same logical
work, profiled the same way. cProfile adds its own cost to every call, so read the times as
shares and the call counts as exact. On a busy machine, ``--cpu-clock`` times with the
process's CPU time, so time spent descheduled is not charged to whatever function was running
(at a higher cost per call, which favours functions called often).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import _common as c
import bench_agentloop
import bench_floor

import agentloop

ROOT = Path(__file__).resolve().parent.parent


def where(key: tuple[str, int, str]) -> str:
    """``path:line(function)``, with the path cut to the package it belongs to."""
    path, line, name = key
    if path == "~":
        return name  # a builtin, shown as cProfile names it
    p = Path(path)
    for anchor in (ROOT, *map(Path, sys.path)):
        try:
            p = p.relative_to(anchor)
            break
        except ValueError:
            continue
    return f"{p}:{line}({name})"


def make_profiler(cpu: bool) -> cProfile.Profile:
    # The CPU clock is a system call per reading (several times the cost of the default
    # clock), but it does not charge the time the process is descheduled to whatever ran.
    return cProfile.Profile(time.process_time_ns, 1e-9) if cpu else cProfile.Profile()


async def profile_turn(model: str, steps: int, cpu: bool) -> tuple[pstats.Stats, float]:
    """Profile one turn after a warm-up turn; also return its wall time unprofiled (us/step)."""
    profiler = make_profiler(cpu)
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(bench_agentloop.noop, concurrency="parallel")
        plain = 0.0
        for i, profiled in enumerate([False, False, True]):
            unregister = rt.llm.register("bench", bench_agentloop.make_model(model, steps))
            handle = await rt.agents.create(session_id=f"p{i}",
                                            agent_options=bench_agentloop.OPTIONS)
            async with handle:
                agent = handle.agent
                start = time.perf_counter_ns()
                if profiled:
                    profiler.enable()
                agent.followup("go")
                await agent.wait_idle()
                if profiled:
                    profiler.disable()
                else:
                    plain = (time.perf_counter_ns() - start) / steps / 1000
                assert agent.session.events[-1].data["reason"] == "completed"
            unregister()
    return pstats.Stats(profiler), plain


async def floor_calls(cpu: bool) -> tuple[float, float]:
    """Function calls per step of the bare trio loop (a full-size turn), profiled the same way."""
    turn = bench_floor.w1_turn(c.Sizes(quick=False), trio.lowlevel.checkpoint)
    await turn()
    profiler = make_profiler(cpu)
    profiler.enable()
    await turn()
    profiler.disable()
    return calls_per_step(pstats.Stats(profiler), c.STEPS)


def calls_per_step(stats: Any, steps: int) -> tuple[float, float]:
    """Calls of Python functions, and of everything including builtins, per step."""
    python = sum(nc for key, (_cc, nc, *_rest) in stats.stats.items() if key[0] != "~")
    return python / steps, float(stats.total_calls) / steps


def report(stats: Any, steps: int, top: int, sort: str, plain: float,
           floor: tuple[float, float]) -> None:
    python, every = calls_per_step(stats, steps)
    print(f"agentloop {agentloop.__version__} (working tree), trio {trio.__version__}, "
          f"python {sys.version.split()[0]}")
    print(f"one {steps}-step turn: {plain:.1f} us/step unprofiled, "
          f"{stats.total_tt / steps * 1e6:.1f} us/step profiled")
    print(f"calls per step: {python:.1f} Python functions ({python / floor[0]:.1f}x the bare "
          f"trio loop's {floor[0]:.1f}), {every:.1f} with builtins (loop: {floor[1]:.1f})")
    rows = []
    for key, (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append((nc / steps, tt / steps * 1e6, ct / steps * 1e6, where(key)))
    column = {"ncalls": 0, "tottime": 1, "cumtime": 2}[sort]
    rows.sort(key=lambda r: r[column], reverse=True)
    print(f"\ntop {top} by {sort}, per step:")
    print(f"{'calls':>8} {'own us':>8} {'cum us':>8}  function")
    for calls, own, cum, name in rows[:top]:
        print(f"{calls:8.2f} {own:8.2f} {cum:8.2f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["function", "scripted"], default="function")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--steps", type=int, default=c.STEPS)
    parser.add_argument("--sort", choices=["tottime", "cumtime", "ncalls"], default="tottime")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="profile with the process CPU clock (for a shared machine)")
    parser.add_argument("--quick", action="store_true", help="a 3-step turn and the top 5")
    args = parser.parse_args()
    steps, top = (3, 5) if args.quick else (args.steps, args.top)
    if steps < 2:
        parser.error("a turn needs at least 2 steps (one with a tool call, the last without)")

    async def go() -> None:
        stats, plain = await profile_turn(args.model, steps, args.cpu_clock)
        report(stats, steps, top, args.sort, plain, await floor_calls(args.cpu_clock))

    trio.run(go)


if __name__ == "__main__":
    main()
