"""Durable approvals: ``Ask(prompt)`` parks one call until a person answers, across restarts.

Persistence tests use a real SQLite file; the crash test kills a real child process.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS, check_history_valid, of_type, turn_ends
from crash_child import CHMOD_ID, ECHO_ID, RM_ID, RM_PROMPT
from test_persistence import (
    CHILD,
    _run_child_until_ready,
    rows_of,
    sqlite_config,
    stored_rows,
)

import agentloop
from agentloop import events as ev
from agentloop.testing import ScriptedModel, check_log, reply


def gate(*names: str) -> Any:
    """A tools/pre-execute policy that asks before every call of ``names``."""
    return lambda e: agentloop.Ask(f"run {e.call.name}?") if e.call.name in names else None


def register_tools(rt: agentloop.Context, ran: list[str]) -> None:
    @rt.tools.tool(concurrency="parallel")
    async def echo(text: str) -> str:
        """Say it back."""
        await trio.sleep(0.05)
        ran.append(f"echo {text}")
        return text

    @rt.tools.tool
    async def rm(path: str) -> str:
        """Remove a path."""
        ran.append(f"rm {path}")
        return f"removed {path}"


def results(agent: agentloop.Agent) -> dict[str, Any]:
    return {e.data["call_id"]: e.data for e in of_type(agent, "tool/result")}


STEP = reply("", tool_calls=[
    ("echo", {"text": "a"}, "c1"), ("rm", {"path": "/x"}, "c2"), ("echo", {"text": "b"}, "c3"),
])


async def parked_agent(
    rt: agentloop.Context, model: ScriptedModel, ran: list[str], sid: str = "s1"
) -> agentloop.Agent:
    register_tools(rt, ran)
    rt.events.on(ev.ToolPreExecute, gate("rm"))
    model.add(STEP, reply("all done"))
    handle = await rt.agents.create(session_id=sid, agent_options=OPTIONS)
    handle.agent.followup("clean up")
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    return handle.agent


# --- parking one call ------------------------------------------------------------------------


async def test_ask_parks_only_that_call_and_its_siblings_go_on(rt, model, autojump_clock) -> None:
    ran: list[str] = []
    other = ScriptedModel(["meanwhile"])
    rt.llm.register("other", other)
    agent = await parked_agent(rt, model, ran)
    # wait_idle returned because the turn waits for nothing but the person.
    assert agent.status == "running"
    assert sorted(ran) == ["echo a", "echo b"]
    assert set(results(agent)) == {"c1", "c3"}
    [asked] = of_type(agent, "tool/approval-requested")
    assert dict(asked.data) == {
        "call_id": "c2", "name": "rm", "arguments": {"path": "/x"}, "prompt": "run rm?",
    }
    assert asked.turn == 1
    assert agent.pending_approvals == (
        agentloop.PendingApproval("c2", "rm", agentloop.FrozenDict(path="/x"), "run rm?"),
    )
    assert len(model.requests) == 1  # the step loop waits for the parked call
    # Other agents are not held up.
    h2 = await rt.agents.create(
        session_id="s2", agent_options=agentloop.AgentOptions(provider="other", model="m")
    )
    h2.agent.followup("hello")
    with trio.fail_after(10):
        await h2.agent.wait_idle()
    assert turn_ends(h2.agent) == ["completed"]

    assert agent.approve("c2") is True
    assert agent.pending_approvals == ()
    with trio.fail_after(10):
        await agent.wait_idle()
    assert agent.status == "idle"
    assert sorted(ran) == ["echo a", "echo b", "rm /x"]
    assert results(agent)["c2"]["content"] == "removed /x"
    assert results(agent)["c2"]["error_code"] is None
    [answered] = of_type(agent, "tool/approval-answered")
    assert dict(answered.data) == {"call_id": "c2", "approved": True}
    assert turn_ends(agent) == ["completed"]
    second = model.requests[1]
    assert {m.tool_call_id for m in second.messages if m.role == "tool"} == {"c1", "c2", "c3"}
    check_history_valid(second.messages)
    check_log(agent.session)


async def test_deny_answers_denied_with_the_reason(rt, model, autojump_clock) -> None:
    ran: list[str] = []
    agent = await parked_agent(rt, model, ran)
    assert agent.deny("c2", reason="not today") is True
    with trio.fail_after(10):
        await agent.wait_idle()
    assert "rm /x" not in ran
    result = results(agent)["c2"]
    assert (result["is_error"], result["error_code"]) == (True, "DENIED")
    assert "not today" in result["content"]
    assert dict(of_type(agent, "tool/approval-answered")[0].data) == {
        "call_id": "c2", "approved": False, "reason": "not today",
    }
    assert turn_ends(agent) == ["completed"]
    check_log(agent.session)


async def test_answering_what_is_not_pending_is_false(rt, model, autojump_clock) -> None:
    ran: list[str] = []
    agent = await parked_agent(rt, model, ran)
    assert agent.approve("nope") is False
    assert agent.deny("c1") is False  # ran without asking
    assert agent.approve("c2") is True
    assert agent.approve("c2") is False  # answered once
    assert agent.deny("c2") is False
    with trio.fail_after(10):
        await agent.wait_idle()
    assert ran.count("rm /x") == 1


async def test_a_tool_approval_handler_still_answers_synchronously(rt, model) -> None:
    ran: list[str] = []
    register_tools(rt, ran)
    rt.events.on(ev.ToolPreExecute, gate("rm"))
    rt.events.on(
        ev.ToolApproval,
        lambda e: agentloop.Allow() if e.call.arguments["path"] == "/ok" else agentloop.Deny("no"),
    )
    model.add(
        reply("", tool_calls=[("rm", {"path": "/ok"}, "c1"), ("rm", {"path": "/no"}, "c2")]),
        reply("done"),
    )
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    handle.agent.followup("go")
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    agent = handle.agent
    assert agent.status == "idle"
    assert of_type(agent, "tool/approval-requested") == []
    assert [results(agent)[c]["error_code"] for c in ("c1", "c2")] == [None, "DENIED"]
    assert ran == ["rm /ok"]


async def test_new_input_waits_until_the_approvals_are_answered(
    rt, model, autojump_clock
) -> None:
    ran: list[str] = []
    agent = await parked_agent(rt, model, ran)
    model.add(reply("second answer"))
    mid = agent.followup("next question")
    await trio.testing.wait_all_tasks_blocked()
    assert [m.id for m in agent.inbox.next_turn] == [mid]
    assert len(model.requests) == 1
    assert of_type(agent, "turn/start")[-1].turn == 1
    agent.approve("c2")
    with trio.fail_after(10):
        await agent.wait_idle()
    assert turn_ends(agent) == ["completed", "completed"]
    [claim] = [e for e in of_type(agent, "user/message") if e.data["message_id"] == mid]
    assert claim.turn == 2
    check_log(agent.session)


async def test_cancel_answers_pending_approvals_aborted_before_dispatch(
    rt, model, autojump_clock
) -> None:
    ran: list[str] = []
    agent = await parked_agent(rt, model, ran)
    assert agent.cancel() is True
    with trio.fail_after(10):
        await agent.wait_idle()
    assert agent.pending_approvals == ()
    result = results(agent)["c2"]
    assert result["error_code"] == "ABORTED_BEFORE_DISPATCH"
    assert result["content"] == "Error: tool call aborted before dispatch"
    assert turn_ends(agent) == ["aborted"]
    assert "rm /x" not in ran
    check_log(agent.session)


# --- approval_timeout ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, "5", True, math.nan, math.inf])
async def test_approval_timeout_must_be_a_positive_number(rt, bad: object) -> None:
    with pytest.raises(agentloop.SettingsError, match="approval_timeout"):
        rt.settings.set("agent-loop.approval_timeout", bad)
    assert rt.settings.get("agent-loop.approval_timeout") is None


async def test_approval_timeout_denies_with_a_reason(rt, model, autojump_clock) -> None:
    rt.settings.set("agent-loop.approval_timeout", 30)
    ran: list[str] = []
    start = trio.current_time()
    async with rt.events.subscribe(ev.AgentTurnEnd) as ends:
        agent = await parked_agent(rt, model, ran)
        assert agent.pending_approvals  # echo's work is long over; 30 s are not
        with trio.fail_after(100):
            await ends.receive()
    result = results(agent)["c2"]
    assert result["error_code"] == "DENIED"
    assert "within 30 s" in result["content"]
    assert 30 <= trio.current_time() - start <= 33
    assert "rm /x" not in ran
    assert turn_ends(agent) == ["completed"]


# --- surviving disposal, shutdown and a restart -----------------------------------------------


async def test_disposal_suspends_the_turn_and_resume_makes_the_approval_pending_again(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sessions.db"
    ran: list[str] = []
    with trio.fail_after(20):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            model = ScriptedModel()
            rt.llm.register("scripted", model)
            agent = await parked_agent(rt, model, ran)
            assert agent.pending_approvals
        # Runtime shutdown disposed the agent while c2 waited for a person.
        suspended = list(agent.session.events)
        assert turn_ends(agent) == ["suspended"]
        assert "c2" not in results(agent)
        assert set(results(agent)) == {"c1", "c3"}
        check_log(suspended)
        assert stored_rows(db, "s1") == rows_of(suspended)

        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            model = ScriptedModel([reply("done now"), reply("and the next one")])
            rt.llm.register("scripted", model)
            register_tools(rt, ran)
            handle = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
            agent = handle.agent
            assert agent.pending_approvals == (
                agentloop.PendingApproval("c2", "rm", agentloop.FrozenDict(path="/x"), "run rm?"),
            )
            # New input waits: no turn opens while the approval is pending.
            agent.followup("next question")
            await trio.testing.wait_all_tasks_blocked()
            assert agent.status == "idle"
            assert len(agent.session.events) == len(suspended)
            assert model.requests == []

            assert agent.approve("c2") is True
            await agent.wait_idle()
            assert sorted(ran) == ["echo a", "echo b", "rm /x"]
            resumed = agent.session.events[len(suspended):]
            assert [e.type for e in resumed[:4]] == [
                "turn/start", "tool/approval-answered", "tool/result", "request/header",
            ]
            assert resumed[0].turn == 2
            assert resumed[2].data["call_id"] == "c2"
            assert resumed[2].data["content"] == "removed /x"
            assert turn_ends(agent) == ["suspended", "completed", "completed"]
            first, second = model.requests
            assert first.messages[-1].role == "tool"  # the step loop went on from the results
            check_history_valid(first.messages)
            assert second.messages[-1].text == "next question"
            check_log(agent.session)
            final = list(agent.session.events)
    assert stored_rows(db, "s1") == rows_of(final)


@pytest.mark.parametrize("answer", ["deny", "cancel", "timeout"])
async def test_a_resumed_approval_can_be_denied_cancelled_or_time_out(
    tmp_path: Path, answer: str
) -> None:
    # The real clock: the store's worker thread would make a mock clock jump to any deadline.
    db = tmp_path / "sessions.db"
    ran: list[str] = []
    async with agentloop.open_runtime(sqlite_config(db)) as rt:
        model = ScriptedModel()
        rt.llm.register("scripted", model)
        agent = await parked_agent(rt, model, ran)
    assert turn_ends(agent) == ["suspended"]
    async with agentloop.open_runtime(sqlite_config(db)) as rt:
        model = ScriptedModel([reply("understood")])
        rt.llm.register("scripted", model)
        register_tools(rt, ran)
        if answer == "timeout":
            rt.settings.set("agent-loop.approval_timeout", 0.2)
        async with rt.events.subscribe(ev.AgentTurnEnd) as ends:
            handle = await rt.agents.resume(resume_session_id="s1", agent_options=OPTIONS)
            agent = handle.agent
            start = trio.current_time()
            assert agent.pending_approvals
            if answer == "deny":
                assert agent.deny("c2", reason="changed my mind")
            elif answer == "cancel":
                agent.followup("queued")
                assert agent.cancel() is True
                assert agent.inbox.next_turn == ()
            with trio.fail_after(10):
                await ends.receive()
        await agent.wait_idle()
        assert agent.pending_approvals == ()
        assert "rm /x" not in ran
        result = results(agent)["c2"]
        if answer == "cancel":
            assert result["error_code"] == "ABORTED_BEFORE_DISPATCH"
            assert turn_ends(agent) == ["suspended", "aborted"]
            assert model.requests == []
        else:
            assert result["error_code"] == "DENIED"
            reason = "changed my mind" if answer == "deny" else "within 0.2 s"
            assert reason in result["content"]
            assert turn_ends(agent) == ["suspended", "completed"]
            assert model.requests[0].messages[-1].tool_call_id == "c2"
        if answer == "timeout":
            assert trio.current_time() - start >= 0.2
        check_log(agent.session)


async def test_disposal_leaves_the_call_pending_and_answers_are_refused(
    rt, model, autojump_clock
) -> None:
    ran: list[str] = []
    register_tools(rt, ran)
    rt.events.on(ev.ToolPreExecute, gate("rm"))
    model.add(STEP)
    handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
    agent = handle.agent
    agent.followup("clean up")
    await agent.wait_idle()
    await handle.aclose()
    assert turn_ends(agent) == ["suspended"]
    assert "c2" not in results(agent)
    assert [p.call_id for p in agent.pending_approvals] == ["c2"]
    with pytest.raises(agentloop.AgentDisposed):
        agent.approve("c2")
    with pytest.raises(agentloop.AgentDisposed):
        agent.deny("c2")
    assert [p.call_id for p in agent.pending_approvals] == ["c2"]
    check_log(agent.session)


@pytest.mark.slow
async def test_an_approval_pending_when_the_process_was_killed_is_pending_after_resume(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sessions.db"
    await _run_child_until_ready(db, "approval", tmp_path / "child.log")
    left = stored_rows(db, "crashy")
    types = [r[1] for r in left]
    assert "turn/end" not in types
    assert types[-1] in ("tool/approval-requested", "tool/result")
    assert [r[3]["call_id"] for r in left if r[1] == "tool/result"] == [ECHO_ID]

    with trio.fail_after(15):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            model = ScriptedModel([reply("removed it")])
            rt.llm.register("scripted", model)
            removed: list[str] = []

            @rt.tools.tool
            async def rm(path: str) -> str:
                """Remove a path."""
                removed.append(path)
                return "gone"

            handle = await rt.agents.resume(resume_session_id="crashy", agent_options=OPTIONS)
            agent = handle.agent
            events = agent.session.events
            assert rows_of(events[: len(left)]) == left
            [end] = events[len(left):]
            assert (end.type, end.turn) == ("turn/end", 1)
            assert (end.data["reason"], end.data["cause"]) == ("suspended", "crash")
            assert agent.pending_approvals == (
                agentloop.PendingApproval(
                    RM_ID, "rm", agentloop.FrozenDict(path="/srv/data"), RM_PROMPT
                ),
            )
            assert agent.approve(RM_ID)
            await agent.wait_idle()
            assert removed == ["/srv/data"]
            assert turn_ends(agent) == ["suspended", "completed"]
            [request] = model.requests
            check_history_valid(request.messages)
            tool_ids = [m.tool_call_id for m in request.messages if m.role == "tool"]
            assert tool_ids == [ECHO_ID, RM_ID]
            check_log(agent.session)


EXIT_RUNS = 12


@pytest.mark.slow
async def test_approvals_a_turn_reported_pending_survive_an_exit_right_after_wait_idle(
    tmp_path: Path,
) -> None:
    # The child leaves with os._exit the moment wait_idle() returns: whatever the writer had
    # not committed by then is gone, so each run checks that the parking itself was durable.
    for run in range(EXIT_RUNS):
        db = tmp_path / f"run{run}.db"
        with trio.fail_after(30):
            done = await trio.run_process(
                [sys.executable, str(CHILD), str(db), "approval-exit"],
                capture_stdout=True, capture_stderr=True, check=False,
            )
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode().split() == ["PENDING", RM_ID, CHMOD_ID]
        parked = [r[3]["call_id"] for r in stored_rows(db, "crashy")
                  if r[1] == "tool/approval-requested"]
        assert parked == [RM_ID, CHMOD_ID], f"run {run}: the store kept only {parked}"
        with trio.fail_after(15):
            async with agentloop.open_runtime(sqlite_config(db)) as rt:
                rt.llm.register("scripted", ScriptedModel([]))
                handle = await rt.agents.resume(resume_session_id="crashy",
                                                agent_options=OPTIONS)
                pending = [p.call_id for p in handle.agent.pending_approvals]
                assert pending == [RM_ID, CHMOD_ID], f"run {run}: pending after resume {pending}"
                check_log(handle.agent.session)
                await handle.aclose()


async def test_parked_calls_are_answered_in_any_order_and_recorded_as_answered(
    rt, model, autojump_clock
) -> None:
    ran: list[str] = []
    register_tools(rt, ran)
    rt.events.on(ev.ToolPreExecute, gate("rm"))
    model.add(
        reply("", tool_calls=[
            ("rm", {"path": "/a"}, "c1"), ("rm", {"path": "/b"}, "c2"),
            ("echo", {"text": "x"}, "c3"),
        ]),
        reply("done"),
    )
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    agent = handle.agent
    agent.followup("go")
    await agent.wait_idle()
    assert [p.call_id for p in agent.pending_approvals] == ["c1", "c2"]
    assert list(results(agent)) == ["c3"]
    agent.approve("c2")
    await agent.wait_idle()
    assert agent.status == "running"  # c1 still waits
    assert list(results(agent)) == ["c3", "c2"]
    agent.deny("c1", reason="keep /a")
    await agent.wait_idle()
    assert list(results(agent)) == ["c3", "c2", "c1"]
    assert ran == ["echo x", "rm /b"]
    assert turn_ends(agent) == ["completed"]
    check_log(agent.session)
    check_history_valid(model.requests[1].messages)
