"""``history/compacting`` (a waterfall: ``Reject`` vetoes, ``Replace`` supplies the
replacement) and ``history/compacted`` (what was replaced, the summary, tokens before and
after), as the ``compact`` plugin emits them."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from agentloop_compact import SUMMARY_PREFIX
from conftest import OPTIONS, of_type
from test_compact import COMPACT, PROMPTS, Chat

import agentloop
from agentloop import Message
from agentloop.events import HistoryCompacted, HistoryCompacting, Reject, Replace
from agentloop.testing import check_history, check_log


async def chat_with(
    model: Chat, prompts: list[str], *hooks: tuple[type[Any], Any], config: Any = None,
) -> tuple[agentloop.Agent, list[Any]]:
    """Run ``prompts`` with the compact plugin and ``hooks`` registered; the agent and every
    compaction event the hooks' subscriber saw."""
    seen: list[Any] = []
    async with agentloop.open_runtime(config or COMPACT) as rt:
        rt.llm.register("scripted", model.adapter)
        for cls, handler in hooks:
            rt.events.on(cls, handler)

        @rt.tools.tool
        async def note() -> str:
            """Take a note."""
            return "noted " * 20

        async with rt.events.subscribe(HistoryCompacting, HistoryCompacted) as events:
            handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
            for prompt in prompts:
                handle.agent.followup(prompt)
                with trio.fail_after(10):
                    await handle.agent.wait_idle()
            while True:
                try:
                    seen.append(events.receive_nowait())
                except trio.WouldBlock:
                    break
        return handle.agent, seen


async def test_compacting_then_compacted_describe_each_compaction() -> None:
    model = Chat()
    agent, seen = await chat_with(model, PROMPTS[:12])
    replaced = of_type(agent, "history/replaced")
    assert replaced and model.summaries == len(replaced)
    kinds = [type(e) for e in seen]
    assert kinds == [HistoryCompacting, HistoryCompacted] * len(replaced)
    for (before, after), logged in zip(zip(seen[::2], seen[1::2], strict=True), replaced,
                                       strict=True):
        assert (before.agent_id, after.agent_id) == ("s", "s")
        assert (before.first_seq, before.last_seq) == (after.first_seq, after.last_seq)
        assert (logged.data["first_seq"], logged.data["last_seq"]) == (
            after.first_seq, after.last_seq)
        assert before.messages and before.decision is None
        assert after.summary.startswith("summary #")
        assert logged.data["messages"][0]["content"] == SUMMARY_PREFIX + after.summary
        assert after.tokens_before == before.tokens_before
        assert 0 < after.tokens_after < after.tokens_before


async def test_a_reject_vetoes_the_compaction_and_no_summary_is_made() -> None:
    model = Chat()
    vetoed: list[HistoryCompacting] = []

    def veto(event: HistoryCompacting) -> Reject:
        vetoed.append(event)
        return Reject("audit hold")

    agent, seen = await chat_with(model, PROMPTS[:12], (HistoryCompacting, veto))
    assert vetoed
    assert model.summaries == 0
    assert of_type(agent, "history/replaced") == []
    assert not any(isinstance(e, HistoryCompacted) for e in seen)
    assert [e.data["reason"] for e in of_type(agent, "turn/end")] == ["completed"] * 12


async def test_a_replace_supplies_the_replacement_without_a_summary_call() -> None:
    model = Chat()

    async def own_summary(event: HistoryCompacting) -> Replace:
        users = sum(1 for m in event.messages if m.role == "user")
        return Replace([Message("user", f"(my own summary of {users} prompts)")])

    agent, seen = await chat_with(model, PROMPTS[:12], (HistoryCompacting, own_summary))
    replaced = of_type(agent, "history/replaced")
    assert replaced
    assert model.summaries == 0
    messages = agent.session.messages()
    assert messages[0].text.startswith("(my own summary of ")
    done = [e for e in seen if isinstance(e, HistoryCompacted)]
    assert [d.summary for d in done] == [
        r.data["messages"][0]["content"] for r in replaced
    ]
    check_history(messages)
    check_log(agent.session)


async def test_the_waterfall_passes_the_decision_on_and_the_last_word_wins() -> None:
    model = Chat()
    decisions: list[object] = []

    def first(event: HistoryCompacting) -> Reject:
        return Reject("first says no")

    def second(event: HistoryCompacting) -> Replace | None:
        decisions.append(event.decision)
        return Replace([Message("user", "overruled")])

    agent, _ = await chat_with(
        model, PROMPTS[:12], (HistoryCompacting, first), (HistoryCompacting, second)
    )
    assert decisions and all(d == Reject("first says no") for d in decisions)
    assert agent.session.messages()[0].text == "overruled"
    assert model.summaries == 0


async def test_an_unpaired_replacement_is_refused_and_the_history_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Chat()

    def broken(event: HistoryCompacting) -> Replace:
        call = next(m for m in event.messages if m.tool_calls)
        return Replace([Message("user", "x"), call])  # a call without its result

    agent, seen = await chat_with(model, PROMPTS[:12], (HistoryCompacting, broken))
    assert of_type(agent, "history/replaced") == []
    assert not any(isinstance(e, HistoryCompacted) for e in seen)
    assert any("refused" in r.getMessage() for r in caplog.records)
    check_history(agent.session.messages())


def test_a_handler_returning_something_else_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="history/compacting"):
        HistoryCompacting("s", 1, 2, (), 10, decision="keep")  # type: ignore[arg-type]

