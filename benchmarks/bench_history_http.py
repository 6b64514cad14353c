"""Per-step cost against the history's length, over real HTTP.

    python benchmarks/bench_history_http.py [--quick] [--runs N]

``bench_core.py history`` on the in-process model shows the runtime's own step does not grow
with the history; a request to a provider carries the whole conversation, though, so this
runs the same 50-step turn (10 chunks and one tool call per step) through
``OpenAIChatAdapter`` from ``sse_server.py`` (a server in a process of its own) on sessions
seeded with 10 and with 1,000 messages, interleaved. The figure is this process's CPU time
per step (the server's work is not in it), best of N; what grows with the history is
building and sending the request body. Beside it, in process: building the body of one
1,000-message request as it is sent (each message encoded once per history) and encoded
whole, as it was.
"""

from __future__ import annotations

import gc
import sys
import time

import sse_server
import trio
from bench_core import seed_history

import agentloop
from agentloop._bus import EventBus
from agentloop._json import FrozenDict, freeze
from agentloop._model import CallConfig, LLMRequest
from agentloop._session import Session
from agentloop.llm import OpenAIChatAdapter
from agentloop.llm._wire import encode_body

STEPS, CHUNKS = 50, 10
QUICK = "--quick" in sys.argv
RUNS = 1 if QUICK else int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 5
HISTORIES = (10, 1000)


def body_us() -> tuple[float, float]:
    """Microseconds to build one 1,000-message request body: as sent, and encoded whole."""
    adapter = OpenAIChatAdapter("http://127.0.0.1:9/v1", api_key="bench")
    session = Session("body", FrozenDict(), EventBus())
    for i in range(500):
        session.append("user/message", freeze({"message_id": f"m{i}", "content": f"q {i}"}), i)
        session.append("assistant/message", freeze({"content": f"answer {i} " * 20}), i)
    request = LLMRequest(system="You are helpful.", messages=session.messages(), tools=(),
                         config=CallConfig(provider="p", model="m", max_tokens=64))
    assert adapter._content(request) == encode_body(adapter._body(request))
    spliced = whole = float("inf")
    for _ in range(RUNS + 2):
        start = time.process_time_ns()
        for _ in range(50):
            adapter._content(request)
        spliced = min(spliced, (time.process_time_ns() - start) / 50 / 1000)
        start = time.process_time_ns()
        for _ in range(5):
            encode_body(adapter._body(request))
        whole = min(whole, (time.process_time_ns() - start) / 5 / 1000)
    return spliced, whole


async def main() -> None:
    best = {h: float("inf") for h in HISTORIES}
    async with agentloop.open_runtime() as rt:

        @rt.tools.tool(concurrency="parallel")
        async def noop() -> str:
            """Do nothing."""
            return "ok"

        with sse_server.started(STEPS, CHUNKS) as url:
            rt.llm.register("http", OpenAIChatAdapter(url, api_key="bench"))
            options = agentloop.AgentOptions(provider="http", model="bench")
            for n in range(-1, RUNS):  # -1: the warm-up round
                for history in HISTORIES:
                    handle = await rt.agents.create(
                        session_id=f"h{history}-{n}", agent_options=options,
                        seed=seed_history(history) or None,
                    )
                    async with handle:
                        agent = handle.agent
                        gc.collect()
                        start = time.process_time_ns()
                        agent.followup("go")
                        await agent.wait_idle()
                        elapsed = time.process_time_ns() - start
                        end = agent.session.events[-1]
                        assert end.data["reason"] == "completed", end
                    if n >= 0:
                        best[history] = min(best[history], elapsed / STEPS / 1000)
    small, large = best[10], best[1000]
    print(f"per step over loopback HTTP, {STEPS}-step turn, CPU clock, best of {RUNS}")
    print(f"  10 messages:     {small:8.1f} us/step")
    print(f"  1,000 messages:  {large:8.1f} us/step")
    print(f"  ratio:           {large / small:8.3f}x")
    spliced, whole = body_us()
    print("one 1,000-message request body, in process, CPU clock")
    print(f"  as sent:         {spliced:8.1f} us")
    print(f"  encoded whole:   {whole:8.1f} us")


if __name__ == "__main__":
    trio.run(main)
