"""Instructions per step of the yardstick's W1 turn, counted by valgrind: a figure that does
not move with the machine's load.

    python benchmarks/bench_instructions.py [--subscribers N] [--pythonpath TREE] [--caches]
    python benchmarks/bench_instructions.py --workload w2 [--pythonpath TREE] [--caches]
                                            [--collector-share]

On a shared machine the wall and CPU clocks move by 1.5x between minutes, so two trees a few
percent apart cannot be told apart by timing them. Counting instructions can: valgrind's
``callgrind`` runs the same turns in a child process twice (2 and 6 turns of 50 steps) and
the difference, divided by the 200 steps between them, is what a step costs, start-up and
imports cancelled out. Two runs of one tree agree within about 0.5%: trio runs the tasks
of each pass of its loop in an order it picks at random, and whether a step's actor runs
before or after its tool's task decides whether it waits a pass more; compare the mean of
a few runs, or pass ``--seed N``, which seeds that order (trio's scheduler's random
generator, a private of trio's: a benchmark's reach, never the library's) so that runs of
one tree agree to the instruction and two trees differ only by what their code does.
The same is done for the bare trio loop of the yardstick's floor (``floor_trio.py``'s W1,
written out below), so the ratio is the yardstick's W1 ratio counted in instructions. A
third loop is that floor in the design card's shape (an actor task fed by a channel, a
task per tool call): the least the shape itself costs.

Instructions are not time: a step's memory traffic and branches do not count the same, and
the ratio counted here runs below the timed one (8.1x counted when the yardstick timed 10.3x
on 2026-12-06). ``--caches`` shows why: it also counts valgrind's simulated first-level
cache misses per step, and the runtime's data misses are a larger multiple of the floor's
than its instructions are. Use it to compare two trees (``--pythonpath`` points at another
checkout, first on ``sys.path``), and the yardstick for the goal figures. The turn is the
yardstick's: ``FunctionModel`` with one checkpoint per model call, 10 text chunks and one
tool call a step (none on the last), a fresh agent per turn; ``--subscribers N`` adds N
durable subscribers reading every event.
``--workload w2`` counts the yardstick's W2 instead: 500 fresh agents each running a two-step
turn at once (a tool call, then the answer), beside the floor's 500 concurrent loops. Each
loop runs two repetitions twice, with and without the turns (the agents are made and closed
either way), so a run's figure is what its turn costs, creation and closing cancelled out.
With 500 turns in flight, Python's cyclic collector runs its young-generation passes over
what they hold; ``--collector-share`` counts the same runs with it disabled, so the
difference is its share (on 2026-12-07: about 10% of a W2 run here, 5% of the floor's).
Needs ``valgrind`` on ``PATH``; about 3 minutes (5 with ``--caches``; 2 for W2, 7 with
``--caches``, 4 more with ``--collector-share``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

STEPS = 50
SEED: int | None = None  # --seed: trio's batch order, fixed in every child
CHUNKS = [f"tok{i} " for i in range(10)]


async def agentloop_turns(turns: int, subscribers: int) -> None:
    import trio

    import agentloop
    from agentloop.events import SessionEventAppended

    async def observe(rt: Any, done: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with rt.events.subscribe(SessionEventAppended) as rx:
            task_status.started()
            async for appended in rx:
                if appended.event.type == "turn/end":
                    break
        done.set()

    options = agentloop.AgentOptions(provider="bench", model="zero-latency")
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(add, concurrency="parallel")
        model = agentloop_model()
        rt.llm.register("bench", model)
        for turn in range(turns):
            handle = await rt.agents.create(session_id=f"w1-{turn}", agent_options=options)
            async with handle, trio.open_nursery() as nursery:
                seen = [trio.Event() for _ in range(subscribers)]
                for done in seen:
                    await nursery.start(observe, rt, done)
                handle.agent.followup("go")
                await handle.agent.wait_idle()
                for done in seen:
                    await done.wait()
            model.requests.clear()


W2_AGENTS = 500
W2_REPS = 2


async def agentloop_w2(reps: int, run: bool) -> None:
    """W2's repetitions: 500 fresh agents made, then (with ``run``) one turn for each of them,
    all at once, then closed. A first agent's turn, in either case, warms the runtime up."""
    import trio

    import agentloop

    options = agentloop.AgentOptions(provider="bench", model="zero-latency")
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(add, concurrency="parallel")
        model = agentloop_model(None)
        rt.llm.register("bench", model)
        async with await rt.agents.create(session_id="w2-warm", agent_options=options) as warm:
            warm.agent.followup("go")
            await warm.agent.wait_idle()
        for rep in range(reps):
            handles = [
                await rt.agents.create(session_id=f"w2-{rep}-{i}", agent_options=options)
                for i in range(W2_AGENTS)
            ]
            if run:
                for handle in handles:
                    handle.agent.followup("go")
                for handle in handles:
                    await handle.agent.wait_idle()
            model.requests.clear()
            async with trio.open_nursery() as nursery:
                for handle in handles:
                    nursery.start_soon(handle.aclose)


async def floor_w2(reps: int, run: bool) -> None:
    """``floor_trio.py``'s W2: 500 two-step loops at once, each a task of its own."""
    import trio

    await floor_turn("go", direct, 2)
    for _ in range(reps):
        if run:
            async with trio.open_nursery() as nursery:
                for _ in range(W2_AGENTS):
                    nursery.start_soon(floor_turn, "go", direct, 2)


_MADE = [0]


async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def agentloop_model(steps: int | None = STEPS) -> Any:
    """The yardstick's model as agentloop's ``FunctionModel``: one checkpoint a call (the
    request's network read), the chunks, then a tool call on every step but the last of
    ``steps``, or, with ``steps=None`` (W2), unless the last message is a tool result."""
    import trio

    from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

    made = [0]

    async def stream(request: Any) -> AsyncIterator[Any]:
        await trio.lowlevel.checkpoint()
        if steps is None:
            want = request.messages[-1].role != "tool"
        else:
            want = request.step < steps
        for chunk in CHUNKS:
            yield TextDelta(chunk)
        if want:
            made[0] += 1
            n = made[0]
            yield ToolCallDelta(0, id=f"call_{n}", name="add", arguments=f'{{"a": {n}, "b": 1}}')
        yield Finish("tool_calls" if want else "stop")

    return FunctionModel(stream)


async def model(want_tool: bool) -> AsyncIterator[Any]:
    """The floors' model: the chunks, then one tool call (a plain dict) unless told not to."""
    for chunk in CHUNKS:
        yield chunk
    if want_tool:
        _MADE[0] += 1
        yield {"id": f"call_{_MADE[0]}", "name": "add",
               "arguments": f'{{"a": {_MADE[0]}, "b": 1}}'}


def direct(call: dict[str, Any]) -> Awaitable[Any]:
    """The floor's tool call: the tool's coroutine, awaited by the loop itself."""
    return add(**json.loads(call["arguments"]))


async def floor_turn(
    content: str, run_tool: Callable[[dict[str, Any]], Awaitable[Any]], steps: int = STEPS
) -> None:
    """``floor_trio.py``'s W1 turn: plain lists and dicts, one checkpoint per model call, the
    tool call made by ``run_tool``, on every step but the last of ``steps``."""
    import trio

    history: list[dict[str, Any]] = [{"role": "user", "content": content}]
    for step in range(1, steps + 1):
        await trio.lowlevel.checkpoint()
        chunks, call = [], None
        async for part in model(step < steps):
            if type(part) is str:
                chunks.append(part)
            else:
                call = part
        history.append({"role": "assistant", "content": "".join(chunks),
                        "tool_calls": [call] if call else None})
        if call is None:
            return
        result = await run_tool(call)
        history.append({"role": "tool", "tool_call_id": call["id"], "content": result})


async def floor_turns(turns: int) -> None:
    for _ in range(turns):
        await floor_turn("go", direct)


async def _call_tool(call: dict[str, Any], box: list[Any], done: Any) -> None:
    try:
        box.append(await direct(call))
    finally:
        done.set()


async def _actor(inbox: Any, idle: Any, steps: int = STEPS) -> None:
    """An agent in the design card's shape: a task fed by a channel that runs each turn with
    one nursery for its tool calls, each call in a task of its own that it waits for."""
    import trio

    async for content in inbox:
        async with trio.open_nursery() as tools:

            async def in_task(call: dict[str, Any]) -> Any:
                box: list[Any] = []
                done = trio.Event()
                tools.start_soon(_call_tool, call, box, done, name=f"tool:{call['id']}")
                # As the runtime waits for a step's calls: up to two yields (the task
                # runs in trio's next pass, before or after this one), then a park.
                await trio.lowlevel.cancel_shielded_checkpoint()
                if not done.is_set():
                    await trio.lowlevel.cancel_shielded_checkpoint()
                if not done.is_set():
                    await done.wait()
                return box[0]

            await floor_turn(content, in_task, steps)
        idle.set()


async def shape_turns(turns: int) -> None:
    """The floor in the design card's shape: an actor task per agent receiving its input
    from a channel, and each tool call in a task of its own (in one nursery per turn), the
    actor waiting for it. The least the shape itself costs on trio."""
    import trio

    async with trio.open_nursery() as agents:
        for _ in range(turns):
            send, inbox = trio.open_memory_channel[str](1)
            idle = trio.Event()
            agents.start_soon(_actor, inbox, idle)
            async with send:
                send.send_nowait("go")
                await idle.wait()


async def floor_w2_seconds(agents: int) -> float:
    """The yardstick's W2 floor: ``agents`` two-step turns at once, as tasks of one nursery;
    seconds."""
    import time

    import trio

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(agents):
            nursery.start_soon(floor_turn, "go", direct, 2)
    return time.perf_counter() - start


async def shape_w2_seconds(agents: int) -> float:
    """W2 in the shape: ``agents`` actors made and parked on their channels first, then each
    sent its prompt and waited for in turn, as the yardstick waits for its agents; seconds
    from the first send to the last idle (the actors are made and closed off the clock)."""
    import time

    import trio
    import trio.testing

    async with trio.open_nursery() as nursery:
        sends, idles = [], []
        for _ in range(agents):
            send, inbox = trio.open_memory_channel[str](1)
            idle = trio.Event()
            nursery.start_soon(_actor, inbox, idle, 2)
            sends.append(send)
            idles.append(idle)
        await trio.testing.wait_all_tasks_blocked()
        start = time.perf_counter()
        for send in sends:
            send.send_nowait("go")
        for idle in idles:
            await idle.wait()
        elapsed = time.perf_counter() - start
        for send in sends:
            send.close()
    return elapsed


def count(
    what: str, turns: int, subscribers: int, pythonpath: str | None, caches: bool = False,
    collector: bool = True,
) -> dict[str, int]:
    """valgrind's totals for a child running ``turns`` turns (a W2 child: repetitions, and
    ``subscribers`` 1 or 0 for with or without the turns): ``Ir`` (instructions) and, with
    ``caches``, the simulated first-level misses (``I1mr`` code, ``D1mr``/``D1mw`` data).
    Without ``collector`` the child runs with Python's cyclic collector disabled."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    if not collector:
        env["BENCH_NO_GC"] = "1"
    if SEED is not None:
        env["BENCH_TRIO_SEED"] = str(SEED)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pythonpath, os.path.join(pythonpath, "plugins"),
                        env.get("PYTHONPATH")) if p
        )
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         *(["--cache-sim=yes"] if caches else []), sys.executable,
         __file__, "--child", what, str(turns), str(subscribers)],
        env=env, capture_output=True, text=True, check=False,
    )
    events = re.search(r"Events\s*:\s*(.+)", out.stderr)
    found = re.search(r"Collected\s*:\s*(.+)", out.stderr)
    if out.returncode != 0 or events is None or found is None:
        raise SystemExit(f"the {what} run under valgrind failed:\n{out.stderr[-2000:]}")
    values = [int(v.replace(",", "")) for v in found[1].split()]
    return dict(zip(events[1].split(), values, strict=True))


def per_step(
    what: str, subscribers: int, pythonpath: str | None, caches: bool = False
) -> dict[str, float]:
    many = count(what, 6, subscribers, pythonpath, caches)
    few = count(what, 2, subscribers, pythonpath, caches)
    return {name: (many[name] - few[name]) / (4 * STEPS) for name in many}


def per_w2_run(
    what: str, pythonpath: str | None, caches: bool = False, collector: bool = True
) -> dict[str, float]:
    """What a W2 run's turn costs (``Ir``, and the misses with ``caches``): two repetitions
    with the turns, less the same without them, over the runs."""
    ran = count(what, W2_REPS, 1, pythonpath, caches, collector)
    idle = count(what, W2_REPS, 0, pythonpath, caches, collector)
    return {name: (ran[name] - idle[name]) / (W2_REPS * W2_AGENTS) for name in ran}


def seed_trio(seed: int) -> None:
    """Fix the order in which trio runs the tasks of each pass of its loop: its
    scheduler's random generator is a private of trio's, reached here and nowhere in the
    library, and a trio that renamed it fails this loudly rather than count unseeded."""
    import trio

    trio._core._run._r.seed(seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["w1", "w2"], default="w1")
    parser.add_argument("--subscribers", type=int, default=0)
    parser.add_argument("--pythonpath", help="a checkout to measure instead of the installed one")
    parser.add_argument("--caches", action="store_true",
                        help="also count first-level cache misses (simulated; slower)")
    parser.add_argument("--collector-share", action="store_true",
                        help="W2: count the runs again with the cyclic collector off")
    parser.add_argument("--quick", action="store_true",
                        help="run each loop for one turn, uncounted (checks that they run)")
    parser.add_argument("--seed", type=int,
                        help="seed trio's order of running each pass's tasks (exact repeats)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global SEED
    SEED = args.seed
    if args.quick:
        import trio

        if SEED is not None:
            seed_trio(SEED)

        trio.run(floor_turns, 1)
        trio.run(shape_turns, 1)
        trio.run(agentloop_turns, 1, max(args.subscribers, 1))
        trio.run(floor_w2, 1, True)
        trio.run(agentloop_w2, 1, True)
        print("quick: the floor, the floor in the shape and agentloop each ran one turn, "
              "and W2's loops one repetition (uncounted; run without --quick to count)")
        return
    if args.child:
        import trio

        seed = os.environ.get("BENCH_TRIO_SEED")
        if seed is not None:
            seed_trio(int(seed))
        if os.environ.get("BENCH_NO_GC"):
            import gc

            gc.disable()

        what, turns, subscribers = args.child[0], int(args.child[1]), int(args.child[2])
        if what == "floor-w2":
            trio.run(floor_w2, turns, bool(subscribers))
        elif what == "agentloop-w2":
            trio.run(agentloop_w2, turns, bool(subscribers))
        elif what == "floor":
            trio.run(floor_turns, turns)
        elif what == "shape":
            trio.run(shape_turns, turns)
        else:
            trio.run(agentloop_turns, turns, subscribers)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH: this benchmark counts instructions with it")
    if args.workload == "w2":
        floor_run = per_w2_run("floor-w2", None, args.caches)
        ours_run = per_w2_run("agentloop-w2", args.pythonpath, args.caches)
        print(f"{'floor (bare trio)':<26} {floor_run['Ir']:>10,.0f} instructions per W2 run")
        print(f"{'agentloop':<26} {ours_run['Ir']:>10,.0f} instructions per W2 run "
              f"({ours_run['Ir'] / floor_run['Ir']:.2f}x)")
        if args.caches:
            print("first-level cache misses per W2 run (valgrind's simulation):")
            for name, run in (("floor (bare trio)", floor_run), ("agentloop", ours_run)):
                data = run["D1mr"] + run["D1mw"]
                print(f"{name:<26} {run['I1mr']:>10,.0f} code {data:>10,.0f} data")
        if args.collector_share:
            # The same runs with the cyclic collector off: what is left of each is what the
            # collector's young-generation passes cost while 500 turns are in flight.
            print("without the cyclic collector (its share of the run):")
            for name, what, path, run in (
                ("floor (bare trio)", "floor-w2", None, floor_run),
                ("agentloop", "agentloop-w2", args.pythonpath, ours_run),
            ):
                bare = per_w2_run(what, path, collector=False)["Ir"]
                print(f"{name:<26} {bare:>10,.0f} instructions per W2 run "
                      f"(the collector: {1 - bare / run['Ir']:.1%})")
        return
    caches = args.caches
    floor = per_step("floor", 0, None, caches)
    shape = per_step("shape", 0, None, caches)
    ours = per_step("agentloop", 0, args.pythonpath, caches)
    rows = [("floor (bare trio)", floor, "")]
    rows.append(("floor in the shape", shape, f" ({shape['Ir'] / floor['Ir']:.2f}x)"))
    rows.append(("agentloop", ours, f" ({ours['Ir'] / floor['Ir']:.2f}x)"))
    if args.subscribers:
        subs = per_step("agentloop", args.subscribers, args.pythonpath, caches)
        plural = "s" if args.subscribers > 1 else ""
        rows.append((
            f"agentloop + {args.subscribers} subscriber{plural}", subs,
            f" ({subs['Ir'] / ours['Ir']:.2f}x agentloop)",
        ))
    for name, step, ratio in rows:
        print(f"{name:<26} {step['Ir']:>10,.0f} instructions per step{ratio}")
    if caches:
        print("first-level cache misses per step (valgrind's simulation):")
        for name, step, _ in rows:
            data = step["D1mr"] + step["D1mw"]
            print(f"{name:<26} {step['I1mr']:>10,.0f} code {data:>10,.0f} data")

if __name__ == "__main__":
    main()
