"""Structured output: a run's output_type, through a final_result tool and a native format."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypedDict

import attrs
import loopback
import pytest
import trio
import trio.testing
from conftest import OPTIONS, check_history_valid, check_log_invariants

import agentloop
from agentloop._json import freeze
from agentloop._output import rebuild_output
from agentloop._schema import schema_for_type
from agentloop.llm import OpenAIChatAdapter
from agentloop.testing import ScriptedModel, reply


@attrs.frozen
class Point:
    x: int
    y: int


@dataclasses.dataclass(frozen=True)
class City:
    name: str
    population: int


class Pair(TypedDict):
    left: str
    right: str


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _final(arguments: object, call_id: str = "call_out") -> Any:
    return reply(tool_calls=[("final_result", arguments, call_id)])


def _outputs(agent: agentloop.Agent) -> list[Any]:
    return [
        e.data["output"] for e in agent.session.events
        if e.type == "assistant/message" and "output" in e.data
    ]


@pytest.mark.parametrize(
    ("output_type", "arguments", "expected"),
    [
        (Point, {"x": 1, "y": 2}, Point(1, 2)),
        (City, {"name": "Oslo", "population": 700000}, City("Oslo", 700000)),
        (Pair, {"left": "a", "right": "b"}, {"left": "a", "right": "b"}),
        (SCHEMA, {"answer": 5}, {"answer": 5}),
    ],
)
async def test_output_through_the_final_result_tool(
    rt: agentloop.Context, model: ScriptedModel, output_type: Any, arguments: Any,
    expected: Any,
) -> None:
    model.add(_final(arguments))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        result = await h.agent.ask("answer", output_type=output_type)
        assert (result.reason, result.output) == ("completed", expected)
        assert type(result.output) is type(expected)
        [request] = model.requests
        assert request.output_schema is None
        [tool] = [t for t in request.tools if t.name == "final_result"]
        assert tool.parameters == (
            freeze(SCHEMA) if output_type is SCHEMA else schema_for_type(output_type)
        )
        assert _outputs(h.agent) == [agentloop.FrozenDict(arguments)]
        check_history_valid(h.agent.session.messages())
        # A run without an output_type gets neither the tool nor an output.
        model.add(reply("plain"))
        plain = await h.agent.ask("again")
        assert plain.output is None
        assert all(t.name != "final_result" for t in model.requests[-1].tools)


async def test_invalid_output_is_corrected_within_the_turn(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(_final({"x": "one"}, "call_1"), reply("forgot the tool"), _final({"x": 1, "y": 2}))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        result = await h.agent.ask("where?", output_type=Point)
        assert (result.output, result.turn) == (Point(1, 2), 1)
        events = h.agent.session.events
        assert {e.turn for e in events if e.turn is not None} == {1}
        [bad] = [e for e in events if e.type == "tool/result" and e.data["call_id"] == "call_1"]
        assert bad.data["is_error"] and bad.data["error_code"] == "OUTPUT_INVALID"
        assert "x" in bad.data["content"] and "y" in bad.data["content"]
        # The second request carried the tool error, the third a steering correction.
        second, third = model.requests[1], model.requests[2]
        assert second.messages[-1].role == "tool"
        assert third.messages[-1].role == "user"
        assert "final_result" in third.messages[-1].text
        check_log_invariants(events)
        check_history_valid(h.agent.session.messages())


async def test_exhausted_retries_fail_the_turn_with_output_invalid(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    options = agentloop.AgentOptions(provider="scripted", model="m", output_retries=1)
    model.add(_final({"answer": "x"}, "c1"), _final({}, "c2"), reply("unused"))
    async with await rt.agents.create(session_id="s", agent_options=options) as h:
        with pytest.raises(agentloop.TurnFailed) as info:
            await h.agent.ask("answer", output_type=SCHEMA)
        assert info.value.reason == "error"
        assert isinstance(info.value.error, agentloop.ProviderError)
        assert info.value.error.code == "OUTPUT_INVALID"
        assert model.remaining == 1  # one correction, then no further call
        assert _outputs(h.agent) == []
        check_history_valid(h.agent.session.messages())


def test_output_retries_is_validated() -> None:
    with pytest.raises(agentloop.ConfigError, match="output_retries"):
        agentloop.AgentOptions(output_retries=-1)
    with pytest.raises(agentloop.ConfigError, match="output_retries"):
        agentloop.AgentOptions(output_retries=True)


def _chat_sse(content: str) -> bytes:
    return loopback.sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": content}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        done=True,
    )


async def test_native_response_format_over_loopback() -> None:
    bodies = [_chat_sse('{"x": 1}'), _chat_sse('{"x": 3, "y": 4}')]

    async def handler(request: loopback.Request, stream: trio.SocketStream) -> None:
        await loopback.sse_body(bodies.pop(0))(request, stream)

    with trio.fail_after(10):
        async with loopback.serve(handler) as srv, agentloop.open_runtime() as rt:
            rt.llm.register("real", OpenAIChatAdapter(srv.url, api_key="sk-test-123456"))
            options = agentloop.AgentOptions(provider="real", model="m")
            async with await rt.agents.create(session_id="s", agent_options=options) as h:
                result = await h.agent.ask("where?", output_type=Point)
                assert (result.output, result.turn) == (Point(3, 4), 1)
                first, second = (r.json() for r in srv.requests)
                assert "tools" not in first
                assert first["response_format"] == {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "Point",
                        "schema": json.loads(json.dumps(schema_for_type(Point))),
                        "strict": False,
                    },
                }
                correction = second["messages"][-1]
                assert correction["role"] == "user" and "y" in correction["content"]
                assert _outputs(h.agent) == [agentloop.FrozenDict(x=3, y=4)]


async def test_the_output_survives_a_resume(tmp_path: Path) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    with trio.fail_after(10):
        async with agentloop.open_runtime(config) as rt:
            rt.llm.register("scripted", ScriptedModel([_final({"x": 5, "y": 6})]))
            async with await rt.agents.create(session_id="r", agent_options=OPTIONS) as h:
                assert (await h.agent.ask("p", output_type=Point)).output == Point(5, 6)
        async with agentloop.open_runtime(config) as rt:
            model = ScriptedModel([reply("hello again")])
            rt.llm.register("scripted", model)
            h = await rt.agents.resume(resume_session_id="r", agent_options=OPTIONS)
            async with h:
                assert _outputs(h.agent) == [agentloop.FrozenDict(x=5, y=6)]
                assert rebuild_output(Point, _outputs(h.agent)[0]) == Point(5, 6)
                # The final_result call and its answer replay as a valid history.
                assert (await h.agent.ask("and now?")).text == "hello again"
                check_history_valid(model.requests[0].messages)


async def test_a_run_left_before_its_claim_forgets_its_output_spec(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        async with h.agent.run("never mind", output_type=Point) as run:
            assert run.message_id in (h.agent._run_outputs or {})
        assert (await run.result()).reason == "aborted"
        assert not h.agent._run_outputs
        # A later run without an output_type is not handed the forgotten spec.
        model.add(reply("fine"))
        assert (await h.agent.ask("hello")).output is None
        assert all(t.name != "final_result" for t in model.requests[0].tools)


async def test_calls_beside_a_valid_answer_run_before_the_turn_ends(rt, model) -> None:
    ran: list[str] = []

    @rt.tools.tool
    async def save(note: str) -> str:
        """Save a note."""
        ran.append(note)
        return f"saved {note}"

    model.add(reply(tool_calls=[
        ("save", {"note": "seen"}, "c1"), ("final_result", {"answer": 4}, "c2"),
    ]))
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    async with handle:
        with trio.fail_after(10):
            result = await handle.agent.ask("2 + 2, and note it", output_type=SCHEMA)
        agent = handle.agent
    assert result.reason == "completed"
    assert result.output == {"answer": 4}
    assert ran == ["seen"]
    tool_results = {
        e.data["call_id"]: e.data for e in agent.session.events if e.type == "tool/result"
    }
    assert tool_results["c1"]["content"] == "saved seen"
    assert not tool_results["c1"]["is_error"]
    # The answer ended the turn: no model call after the tools.
    assert len(model.requests) == 1
    check_log_invariants(agent.session.events)


async def test_the_turn_an_approval_resumes_asks_for_the_same_output(tmp_path: Path) -> None:
    from test_persistence import sqlite_config

    db = tmp_path / "s.db"
    ran: list[str] = []

    def register(rt: agentloop.Context) -> None:
        @rt.tools.tool
        async def rm(path: str) -> str:
            """Remove a path."""
            ran.append(path)
            return f"removed {path}"

        rt.events.on(agentloop.events.ToolPreExecute, lambda e: agentloop.Ask("really?"))

    with trio.fail_after(20):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            register(rt)
            first = ScriptedModel([reply(tool_calls=[("rm", {"path": "/tmp/x"}, "c1")])])
            rt.llm.register("scripted", first)
            handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
            results: list[agentloop.RunResult] = []

            async def ask() -> None:
                results.append(await handle.agent.ask("clean up, report", output_type=Point))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await trio.testing.wait_all_tasks_blocked()
                assert handle.agent.pending_approvals
                # Disposed with the approval pending: the turn is suspended.
                await handle.aclose()
        assert [r.reason for r in results] == ["suspended"]
        [end] = [e for e in handle.agent.session.events if e.type == "turn/end"]
        assert end.data["output_schema"] == schema_for_type(Point)
        assert end.data["output_name"] == "Point"

        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            register(rt)
            second = ScriptedModel([_final({"x": 1, "y": 2})])
            rt.llm.register("scripted", second)
            handle = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
            agent = handle.agent
            assert agent.approve("c1") is True
            await agent.wait_idle()
            assert ran == ["/tmp/x"]
            [request] = second.requests
            assert any(t.name == "final_result" for t in request.tools)
            assert _outputs(agent) == [{"x": 1, "y": 2}]
            ends = [e.data for e in agent.session.events if e.type == "turn/end"]
            assert [e["reason"] for e in ends] == ["suspended", "completed"]
            assert "output_schema" not in ends[1]
            check_log_invariants(agent.session.events)
