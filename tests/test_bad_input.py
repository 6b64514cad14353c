"""Adversarial input, round two: each bad input is refused with an error naming what is
wrong, or handled correctly; nothing accepted is lost (one regression test per defect)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import loopback
import pytest
import trio
import trio.testing
from agentloop_subagent import Profile, subagents

import agentloop
from agentloop import AgentOptions, Context
from agentloop.llm import LLMRequest, OpenAIChatAdapter
from agentloop.testing import (
    Finish,
    FunctionModel,
    Recording,
    TextDelta,
    ToolCallDelta,
    record_stream,
    replay_stream,
)

OPTIONS = AgentOptions(provider="fn", model="m")
Part = TextDelta | ToolCallDelta | Finish


def depth_of(rt: Context, request: LLMRequest) -> int:
    session = rt.sessions.get(request.session_id)
    assert session is not None
    return int(session.meta.get("depth", 0))


# --- High: a sub-agent sandbox holds down the whole tree ----------------------------------


@pytest.mark.parametrize("grandchild_profile", [None, "wide"])
async def test_a_profile_allow_list_reaches_the_childs_own_sub_agents(
    grandchild_profile: str | None,
) -> None:
    profiles = [Profile("limited", tools=("subagent", "safe")),
                Profile("wide", tools=("subagent", "safe", "danger"))]
    ran: list[str] = []
    offered: dict[int, list[str]] = {}
    async with agentloop.open_runtime(plugins=[subagents(profiles=profiles)]) as rt:

        @rt.tools.tool()
        async def safe() -> str:
            """Harmless."""
            ran.append("safe")
            return "safe ran"

        @rt.tools.tool()
        async def danger() -> str:
            """Must never run below a sandbox that leaves it out."""
            ran.append("danger")
            return "danger ran"

        async def fn(request: LLMRequest) -> AsyncIterator[Part]:
            depth = depth_of(rt, request)
            last = request.messages[-1]
            offered.setdefault(depth, [t.name for t in request.tools])
            if last.role == "user":
                if depth == 0:
                    call = ("subagent", {"task": "go", "agent": "limited"})
                elif depth == 1:
                    args: dict[str, Any] = {"task": "go deeper"}
                    if grandchild_profile is not None:
                        args["agent"] = grandchild_profile
                    call = ("subagent", args)
                else:
                    call = ("danger", {})
                yield ToolCallDelta(0, id=f"c{depth}", name=call[0],
                                    arguments=json.dumps(call[1]))
                yield Finish("tool_calls")
                return
            yield TextDelta(last.text)
            yield Finish("stop")

        rt.llm.register("fn", FunctionModel(fn))
        async with await rt.agents.create(session_id="p", agent_options=OPTIONS) as handle:
            result = await handle.agent.ask("x")
    assert "danger" in offered[0]
    assert sorted(offered[1]) == ["safe", "subagent"]
    assert sorted(offered[2]) == ["safe", "subagent"]  # inherited, never widened
    assert ran == []
    assert "may only call: safe, subagent" in result.text


# --- High: record_stream scrubs by value, across reads, in every header ------------------

GOOG = "AIzaSyD-goog-key-0123456789abcdef"
AUTH = "tok-auth-0123456789abcdefghij"
BEARER = "sk-live-abcdefghijklmnop1234"


async def test_record_stream_scrubs_keys_split_across_reads_and_in_any_header(
    tmp_path: Path,
) -> None:
    body = loopback.fixture("openai-chat-tool-call.sse")
    echo = f'data: {{"echo": "{GOOG}", "also": "{AUTH}"}}\n\n'.encode()
    half = echo.index(GOOG.encode()) + len(GOOG) // 2

    async def provider(request: loopback.Request, stream: trio.SocketStream) -> None:
        assert request.headers["x-goog-api-key"] == GOOG
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            + f"X-Echo-Key: {GOOG}\r\nX-Trace: user {AUTH} ok\r\n".encode()
            + b"Connection: close\r\n\r\n"
        )
        await stream.send_all(body)
        # The proxy reads the first half of the key alone before the second is sent.
        await stream.send_all(echo[:half])
        await trio.testing.wait_all_tasks_blocked()
        await stream.send_all(echo[half:])

    file = tmp_path / "exchange.json"
    request = loopback.make_request()
    headers = {"x-goog-api-key": GOOG, "X-Auth-Token": AUTH}
    async with loopback.serve(provider) as upstream, record_stream(upstream.url, file) as proxy:
        adapter = OpenAIChatAdapter(proxy.url, api_key=BEARER, headers=headers)
        live = await loopback.collect(adapter, request)
    saved = file.read_text()
    for secret in (GOOG, AUTH, BEARER, GOOG[: len(GOOG) // 2], GOOG[len(GOOG) // 2:]):
        assert secret not in saved, secret
    (exchange,) = Recording.load(file).exchanges
    # The cut between the two reads survives, just past the scrubbed key.
    assert any(c.endswith(b"<scrubbed>") for c in exchange.chunks)
    assert len(exchange.chunks) >= 2
    assert dict(exchange.response_headers)["x-echo-key"] == "<scrubbed>"
    assert dict(exchange.response_headers)["x-trace"] == "user <scrubbed> ok"
    async with replay_stream(file) as replay:
        replayed = await loopback.collect(OpenAIChatAdapter(replay.url), request)
    assert replayed == live


async def test_record_stream_scrubs_a_key_passed_in_the_query(tmp_path: Path) -> None:
    async def provider(request: loopback.Request, stream: trio.SocketStream) -> None:
        await loopback.respond(stream, 200, json.dumps({"path": request.path}).encode())

    file = tmp_path / "exchange.json"
    async with (
        loopback.serve(provider) as upstream,
        record_stream(upstream.url, file) as proxy,
        httpx.AsyncClient() as client,
    ):
        got = await client.get(f"{proxy.url}/models?key={GOOG}&alt=sse")
    assert GOOG in got.text  # the upstream saw it, the recording does not
    saved = file.read_text()
    assert GOOG not in saved and "alt=sse" in saved


async def test_record_stream_finds_a_listed_secret_cut_in_two_by_the_reads(
    tmp_path: Path,
) -> None:
    secret = "s3cr3t-value-0123456789"
    line = f'data: {{"echo": "{secret}"}}\n\n'.encode()
    half = line.index(secret.encode()) + 7

    async def provider(request: loopback.Request, stream: trio.SocketStream) -> None:
        await loopback.start_stream(stream)
        await stream.send_all(line[:half])
        await trio.testing.wait_all_tasks_blocked()
        await stream.send_all(line[half:])

    file = tmp_path / "exchange.json"
    async with (
        loopback.serve(provider) as upstream,
        record_stream(upstream.url, file, secrets=[secret]) as proxy,
        httpx.AsyncClient() as client,
    ):
        got = await client.post(f"{proxy.url}/chat/completions", content=b"{}")
    assert secret in got.text
    (exchange,) = Recording.load(file).exchanges
    assert exchange.chunks == (line[:line.index(secret.encode())] + b"<scrubbed>",
                               b'"}\n\n')
