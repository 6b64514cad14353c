"""The budget plugin: a runaway turn ends ``aborted`` with cause ``budget``, naming the limit."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import agentloop_budget
import pytest
import trio
import trio.testing
from conftest import OPTIONS, of_type

import agentloop
from agentloop import ConfigError
from agentloop.llm import LLMRequest
from agentloop.testing import (
    Finish,
    FunctionModel,
    ToolCallDelta,
    check_history,
    check_log,
)


def looping(tokens: int = 10) -> FunctionModel:
    """A model that calls the ``tick`` tool forever."""

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        yield ToolCallDelta(0, id=f"c{len(request.messages)}", name="tick", arguments="{}")
        yield Finish("tool_calls", {"input_tokens": tokens, "output_tokens": 1})

    return FunctionModel(fn)


async def drive(config: Any, *, model: FunctionModel, tick_seconds: float = 0.0) -> agentloop.Agent:
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("scripted", model)

        @rt.tools.tool
        async def tick() -> str:
            """Advance."""
            await trio.sleep(tick_seconds)
            return "tick"

        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        handle.agent.followup("go")
        with trio.fail_after(10_000):
            await handle.agent.wait_idle()
        return handle.agent


def ended(agent: agentloop.Agent) -> Any:
    (end,) = of_type(agent, "turn/end")
    return end.data


@pytest.mark.parametrize(
    ("limits", "calls", "named"),
    [
        ({"max_steps_per_turn": 3}, 3, "max_steps_per_turn (3)"),
        ({"max_tool_calls_per_turn": 4}, 4, "max_tool_calls_per_turn (4)"),
        ({"max_tokens_per_turn": 50}, 5, "max_tokens_per_turn (50"),
    ],
)
async def test_a_runaway_turn_is_ended_by_the_first_limit(
    limits: dict[str, int], calls: int, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = looping()
    with caplog.at_level(logging.WARNING, logger="agentloop.budget"):
        agent = await drive({"plugins": ["budget"], "budget": limits}, model=model)
    end = ended(agent)
    assert (end["reason"], end["cause"]) == ("aborted", "budget")
    assert named in end["detail"]
    assert len(model.requests) == calls
    assert any(named in r.getMessage() for r in caplog.records if r.name == "agentloop.budget")
    check_log(agent.session)
    check_history(agent.session.messages())


async def test_wall_clock_limit(autojump_clock: trio.testing.MockClock) -> None:
    model = looping()
    agent = await drive(
        {"plugins": ["budget"], "budget": {"max_turn_seconds": 25}}, model=model, tick_seconds=10
    )
    end = ended(agent)
    assert (end["reason"], end["cause"]) == ("aborted", "budget")
    assert "max_turn_seconds (25)" in end["detail"]
    # Checked after each tool step: 10 s, 20 s, then 30 s >= 25 s stops it.
    assert len(model.requests) == 3


async def test_without_limits_nothing_stops_a_turn_that_ends() -> None:
    calls = 0

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        nonlocal calls
        calls += 1
        if calls < 5:
            yield ToolCallDelta(0, id=f"c{calls}", name="tick", arguments="{}")
            yield Finish("tool_calls")
        else:
            yield Finish("stop")

    agent = await drive(
        {"plugins": ["budget"], "budget": {"max_steps_per_turn": 5}}, model=FunctionModel(fn)
    )
    assert ended(agent)["reason"] == "completed"


async def test_the_code_form_and_its_overrides() -> None:
    model = looping()
    plugin = agentloop_budget.budget(
        agentloop_budget.BudgetPolicy(max_steps_per_turn=9), max_steps_per_turn=2
    )
    async with agentloop.open_runtime(plugins=[plugin]) as rt:
        rt.llm.register("scripted", model)
        rt.tools.tool(_tick)
        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        handle.agent.followup("go")
        with trio.fail_after(10):
            await handle.agent.wait_idle()
        assert ended(handle.agent)["cause"] == "budget"
    assert len(model.requests) == 2


async def _tick() -> str:
    """Advance."""
    return "tick"


@pytest.mark.parametrize(
    "table",
    [{"max_steps_per_turn": 0}, {"max_turn_seconds": -1}, {"max_steps": 3},
     {"max_tokens_per_turn": "many"}],
)
async def test_bad_config_fails_the_runtime(table: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="budget"):
        async with agentloop.open_runtime({"plugins": ["budget"], "budget": table}):
            pass
