"""Plain ``def`` tools run in a worker thread; ``timeout`` and cancellation abandon the thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import trio
import trio.testing
from conftest import OPTIONS, of_type, turn_ends

import agentloop
from agentloop.testing import ScriptedModel, check_log, reply


def results(agent: agentloop.Agent) -> list[dict[str, object]]:
    return [dict(e.data) for e in of_type(agent, "tool/result")]


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Released at teardown, so no abandoned worker thread outlives its test."""
    event = threading.Event()
    yield event
    event.set()


async def run(rt: agentloop.Context, sid: str = "s") -> agentloop.AgentHandle:
    handle = await rt.agents.create(session_id=sid, agent_options=OPTIONS)
    handle.agent.followup("go")
    return handle


async def test_a_plain_def_runs_in_a_worker_thread_with_the_agent_visible(rt, model) -> None:
    seen: dict[str, object] = {}

    @rt.tools.tool
    def add(a: int, b: int = 2) -> int:
        """Add two numbers.

        Args:
            a: the first.
            b: the second.
        """
        seen["thread"] = threading.get_ident()
        seen["agent"] = rt.agents.current()
        return a + b

    tool = rt.tools.get("add")
    assert tool is not None
    assert tool.parameters["properties"]["a"] == {"type": "integer", "description": "the first."}
    assert tool.parameters["required"] == ("a",)
    model.add(reply("", tool_calls=[("add", {"a": 40})]), reply("42"))
    handle = await run(rt)
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    assert seen["thread"] != threading.get_ident()
    assert seen["agent"] is handle.agent
    assert results(handle.agent)[0]["content"] == "42"
    check_log(handle.agent.session)


async def test_a_blocking_tool_does_not_stall_other_agents(rt, gate: threading.Event) -> None:
    started = threading.Event()

    @rt.tools.tool
    def wait_for_gate() -> str:
        """Block until the gate opens."""
        started.set()
        assert gate.wait(10)
        return "through"

    rt.llm.register("scripted", ScriptedModel([
        reply("", tool_calls=[("wait_for_gate", {})]), reply("first done"),
    ]))
    rt.llm.register("other", ScriptedModel(["second done"]))
    blocked = await run(rt)
    with trio.fail_after(10):
        await trio.to_thread.run_sync(started.wait)
        other = await rt.agents.create(
            session_id="other", agent_options=agentloop.AgentOptions(provider="other", model="m")
        )
        other.agent.followup("hi")
        await other.agent.wait_idle()
    assert turn_ends(other.agent) == ["completed"]
    assert blocked.agent.status == "running"
    gate.set()
    with trio.fail_after(10):
        await blocked.agent.wait_idle()
    assert results(blocked.agent)[0]["content"] == "through"


async def test_timeout_abandons_the_thread_and_reports_timeout(
    rt, model, autojump_clock, gate: threading.Event
) -> None:
    @rt.tools.tool(timeout=5)
    def stuck() -> str:
        """Never comes back in time."""
        gate.wait(30)
        return "late"

    model.add(reply("", tool_calls=[("stuck", {})]), reply("gave up"))
    handle = await run(rt)
    start = trio.current_time()
    with trio.fail_after(20):
        await handle.agent.wait_idle()
    assert trio.current_time() - start == pytest.approx(5)
    [result] = results(handle.agent)
    assert result["error_code"] == "TIMEOUT"
    assert "within 5 s" in str(result["content"])
    assert turn_ends(handle.agent) == ["completed"]


async def test_cancel_abandons_a_running_thread_and_reports_aborted(
    rt, model, gate: threading.Event
) -> None:
    started = threading.Event()
    finished = threading.Event()

    @rt.tools.tool
    def slow() -> str:
        """Takes as long as the gate stays shut."""
        started.set()
        gate.wait(10)
        finished.set()
        return "finished after all"

    model.add(reply("", tool_calls=[("slow", {})]))
    handle = await run(rt)
    with trio.fail_after(10):
        await trio.to_thread.run_sync(started.wait)
        assert handle.agent.cancel() is True
        await handle.agent.wait_idle()
    [result] = results(handle.agent)
    assert result["error_code"] == "ABORTED"
    assert turn_ends(handle.agent) == ["aborted"]
    # The abandoned thread finishes later; its value goes nowhere.
    gate.set()
    with trio.fail_after(10):
        await trio.to_thread.run_sync(finished.wait)
    await trio.testing.wait_all_tasks_blocked()
    assert len(results(handle.agent)) == 1
    check_log(handle.agent.session)


async def test_a_failing_thread_tool_is_an_error_result(rt, model) -> None:
    @rt.tools.tool
    def broken() -> str:
        """Fails."""
        raise ValueError("bad input")

    model.add(reply("", tool_calls=[("broken", {})]), reply("sorry"))
    handle = await run(rt)
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    [result] = results(handle.agent)
    assert result["error_code"] == "TOOL_ERROR"
    assert result["content"] == "Error: ValueError: bad input"


async def test_an_explicit_tool_may_take_a_plain_run(rt, model) -> None:
    rt.tools.register(agentloop.Tool(
        "shout", "Upper-case it.",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        lambda text: (threading.get_ident(), text.upper()),
    ))
    model.add(reply("", tool_calls=[("shout", {"text": "hi"})]), reply("ok"))
    handle = await run(rt)
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    ident, text = __import__("json").loads(results(handle.agent)[0]["content"])
    assert (ident != threading.get_ident(), text) == (True, "HI")


def test_generators_and_bad_timeouts_are_refused() -> None:
    def gen() -> Iterator[str]:
        """Yields."""
        yield "x"

    with pytest.raises(agentloop.ToolDefinitionError, match="generator"):
        agentloop.Tool("g", "", {"type": "object"}, gen)
    for bad in (0, -1, True, "5"):
        with pytest.raises(agentloop.ToolDefinitionError, match="timeout"):
            agentloop.Tool("t", "", {"type": "object"}, lambda: None, timeout=bad)  # type: ignore[arg-type]
