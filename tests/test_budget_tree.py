"""``[budget] scope = "tree"``: a turn and its sub-agents' turns spend from one account.

Each test runs a root agent that delegates to sub-agents working in parallel (the ``subagent``
plugin's tool), counts what really happened (model calls and their tokens in the model double,
tool bodies in the tool itself) and compares it with the limits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

import agentloop
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta, check_log

OPTIONS = agentloop.AgentOptions(provider="fn", model="m")


@attrs.define
class Tally:
    """What the tree really did, counted where it happened."""

    model_calls: int = 0
    tokens: int = 0
    ticks: int = 0
    agents: set[str] = attrs.field(factory=set)
    seconds: float = 0.0  # the top turn's duration
    sessions: dict[str, agentloop.Session] = attrs.field(factory=dict)

    def delegations(self) -> int:
        """``subagent`` calls that ran (the budget refuses some before they run)."""
        return sum(
            1 for s in self.sessions.values() for e in s.events
            if e.type == "tool/result" and e.data["name"] == "subagent"
            and e.data.get("error_code") not in ("DENIED", "ABORTED_BEFORE_DISPATCH")
        )


@attrs.frozen
class Plan:
    children: int = 3  # sub-agents the root starts in one reply, run in parallel
    ticks: int = 1  # tool calls in each reply of a sub-agent
    tokens: int = 10  # input + output tokens of every reply
    levels: int = 1  # 2: each child delegates once more, to a grandchild
    tick_seconds: float = 0.0


def tree_model(rt: agentloop.Context, plan: Plan, tally: Tally) -> FunctionModel:
    """The root delegates ``plan.children`` tasks at once and then answers; a child at a
    depth below ``plan.levels`` delegates one task; the deepest children tick forever."""

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        sid = request.session_id
        session = rt.sessions.get(sid)
        assert session is not None
        tally.sessions[sid] = session
        tally.agents.add(sid)
        tally.model_calls += 1
        depth = session.meta.get("depth", 0)
        assert isinstance(depth, int)
        usage = {"input_tokens": plan.tokens - 1, "output_tokens": 1}
        answered = any(m.role == "tool" for m in request.messages)
        if depth < plan.levels and not answered:
            wide = plan.children if depth == 0 else 1
            for i in range(wide):
                args = json.dumps({"task": f"part {i} at depth {depth + 1}"})
                yield ToolCallDelta(i, id=f"d{i}", name="subagent", arguments=args)
            tally.tokens += plan.tokens
            yield Finish("tool_calls", usage)
            return
        if depth < plan.levels:
            yield TextDelta("all parts done")
            tally.tokens += plan.tokens
            yield Finish("stop", usage)
            return
        n = len(request.messages)
        for i in range(plan.ticks):
            yield ToolCallDelta(i, id=f"t{n}_{i}", name="tick", arguments="{}")
        tally.tokens += plan.tokens
        yield Finish("tool_calls", usage)

    return FunctionModel(fn)


async def run_tree(
    budget: dict[str, Any], plan: Plan, *, prices: dict[str, Any] | None = None
) -> tuple[agentloop.Agent, Tally]:
    config: dict[str, Any] = {"plugins": ["subagent", "budget"], "budget": budget}
    if prices is not None:
        config["prices"] = prices
    tally = Tally()
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("fn", tree_model(rt, plan, tally))

        @rt.tools.tool(concurrency="parallel")
        async def tick() -> str:
            """Do one unit of work."""
            tally.ticks += 1
            await trio.sleep(plan.tick_seconds)
            return "ticked"

        handle = await rt.agents.create(session_id="root", agent_options=OPTIONS)
        agent = handle.agent
        started = trio.current_time()
        agent.followup("do the work in parts")
        with trio.fail_after(100_000):
            await agent.wait_idle()
        tally.seconds = trio.current_time() - started
        for session in tally.sessions.values():
            check_log(session, quiescent=False)
        return agent, tally


def root_end(agent: agentloop.Agent) -> Any:
    (end,) = [e.data for e in agent.session.events if e.type == "turn/end"]
    return end


def delegation_results(agent: agentloop.Agent) -> list[Any]:
    return [
        e.data for e in agent.session.events
        if e.type == "tool/result" and e.data["name"] == "subagent"
    ]


# --- each limit, shared ------------------------------------------------------------------------


async def test_tokens_are_shared_by_the_tree_and_the_parents_model_is_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan = Plan(children=3, tokens=10)
    with caplog.at_level(logging.WARNING, logger="agentloop.budget"):
        agent, tally = await run_tree({"scope": "tree", "max_tokens_per_turn": 100}, plan)
    # Each of the 4 agents may have one reply in flight when the account runs out.
    assert 100 <= tally.tokens < 100 + len(tally.agents) * plan.tokens
    end = root_end(agent)
    assert (end["reason"], end["cause"]) == ("aborted", "budget")
    assert "max_tokens_per_turn (100" in end["detail"]
    results = delegation_results(agent)
    assert len(results) == 3
    for result in results:
        assert result["is_error"] and result["error_code"] == "BUDGET"
        assert "tree budget limit max_tokens_per_turn (100" in result["content"]
    assert any("tree's budget limit" in r.getMessage() for r in caplog.records)


async def test_in_turn_scope_each_child_has_its_own_limit() -> None:
    plan = Plan(children=3, tokens=10)
    _, tally = await run_tree({"max_tokens_per_turn": 100}, plan)
    # Three children each spend up to the limit: the tree spends about four times it.
    assert tally.tokens >= 300


async def test_tool_calls_are_reserved_before_they_run() -> None:
    plan = Plan(children=3, ticks=4)
    agent, tally = await run_tree({"scope": "tree", "max_tool_calls_per_turn": 10}, plan)
    # The root's 3 delegations count, and the ticks fill the rest exactly: never more (the
    # calls past the limit are refused before they run).
    assert tally.delegations() == 3
    assert tally.ticks + 3 == 10
    denied = [
        e.data for s in tally.sessions.values() for e in s.events
        if e.type == "tool/result" and e.data.get("error_code") == "DENIED"
    ]
    assert denied and all("max_tool_calls_per_turn (10)" in d["content"] for d in denied)
    assert root_end(agent)["cause"] == "budget"


async def test_model_calls_are_reserved_before_they_are_made() -> None:
    plan = Plan(children=3)
    agent, tally = await run_tree({"scope": "tree", "max_steps_per_turn": 9}, plan)
    assert tally.model_calls == 9
    assert root_end(agent)["cause"] == "budget"


async def test_grandchildren_share_the_account_too() -> None:
    plan = Plan(children=2, levels=2)
    agent, tally = await run_tree({"scope": "tree", "max_steps_per_turn": 12}, plan)
    assert tally.model_calls == 12
    depths = {s.meta.get("depth", 0) for s in tally.sessions.values()}
    assert depths == {0, 1, 2}
    assert root_end(agent)["cause"] == "budget"


async def test_seconds_count_from_the_top_turn(autojump_clock: trio.testing.MockClock) -> None:
    plan = Plan(children=2, tick_seconds=10)
    started = trio.current_time()
    agent, _ = await run_tree({"scope": "tree", "max_turn_seconds": 25}, plan)
    end = root_end(agent)
    assert (end["reason"], end["cause"]) == ("aborted", "budget")
    assert "max_turn_seconds (25)" in end["detail"]
    # Children stop at their first check past 25 s: after their third tick.
    assert trio.current_time() - started == pytest.approx(30)


async def test_money_is_shared_when_prices_are_known() -> None:
    plan = Plan(children=3, tokens=1000)
    prices = {"fn:m": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}}  # 0.001 a reply
    agent, tally = await run_tree(
        {"scope": "tree", "max_cost_per_turn": 0.01}, plan, prices=prices
    )
    spent = tally.tokens / 1_000_000
    assert 0.01 <= spent < 0.01 + len(tally.agents) * 0.001
    end = root_end(agent)
    assert end["cause"] == "budget" and "max_cost_per_turn (0.01" in end["detail"]
    assert end["usage"]["cost"] == pytest.approx(agent.session.usage["cost"])


async def test_the_code_form_takes_the_scope() -> None:
    import agentloop_budget

    plugin = agentloop_budget.budget(scope="tree", max_steps_per_turn=2)
    assert plugin.__doc__ is not None and "scope='tree'" in plugin.__doc__
    with pytest.raises(agentloop.ConfigError, match="scope"):
        agentloop_budget.budget(scope="forest")  # type: ignore[arg-type]


# --- the property: parallel spawns never overshoot -----------------------------------------------


LIMITS = st.fixed_dictionaries(
    {"max_steps_per_turn": st.integers(2, 30)},
    optional={
        "max_tool_calls_per_turn": st.integers(1, 30),
        "max_tokens_per_turn": st.integers(1, 400),
        "max_cost_per_turn": st.sampled_from([0.0001, 0.0005, 0.002]),
        "max_turn_seconds": st.integers(1, 40),
    },
)
PLANS = st.builds(
    Plan,
    children=st.integers(1, 5),
    ticks=st.integers(1, 3),
    tokens=st.integers(2, 40),
    levels=st.integers(1, 2),
    tick_seconds=st.sampled_from([0.0, 1.0, 7.0]),
)


@given(limits=LIMITS, plan=PLANS)
def test_parallel_spawns_never_overshoot_the_tree_budget(
    limits: dict[str, Any], plan: Plan
) -> None:
    prices = {"fn:m": {"input_per_mtok": 5.0, "output_per_mtok": 5.0}}
    result: list[tuple[agentloop.Agent, Tally]] = []

    async def main() -> None:
        result.append(await run_tree({"scope": "tree", **limits}, plan, prices=prices))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    agent, tally = result[0]
    # Reserved before they happen: never more than the limit.
    assert tally.model_calls <= limits["max_steps_per_turn"]
    if "max_tool_calls_per_turn" in limits:
        assert tally.ticks + tally.delegations() <= limits["max_tool_calls_per_turn"]
    # Booked when each reply arrives: over by at most one reply per agent of the tree.
    in_flight = len(tally.agents) * plan.tokens
    if "max_tokens_per_turn" in limits:
        assert tally.tokens < limits["max_tokens_per_turn"] + in_flight
    if "max_cost_per_turn" in limits:
        cost = tally.tokens * 5.0 / 1_000_000
        assert cost < limits["max_cost_per_turn"] + in_flight * 5.0 / 1_000_000
    # Checked between steps: a tool that is running finishes first.
    if "max_turn_seconds" in limits:
        assert tally.seconds <= limits["max_turn_seconds"] + plan.tick_seconds
    assert root_end(agent)["reason"] in ("completed", "aborted")
