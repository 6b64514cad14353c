"""A server that refuses a JSON-schema response format still gives structured output: the
call is made again with the ``final_result`` tool, and the route remembers."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import attrs
import pytest
import trio
from conftest import check_history_valid, check_log_invariants
from fake_openai import REFUSAL, FakeOpenAI, Reply

import agentloop
from agentloop.llm import OpenAIChatAdapter


@attrs.frozen
class Point:
    x: int
    y: int


def _tool_names(body: dict[str, object]) -> list[str]:
    tools = body.get("tools") or []
    assert isinstance(tools, list)
    return [t["function"]["name"] for t in tools]


def _options(provider: str = "real") -> agentloop.AgentOptions:
    return agentloop.AgentOptions(provider=provider, model="m")


@pytest.mark.parametrize("status", [422, 400])
async def test_a_refused_format_falls_back_to_the_tool_once_and_is_remembered(
    fake: FakeOpenAI, status: int
) -> None:
    fake.refuse_response_format = status
    fake.replies += [
        Reply(chunks=[], tool=("final_result", {"x": 1, "y": 2})),
        Reply(chunks=[], tool=("final_result", {"x": 3, "y": 4})),
        Reply(chunks=[], tool=("final_result", {"x": 5, "y": 6})),
    ]
    with trio.fail_after(20):
        async with agentloop.open_runtime() as rt:
            rt.llm.register("real", OpenAIChatAdapter(fake.url, api_key="sk-test"))
            async with await rt.agents.create(session_id="a", agent_options=_options()) as h:
                first = await h.agent.ask("where?", output_type=Point)
                second = await h.agent.ask("and now?", output_type=Point)
                events = h.agent.session.events
            # Another agent on the same route goes straight to the tool as well.
            async with await rt.agents.create(session_id="b", agent_options=_options()) as h2:
                third = await h2.agent.ask("and there?", output_type=Point)
    assert (first.output, second.output, third.output) == (Point(1, 2), Point(3, 4), Point(5, 6))
    assert first.turn == 1 and first.reason == "completed"
    refused, *rest = fake.requests
    assert refused["response_format"]["type"] == "json_schema"
    assert _tool_names(refused) == []
    assert len(rest) == 3
    for body in rest:
        assert "response_format" not in body
        assert _tool_names(body) == ["final_result"]
    # The log keeps the refused call: the header of the call made again records it.
    headers = [e for e in events if e.type == "request/header"]
    after = headers[1].data["after_error"]
    assert after["error"]["status"] == status and REFUSAL in after["error"]["message"]
    assert headers[0].data["step"] == headers[1].data["step"]
    check_log_invariants(events)
    check_history_valid(h.agent.session.messages())


async def test_an_invalid_answer_through_the_fallback_is_corrected(fake: FakeOpenAI) -> None:
    fake.refuse_response_format = 422
    fake.replies += [
        Reply(chunks=[], tool=("final_result", {"x": 1})),
        Reply(chunks=[], tool=("final_result", {"x": 1, "y": 2})),
    ]
    with trio.fail_after(20):
        async with agentloop.open_runtime() as rt:
            rt.llm.register("real", OpenAIChatAdapter(fake.url, api_key="sk-test"))
            async with await rt.agents.create(session_id="a", agent_options=_options()) as h:
                result = await h.agent.ask("where?", output_type=Point)
                bad, _ok = [e for e in h.agent.session.events if e.type == "tool/result"]
    assert result.output == Point(1, 2)
    assert bad.data["error_code"] == "OUTPUT_INVALID"
    assert "y: missing required field" in bad.data["content"]
    assert len(fake.requests) == 3


async def _failed_ask(fake: FakeOpenAI) -> agentloop.ProviderError:
    """Ask for a ``Point`` once; the turn must fail with a provider error, returned."""
    with trio.fail_after(20):
        async with agentloop.open_runtime() as rt:
            rt.llm.register("real", OpenAIChatAdapter(fake.url, api_key="sk-test"))
            async with await rt.agents.create(session_id="a", agent_options=_options()) as h:
                with pytest.raises(agentloop.TurnFailed) as info:
                    await h.agent.ask("where?", output_type=Point)
    assert isinstance(info.value.error, agentloop.ProviderError)
    return info.value.error


async def test_an_error_that_does_not_name_the_format_still_fails_the_turn(
    fake: FakeOpenAI,
) -> None:
    fake.replies += [Reply(status=400, error="model 'm' does not exist")]
    error = await _failed_ask(fake)
    assert error.status == 400
    assert len(fake.requests) == 1


async def test_the_fallback_is_tried_once_then_the_failure_is_reported(fake: FakeOpenAI) -> None:
    fake.refuse_response_format = 422
    fake.replies += [Reply(status=422, error="response_format and tools cannot be combined")]
    error = await _failed_ask(fake)
    assert error.status == 422
    assert len(fake.requests) == 2


async def test_a_new_registration_of_the_route_asks_for_the_format_again(
    fake: FakeOpenAI,
) -> None:
    fake.refuse_response_format = 422
    fake.replies += [Reply(chunks=[], tool=("final_result", {"x": 1, "y": 2}))]
    with trio.fail_after(20):
        async with agentloop.open_runtime() as rt:
            dispose = rt.llm.register("real", OpenAIChatAdapter(fake.url, api_key="sk-test"))
            async with await rt.agents.create(session_id="a", agent_options=_options()) as h:
                assert (await h.agent.ask("where?", output_type=Point)).output == Point(1, 2)
                dispose()
                # The server behind the route was replaced by one with schema support.
                fake.refuse_response_format = 0
                fake.replies += [Reply(chunks=['{"x": 7, "y": 8}'])]
                rt.llm.register("real", OpenAIChatAdapter(fake.url, api_key="sk-test"))
                assert (await h.agent.ask("again?", output_type=Point)).output == Point(7, 8)
    assert "response_format" in fake.requests[-1]


async def test_plain_turns_never_meet_the_fallback(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    fake.refuse_response_format = 422
    async with agentloop.open_agent("openai:m") as agent:
        assert (await agent.ask("hi")).text == "Hello from the fake model."
    assert "response_format" not in fake.requests[0]


PAGE = Path(__file__).resolve().parents[1] / "docs" / "how-to" / "structured-output.md"


async def test_the_how_to_program_runs_against_a_server_without_schema_support(
    fake: FakeOpenAI,
) -> None:
    """docs/how-to/structured-output.md's program, against a server that answers 422."""
    pytest.importorskip("pydantic", reason="pydantic is not installed (the mcp extra)")
    [program] = [
        b for b in re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)
        if "trio.run(" in b
    ]
    fake.refuse_response_format = 422
    fake.replies += [
        Reply(chunks=[], tool=("final_result", {"name": "Paris", "country": "France"})),
        Reply(chunks=[], tool=("final_result", {"name": "Tokyo", "country": "Japan"})),
    ]
    env = {**os.environ, "OPENAI_BASE_URL": fake.url, "OPENAI_API_KEY": "sk-docs",
           "PYTHONPATH": str(PAGE.parents[2])}
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-c", program], env=env, capture_stdout=True,
            capture_stderr=True, check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().splitlines() == [
        "name='Paris' country='France'", "name='Tokyo' country='Japan'",
    ]
    # One refusal, then the tool: the second question went straight to it.
    assert ["response_format" in r for r in fake.requests] == [True, False, False]
