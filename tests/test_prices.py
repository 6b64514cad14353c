"""``[prices]``: every call's usage carries its cost, summed into turn/end, the session, run
results and ``agentloop sessions show --tree``; logs written before prices load unchanged."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import OPTIONS, of_type

import agentloop
from agentloop import ConfigError
from agentloop._cli_main import main
from agentloop.testing import ScriptedModel, check_log, reply

PRICES = {
    "scripted:m": {"input_per_mtok": 2.0, "output_per_mtok": 8.0, "cache_read_per_mtok": 0.5,
                   "reasoning_per_mtok": 10.0},
    "scripted:*": {"input_per_mtok": 1.0, "output_per_mtok": 1.0},
}


async def ask_all(config: Any, replies: list[Any], *prompts: str,
                  options: agentloop.AgentOptions = OPTIONS) -> tuple[agentloop.Agent, list[Any]]:
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("scripted", ScriptedModel(replies))
        handle = await rt.agents.create(session_id="s", agent_options=options)
        async with handle:
            results = [await handle.agent.ask(p) for p in prompts]
            check_log(handle.agent.session)
            return handle.agent, results


# --- the price of one call ---------------------------------------------------------------------


def test_openai_style_usage_takes_cached_and_reasoning_tokens_out_of_the_totals() -> None:
    from agentloop._prices import Price

    price = Price(input_per_mtok=2.0, output_per_mtok=8.0, cache_read_per_mtok=0.5,
                  reasoning_per_mtok=10.0)
    usage = {"input_tokens": 1000, "cache_read_tokens": 400, "output_tokens": 300,
             "reasoning_tokens": 100}
    # 600 uncached + 400 cached in; 200 visible + 100 reasoning out.
    assert price.cost(usage) == pytest.approx((600 * 2 + 400 * 0.5 + 200 * 8 + 100 * 10) / 1e6)


def test_anthropic_usage_adds_cache_reads_and_writes_beside_the_input() -> None:
    from agentloop._prices import Price

    price = Price(input_per_mtok=3.0, output_per_mtok=15.0, cache_read_per_mtok=0.3,
                  cache_write_per_mtok=3.75)
    usage = {"input_tokens": 12, "cache_read_input_tokens": 4096, "cache_read_tokens": 4096,
             "cache_creation_input_tokens": 2048, "cache_write_tokens": 2048,
             "output_tokens": 87}
    expected = (12 * 3.0 + 4096 * 0.3 + 2048 * 3.75 + 87 * 15.0) / 1e6
    assert price.cost(usage) == pytest.approx(expected)


def test_unset_cache_and_reasoning_prices_fall_back_to_input_and_output() -> None:
    from agentloop._prices import Price

    price = Price(input_per_mtok=1.0, output_per_mtok=4.0)
    usage = {"input_tokens": 100, "cache_read_tokens": 50, "output_tokens": 10,
             "reasoning_tokens": 5}
    assert price.cost(usage) == pytest.approx((100 * 1.0 + 10 * 4.0) / 1e6)


# --- cost in the log, the session and run results ---------------------------------------------


async def test_turn_end_session_and_run_result_carry_the_cost() -> None:
    usage1 = {"input_tokens": 1000, "cache_read_tokens": 400, "output_tokens": 300,
              "reasoning_tokens": 100}
    usage2 = {"input_tokens": 2000, "output_tokens": 50}
    agent, (first, second) = await ask_all(
        {"prices": PRICES},
        [reply("one", usage=usage1), reply("two", usage=usage2)], "a", "b",
    )
    cost1 = (600 * 2 + 400 * 0.5 + 200 * 8 + 100 * 10) / 1e6
    cost2 = (2000 * 2 + 50 * 8) / 1e6
    anchors = of_type(agent, "assistant/message")
    assert [a.data["usage"]["cost"] for a in anchors] == [pytest.approx(cost1),
                                                          pytest.approx(cost2)]
    ends = of_type(agent, "turn/end")
    assert [e.data["usage"]["cost"] for e in ends] == [pytest.approx(cost1),
                                                       pytest.approx(cost2)]
    assert first.usage["cost"] == pytest.approx(cost1)
    assert second.usage["cost"] == pytest.approx(cost2)
    assert agent.session.usage["cost"] == pytest.approx(cost1 + cost2)
    assert agent.session.usage["input_tokens"] == 3000


async def test_a_route_without_its_own_price_takes_the_providers_star() -> None:
    options = agentloop.AgentOptions(provider="scripted", model="other")
    _, (result,) = await ask_all(
        {"prices": PRICES}, [reply("x", usage={"input_tokens": 10, "output_tokens": 10})], "a",
        options=options,
    )
    assert result.usage["cost"] == pytest.approx(20 / 1e6)


async def test_an_unpriced_route_has_cost_none_and_is_counted() -> None:
    prices = {"openai:gpt-4o-mini": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}}
    agent, _ = await ask_all(
        {"prices": prices}, [reply("x", usage={"input_tokens": 10, "output_tokens": 1})], "a"
    )
    (end,) = of_type(agent, "turn/end")
    assert end.data["usage"]["cost"] is None
    assert end.data["usage"]["unpriced_calls"] == 1
    assert agent.session.usage["cost"] is None


async def test_without_prices_usage_is_as_before() -> None:
    agent, (result,) = await ask_all(
        None, [reply("x", usage={"input_tokens": 10, "output_tokens": 1})], "a"
    )
    (end,) = of_type(agent, "turn/end")
    assert end.data["usage"] == {"input_tokens": 10, "output_tokens": 1}
    assert "cost" not in agent.session.usage and "cost" not in (result.usage or {})


async def test_a_log_written_before_prices_loads_and_new_calls_add_their_cost(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.db"
    store = {"persistence": {"backend": "sqlite", "path": str(db)}}
    usage = {"input_tokens": 1000, "output_tokens": 100}
    async with agentloop.open_runtime(store) as rt:
        rt.llm.register("scripted", ScriptedModel([reply("old", usage=usage)]))
        async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as handle:
            await handle.agent.ask("before prices")
    async with agentloop.open_runtime({**store, "prices": PRICES}) as rt:
        rt.llm.register("scripted", ScriptedModel([reply("new", usage=usage)]))
        async with await rt.agents.resume(resume_session_id="s") as handle:
            session = handle.agent.session
            (old_end,) = of_type(handle.agent, "turn/end")
            assert "cost" not in old_end.data["usage"]  # the old line, loaded as it was
            assert session.usage == {"input_tokens": 1000, "output_tokens": 100}
            result = await handle.agent.ask("with prices")
            cost = (1000 * 2 + 100 * 8) / 1e6
            assert result.usage is not None and result.usage["cost"] == pytest.approx(cost)
            # Calls recorded before a price was known cost nothing here: the log says so.
            assert session.usage["cost"] == pytest.approx(cost)
            assert session.usage["input_tokens"] == 2000
            check_log(session)


def test_an_old_log_line_without_cost_is_read_as_before() -> None:
    from agentloop._session import _add_usage

    total: dict[str, Any] = {}
    _add_usage(total, agentloop.FrozenDict(input_tokens=5, output_tokens=2))
    assert total == {"input_tokens": 5, "output_tokens": 2}
    _add_usage(total, agentloop.FrozenDict(input_tokens=1, output_tokens=1, cost=0.5))
    assert total == {"input_tokens": 6, "output_tokens": 3, "cost": 0.5}


# --- the config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prices", "named"),
    [
        ({"gpt-4o": {"input_per_mtok": 1, "output_per_mtok": 1}}, 'prices."gpt-4o"'),
        ({"a:b": {"input_per_mtok": 1}}, 'prices."a:b".output_per_mtok: missing'),
        ({"a:b": {"input_per_mtok": -1, "output_per_mtok": 1}},
         'prices."a:b".input_per_mtok: must be a non-negative number'),
        ({"a:b": {"input_per_mtok": 1, "output_per_mtok": "1"}},
         'prices."a:b".output_per_mtok'),
        ({"a:b": {"input_per_mtok": 1, "output_per_mtok": 1, "cached_per_mtok": 1}},
         'prices."a:b".cached_per_mtok: unknown key'),
        ({"a:b": 3}, 'prices."a:b": must be a table'),
    ],
)
async def test_a_bad_price_fails_the_runtime_naming_it(prices: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        async with agentloop.open_runtime({"prices": prices}):
            pass
    assert named in str(caught.value)


# --- the budget's max_cost_per_turn, per turn ----------------------------------------------------


async def test_max_cost_per_turn_ends_the_turn() -> None:
    looping = [
        reply(tool_calls=[("noop", {}, f"c{i}")], usage={"input_tokens": 1000,
                                                         "output_tokens": 0})
        for i in range(10)
    ]
    async with agentloop.open_runtime(
        {"plugins": ["budget"], "budget": {"max_cost_per_turn": 0.005}, "prices": PRICES}
    ) as rt:
        model = ScriptedModel(looping)
        rt.llm.register("scripted", model)

        @rt.tools.tool
        async def noop() -> str:
            """Nothing."""
            return "ok"

        async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as handle:
            result = await handle.agent.ask("go")
            (end,) = of_type(handle.agent, "turn/end")
    # 0.002 a call: stopped once the turn's cost reaches 0.005, after the third.
    assert (result.reason, end.data["cause"]) == ("aborted", "budget")
    assert "max_cost_per_turn (0.005; the turn spent 0.006)" in end.data["detail"]
    assert len(model.requests) == 3


async def test_max_cost_without_prices_warns_that_it_never_applies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="agentloop.budget"):
        async with agentloop.open_runtime(
            {"plugins": ["budget"], "budget": {"max_cost_per_turn": 1}}
        ):
            pass
    assert any("no [prices] table" in r.getMessage() for r in caplog.records)


# --- agentloop sessions show --tree ------------------------------------------------------------


def test_sessions_show_tree_prints_each_sessions_cost_and_the_trees_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "s.db"
    config = {"persistence": {"backend": "sqlite", "path": str(db)}, "prices": PRICES}
    usage = {"input_tokens": 1000, "output_tokens": 100}  # 0.0028 a call

    async def build() -> None:
        async with agentloop.open_runtime(config) as rt:
            rt.llm.register("scripted", ScriptedModel([
                reply(tool_calls=[("delegate", {}, "d1")], usage=usage),
                reply("child a", usage=usage),
                reply("child b", usage=usage),
                reply("done", usage=usage),
            ]))

            @rt.tools.tool
            async def delegate() -> str:
                """Delegate twice."""
                a = await rt.subagents.run("a", session_id="child-a")
                b = await rt.subagents.run("b", session_id="child-b")
                return a.text + b.text

            async with await rt.agents.create(session_id="top", agent_options=OPTIONS) as h:
                await h.agent.ask("x")

    trio.run(build)
    assert main(["sessions", "show", "top", "--tree", "--db", str(db)]) == 0
    out = capsys.readouterr().out.splitlines()
    totals = [line for line in out if "total" in line]
    assert totals == [
        "session total, tokens: in 2000, out 200, cost 0.0056",
        "  session total, tokens: in 1000, out 100, cost 0.0028",
        "  session total, tokens: in 1000, out 100, cost 0.0028",
        "tree total (3 sessions), tokens: in 4000, out 400, cost 0.0112",
    ]
    assert any(line.endswith("cost 0.0028 ---") for line in out)  # each turn's own


def test_usage_sums_keep_a_known_cost_and_an_unknown_one_apart() -> None:
    from agentloop._prices import add_usage

    total: dict[str, object] = {}
    add_usage(total, {"input_tokens": 3, "cost": None})
    assert total == {"input_tokens": 3, "cost": None}  # unpriced: unknown, never free
    add_usage(total, {"input_tokens": 2, "cost": 0.5, "by_model": {"m": {"cost": 0.5}}})
    add_usage(total, {"cost": 0})  # an int cost adds to a float one
    add_usage(total, {"cost": None, "cached": True})
    assert total == {"input_tokens": 5, "cost": 0.5, "by_model": {"m": {"cost": 0.5}}}
