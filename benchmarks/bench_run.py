"""Per-step cost of reading a turn through a run handle, against the same turn read by nobody.

    python benchmarks/bench_run.py [--quick] [--runs N] [--cpu-clock] [--scripted]

One 50-step turn (each step 10 text chunks and one trivial parallel tool call, the shape of
``bench_core.py steps``), driven six ways on fresh agents of one runtime, interleaved and
rotated: ``bare``, ``followup`` + ``wait_idle`` with no reader; ``woken``, the same beside a
task that is woken by every append as a reader is and does nothing else (trio's floor under
any reader); ``iterated``, the smallest async iterator over the log that parks the same way
(the floor with iteration); ``ask``, a run nobody reads (``agent.ask``); ``events``,
``agent.run`` iterating ``run.events()``; ``text``, iterating ``run.text()``.

The turn is run three times over: on the yardstick's ``FunctionModel``, in process with one
checkpoint per model call (a reader is then woken about once a step and reads the step's
fifteen events in one go: what the reader itself costs shows most); on the in-process
``ScriptedModel``, which costs nothing and checkpoints before every part (a reader is woken
for every chunk, the runtime's own step is all there is to compare with); and on
``OpenAIChatAdapter`` streaming from ``sse_server.py``, an OpenAI-compatible server in a
process of its own that writes every event as it makes it (a run as an application has it;
``--scripted`` skips it). The figure is the wall time
(``--cpu-clock``: this process's CPU time, steadier on a shared machine, and without the
server's) from the prompt to the end of the turn, divided by 50: the best of the rounds,
and the median of each round's ratios. The target: ``events`` at most 1.15x ``ask``, a run
without a reader. Beside it, trio's own cost of waking one parked task at a checkpoint (a
reader is woken at most once per checkpoint of the driver, about ten times per step here).
Printed, never asserted.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import attrs
import sse_server
import trio

import agentloop
from agentloop.llm import LLMRequest, OpenAIChatAdapter
from agentloop.testing import (
    Finish,
    FunctionModel,
    Reply,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    reply,
)

STEPS = 50
CHUNKS = 10
TEXT = "abcde" * CHUNKS
QUICK = "--quick" in sys.argv
RUNS = 1 if QUICK else int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 7
# --cpu-clock: the process's CPU time, not the wall clock, for a machine shared with other work.
CLOCK = time.process_time_ns if "--cpu-clock" in sys.argv else time.perf_counter_ns
OPTIONS = agentloop.AgentOptions(provider="scripted", model="bench")


def script() -> list[Reply]:
    with_call = reply(TEXT, tool_calls=[("noop", {})], chunk_size=5)
    return [with_call] * (STEPS - 1) + [reply(TEXT, chunk_size=5)]


Way = Callable[[agentloop.Agent], Awaitable[int]]


async def bare(agent: agentloop.Agent) -> int:
    agent.followup("go")
    await agent.wait_idle()
    return len(agent.session.events)


async def ask(agent: agentloop.Agent) -> int:
    return 1 if (await agent.ask("go")).turn else 0


async def events(agent: agentloop.Agent) -> int:
    seen = 0
    async with agent.run("go") as run:
        async for _ in run.events():
            seen += 1
    return seen


async def text(agent: agentloop.Agent) -> int:
    seen = 0
    async with agent.run("go") as run:
        async for _ in run.text():
            seen += 1
    await run.result()
    return seen


async def woken(agent: agentloop.Agent) -> int:
    """The bare turn beside a task that is woken by every append, as a reader is, and does
    nothing else: what the wakes alone cost, the floor under ``events``. Like a reader, it
    sets the session's wake hook as it parks, and the hook clears itself as it fires."""
    session = agent.session
    waiting: list[trio.lowlevel.Task] = []
    wakes = 0

    def wake() -> None:
        nonlocal wakes
        session._wake = None
        if waiting:
            wakes += 1
            trio.lowlevel.reschedule(waiting.pop())

    def abort(_: object) -> trio.lowlevel.Abort:
        waiting.clear()
        return trio.lowlevel.Abort.SUCCEEDED

    async def parked() -> None:
        while True:
            waiting.append(trio.lowlevel.current_task())
            session._wake = wake  # the hook a run's readers are woken through
            await trio.lowlevel.wait_task_rescheduled(abort)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(parked)
        await trio.lowlevel.checkpoint()
        try:
            agent.followup("go")
            await agent.wait_idle()
        finally:
            session._wake = None
            nursery.cancel_scope.cancel()
    return wakes


async def iterated(agent: agentloop.Agent) -> int:
    """The bare turn read by the smallest async iterator over the log that parks as a reader
    does (no turn filter, no cancel check): the floor under ``events`` with iteration."""
    session = agent.session
    event_at = session.event_at
    waiting: list[trio.lowlevel.Task] = []

    def wake() -> None:
        session._wake = None
        if waiting:
            trio.lowlevel.reschedule(waiting.pop())

    def abort(_: object) -> trio.lowlevel.Abort:
        waiting.clear()
        return trio.lowlevel.Abort.SUCCEEDED

    class Tail:
        def __init__(self) -> None:
            self.i = session.last_seq

        def __aiter__(self) -> Tail:
            return self

        async def __anext__(self) -> object:
            while True:
                i = self.i
                event = event_at(i)  # the event, made now if the log kept a chunk's parts
                if event is not None:
                    self.i = i + 1
                    if event.type == "turn/end":
                        raise StopAsyncIteration
                    return event
                waiting.append(trio.lowlevel.current_task())
                session._wake = wake
                await trio.lowlevel.wait_task_rescheduled(abort)

    seen = 0
    tail = Tail()
    agent.followup("go")
    async for _ in tail:
        seen += 1
    await agent.wait_idle()
    return seen


async def trio_wake_cost(n: int = 1000 if QUICK else 20000) -> float:
    """Microseconds that waking one parked task adds to a checkpoint."""
    lot = trio.lowlevel.ParkingLot()
    done = False

    async def reader() -> None:
        while not done:
            await lot.park()

    async def loop(wake: bool) -> int:
        start = CLOCK()
        for _ in range(n):
            if wake and lot:
                lot.unpark_all()
            await trio.lowlevel.checkpoint()
        return CLOCK() - start

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.lowlevel.checkpoint()
        alone, woken = await loop(False), await loop(True)
        done = True
        lot.unpark_all()
    return (woken - alone) / n / 1000


async def timed(rt: agentloop.Context, provider: str, prepare: Callable[[], None], way: Way,
                n: int) -> float:
    prepare()
    options = attrs.evolve(OPTIONS, provider=provider)
    handle = await rt.agents.create(
        session_id=f"bench-{provider}-{way.__name__}-{n}", agent_options=options
    )
    async with handle:
        gc.collect()  # each turn starts from the same heap, whatever ran before it
        start = CLOCK()
        count = await way(handle.agent)
        elapsed = CLOCK() - start
        assert count > 0
        end = handle.agent.session.events[-1]
        assert end.data["reason"] == "completed", end
    return elapsed / STEPS / 1000


WAYS: list[Way] = [bare, woken, iterated, ask, events, text]


async def measure(rt: agentloop.Context, provider: str, prepare: Callable[[], None],
                  title: str) -> None:
    for way in WAYS:  # warm-up
        await timed(rt, provider, prepare, way, -1)
    figures: dict[str, list[float]] = {way.__name__: [] for way in WAYS}
    for n in range(RUNS):
        # Rotated, so that no way always runs first (or last) in a round.
        for way in WAYS[n % len(WAYS):] + WAYS[:n % len(WAYS)]:
            figures[way.__name__].append(await timed(rt, provider, prepare, way, n))
    base, run = figures["bare"], figures["ask"]
    print(f"{title}: per step, {STEPS}-step turn, {CHUNKS} chunks + 1 tool call per step, "
          f"{RUNS} rounds")
    print(f"  {'':<8} {'best':>8}     {'/bare':>6} {'/ask':>6}   median of rounds /bare /ask")
    for name, values in figures.items():
        print(f"  {name:<8} {min(values):8.1f} us   {min(values) / min(base):6.3f} "
              f"{min(values) / min(run):6.3f}   "
              f"{statistics.median(v / b for v, b in zip(values, base, strict=True)):21.3f} "
              f"{statistics.median(v / r for v, r in zip(values, run, strict=True)):5.3f}")


async def main() -> None:
    async with agentloop.open_runtime() as rt:

        @rt.tools.tool(concurrency="parallel")
        async def noop() -> str:
            """Do nothing."""
            return "ok"

        async def yardstick(
            request: LLMRequest,
        ) -> AsyncIterator[TextDelta | ToolCallDelta | Finish]:
            await trio.lowlevel.checkpoint()  # the request's network read: once a call
            for k in range(CHUNKS):
                yield TextDelta(f"tok{k} ")
            going_on = request.step < STEPS
            if going_on:
                yield ToolCallDelta(0, id=f"call_{request.step}", name="noop", arguments="{}")
            yield Finish("tool_calls" if going_on else "stop")

        function = FunctionModel(yardstick)
        rt.llm.register("function", function)
        await measure(rt, "function", function.requests.clear,
                      "FunctionModel, the yardstick's turn (in process, one checkpoint per call)")
        model = ScriptedModel()
        rt.llm.register("scripted", model)
        await measure(rt, "scripted", lambda: model.add(*script()),
                      "ScriptedModel (in process, one checkpoint per part)")
        if "--scripted" not in sys.argv:
            with sse_server.started(STEPS, CHUNKS) as url:
                rt.llm.register("http", OpenAIChatAdapter(url, api_key="bench"))
                await measure(rt, "http", lambda: None,
                              "OpenAI chat completions over loopback HTTP (a server process, "
                              "one write per event)")
    floor = min([await trio_wake_cost() for _ in range(3)])
    print("target: run.events() at most 1.15x a run without a reader "
          "(woken: a task woken per append that does nothing else)")
    print(f"trio floor: waking a parked reader at a checkpoint costs {floor:.1f} us per wake")


if __name__ == "__main__":
    trio.run(main)
