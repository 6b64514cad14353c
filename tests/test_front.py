"""The front door: ``open_agent``, ``@tool(requires_approval=True)`` and the default step limit."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from conftest import OPTIONS, of_type
from fake_openai import FakeOpenAI

import agentloop
from agentloop import ConfigError, SettingsError, events
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, ScriptedModel, ToolCallDelta, reply

# --- open_agent ---------------------------------------------------------------------------


async def test_open_agent_with_a_provider_string_calls_that_server(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    async with agentloop.open_agent("openai:gpt-4o-mini", instructions="Be brief.") as agent:
        result = await agent.ask("hi")
    assert result.text == "Hello from the fake model."
    assert result.reason == "completed"
    (request,) = fake.requests
    assert request["model"] == "gpt-4o-mini"
    assert request["messages"][0] == {"role": "system", "content": "Be brief."}
    assert fake.headers[0]["authorization"] == "Bearer sk-test"


async def test_a_base_url_alone_calls_the_server_without_a_key(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OLLAMA_API_KEY", raising=False)
    monkeypatch.setenv("OLLAMA_BASE_URL", fake.url)
    async with agentloop.open_agent("ollama:llama3.2:3b") as agent:
        assert (await agent.ask("hi")).text == "Hello from the fake model."
    assert fake.requests[0]["model"] == "llama3.2:3b"
    assert "authorization" not in fake.headers[0]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("gpt-4o", "model must be 'provider:model' (for example 'openai:gpt-4o-mini'), got "),
        ("acme:x", "unknown provider 'acme' in 'acme:x' (known: anthropic, deepseek, local, "),
        ("openai:gpt-4o-mini", "provider 'openai' needs OPENAI_API_KEY in the environment"),
        ("anthropic:claude", "needs ANTHROPIC_API_KEY"),
        (object(), "a model object with a 'stream' method"),
    ],
)
async def test_a_bad_model_is_refused_before_anything_starts(
    model: object, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as info:
        async with agentloop.open_agent(model):
            pytest.fail("the block must not run")
    assert message in str(info.value)


async def test_a_configured_provider_is_used_as_configured(fake: FakeOpenAI) -> None:
    config = {"providers": {"mine": {"kind": "openai", "base_url": fake.url, "model": "m1"}}}
    async with agentloop.open_agent("mine", config=config) as agent:
        await agent.ask("hi")
    async with agentloop.open_agent("mine:m2", config=config) as agent:
        await agent.ask("hi")
    assert [r["model"] for r in fake.requests] == ["m1", "m2"]


async def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name.
    """
    return f"sunny in {city}"


@agentloop.tool(concurrency="parallel")
def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: what to say.
    """
    return text.upper()


async def test_tools_are_functions_or_tool_values() -> None:
    model = ScriptedModel([
        reply(tool_calls=[("get_weather", {"city": "Paris"}), ("shout", {"text": "hey"})]),
        reply("Sunny."),
    ])
    async with agentloop.open_agent(model, tools=[get_weather, shout]) as agent:
        result = await agent.ask("Weather in Paris?")
        results = [e.data["content"] for e in of_type(agent, "tool/result")]
    assert result.text == "Sunny."
    assert results == ["sunny in Paris", "HEY"]
    assert isinstance(shout, agentloop.Tool)
    assert shout.concurrency == "parallel"


async def test_a_tool_that_is_neither_is_refused() -> None:
    with pytest.raises(TypeError, match=r"tools must be agentloop\.Tool or functions, got 3"):
        async with agentloop.open_agent(ScriptedModel(), tools=[3]):
            pass


@attrs.frozen
class City:
    name: str
    population: int


async def test_output_type_is_the_default_of_every_ask() -> None:
    model = ScriptedModel([
        reply(tool_calls=[("final_result", {"name": "Paris", "population": 2100000})]),
        reply(tool_calls=[("final_result", {"n": 1})]),
    ])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    async with agentloop.open_agent(model, output_type=City) as agent:
        first = await agent.ask("The largest city of France?")
        second = await agent.ask("A number?", output_type=schema)
    assert first.output == City("Paris", 2100000)
    assert second.output == {"n": 1}


async def test_an_output_type_without_a_schema_is_refused_at_open() -> None:
    with pytest.raises(TypeError, match="must describe a JSON object"):
        async with agentloop.open_agent(ScriptedModel(), output_type=int):
            pytest.fail("the block must not run")


async def test_a_session_id_resumes_the_stored_session(tmp_path: Path) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    async with agentloop.open_agent(
        ScriptedModel([reply("one")]), session_id="chat-1", config=config
    ) as agent:
        await agent.ask("first")
    model = ScriptedModel([reply("two")])
    async with agentloop.open_agent(model, session_id="chat-1", config=config) as agent:
        assert (await agent.ask("second")).text == "two"
        assert agent.id == "chat-1"
        assert agent.session.turns == 2
    user_texts = [
        m.content for m in model.requests[0].messages if m.role == "user"
    ]
    assert user_texts == ["first", "second"]


async def test_the_agent_and_runtime_are_gone_after_the_block() -> None:
    async with agentloop.open_agent(ScriptedModel([reply("ok")])) as agent:
        await agent.ask("hi")
    assert agent.status == "disposed"
    assert agent.id.startswith("agent-session-")


# --- @tool(requires_approval=True) -----------------------------------------------------------

ran: list[str] = []


@agentloop.tool(requires_approval=True)
async def deploy(service: str) -> str:
    """Deploy a service.

    Args:
        service: which one.
    """
    ran.append(service)
    return f"{service} deployed"


async def test_a_tool_that_requires_approval_is_parked_until_approved() -> None:
    ran.clear()
    model = ScriptedModel([reply(tool_calls=[("deploy", {"service": "web"})]), reply("Done.")])
    async with agentloop.open_agent(model, tools=[deploy]) as agent:
        agent.followup("ship it")
        with trio.fail_after(10):
            await agent.wait_idle()
        (pending,) = agent.pending_approvals
        assert pending.prompt == "run deploy?"
        assert pending.name == "deploy"
        assert ran == []
        # Answered while the agent is open: the parked call runs and the turn goes on.
        agent.approve(pending.call_id)
        with trio.fail_after(10):
            await agent.wait_idle()
        assert ran == ["web"]
        (result,) = of_type(agent, "tool/result")
        assert result.data["content"] == "web deployed"
        assert of_type(agent, "turn/end")[-1].data["reason"] == "completed"


async def test_a_denied_call_never_runs() -> None:
    ran.clear()
    model = ScriptedModel([reply(tool_calls=[("deploy", {"service": "db"})]), reply("Fine.")])
    async with agentloop.open_agent(model, tools=[deploy]) as agent:
        agent.followup("ship it")
        with trio.fail_after(10):
            await agent.wait_idle()
        agent.deny(agent.pending_approvals[0].call_id, reason="not today")
        with trio.fail_after(10):
            await agent.wait_idle()
        (result,) = of_type(agent, "tool/result")
    assert ran == []
    assert result.data["error_code"] == "DENIED"


async def test_the_registry_decorator_takes_the_flag_and_a_hook_deny_still_wins(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    calls: list[str] = []

    @rt.tools.tool(requires_approval=True)
    async def wipe(target: str) -> str:
        """Wipe something.

        Args:
            target: what.
        """
        calls.append(target)
        return "wiped"

    rt.events.on(
        events.ToolPreExecute,
        lambda e: agentloop.Deny("never prod") if "prod" in str(e.call.arguments) else None,
    )
    model.add(
        reply(tool_calls=[("wipe", {"target": "prod"}), ("wipe", {"target": "tmp"})]),
        reply("ok"),
    )
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    async with handle:
        handle.agent.followup("clean up")
        with trio.fail_after(10):
            await handle.agent.wait_idle()
        assert [p.arguments for p in handle.agent.pending_approvals] == [{"target": "tmp"}]
        denied = [e for e in of_type(handle.agent, "tool/result") if e.data.get("error_code")]
        assert [e.data["error_code"] for e in denied] == ["DENIED"]
    assert calls == []


# --- agent-loop.max_steps_per_turn ---------------------------------------------------------


def looping() -> FunctionModel:
    """A model that calls the ``tick`` tool forever."""

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        yield ToolCallDelta(0, id=f"c{len(request.messages)}", name="tick", arguments="{}")
        yield Finish("tool_calls")

    return FunctionModel(fn)


async def tick() -> str:
    """Advance."""
    return "tick"


async def test_a_model_that_keeps_calling_tools_stops_at_50_steps() -> None:
    model = looping()
    async with agentloop.open_agent(model, tools=[tick]) as agent:
        with trio.fail_after(60):
            result = await agent.ask("go")
        end = of_type(agent, "turn/end")[-1].data
    assert result.reason == "aborted"
    assert end["cause"] == "step_limit"
    assert end["detail"] == "agent-loop.max_steps_per_turn (50) reached"
    assert len(model.requests) == 50


async def test_the_step_limit_is_a_setting() -> None:
    model = looping()
    config = {"settings": {"agent-loop": {"max_steps_per_turn": 3}}}
    async with agentloop.open_agent(model, tools=[tick], config=config) as agent:
        with trio.fail_after(10):
            result = await agent.ask("go")
    assert (result.reason, len(model.requests)) == ("aborted", 3)


async def test_a_write_applies_to_the_next_turn(rt: agentloop.Context) -> None:
    model = looping()
    rt.llm.register("scripted", model)
    rt.tools.register(agentloop.tool(tick))
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    async with handle:
        rt.settings.set("agent-loop.max_steps_per_turn", 2)
        with trio.fail_after(10):
            await handle.agent.ask("go")
        assert len(model.requests) == 2
        rt.settings.set("agent-loop.max_steps_per_turn", 4)
        with trio.fail_after(10):
            await handle.agent.ask("again")
        assert len(model.requests) == 6
        causes = [e.data["cause"] for e in of_type(handle.agent, "turn/end")]
    assert causes == ["step_limit", "step_limit"]


async def test_zero_disables_the_step_limit() -> None:
    calls = 0

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        nonlocal calls
        calls += 1
        if calls <= 60:
            yield ToolCallDelta(0, id=f"c{calls}", name="tick", arguments="{}")
            yield Finish("tool_calls")
        else:
            yield Finish("stop")

    config = {"settings": {"agent-loop": {"max_steps_per_turn": 0}}}
    async with agentloop.open_agent(FunctionModel(fn), tools=[tick], config=config) as agent:
        with trio.fail_after(60):
            result = await agent.ask("go")
    assert result.reason == "completed"
    assert calls == 61


@pytest.mark.parametrize("bad", [-1, 2.5, True, "50", None])
async def test_a_bad_step_limit_is_refused_at_the_write(bad: object) -> None:
    async with agentloop.open_runtime() as rt:
        with pytest.raises(SettingsError, match=r"agent-loop\.max_steps_per_turn: must be a "
                                                r"non-negative integer"):
            rt.settings.set("agent-loop.max_steps_per_turn", bad)
        assert rt.settings.get("agent-loop.max_steps_per_turn") == 50


async def test_a_plugin_stop_at_the_same_step_wins_over_the_step_limit() -> None:
    model = looping()
    config = {"plugins": ["budget"], "budget": {"max_steps_per_turn": 3},
              "settings": {"agent-loop": {"max_steps_per_turn": 3}}}
    async with agentloop.open_agent(model, tools=[tick], config=config) as agent:
        with trio.fail_after(10):
            await agent.ask("go")
        end = of_type(agent, "turn/end")[-1].data
    assert (end["cause"], len(model.requests)) == ("budget", 3)


@pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is not None,
                    reason="the local extra is installed: this test is for its absence")
async def test_the_local_model_without_its_extra_is_refused_at_open() -> None:
    with pytest.raises(ConfigError, match=r"nothing serves provider 'local' \(plugin local "
                                          r"failed: the local model needs xllamacpp"):
        async with agentloop.open_agent("local"):
            pytest.fail("the block must not run")
