"""The fallback plugin: a call that fails for good moves to the next configured route.

The end-to-end cases run over real loopback HTTP (provider A answers an error status,
provider B streams the answer); the ones counting retries and fallbacks together use scripted
models under trio's MockClock with autojump, so backoff waits cost no real time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import agentloop_fallback
import agentloop_retry
import attrs
import loopback
import pytest
import trio
import trio.testing
from trio.testing import MockClock

import agentloop
from agentloop import ConfigError, ProviderError
from agentloop.events import AgentRequestError, LlmRetry
from agentloop.testing import ScriptedModel, check_log, reply

GUARD = 100_000  # virtual seconds under autojump: a hang jumps to it and fails


def anthropic_answer(text: str) -> bytes:
    """A complete Messages stream answering ``text``."""
    return loopback.named_sse(
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "usage": {"input_tokens": 3, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    )


def chat_answer(text: str) -> bytes:
    return loopback.sse(
        {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        done=True,
    )


def of(events: Sequence[agentloop.SessionEvent], type_: str) -> list[agentloop.SessionEvent]:
    return [e for e in events if e.type == type_]


async def one_turn(
    rt: agentloop.Context, options: agentloop.AgentOptions, prompt: str = "hi"
) -> tuple[agentloop.SessionEvent, ...]:
    handle = await rt.agents.create(session_id="s1", agent_options=options)
    async with handle:
        agent = handle.agent
        agent.followup(prompt)
        await agent.wait_idle()
        check_log(agent.session)
        return tuple(agent.session.events)


# --- over loopback HTTP -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 500])
async def test_a_terminal_failure_falls_back_to_the_next_route(status: int) -> None:
    failing = loopback.json_error(status, {"error": {"message": "nope", "type": "bad"}})
    retries: list[LlmRetry] = []
    with trio.fail_after(20):
        async with loopback.serve(failing) as a, loopback.serve(
            loopback.sse_body(anthropic_answer("from B"))
        ) as b:
            config = {
                "plugins": ["fallback"],
                "providers": {
                    "a": {"kind": "openai", "base_url": a.url},
                    "b": {"kind": "anthropic", "base_url": b.url, "api_key": "k"},
                },
                "fallback": {"routes": ["a:gpt", "b:claude"]},
            }
            async with agentloop.open_runtime(config) as rt:
                rt.events.on(LlmRetry, retries.append)
                events = await one_turn(rt, agentloop.AgentOptions(
                    provider="a", model="gpt", reasoning_effort="low"))

    assert of(events, "turn/end")[-1].data["reason"] == "completed"
    assert of(events, "assistant/message")[-1].data["content"] == "from B"
    first, second = of(events, "request/header")
    assert (first.data["provider"], first.data["model"]) == ("a", "gpt")
    assert "after_error" not in first.data
    assert (second.data["provider"], second.data["model"]) == ("b", "claude")
    failed = second.data["after_error"]
    assert (failed["provider"], failed["model"], failed["attempt"]) == ("a", "gpt", 1)
    assert failed["error"]["status"] == status
    assert failed["error"]["message"] == "nope"
    # A's reasoning_effort belongs to A's adapter: the Messages API would refuse it.
    assert second.data["config"]["reasoning_effort"] is None
    assert "reasoning_effort" not in b.requests[0].json()
    assert len(a.requests) == 1
    assert len(b.requests) == 1
    assert a.requests[0].json()["reasoning_effort"] == "low"
    assert [(r.attempt, r.route) for r in retries] == [(1, "b:claude")]
    assert retries[0].error.status == status


@attrs.define
class Arrived(loopback.Hang):
    """A hanging stream that also says when the request has come in."""

    arrived: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, request: loopback.Request, stream: trio.SocketStream) -> None:
        self.arrived.set()
        await super().__call__(request, stream)


async def test_a_cancelled_turn_never_falls_back() -> None:
    hang = Arrived(b": connected\n\n")
    with trio.fail_after(20):
        async with loopback.serve(hang) as a, loopback.serve(
            loopback.sse_body(chat_answer("from B"))
        ) as b:
            config = {
                "providers": {
                    "a": {"kind": "openai", "base_url": a.url},
                    "b": {"kind": "openai", "base_url": b.url},
                },
            }
            plugin = agentloop_fallback.fallback(["a:m", "b:m"])
            async with agentloop.open_runtime(config, plugins=[plugin]) as rt:
                handle = await rt.agents.create(
                    session_id="s1", agent_options=agentloop.AgentOptions(provider="a", model="m")
                )
                async with handle:
                    agent = handle.agent
                    agent.followup("hi")
                    await hang.arrived.wait()
                    assert agent.cancel() is True
                    await agent.wait_idle()
                    events = agent.session.events
            await hang.disconnected.wait()

    assert [e.data["reason"] for e in of(events, "turn/end")] == ["aborted"]
    assert len(of(events, "request/header")) == 1
    assert b.requests == []


# --- with scripted models ---------------------------------------------------------------------


async def test_every_route_is_tried_once_per_call_and_the_last_failure_ends_the_turn(
    autojump_clock: MockClock,
) -> None:
    a = ScriptedModel([ProviderError("a down", status=400), "a again"])
    b = ScriptedModel([ProviderError("b down", status=401)])
    c = ScriptedModel([ProviderError("c down", status=404)])
    seen: list[AgentRequestError] = []
    # The current route, a repeated route and a provider-only route are all in the chain.
    plugin = agentloop_fallback.fallback(["b:m", "a:m", "b:m", "c", "a"])
    async with agentloop.open_runtime(plugins=[plugin]) as rt:
        for name, model in (("a", a), ("b", b), ("c", c)):
            rt.llm.register(name, model)
        rt.events.on(AgentRequestError, seen.append, priority=1000)
        with trio.fail_after(GUARD):
            events = await one_turn(rt, agentloop.AgentOptions(provider="a", model="m"))

    end = of(events, "turn/end")[-1].data
    assert end["reason"] == "error"
    assert end["error"]["message"] == "c down"
    # a, then the routes after it in the chain (b, c), never a second time.
    assert [(h.data["provider"], h.data["model"]) for h in of(events, "request/header")] == [
        ("a", "m"), ("b", "m"), ("c", "m")
    ]
    assert (len(a.requests), len(b.requests), len(c.requests)) == (1, 1, 1)
    assert [e.routes for e in seen] == [("a:m",), ("a:m", "b:m"), ("a:m", "b:m", "c:m")]
    assert [e.attempt for e in seen] == [1, 1, 1]


async def test_retries_come_first_and_each_route_counts_its_own(
    autojump_clock: MockClock,
) -> None:
    busy = ProviderError("busy", status=503)
    a = ScriptedModel([busy, busy])
    b = ScriptedModel([busy, "from b"])
    retries: list[LlmRetry] = []
    plugins = [
        agentloop_retry.retry(max_attempts=2, base_delay=1.0, jitter=False),
        agentloop_fallback.fallback(["a:m", "b:n"]),
    ]
    async with agentloop.open_runtime(plugins=plugins) as rt:
        rt.llm.register("a", a)
        rt.llm.register("b", b)
        rt.events.on(LlmRetry, retries.append)
        with trio.fail_after(GUARD):
            events = await one_turn(rt, agentloop.AgentOptions(provider="a", model="m"))

    assert of(events, "turn/end")[-1].data["reason"] == "completed"
    assert of(events, "assistant/message")[-1].data["content"] == "from b"
    assert (len(a.requests), len(b.requests)) == (2, 2)
    assert [(r.attempt, r.route, r.delay) for r in retries] == [
        (1, None, 1.0), (2, "b:n", 0.0), (1, None, 1.0)
    ]
    headers = of(events, "request/header")
    assert [h.data["after_error"]["attempt"] for h in headers[1:]] == [1, 2, 1]
    assert [h.data["after_error"]["provider"] for h in headers[1:]] == ["a", "a", "b"]
    assert headers[-1].data["provider"] == "b"


async def test_the_next_step_goes_back_to_the_agents_own_route() -> None:
    a = ScriptedModel([ProviderError("no", status=400), "a answers step 2"])
    b = ScriptedModel([reply(tool_calls=[("echo", {"text": "x"})])])
    async with agentloop.open_runtime(plugins=[agentloop_fallback.fallback(["b"])]) as rt:
        rt.llm.register("a", a)
        rt.llm.register("b", b)

        @rt.tools.tool()
        async def echo(text: str) -> str:
            """Echo ``text``."""
            return text

        events = await one_turn(rt, agentloop.AgentOptions(provider="a", model="m"))

    assert of(events, "turn/end")[-1].data["reason"] == "completed"
    assert [h.data["provider"] for h in of(events, "request/header")] == ["a", "b", "a"]
    assert of(events, "tool/result")[-1].data["content"] == "x"
    assert of(events, "assistant/message")[-1].data["content"] == "a answers step 2"


async def test_a_hook_that_cancels_the_turn_stops_the_fallback() -> None:
    a = ScriptedModel([ProviderError("no", status=400)])
    b = ScriptedModel(["never"])
    async with agentloop.open_runtime(plugins=[agentloop_fallback.fallback(["b"])]) as inner:
        inner.llm.register("a", a)
        inner.llm.register("b", b)
        handle = await inner.agents.create(
            session_id="s1", agent_options=agentloop.AgentOptions(provider="a", model="m")
        )

        def cancel_it(event: AgentRequestError) -> None:
            handle.agent.cancel()

        inner.events.on(AgentRequestError, cancel_it)
        retries: list[LlmRetry] = []
        inner.events.on(LlmRetry, retries.append)
        async with handle:
            handle.agent.followup("hi")
            await handle.agent.wait_idle()
            events = handle.agent.session.events

    assert [e.data["reason"] for e in of(events, "turn/end")] == ["aborted"]
    assert b.requests == []
    assert retries == []  # not even announced


async def test_without_a_route_left_the_failure_is_left_alone() -> None:
    a = ScriptedModel([ProviderError("no", status=400)])
    async with agentloop.open_runtime(plugins=[agentloop_fallback.fallback(["a:m"])]) as inner:
        inner.llm.register("a", a)
        events = await one_turn(inner, agentloop.AgentOptions(provider="a", model="m"))
    assert of(events, "turn/end")[-1].data["error"]["message"] == "no"
    assert len(a.requests) == 1


async def test_a_chain_of_its_own_and_a_when_predicate() -> None:
    a = ScriptedModel([ProviderError("quota", status=429, code="insufficient_quota"),
                       ProviderError("bad", status=400)])
    b = ScriptedModel(["from b"])
    c = ScriptedModel(["from c"])
    plugin = agentloop_fallback.fallback(
        ["b"], chains={"a:m": ["c"]}, when=lambda e: e.code == "insufficient_quota"
    )
    async with agentloop.open_runtime(plugins=[plugin]) as inner:
        for name, model in (("a", a), ("b", b), ("c", c)):
            inner.llm.register(name, model)
        events = await one_turn(inner, agentloop.AgentOptions(provider="a", model="m"))
        assert of(events, "assistant/message")[-1].data["content"] == "from c"
        handle = await inner.agents.create(
            session_id="s2", agent_options=agentloop.AgentOptions(provider="a", model="m")
        )
        async with handle:
            handle.agent.followup("hi")
            await handle.agent.wait_idle()
            second = handle.agent.session.events
    assert of(second, "turn/end")[-1].data["reason"] == "error"  # not a quota failure
    assert (len(b.requests), len(c.requests)) == (0, 1)


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"routes": ["a:"]}, "fallback.routes[0]: must be 'provider' or 'provider:model'"),
        ({"routes": "a"}, "fallback.routes: expected an array"),
        ({"routes": ["ok", 3]}, "fallback.routes[1]: expected a string"),
        ({"chains": {"a": [":m"]}}, "fallback.chains.a[0]: must be"),
        ({"chains": {"a": "b"}}, "fallback.chains.a: must be an array"),
        ({"route": ["a"]}, "fallback.route: unknown key; did you mean 'routes'?"),
        ({"when": "always"}, "fallback.when: unknown key"),
    ],
)
async def test_an_invalid_table_fails_the_runtime_start(
    table: Mapping[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        async with agentloop.open_runtime({"plugins": ["fallback"], "fallback": table}):
            pass
    assert problem in str(info.value)


def test_routes_are_checked_when_the_plugin_is_built() -> None:
    with pytest.raises(ConfigError, match=r"^routes\[1\]: "):
        agentloop_fallback.fallback(["a", "b: "])
    assert "a:m" in json.dumps(agentloop_fallback.fallback(["a:m"]).__doc__)


def test_a_model_may_contain_a_colon() -> None:
    route = agentloop_fallback.Route.parse("ollama:llama3:8b")
    assert route == agentloop_fallback.Route("ollama", "llama3:8b")
    policy = agentloop_fallback.FallbackPolicy(routes=("ollama:llama3:8b", "b"))
    config = agentloop.CallConfig(provider="a", model="x")
    assert policy.next_route(config, ["a:x"]) == route
    assert policy.next_route(config, ["a:x", "ollama:llama3:8b"]) == (
        agentloop_fallback.Route("b", "x")
    )
    assert policy.next_route(config, ["a:x", "ollama:llama3:8b", "b:x"]) is None


def test_a_retry_config_must_be_a_call_config() -> None:
    assert agentloop.Retry().config is None
    with pytest.raises(TypeError):
        agentloop.Retry(config={"provider": "b"})  # type: ignore[arg-type]


async def test_the_system_prompt_follows_the_route_the_call_moved_to() -> None:
    a = ScriptedModel([ProviderError("no", status=400), ProviderError("no", status=400)])
    b = ScriptedModel(["b answers"])
    async with agentloop.open_runtime(plugins=[agentloop_fallback.fallback(["b"])]) as rt:
        rt.llm.register("a", a)
        rt.llm.register("b", b)
        options = agentloop.AgentOptions(
            provider="a", model="m", system_prompt="You are {model} on {provider}."
        )
        events = await one_turn(rt, options)
        assert of(events, "turn/end")[-1].data["reason"] == "completed"
        [moved] = b.requests
        assert moved.system == "You are m on b."

        # A handler's own system prompt is kept on every route.
        rt.events.on(
            agentloop.events.AgentRequest,
            lambda e: attrs.evolve(e.request, system="fixed"),
        )
        handle = await rt.agents.create(session_id="s2", agent_options=options)
        async with handle:
            b.add("again")
            handle.agent.followup("hi")
            await handle.agent.wait_idle()
        assert b.requests[-1].system == "fixed"
