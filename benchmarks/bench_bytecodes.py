"""Bytecodes per step of the yardstick's W1 turn, split by whose code runs them: the
runtime's, trio's, the standard library's and the workload's (the test model, the tool and
the floor loops).

    python benchmarks/bench_bytecodes.py [--subscribers N] [--pythonpath TREE [--python PY]]

The yardstick's ratio to its trio floor mixes two costs: the runtime's own code, and the trio
machinery the design card's shape asks for (an actor task per agent, a task per tool call
the actor waits for, so three passes of trio's run loop a step where the floor makes one).
Counting the bytecodes each step executes (``sys.settrace`` with opcode events, in a child
process: 1 and then 3 turns of 50 steps, the difference divided by 100 steps, so start-up
and imports cancel out) tells them apart: the ``trio`` column of "floor in the shape" less
that of the floor is the shape's, whoever keeps it. The counts do not move with the
machine's load; trio's column moves by about 1% between runs (trio runs a pass's tasks in an
order it picks at random). They are not time (a bytecode of trio's run loop is not one of a
dict lookup), so read them beside ``bench_instructions.py`` and the yardstick.

``--pythonpath`` adds a row for another checkout (first on ``sys.path``, as
``bench_instructions.py`` does), run by ``--python`` when that tree needs an interpreter of
its own (other dependencies). Modules of the compiled build run as native code, which no
bytecode counts: the script says so when the tree it counts has any.
About 20 seconds.

With ``--subscribers 1`` it also says what the subscriber goal (a step with one durable
subscriber at most 1.25x one without) leaves the runtime: the goal's margin, less what trio,
the standard library and the reader's own loop add to a step whoever makes the events.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

from bench_instructions import STEPS, agentloop_turns, floor_turns, shape_turns

OWNERS = ("agentloop", "trio", "Python", "workload")
HERE = os.path.dirname(os.path.abspath(__file__))


def owner_of(filename: str, roots: list[tuple[str, str]]) -> str:
    """Whose code a code object's file is: code that attrs or the runtime generate has a
    ``<...>`` name saying for which class."""
    if filename.startswith("<"):
        if "agentloop" in filename or filename.startswith(("<stored_maker", "<quick_init")):
            return "agentloop"
        if "trio." in filename or "outcome." in filename:
            return "trio"
        return "Python"
    for root, owner in roots:
        if filename.startswith(root):
            return owner
    return "Python"


def child(what: str, turns: int, subscribers: int) -> None:
    """Runs ``turns`` turns of ``what`` under an opcode tracer; prints the counts by owner."""
    import outcome
    import trio

    import agentloop

    roots = [
        (HERE + os.sep, "workload"),
        (os.path.dirname(agentloop.__file__) + os.sep, "agentloop"),
        (os.path.dirname(trio.__file__) + os.sep, "trio"),
        (os.path.dirname(outcome.__file__) + os.sep, "trio"),  # the outcomes trio hands out
    ]
    counts: Counter[str] = Counter()
    owners: dict[Any, str] = {}

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            owner = owners.get(code)
            if owner is None:
                owner = owners[code] = owner_of(code.co_filename, roots)
            counts[owner] += 1
        return tracer

    run: Any
    if what == "floor":
        run, run_args = floor_turns, (turns,)
    elif what == "shape":
        run, run_args = shape_turns, (turns,)
    else:
        run, run_args = agentloop_turns, (turns, subscribers)
    sys.settrace(tracer)
    try:
        trio.run(run, *run_args)
    finally:
        sys.settrace(None)
    native = sorted(
        name for name, module in list(sys.modules.items())
        if name.startswith("agentloop.") and str(getattr(module, "__file__", "")).endswith(
            (".so", ".pyd"))
    )
    print(json.dumps({"counts": counts, "native": native, "python": sys.version.split()[0]}))


def measure(
    what: str, subscribers: int = 0, pythonpath: str | None = None, python: str | None = None,
) -> tuple[dict[str, float], list[str], str]:
    """Bytecodes per step of ``what`` by owner, the compiled modules it ran, the Python."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pythonpath, os.path.join(pythonpath, "plugins"),
                        env.get("PYTHONPATH")) if p
        )
    found = []
    for turns in (1, 3):
        out = subprocess.run(
            [python or sys.executable, os.path.abspath(__file__), "--child", what, str(turns),
             str(subscribers)],
            env=env, capture_output=True, text=True, check=False, cwd=HERE,
        )
        if out.returncode != 0:
            raise SystemExit(f"the {what} run failed:\n{out.stderr[-2000:]}")
        found.append(json.loads(out.stdout.splitlines()[-1]))
    few, many = (f["counts"] for f in found)
    step = {o: (many.get(o, 0) - few.get(o, 0)) / (2 * STEPS) for o in OWNERS}
    return step, found[-1]["native"], found[-1]["python"]


# What a step of the W1 turn appends, but for the last of its fifty: a request header, ten
# text chunks, a tool-call chunk, the reply, the call and its result.
EVENTS_PER_STEP = 15
SUBSCRIBER_GOAL = 1.25  # issue 31: a step with one durable subscriber, x a step without


def subscriber_budget(ours: dict[str, float], subs: dict[str, float]) -> str:
    """What the subscriber goal leaves the runtime, in bytecodes: the goal's margin over a
    step without a subscriber, less what trio, the standard library and the reader's own
    loop add whoever delivers the events (trio's receive and ``async for``)."""
    margin = (SUBSCRIBER_GOAL - 1) * sum(ours.values())
    others = sum(subs[o] - ours[o] for o in OWNERS if o != "agentloop")
    left = margin - others
    runtime = subs["agentloop"] - ours["agentloop"]
    return (
        f"the subscriber goal ({SUBSCRIBER_GOAL}x) leaves {margin:,.0f} bytecodes a step for "
        f"all a subscriber adds; trio, Python and the reader's loop add {others:,.0f}, which "
        f"leaves the runtime {left:,.0f} ({left / EVENTS_PER_STEP:,.0f} an event) to make "
        f"the step's {EVENTS_PER_STEP} events and hand them over; it spends {runtime:,.0f} "
        f"({runtime / EVENTS_PER_STEP:,.0f} an event)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=0)
    parser.add_argument("--pythonpath", help="a checkout to count beside the installed one")
    parser.add_argument("--python", help="the interpreter for --pythonpath's tree")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    if args.python and not args.pythonpath:
        parser.error("--python runs --pythonpath's tree: give both")
    floor, _, version = measure("floor")
    shape, _, _ = measure("shape")
    rows: list[tuple[str, dict[str, float]]] = [
        ("floor (bare trio)", floor), ("floor in the shape", shape),
    ]
    ours, native, _ = measure("agentloop")
    rows.append(("agentloop", ours))
    notes = [("agentloop", native)]
    if args.subscribers:
        plural = "s" if args.subscribers > 1 else ""
        subs, _, _ = measure("agentloop", args.subscribers)
        rows.append((f"agentloop + {args.subscribers} subscriber{plural}", subs))
    if args.pythonpath:
        other, other_native, _ = measure("agentloop", 0, args.pythonpath, args.python)
        name = f"agentloop at {os.path.basename(os.path.normpath(args.pythonpath))}"
        rows.append((name, other))
        notes.append((name, other_native))
    print(f"bytecodes per step of the yardstick's W1 turn (Python {version}, "
          f"{STEPS}-step turns)")
    width = max(len(name) for name, _ in rows) + 2
    print(" " * width + "".join(f"{o:>11}" for o in OWNERS) + f"{'total':>11}")
    for name, step in rows:
        cells = "".join(f"{step[o]:>11,.0f}" for o in OWNERS)
        print(f"{name:<{width}}{cells}{sum(step.values()):>11,.0f}")
    print(f"the shape's own trio work: {shape['trio'] - floor['trio']:,.0f} bytecodes a step "
          f"(floor in the shape less the floor)")
    if args.subscribers == 1:
        print(subscriber_budget(ours, subs))
    for name, modules in notes:
        if modules:
            print(f"{name}: {len(modules)} compiled modules ran as native code and are not "
                  f"counted ({', '.join(m.removeprefix('agentloop.') for m in modules)})")


if __name__ == "__main__":
    main()
