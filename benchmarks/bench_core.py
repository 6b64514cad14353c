"""Core hot-path figures: per-step overhead, history independence, idle memory, emit cost.

    python benchmarks/bench_core.py [--quick] [steps|history|memory|emit ...]

With no argument every benchmark runs. ``--quick`` runs each once with tiny repetitions (a
check that the script still works, not a figure). Figures are printed, never asserted: the
machine and whatever else runs on it decide them. See ``benchmarks/README.md`` for the targets.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import trio
import trio.testing

import agentloop
from agentloop._bus import EventBus
from agentloop._events import AgentStatus, AgentTurnContinuation, AgentTurnEnd
from agentloop.testing import Reply, ScriptedModel, reply

STEPS = 50
CHUNKS = 10
CHUNK_SIZE = 5
TEXT = "abcde" * CHUNKS  # CHUNKS chunks of CHUNK_SIZE characters
# Read before the functions below bind these as defaults.
QUICK = __name__ == "__main__" and "--quick" in sys.argv
RUNS = 1 if QUICK else 5
OPTIONS = agentloop.AgentOptions(provider="scripted", model="bench")


def script(steps: int = STEPS) -> list[Reply]:
    """``steps`` replies of 10 text chunks; all but the last also call ``noop``."""
    with_call = reply(TEXT, tool_calls=[("noop", {})], chunk_size=CHUNK_SIZE)
    return [with_call] * (steps - 1) + [reply(TEXT, chunk_size=CHUNK_SIZE)]


def seed_history(messages: int) -> list[dict[str, Any]]:
    """A stored log of ``messages // 2`` completed turns: one user, one assistant message each."""
    events: list[dict[str, Any]] = []
    for turn in range(1, messages // 2 + 1):
        events += [
            {"type": "turn/start", "turn": turn, "data": {"turn": turn}},
            {
                "type": "user/message",
                "turn": turn,
                "data": {
                    "message_id": f"msg_{turn}", "content": f"question {turn}", "source": None
                },
            },
            {
                "type": "assistant/message",
                "turn": turn,
                "data": {
                    "step": 1,
                    "content": f"answer {turn} " * 20,
                    "reasoning": None,
                    "reasoning_signature": None,
                    "tool_calls": [],
                    "source_event_seqs": [],
                    "finish_reason": "stop",
                    "usage": None,
                    "interrupted": False,
                },
            },
            {"type": "turn/end", "turn": turn, "data": {"turn": turn, "reason": "completed"}},
        ]
    return events


async def timed_turn(rt: agentloop.Context, session_id: str, history: int) -> int:
    """Nanoseconds from the prompt to the idle agent, for one STEPS-step turn."""
    model = ScriptedModel(script())
    unregister = rt.llm.register("scripted", model)
    handle = await rt.agents.create(
        session_id=session_id, agent_options=OPTIONS, seed=seed_history(history) or None
    )
    async with handle:
        agent = handle.agent
        assert len(agent.session.messages()) == history
        gc.collect()
        start = time.perf_counter_ns()
        agent.followup("go")
        await agent.wait_idle()
        elapsed = time.perf_counter_ns() - start
        assert model.remaining == 0, "the turn did not take every step"
        assert agent.session.events[-1].data["reason"] == "completed"
    unregister()
    return elapsed


async def per_step_us(histories: Sequence[int], runs: int = RUNS) -> dict[int, list[float]]:
    """Per-step microseconds of every run, for each history size (runs interleaved)."""
    out: dict[int, list[float]] = {h: [] for h in histories}
    async with agentloop.open_runtime() as rt:

        async def noop() -> str:
            """Do nothing."""
            return "ok"

        rt.tools.tool(noop, concurrency="parallel")

        await timed_turn(rt, "warmup", 0)
        for run in range(runs):
            for history in histories:
                ns = await timed_turn(rt, f"h{history}-r{run}", history)
                out[history].append(ns / STEPS / 1000)
    return out


async def bare_loop_us(runs: int = RUNS) -> list[float]:
    """The same logical work with no runtime: chunks with checkpoints, a list, a tool await."""

    async def tool() -> str:
        return "ok"

    async def chunks() -> AsyncIterator[str]:
        for i in range(CHUNKS):
            await trio.lowlevel.checkpoint()
            yield TEXT[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]

    results = []
    for _ in range(runs):
        log: list[object] = []
        gc.collect()
        start = time.perf_counter_ns()
        for step in range(STEPS):
            async for chunk in chunks():
                log.append(chunk)  # noqa: PERF401 - one append per chunk, as the driver does
            if step < STEPS - 1:
                log.append(await tool())
        results.append((time.perf_counter_ns() - start) / STEPS / 1000)
    return results


async def checkpoint_us(n: int = 200 if QUICK else 20_000) -> float:
    """One trio checkpoint (a task switch through the scheduler): the unit both loops pay."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter_ns()
        for _ in range(n):
            await trio.lowlevel.checkpoint()
        best = min(best, (time.perf_counter_ns() - start) / n / 1000)
    return best


# --- memory -----------------------------------------------------------------------------------

IDLE_AGENTS = 50 if QUICK else 5000


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Usage:
    """Allocated bytes from ``start()`` to ``stop()``: traced Python allocations or RSS."""

    def __init__(self, measure: str) -> None:
        self.measure = measure
        self.before = 0

    def _now(self) -> int:
        return tracemalloc.get_traced_memory()[0] if self.measure == "tracemalloc" else rss_bytes()

    def start(self) -> None:
        gc.collect()
        if self.measure == "tracemalloc":
            tracemalloc.start()
        self.before = self._now()

    def stop(self) -> int:
        gc.collect()
        used = self._now() - self.before
        if self.measure == "tracemalloc":
            tracemalloc.stop()
        return used


CONVERSATION = [
    {"type": "user/message", "turn": 1,
     "data": {"message_id": "m1", "content": "hello there", "source": None}},
    {"type": "assistant/message", "turn": 1,
     "data": {"step": 1, "content": "hi, how can I help?", "tool_calls": [],
              "source_event_seqs": [], "finish_reason": "stop", "usage": None,
              "interrupted": False}},
]


async def idle_agents_bytes(measure: str) -> float:
    """Bytes per idle agent actor (its task, channels, state and a 2-message conversation),
    by ``"rss"`` or ``"tracemalloc"``, with IDLE_AGENTS in one runtime."""
    async with agentloop.open_runtime() as rt:
        (await rt.agents.create(session_id="warmup", agent_options=OPTIONS, seed=CONVERSATION))
        await trio.testing.wait_all_tasks_blocked()
        usage = Usage(measure)
        usage.start()
        handles = [
            await rt.agents.create(session_id=f"idle-{i}", agent_options=OPTIONS,
                                   seed=CONVERSATION)
            for i in range(IDLE_AGENTS)
        ]
        # Every actor task has started and parked on its next-turn channel.
        await trio.testing.wait_all_tasks_blocked()
        used = usage.stop()
        assert all(h.agent.status == "idle" for h in handles)
        assert all(len(h.agent.session.messages()) == 2 for h in handles)
        del handles
    return used / IDLE_AGENTS


async def parked_tasks_bytes(measure: str) -> float:
    """The floor: bytes per bare trio task parked on one of its two memory channels."""

    async def parked(rx: trio.MemoryReceiveChannel[object]) -> None:
        await rx.receive()

    keep: list[object] = []
    async with trio.open_nursery() as nursery:
        usage = Usage(measure)
        usage.start()
        for _ in range(IDLE_AGENTS):
            turn_tx, turn_rx = trio.open_memory_channel[object](math.inf)
            step_tx, step_rx = trio.open_memory_channel[object](math.inf)
            keep.append((turn_tx, step_tx, step_rx))
            nursery.start_soon(parked, turn_rx)
        await trio.testing.wait_all_tasks_blocked()
        used = usage.stop()
        nursery.cancel_scope.cancel()
    return used / IDLE_AGENTS


# --- emit -------------------------------------------------------------------------------------

EMITS = 1000 if QUICK else 200_000
Loop = Callable[[int], object]


def _best_ns(loop: Loop, empty: float = 0.0, n: int = EMITS) -> float:
    """Best-of-5 nanoseconds per iteration of ``loop(n)``, minus ``empty`` (the bare loop)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        loop(n)
        best = min(best, (time.perf_counter_ns() - start) / n)
    return best - empty


async def _abest_ns(loop: Callable[[int], Awaitable[object]], empty: float = 0.0) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        await loop(EMITS)
        best = min(best, (time.perf_counter_ns() - start) / EMITS)
    return best - empty


def emit_loops(bus: EventBus) -> tuple[Loop, Loop, Loop]:
    """Loops written as the hot paths write them: each iteration is one emit site."""
    status = AgentStatus("a1", "running", "idle")

    def guarded(n: int) -> None:
        for _ in range(n):
            if bus.has_listeners(AgentStatus):
                bus.emit_nowait(AgentStatus("a1", "running", "idle"))

    def nowait(n: int) -> None:
        for _ in range(n):
            bus.emit_nowait(status)

    def build(n: int) -> None:
        for _ in range(n):
            AgentStatus("a1", "running", "idle")

    return guarded, nowait, build


def hook_loops(bus: EventBus) -> tuple[Callable[[int], Awaitable[None]], ...]:
    notify = AgentTurnEnd("a1", 1, "completed")
    waterfall = AgentTurnContinuation("a1", 1, 1, True)

    async def emit_notify(n: int) -> None:
        for _ in range(n):
            await bus.emit(notify)

    async def emit_waterfall(n: int) -> None:
        for _ in range(n):
            await bus.emit(waterfall)

    return emit_notify, emit_waterfall


async def emit_costs() -> list[tuple[str, float]]:
    """Nanoseconds per emit site, net of the bare loop."""

    def empty_loop(n: int) -> None:
        for _ in range(n):
            pass

    async def aempty_loop(n: int) -> None:
        for _ in range(n):
            pass

    empty = _best_ns(empty_loop)
    aempty = await _abest_ns(aempty_loop)
    bus = EventBus()
    guarded, nowait, build = emit_loops(bus)
    emit_notify, emit_waterfall = hook_loops(bus)
    rows = [
        ("control: has_listeners guard, no listeners", _best_ns(guarded, empty)),
        ("control: emit_nowait(event), no listeners", _best_ns(nowait, empty)),
        ("hook: await emit(notify), no handlers", await _abest_ns(emit_notify, aempty)),
        ("hook: await emit(waterfall), no handlers", await _abest_ns(emit_waterfall, aempty)),
    ]
    bus.on(AgentStatus, lambda e: None)
    bus.on(AgentTurnEnd, lambda e: None)
    bus.on(AgentTurnContinuation, lambda e: None)
    rows += [
        ("control: emit_nowait(event), 1 sync handler", _best_ns(nowait, empty)),
        ("control: guard + build + emit, 1 sync handler", _best_ns(guarded, empty)),
        ("hook: await emit(notify), 1 sync handler", await _abest_ns(emit_notify, aempty)),
        ("hook: await emit(waterfall), 1 sync handler (None)",
         await _abest_ns(emit_waterfall, aempty)),
        ("for scale: building an AgentStatus", _best_ns(build, empty)),
    ]
    return rows


# --- report -----------------------------------------------------------------------------------


def header() -> None:
    print(f"python {sys.version.split()[0]} on {sys.platform}, {os.cpu_count()} cpus, "
          f"trio {trio.__version__}, agentloop {agentloop.__version__}")


async def report_steps() -> None:
    runs = (await per_step_us([0]))[0]
    bare = await bare_loop_us()
    print(f"\nper-step overhead: {STEPS}-step turn, {CHUNKS} text chunks + 1 parallel tool call "
          f"per step, best of {RUNS}")
    print(f"  agentloop:  {min(runs):8.1f} us/step  (median {statistics.median(runs):.1f})"
          "   target < 100")
    print(f"  bare trio:  {min(bare):8.1f} us/step  (median {statistics.median(bare):.1f})")
    print(f"  ratio:      {min(runs) / min(bare):8.1f} x")
    print(f"  (one trio checkpoint costs {await checkpoint_us():.2f} us on this machine)")


async def report_history() -> None:
    runs = await per_step_us([10, 1000])
    small, large = min(runs[10]), min(runs[1000])
    print(f"\nper-step cost vs history: {STEPS}-step turn, best of {RUNS}")
    print(f"  10 messages:     {small:8.1f} us/step  (median {statistics.median(runs[10]):.1f})")
    print(f"  1,000 messages:  {large:8.1f} us/step  (median {statistics.median(runs[1000]):.1f})")
    print(f"  ratio:           {large / small:8.3f}   target within 10% (0.90-1.10)")


async def report_memory() -> None:
    floor_rss = await parked_tasks_bytes("rss")
    rss = await idle_agents_bytes("rss")
    floor = await parked_tasks_bytes("tracemalloc")
    traced = await idle_agents_bytes("tracemalloc")
    print(f"\nmemory per idle agent actor: {IDLE_AGENTS:,} agents in one runtime")
    print(f"  tracemalloc:  {traced / 1024:6.2f} KB/agent; floor (bare task on two channels) "
          f"{floor / 1024:.2f} KB; above the floor {(traced - floor) / 1024:.2f} KB "
          "(target <= 4)")
    print(f"  RSS delta:    {rss / 1024:6.2f} KB/agent; floor {floor_rss / 1024:.2f} KB")


async def report_emit() -> None:
    rows = await emit_costs()
    print(f"\nemit cost: ns per call, best of 5 x {EMITS:,}")
    for label, ns in rows:
        print(f"  {label:<58} {ns:7.0f} ns")


BENCHES: dict[str, Callable[[], Awaitable[None]]] = {
    "steps": report_steps,
    "history": report_history,
    "memory": report_memory,
    "emit": report_emit,
}


async def main(names: Sequence[str]) -> None:
    header()
    for name in names:
        await BENCHES[name]()


if __name__ == "__main__":
    chosen = [a for a in sys.argv[1:] if a != "--quick"] or list(BENCHES)
    unknown = [n for n in chosen if n not in BENCHES]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    trio.run(main, chosen)
