"""Per-step cost of the otel plugin: without it, loaded with no SDK, and with an in-memory
exporter.

    python benchmarks/bench_otel.py [--quick] [--runs N]

The turn is the one of ``bench_core.py steps``: 50 steps, each streaming 10 text chunks and
calling one parallel ``noop`` tool, timed in process CPU time from ``followup()`` to the idle
agent, divided by 50, best of N. Turns with and without the plugin alternate in one runtime
(the plugin installed in the traced agent's own scope), so a busy machine hits both alike.
Three rows, in this order, because OpenTelemetry's global tracer provider can be set only
once per process:

- no plugin;
- the plugin loaded with no SDK configured (the API's no-op providers): what a user pays for
  loading it before they configure an exporter; the budget is 10% over no plugin;
- the plugin with the SDK's ``TracerProvider``, a ``SimpleSpanProcessor`` and an
  ``InMemorySpanExporter`` set as the global provider (and an SDK ``MeterProvider`` with an
  in-memory reader): spans really recorded, exported synchronously at each span's end.

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Awaitable, Callable

import trio
from agentloop_otel import OtelConfig, install

import agentloop
from agentloop.testing import Reply, ScriptedModel, reply

Setup = Callable[[agentloop.Context], Awaitable[None]]

STEPS = 50
TEXT = "abcde" * 10
OPTIONS = agentloop.AgentOptions(provider="scripted", model="bench")


def script() -> list[Reply]:
    with_call = reply(TEXT, tool_calls=[("noop", {})], chunk_size=5)
    return [with_call] * (STEPS - 1) + [reply(TEXT, chunk_size=5)]


async def noop() -> str:
    """Do nothing."""
    return "ok"


async def traced(ctx: agentloop.Context) -> None:
    """An agent's setup that loads the plugin's handlers for that agent only."""
    await trio.lowlevel.checkpoint()
    install(ctx, OtelConfig())


async def timed_turn(rt: agentloop.Context, session_id: str, *, setup: Setup | None) -> float:
    """CPU microseconds per step of one STEPS-step turn."""
    model = ScriptedModel(script())
    unregister = rt.llm.register("scripted", model)
    handle = await rt.agents.create(session_id=session_id, agent_options=OPTIONS, setup=setup)
    async with handle:
        agent = handle.agent
        gc.collect()
        start = time.process_time_ns()
        agent.followup("go")
        await agent.wait_idle()
        elapsed = time.process_time_ns() - start
        assert model.remaining == 0, "the turn did not take every step"
    unregister()
    return elapsed / STEPS / 1000


async def alternated(runs: int) -> tuple[float, float]:
    """Best of ``runs`` turns without and with the plugin, alternated turn by turn in one
    runtime (the plugin installed in the traced agent's own scope), so that whatever else
    the machine does hits both alike."""
    async with agentloop.open_runtime() as rt:
        rt.tools.tool(noop, concurrency="parallel")
        await timed_turn(rt, "warmup-bare", setup=None)
        await timed_turn(rt, "warmup-traced", setup=traced)
        bare, with_plugin = [], []
        for run in range(runs):
            bare.append(await timed_turn(rt, f"bare-{run}", setup=None))
            with_plugin.append(await timed_turn(rt, f"traced-{run}", setup=traced))
    return min(bare), min(with_plugin)


def install_sdk() -> object:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    return exporter


async def main(runs: int) -> None:
    print(f"python {sys.version.split()[0]} on {sys.platform}, {os.cpu_count()} cpus, "
          f"trio {trio.__version__}")
    bare, no_sdk = await alternated(runs)
    try:
        exporter = install_sdk()
    except ImportError:
        exporter = None
    print(f"\n{STEPS}-step turn, 10 text chunks + 1 parallel tool call per step, best of {runs}")
    print(f"  {'no plugin':<44} {bare:8.1f} us/step")
    print(f"  {'otel plugin, no SDK configured':<44} {no_sdk:8.1f} us/step  "
          f"{(no_sdk / bare - 1) * 100:+5.1f}%")
    if exporter is None:
        print("  otel plugin, in-memory exporter: skipped (opentelemetry-sdk is not installed)")
        return
    recorded = (await alternated(runs))[1]
    spans = len(exporter.get_finished_spans())  # type: ignore[attr-defined]
    print(f"  {'otel plugin, SDK + in-memory exporter':<44} {recorded:8.1f} us/step  "
          f"{(recorded / bare - 1) * 100:+5.1f}%  ({spans} spans exported)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="one run of each")
    args = parser.parse_args()
    trio.run(main, 1 if args.quick else args.runs)
