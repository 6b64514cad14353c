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
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    record_stream,
    replay_stream,
    reply,
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


# --- Medium: an empty prompt is refused at send ---------------------------------------------


@pytest.mark.parametrize("content", [
    "", "   \n\t", [], [{"type": "text", "text": ""}],
    [{"type": "text", "text": "fine"}, {"type": "text", "text": "  "}],
])
async def test_an_empty_prompt_is_refused_at_send_and_changes_nothing(
    rt: Context, content: Any,
) -> None:
    rt.llm.register("s", ScriptedModel([reply("ok")]))
    async with await rt.agents.create(
        session_id="e", agent_options=AgentOptions(provider="s", model="m")
    ) as handle:
        agent = handle.agent
        for send in (agent.followup, agent.steer, agent.inject):
            with pytest.raises(agentloop.InvalidContent, match="empty"):
                send(content)
        with pytest.raises(agentloop.InvalidContent, match="empty"):
            await agent.ask(content)
        pending = agent.followup("a real question")
        with pytest.raises(agentloop.InvalidContent, match="empty"):
            agent.edit(pending, content)
        await agent.wait_idle()
        # Nothing empty reached the log, and the session still works.
        assert [m.text for m in agent.session.messages()] == ["a real question", "ok"]
    with pytest.raises(agentloop.InvalidContent, match="empty"):
        await rt.subagents.run(content)


# --- Medium: a seed is a log prefix that ends at a turn boundary ----------------------------


def _turn(n: int, text: str) -> list[dict[str, Any]]:
    return [
        {"type": "turn/start", "turn": n, "data": {"turn": n}},
        {"type": "user/message", "turn": n,
         "data": {"message_id": f"m{n}", "content": text, "source": None}},
        {"type": "assistant/message", "turn": n,
         "data": {"step": 1, "content": f"re: {text}", "source_event_seqs": [],
                  "finish_reason": "stop", "usage": {}, "interrupted": False}},
        {"type": "turn/end", "turn": n, "data": {"turn": n, "reason": "completed"}},
    ]


@pytest.mark.parametrize(("seed", "match"), [
    (_turn(1, "a")[:2], r"seed: ends inside turn 1 \(its turn/start is seed\[0\]"),
    (_turn(1, "a")[:2] + _turn(2, "b"), r"seed\[2\]: turn/start \(turn 2\) inside turn 1"),
    ([_turn(1, "a")[-1]], r"seed\[0\]: turn/end without a turn/start"),
    ([{"type": "user/message", "data": {}}], r"seed\[0\] \(user/message\): malformed.*content"),
    ([{"type": "tool/result", "data": {"call_id": "c"}}], r"seed\[0\] \(tool/result\)"),
])
async def test_a_seed_cut_mid_turn_or_malformed_is_invalid_content(
    rt: Context, seed: list[dict[str, Any]], match: str,
) -> None:
    with pytest.raises(agentloop.InvalidContent, match=match):
        await rt.agents.create(session_id="s", seed=seed)
    assert rt.agents.get("s") is None
    with pytest.raises(agentloop.InvalidContent, match=match):
        await rt.subagents.spawn(seed=seed)
    # A whole turn is a valid seed.
    rt.llm.register("s", ScriptedModel([reply("two")]))
    async with await rt.agents.create(
        session_id="ok", seed=_turn(1, "one"), agent_options=AgentOptions(provider="s", model="m")
    ) as handle:
        assert (await handle.agent.ask("and?")).text == "two"


# --- Low: meta cannot lift subagents.max_depth ----------------------------------------------


@pytest.mark.parametrize("depth", [-10, -1, True, 1.5, "0"])
async def test_a_bad_meta_depth_is_refused(rt: Context, depth: Any) -> None:
    with pytest.raises(agentloop.InvalidContent, match=r"meta\['depth'\].*non-negative"):
        await rt.agents.create(session_id="d", meta={"depth": depth})
    assert rt.agents.get("d") is None
    async with await rt.agents.create(session_id="d", meta={"depth": 2}) as handle:
        assert handle.agent.session.meta["depth"] == 2
