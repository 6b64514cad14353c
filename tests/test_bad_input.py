"""Adversarial input, round two: each bad input is refused with an error naming what is
wrong, or handled correctly; nothing accepted is lost (one regression test per defect)."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import loopback
import pytest
import trio
import trio.testing
from agentloop_subagent import Profile, subagents

import agentloop
from agentloop import AgentOptions, Context
from agentloop._json import thaw
from agentloop.events import AgentRequest as AgentRequestEvent
from agentloop.llm import (
    AnthropicAdapter,
    LLMRequest,
    OpenAIChatAdapter,
    OpenAIResponsesAdapter,
)
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


# --- Medium: structured output JSON cannot hold, or the type refuses, is a correction -------

NUMBER = {"type": "object", "properties": {"answer": {"type": "number"}},
          "required": ["answer"]}
DEEP = '{"answer": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}"


@attrs.frozen
class Positive:
    x: int = attrs.field(validator=attrs.validators.ge(0))


@dataclasses.dataclass(frozen=True)
class Even:
    n: int

    def __post_init__(self) -> None:
        if self.n % 2:
            raise ValueError(f"n must be even, got {self.n}")


class NativeModel(FunctionModel):
    supports_json_schema = True


BAD_OUTPUTS = [
    (NUMBER, '{"answer": 1e400}', '{"answer": 2}', {"answer": 2}, "cannot be stored"),
    (NUMBER, DEEP, '{"answer": 2}', {"answer": 2}, "JSON"),
    (Positive, '{"x": -1}', '{"x": 2}', Positive(2), "Positive refused the output"),
    (Even, '{"n": 3}', '{"n": 4}', Even(4), "n must be even, got 3"),
]


def _corrections(agent: agentloop.Agent) -> list[str]:
    return [json.dumps(thaw(e.data["content"])) for e in agent.session.events
            if e.type in ("user/message", "steering/message") and e.data.get("source")
            and e.data["source"].get("kind") == "output-correction"] + [
        str(e.data["content"]) for e in agent.session.events
        if e.type == "tool/result" and e.data.get("error_code") == "OUTPUT_INVALID"]


@pytest.mark.parametrize("native", [False, True], ids=["final_result", "native"])
@pytest.mark.parametrize(("output_type", "bad", "good", "expected", "said"), BAD_OUTPUTS)
async def test_unholdable_or_refused_output_is_sent_back_for_correction(
    rt: Context, native: bool, output_type: Any, bad: str, good: str, expected: Any, said: str,
) -> None:
    if native:
        texts = iter([bad, good])

        async def fn(request: LLMRequest) -> AsyncIterator[Part]:
            yield TextDelta(next(texts))
            yield Finish("stop")

        rt.llm.register("s", NativeModel(fn))
    else:
        rt.llm.register("s", ScriptedModel([
            reply(tool_calls=[("final_result", bad, "c1")]),
            reply(tool_calls=[("final_result", good, "c2")]),
        ]))
    async with await rt.agents.create(
        session_id="o", agent_options=AgentOptions(provider="s", model="m", output_retries=1)
    ) as handle:
        result = await handle.agent.ask("q", output_type=output_type)
        assert result.reason == "completed"
        assert result.output == expected
        told = _corrections(handle.agent)
        assert len(told) == 1 and said in told[0], told


async def test_a_refused_output_counts_against_output_retries(rt: Context) -> None:
    rt.llm.register("s", ScriptedModel([
        reply(tool_calls=[("final_result", {"x": -1}, "c1")]),
        reply(tool_calls=[("final_result", {"x": -2}, "c2")]),
    ]))
    async with await rt.agents.create(
        session_id="o", agent_options=AgentOptions(provider="s", model="m", output_retries=1)
    ) as handle:
        with pytest.raises(agentloop.TurnFailed) as info:
            await handle.agent.ask("q", output_type=Positive)
        assert info.value.error.code == "OUTPUT_INVALID"
        assert "Positive refused the output" in str(info.value.error)


@pytest.mark.parametrize(("schema", "said"), [
    ({"type": "array", "items": {"type": "integer"}}, "must describe a JSON object"),
    ({"properties": {"a": {"type": "integer"}}}, "must describe a JSON object"),
    ({"type": "object", "properties": 5}, '"properties" must be an object'),
    ({"type": "object", "properties": {"a": 3}}, '"properties".a must be a schema'),
    ({"type": "object", "required": "a"}, '"required" must be a list'),
    ({"type": "object", "additionalProperties": "no"}, '"additionalProperties"'),
    ({"type": "object", "default": float("nan")}, "not JSON"),
])
async def test_a_malformed_schema_is_refused_before_any_model_call(
    rt: Context, schema: dict[str, Any], said: str,
) -> None:
    model = ScriptedModel([reply("never")])
    rt.llm.register("s", model)
    async with await rt.agents.create(
        session_id="o", agent_options=AgentOptions(provider="s", model="m")
    ) as handle:
        with pytest.raises(agentloop.ToolDefinitionError, match=re.escape(said)):
            await handle.agent.ask("q", output_type=schema)
        await handle.agent.wait_idle()
        assert model.requests == []
        assert not [e for e in handle.agent.session.events if e.type == "turn/start"]


# --- Medium: a finished background job keeps its result, not its child ----------------------


async def test_a_finished_job_releases_its_disposed_child() -> None:
    from agentloop._session import Session

    answer = "a long answer " * 700  # about 9.8 KiB, as reported
    model = ScriptedModel([reply(answer)] * 3)
    async with agentloop.open_runtime() as rt:
        rt.llm.register("s", model)
        options = AgentOptions(provider="s", model="m")
        async with await rt.agents.create(session_id="p", agent_options=options):
            jobs = [await rt.jobs.start(f"task {i}", agent_options=options) for i in range(3)]
            results = [await job.result() for job in jobs]
            await trio.testing.wait_all_tasks_blocked()
            model.requests.clear()  # the double keeps every request it saw; the runtime must not
            gc.collect()
            kept = {o.id for o in gc.get_objects() if isinstance(o, Session)}
            assert kept.isdisjoint(job.session_id for job in jobs), kept
            assert [job.status for job in jobs] == ["done"] * 3
            assert all(r.text == answer for r in results)
            assert (await jobs[0].result()).text == answer  # the result stays
            assert rt.jobs.list() == jobs


# --- Medium: the Lagged marker reports every missed event -----------------------------------


async def test_a_reader_that_drains_is_told_of_every_event_it_missed(rt: Context) -> None:
    from agentloop.events import InboxInserted

    async with await rt.agents.create(session_id="l") as handle:
        agent = handle.agent
        async with rt.events.subscribe(InboxInserted, capacity=2) as rx:
            for i in range(5):
                agent.inject(f"burst1-{i}")
            await trio.testing.wait_all_tasks_blocked()
            for i in range(4):
                agent.inject(f"burst2-{i}")
            await trio.testing.wait_all_tasks_blocked()
            got: list[Any] = []
            while True:
                try:
                    got.append(rx.receive_nowait())
                except trio.WouldBlock:
                    break
        kept = [g for g in got if not isinstance(g, agentloop.Lagged)]
        missed = sum(g.missed for g in got if isinstance(g, agentloop.Lagged))
        assert len(kept) == 2
        assert len(kept) + missed == 9, got


# --- Medium: compact summarises on the agent's effective route ------------------------------

COMPACT = {"plugins": ["compact"],
           "compact": {"max_context_tokens": 200, "keep_recent_turns": 1}}


def _long_answers(summaries: list[LLMRequest], *, finish_summary: bool = True) -> FunctionModel:
    from agentloop_compact import SUMMARY_SYSTEM

    async def fn(request: LLMRequest) -> AsyncIterator[Part]:
        if request.system == SUMMARY_SYSTEM:
            summaries.append(request)
            yield TextDelta("the short version")
            if finish_summary:
                yield Finish("stop")
            return
        yield TextDelta("a long answer that fills the context " * 6)
        yield Finish("stop", {"input_tokens": 150, "output_tokens": 60})

    return FunctionModel(fn)


def _replaced(agent: agentloop.Agent) -> list[Any]:
    return [e.data for e in agent.session.events if e.type == "history/replaced"]


async def test_compact_follows_an_agent_routed_by_an_agent_request_hook() -> None:
    summaries: list[LLMRequest] = []
    async with agentloop.open_runtime(COMPACT) as rt:
        rt.llm.register("routed", _long_answers(summaries))

        def route(event: AgentRequestEvent) -> Any:
            return attrs.evolve(event.config, provider="routed", model="m-routed")

        rt.events.on(AgentRequestEvent, route)
        async with await rt.agents.create(session_id="r") as handle:  # no options at all
            for i in range(3):
                await handle.agent.ask(f"question {i}")
            assert _replaced(handle.agent)
            assert summaries and summaries[0].config.provider == "routed"
            assert summaries[0].config.model == "m-routed"


async def test_compact_follows_an_agent_resumed_without_options(tmp_path: Path) -> None:
    summaries: list[LLMRequest] = []
    stored = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    async with agentloop.open_runtime(stored) as rt:
        rt.llm.register("s", _long_answers(summaries))
        async with await rt.agents.create(
            session_id="x", agent_options=AgentOptions(provider="s", model="m")
        ) as handle:
            for i in range(2):
                await handle.agent.ask(f"question {i}")
    async with agentloop.open_runtime({**stored, **COMPACT}) as rt:
        rt.llm.register("s", _long_answers(summaries))
        async with await rt.agents.resume(resume_session_id="x") as handle:
            assert handle.agent.options.provider is None
            await handle.agent.ask("and now?")
            assert _replaced(handle.agent)
            assert [r.config.provider for r in summaries] == ["s"]


# --- Low: compact refuses a summary stream that ended without a finish ----------------------


async def test_compact_refuses_a_summary_stream_without_a_finish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    summaries: list[LLMRequest] = []
    async with agentloop.open_runtime(COMPACT) as rt:
        rt.llm.register("s", _long_answers(summaries, finish_summary=False))
        async with await rt.agents.create(
            session_id="c", agent_options=AgentOptions(provider="s", model="m")
        ) as handle:
            for i in range(3):
                await handle.agent.ask(f"question {i}")
            assert summaries
            assert _replaced(handle.agent) == []
    assert "the summary stream ended without a finish" in caplog.text


# --- Low: a lone string is not a list of one-letter routes ----------------------------------


@pytest.mark.parametrize(("kw", "said"), [
    ({"routes": "openai"}, "routes: must be an array of routes, got the string 'openai'"),
    ({"chains": {"openai": "anthropic"}}, "chains.openai: must be an array of routes"),
])
def test_fallback_refuses_a_string_where_routes_go(kw: dict[str, Any], said: str) -> None:
    from agentloop_fallback import fallback

    with pytest.raises(agentloop.ConfigError, match=re.escape(said)):
        fallback(**kw)


async def test_fallback_from_the_config_refuses_a_string_too() -> None:
    config = {"plugins": ["fallback"], "fallback": {"routes": "openai"}}
    with pytest.raises(agentloop.ConfigError, match=r"fallback\.routes"):
        async with agentloop.open_runtime(config):
            pass


# --- Low: a broken base_url, two config agents on one session -------------------------------


@pytest.mark.parametrize("adapter", [OpenAIChatAdapter, AnthropicAdapter, OpenAIResponsesAdapter])
@pytest.mark.parametrize(("url", "said"), [
    ("http://[::1", "is not a valid URL"),
    ("api.openai.com/v1", "must be an http:// or https:// URL with a host"),
    ("", "must be an http:// or https:// URL with a host"),
    ("ftp://host/v1", "must be an http:// or https:// URL with a host"),
])
def test_a_broken_base_url_is_a_config_error_naming_it(adapter: Any, url: str, said: str) -> None:
    with pytest.raises(agentloop.ConfigError, match=re.escape(f"base_url {url!r} {said}")):
        adapter(url, api_key="k")


def test_a_broken_base_url_hides_its_userinfo() -> None:
    with pytest.raises(agentloop.ConfigError) as info:
        OpenAIChatAdapter("http://user:hunter2@[::1/v1")
    assert "hunter2" not in str(info.value)


async def test_a_broken_base_url_in_the_config_fails_the_runtime_with_its_path() -> None:
    config = {"providers": {"p": {"kind": "openai", "base_url": "http://[::1", "model": "m"}}}
    with pytest.raises(agentloop.ConfigError, match=r"providers\.p: .*base_url 'http://\[::1'"):
        async with agentloop.open_runtime(config):
            pass


@pytest.mark.parametrize(("first", "second"), [
    ("session_id", "session_id"), ("session_id", "resume_session_id"),
    ("resume_session_id", "resume_session_id"),
])
async def test_two_config_agents_on_one_session_are_a_config_error(
    first: str, second: str,
) -> None:
    config = {"agents": [{"id": "a", first: "same"}, {"id": "b", second: "same"}]}
    said = f"agents[1].{second}: session 'same' is already agents[0].{first}"
    with pytest.raises(agentloop.ConfigError, match=re.escape(said)):
        async with agentloop.open_runtime(config):
            pass


async def test_a_stored_negative_depth_does_not_lift_the_limit(tmp_path: Path) -> None:
    from agentloop_sqlite import SqliteSessionStore

    path = str(tmp_path / "s.db")
    async with SqliteSessionStore(path) as store:
        # Stored before negative depths were refused at create.
        await store.create("old", agentloop.FrozenDict(depth=-10))

    async def fn(request: LLMRequest) -> AsyncIterator[Part]:
        last = request.messages[-1]
        if last.role == "user":  # every agent delegates once
            yield ToolCallDelta(0, id="c", name="delegate", arguments="{}")
            yield Finish("tool_calls")
            return
        yield TextDelta(last.text)
        yield Finish("stop")

    model = FunctionModel(fn)
    async with agentloop.open_runtime(
        {"persistence": {"backend": "sqlite", "path": path}}
    ) as rt:
        rt.settings.set("subagents.max_depth", 1)
        rt.llm.register("s", model)

        @rt.tools.tool()
        async def delegate() -> str:
            """Delegate."""
            return (await rt.subagents.run("go")).text

        async with await rt.agents.resume(
            resume_session_id="old", agent_options=AgentOptions(provider="s", model="m")
        ) as handle:
            answer = await handle.agent.ask("x")
    # The stored agent counts as depth 0: one child (depth 1), whose own delegation is refused.
    assert len({r.session_id for r in model.requests}) == 2
    assert "subagents.max_depth" in answer.text
