"""W5, over the wire: the W1 turn streamed from a real OpenAI-compatible server on loopback.

    python benchmarks/peers/bench_wire.py [--rounds N] [--quick] [--json PATH]
    python benchmarks/peers/bench_wire.py --entry NAME [--quick]      # one entry, one process

The server is ``benchmarks/sse_server.py``, in a process of its own (its work is not on the
clock): each request gets 10 content deltas of five characters, one server-sent event per
write, then, but on the last step, one call of a ``noop`` tool, then the finish reason, usage
and ``[DONE]``. A turn is ``STEPS`` such requests, each carrying the conversation so far.

Figure: the CPU time (``time.process_time``, this process only) of one turn divided by its
steps, median of the runs after a warm-up turn; the median over rounds of that. Entries, each
in a fresh process, one at a time, their order rotated each round:

- ``floor``: plain ``httpx`` on trio, by hand: POST the conversation, read the stream line by
  line, parse each event's JSON, gather the text and the tool call, await ``noop``, append
  the assistant and tool messages, again.
- ``agentloop``: ``OpenAIChatAdapter`` on the server, one agent, ``followup`` + ``wait_idle``.
- each peer with its own OpenAI client pointed at the server (``openai-agents``:
  ``OpenAIChatCompletionsModel``; ``pydantic-ai``: ``OpenAIModel``; LangGraph:
  ``create_react_agent`` on ``ChatOpenAI``; AutoGen: ``AssistantAgent`` on
  ``OpenAIChatCompletionClient``), streamed and every event consumed. A peer whose packages
  do not import is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # sse_server

import sse_server  # noqa: E402

STEPS, QUICK_STEPS = 50, 5
RUNS, QUICK_RUNS = 5, 2
CHUNKS = 10
TEXT = "abcde" * CHUNKS
NOOP_SCHEMA = {"type": "function", "function": {
    "name": "noop", "description": "Do nothing.",
    "parameters": {"type": "object", "properties": {}, "required": []},
}}
ENTRIES = ("floor", "agentloop", "openai-agents", "pydantic-ai", "langgraph", "autogen")
PROBES = {"floor": "httpx", "agentloop": "agentloop.llm", "openai-agents": "agents",
          "pydantic-ai": "pydantic_ai.models.openai", "langgraph": "langchain_openai",
          "autogen": "autogen_ext.models.openai"}


def cpu_per_step(turns: list[float], steps: int) -> list[float]:
    return [t / steps * 1e6 for t in turns]


async def measure(turn: Callable[[], Awaitable[None]], steps: int, runs: int) -> list[float]:
    """CPU microseconds per step of ``runs`` turns after a warm-up turn."""
    await turn()
    out = []
    for _ in range(runs):
        gc.collect()
        start = time.process_time()
        await turn()
        out.append(time.process_time() - start)
    return cpu_per_step(out, steps)


# --------------------------------------------------------------------------- trio entries
async def sse_data(chunks: Any) -> Any:
    """The ``data`` of each server-sent event, as bytes: the least a client can do (events
    split on blank lines, one ``data:`` line each, as this server and the providers send)."""
    rest = b""
    async for chunk in chunks:
        rest += chunk
        *events, rest = rest.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].lstrip()


async def floor(url: str, steps: int, runs: int) -> list[float]:
    import httpx

    async def noop() -> str:
        return "ok"

    async with httpx.AsyncClient(timeout=30) as client:
        async def turn() -> None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
            while True:
                body = {"model": "bench", "messages": messages, "stream": True,
                        "tools": [NOOP_SCHEMA]}
                text: list[str] = []
                calls: dict[int, dict[str, Any]] = {}
                finish = None
                async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
                    async for data in sse_data(r.aiter_bytes()):
                        if data == b"[DONE]":
                            break
                        for choice in json.loads(data)["choices"]:
                            delta = choice["delta"]
                            if delta.get("content"):
                                text.append(delta["content"])
                            for part in delta.get("tool_calls") or ():
                                call = calls.setdefault(part["index"], {"id": None, "name": "",
                                                                       "arguments": ""})
                                call["id"] = part.get("id") or call["id"]
                                fn = part.get("function") or {}
                                call["name"] += fn.get("name") or ""
                                call["arguments"] += fn.get("arguments") or ""
                            finish = choice.get("finish_reason") or finish
                message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
                if calls:
                    message["tool_calls"] = [
                        {"id": c["id"], "type": "function",
                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in calls.values()]
                messages.append(message)
                if finish != "tool_calls":
                    break
                for c in calls.values():
                    json.loads(c["arguments"] or "{}")
                    messages.append({"role": "tool", "tool_call_id": c["id"],
                                     "content": await noop()})
            assert messages[-1]["content"] == TEXT
            assert len(messages) == 2 * steps

        return await measure(turn, steps, runs)


async def agentloop_entry(url: str, steps: int, runs: int) -> list[float]:
    import agentloop
    from agentloop.llm import OpenAIChatAdapter

    async with agentloop.open_runtime() as rt:
        @rt.tools.tool(concurrency="parallel")
        async def noop() -> str:
            """Do nothing."""
            return "ok"

        rt.llm.register("http", OpenAIChatAdapter(url, api_key="bench"))
        options = agentloop.AgentOptions(provider="http", model="bench")
        made = 0

        async def turn() -> None:
            nonlocal made
            made += 1
            async with await rt.agents.create(session_id=f"w5-{made}",
                                              agent_options=options) as handle:
                agent = handle.agent
                agent.followup("go")
                await agent.wait_idle()
                end = agent.session.events[-1]
                assert end.data["reason"] == "completed", end
                assert agent.session.messages()[-1].content == TEXT

        return await measure(turn, steps, runs)


# --------------------------------------------------------------------------- asyncio peers
async def openai_agents(url: str, steps: int, runs: int) -> list[float]:
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from agents.tracing import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def noop() -> str:
        """Do nothing."""
        return "ok"

    model = OpenAIChatCompletionsModel("bench", AsyncOpenAI(base_url=url, api_key="bench"))
    agent = Agent(name="bench", instructions=None, model=model, tools=[noop])
    config = RunConfig(tracing_disabled=True)

    async def turn() -> None:
        result = Runner.run_streamed(agent, "go", max_turns=steps + 1, run_config=config)
        async for _ in result.stream_events():
            pass
        assert result.final_output == TEXT, result.final_output

    return await measure(turn, steps, runs)


async def pydantic_ai(url: str, steps: int, runs: int) -> list[float]:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("bench", provider=OpenAIProvider(base_url=url, api_key="bench"))
    agent = Agent(model)

    @agent.tool_plain
    def noop() -> str:
        """Do nothing."""
        return "ok"

    async def turn() -> None:
        text = ""
        async with agent.iter("go") as run:
            async for node in run:
                if Agent.is_model_request_node(node):
                    async with node.stream(run.ctx) as stream:
                        async for _ in stream:
                            pass
        text = str(run.result.output) if run.result is not None else text
        assert text == TEXT, text

    return await measure(turn, steps, runs)


async def langgraph(url: str, steps: int, runs: int) -> list[float]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def noop() -> str:
        """Do nothing."""
        return "ok"

    llm = ChatOpenAI(model="bench", base_url=url, api_key="bench", streaming=True)
    graph = create_react_agent(llm, [noop])
    limit = {"recursion_limit": 2 * steps + 5}

    async def turn() -> None:
        tools, text = 0, []
        async for chunk, _meta in graph.astream({"messages": [("user", "go")]}, limit,
                                                stream_mode="messages"):
            if chunk.type == "tool":
                tools, text = tools + 1, []
            elif isinstance(chunk.content, str):
                text.append(chunk.content)
        assert tools == steps - 1, tools
        assert "".join(text) == TEXT, text

    return await measure(turn, steps, runs)


async def autogen(url: str, steps: int, runs: int) -> list[float]:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.messages import TextMessage
    from autogen_core import CancellationToken
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    async def noop() -> str:
        """Do nothing."""
        return "ok"

    client = OpenAIChatCompletionClient(
        model="bench", base_url=url, api_key="bench",
        model_info={"vision": False, "function_calling": True, "json_output": False,
                    "family": "unknown", "structured_output": False},
    )

    async def turn() -> None:
        agent = AssistantAgent("bench", client, tools=[noop], model_client_stream=True,
                               reflect_on_tool_use=True, max_tool_iterations=steps)
        tools, last = 0, None
        async for event in agent.on_messages_stream([TextMessage(content="go", source="user")],
                                                    CancellationToken()):
            tools += type(event).__name__ == "ToolCallExecutionEvent"
            last = event
        assert tools == steps - 1, tools
        assert getattr(getattr(last, "chat_message", None), "content", None) == TEXT, last

    return await measure(turn, steps, runs)


RUNNERS: dict[str, Callable[[str, int, int], Awaitable[list[float]]]] = {
    "floor": floor, "agentloop": agentloop_entry, "openai-agents": openai_agents,
    "pydantic-ai": pydantic_ai, "langgraph": langgraph, "autogen": autogen,
}


def run_entry(entry: str, quick: bool) -> None:
    steps, runs = (QUICK_STEPS, QUICK_RUNS) if quick else (STEPS, RUNS)
    with sse_server.started(steps, CHUNKS) as url:
        runner = RUNNERS[entry]
        if entry in ("floor", "agentloop"):
            import trio

            values = trio.run(runner, url, steps, runs)
        else:
            import asyncio

            values = asyncio.run(runner(url, steps, runs))
    print("RESULT " + json.dumps({"entry": entry, "cpu_us_per_step": values}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry", choices=ENTRIES)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    if args.entry:
        run_entry(args.entry, args.quick)
        return
    entries = []
    for entry in ENTRIES:
        done = subprocess.run([sys.executable, "-c", f"import {PROBES[entry]}"],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["import failed"])[-1]
            print(f"skipped {entry}: {why}", flush=True)
        else:
            entries.append(entry)
    rounds: dict[str, list[float]] = {e: [] for e in entries}
    for r in range(args.rounds):
        for entry in entries[r % len(entries):] + entries[: r % len(entries)]:
            argv = [sys.executable, __file__, "--entry", entry, *(["--quick"] * args.quick)]
            done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not lines:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"round {r + 1} {entry}: failed: {tail}", flush=True)
                continue
            values = json.loads(lines[-1][len("RESULT "):])["cpu_us_per_step"]
            rounds[entry].append(statistics.median(values))
            print(f"round {r + 1} {entry}: {rounds[entry][-1]:.1f} us CPU/step", flush=True)
    base = statistics.median(rounds["floor"]) if rounds.get("floor") else None
    out = {}
    print(f"\n{'entry':<16} {'CPU us/step':>12} {'x floor':>8}")
    for entry, values in rounds.items():
        if not values:
            continue
        med = statistics.median(values)
        ratio = med / base if base else None
        out[entry] = {"cpu_us_per_step": med, "rounds": values, "x_floor": ratio}
        print(f"{entry:<16} {med:12.1f} {ratio if ratio else float('nan'):8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
