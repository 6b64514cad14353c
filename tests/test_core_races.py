"""The lifecycle races of the core's middle: each test reproduces one defect found from outside.

Every test here failed before the state it exercises had one owner (the agent's lifecycle, its
approvals, its scope): a cancelled turn that still started tool bodies, a disposal past the grace
that left its turn open, a bare ``Agent`` that handed out its scope, a same-id contender that took
the winner's setup child, a kept steer stranded on an idle agent, ``agent_loop.create`` of a stored
id, and the errors and facts at the edges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
from conftest import OPTIONS, check_log_invariants, of_type, turn_ends
from hypothesis import given
from hypothesis import strategies as st

import agentloop
from agentloop import events as ev
from agentloop.testing import (
    Finish,
    FunctionModel,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    check_log,
    reply,
)

# --- a cancelled turn starts no tool body ----------------------------------------------------


def _tools(rt: agentloop.Context, started: list[str], *, parallel: bool = False) -> None:
    mode = "parallel" if parallel else "exclusive"

    @rt.tools.tool(concurrency=mode)
    async def write(name: str) -> str:
        """A side effect before the first checkpoint.

        Args:
            name: what to write.
        """
        started.append(name)
        await trio.lowlevel.checkpoint()
        return "ok"


def _results(agent: agentloop.Agent) -> list[str | None]:
    return [e.data.get("error_code") for e in of_type(agent, "tool/result")]


@pytest.mark.parametrize("parallel", [False, True])
async def test_a_cancel_from_a_sync_pre_execute_hook_starts_no_body(rt, parallel) -> None:
    rt.llm.register("scripted", ScriptedModel([
        reply(tool_calls=[("write", {"name": "a"}), ("write", {"name": "b"}),
                          ("write", {"name": "c"})]),
        reply("never"),
    ]))
    started: list[str] = []
    _tools(rt, started, parallel=parallel)
    h = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    rt.events.on(ev.ToolPreExecute, lambda e: h.agent.cancel() and None)
    async with h:
        h.agent.followup("go")
        with trio.fail_after(5):
            await h.agent.wait_idle()
        assert started == []
        assert _results(h.agent) == ["ABORTED_BEFORE_DISPATCH"] * 3
        assert turn_ends(h.agent) == ["aborted"]
        check_log_invariants(h.agent.session.events)


async def test_a_cancel_from_a_sync_step_result_hook_starts_no_body(rt) -> None:
    rt.llm.register("scripted", ScriptedModel([
        reply(tool_calls=[("write", {"name": "a"}), ("write", {"name": "b"})]), reply("never"),
    ]))
    started: list[str] = []
    _tools(rt, started, parallel=True)
    h = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    rt.events.on(ev.AgentStepResult, lambda e: h.agent.cancel() and None)
    async with h:
        h.agent.followup("go")
        with trio.fail_after(5):
            await h.agent.wait_idle()
        assert started == []
        assert set(_results(h.agent)) <= {"ABORTED_BEFORE_DISPATCH"}
        assert turn_ends(h.agent) == ["aborted"]


async def test_a_cancel_while_the_stream_closes_after_finish_starts_no_body(rt) -> None:
    started: list[str] = []
    _tools(rt, started, parallel=True)
    agents: list[agentloop.Agent] = []

    async def fn(request: Any) -> Any:
        try:
            if request.step == 1:
                yield ToolCallDelta(0, "c1", "write", '{"name": "a"}')
                yield ToolCallDelta(1, "c2", "write", '{"name": "b"}')
                yield Finish("tool_calls")
            else:
                yield TextDelta("never")
                yield Finish("stop")
        finally:
            # The adapter closes its stream after Finish: a cancel here meets no checkpoint
            # before the scheduler dispatches.
            if request.step == 1:
                agents[0].cancel()

    rt.llm.register("scripted", FunctionModel(fn))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        agents.append(h.agent)
        h.agent.followup("go")
        with trio.fail_after(5):
            await h.agent.wait_idle()
        assert started == []
        assert _results(h.agent) == ["ABORTED_BEFORE_DISPATCH"] * 2
        assert turn_ends(h.agent) == ["aborted"]


async def test_approve_then_cancel_in_one_tick_starts_no_body(rt, autojump_clock) -> None:
    rt.llm.register("scripted", ScriptedModel([
        reply(tool_calls=[("write", {"name": "a"})]), reply("never"),
    ]))
    started: list[str] = []
    _tools(rt, started)
    rt.events.on(ev.ToolPreExecute, lambda e: agentloop.Ask("write?"))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        h.agent.followup("go")
        await h.agent.wait_idle()
        [pending] = h.agent.pending_approvals
        assert h.agent.approve(pending.call_id)
        assert h.agent.cancel()
        await h.agent.wait_idle()
        assert started == []
        assert _results(h.agent) == ["ABORTED_BEFORE_DISPATCH"]
        assert turn_ends(h.agent) == ["aborted"]


async def test_approve_after_cancel_is_refused(rt, autojump_clock) -> None:
    rt.llm.register("scripted", ScriptedModel([
        reply(tool_calls=[("write", {"name": "a"}), ("write", {"name": "b"})]), reply("never"),
    ]))
    started: list[str] = []
    _tools(rt, started)
    rt.events.on(ev.ToolPreExecute, lambda e: agentloop.Ask("write?"))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        h.agent.followup("go")
        await h.agent.wait_idle()
        first, second = h.agent.pending_approvals
        assert h.agent.cancel()
        # The turn is over for these calls: answering one can no longer make it run.
        assert not h.agent.approve(first.call_id)
        assert not h.agent.deny(second.call_id)
        await h.agent.wait_idle()
        assert started == []
        assert _results(h.agent) == ["ABORTED_BEFORE_DISPATCH"] * 2


async def test_a_turn_cancelled_by_its_approval_handler_is_over_when_wait_idle_returns(
    rt,
) -> None:
    # The handler cancels the turn while deciding the call, which is then parked: the turn
    # does not wait for the answer, so wait_idle() waits for it to end, every call answered.
    # Repeated: trio runs a pass's tasks in an order it picks at random, and the turn ended
    # in time for wait_idle() by luck in one of the two orders.
    started: list[str] = []
    _tools(rt, started)
    rt.events.on(ev.ToolPreExecute, lambda e: agentloop.Ask("?"))
    agents: dict[str, agentloop.Agent] = {}
    rt.events.on(ev.ToolApproval, lambda e: agents[e.agent_id].cancel())
    for i in range(16):
        undo = rt.llm.register("scripted", ScriptedModel([
            reply(tool_calls=[("write", {"name": "a"})]), reply("never"),
        ]))
        async with await rt.agents.create(session_id=f"s{i}", agent_options=OPTIONS) as h:
            agents[h.agent.id] = h.agent
            h.agent.followup("go")
            await h.agent.wait_idle()
            assert h.agent.status == "idle"
            assert turn_ends(h.agent) == ["aborted"]
            assert _results(h.agent) == ["ABORTED_BEFORE_DISPATCH"]
            check_log_invariants(h.agent.session.events)
        undo()
    assert started == []


_POINTS = (
    "pre-execute", "step-result", "pre-step", "request", "approval", "continuation",
    "turn-stopping", "post-execute", "tool-result", "claimed", "appended-call",
    "appended-anchor", "status",
)


def _cancel_hook(rt: agentloop.Context, point: str, cancel: Any) -> None:
    """Register ``cancel`` as a synchronous handler at the extension point ``point``."""
    on = rt.events.on
    if point == "approval":
        on(ev.ToolPreExecute, lambda e: agentloop.Ask("?"))
        on(ev.ToolApproval, cancel)
    elif point == "request":
        on(ev.AgentRequest, lambda e: cancel(e) or e.config)
    elif point == "post-execute":
        on(ev.ToolPostExecute, lambda e: cancel(e) or e.result)
    elif point in ("appended-call", "appended-anchor"):
        kind = "tool/call" if point == "appended-call" else "assistant/message"
        on(ev.SessionEventAppended, lambda e: cancel(e) if e.event.type == kind else None)
    elif point == "status":
        on(ev.AgentStatus, lambda e: cancel(e) if e.status == "running" else None)
    else:
        cls: dict[str, Any] = {
            "pre-execute": ev.ToolPreExecute, "step-result": ev.AgentStepResult,
            "pre-step": ev.AgentPreStep, "continuation": ev.AgentTurnContinuation,
            "turn-stopping": ev.AgentTurnStopping, "tool-result": ev.ToolResultEvent,
            "claimed": ev.InboxClaimed,
        }
        on(cls[point], cancel)


@pytest.mark.slow
@given(point=st.sampled_from(_POINTS), parallel=st.booleans(), calls=st.integers(1, 3))
def test_no_body_starts_after_a_cancel_from_any_sync_handler(
    point: str, parallel: bool, calls: int
) -> None:
    """Cancel from a synchronous handler at each extension point: no tool body starts after
    the cancel was called, and every call of the turn is answered."""

    async def main() -> None:
        async with agentloop.open_runtime() as rt:
            rt.llm.register("scripted", ScriptedModel([
                reply(tool_calls=[("write", {"name": str(i)}) for i in range(calls)]),
                reply(tool_calls=[("write", {"name": "later"})]),
                reply("done"),
            ]))
            started: list[str] = []
            cancelled_at: list[int] = []
            _tools(rt, started, parallel=parallel)
            h = await rt.agents.create(session_id="s", agent_options=OPTIONS)

            def cancel(_: object) -> None:
                if not cancelled_at:
                    cancelled_at.append(len(started))
                    h.agent.cancel()

            _cancel_hook(rt, point, cancel)
            async with h:
                h.agent.followup("go")
                with trio.fail_after(10):
                    await h.agent.wait_idle()
                if cancelled_at:
                    assert len(started) == cancelled_at[0], (point, started, cancelled_at)
                    # A cancel at admission ("status") leaves no durable turn at all.
                    assert turn_ends(h.agent) in (["aborted"], []), turn_ends(h.agent)
                check_log_invariants(h.agent.session.events)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# --- disposal past the grace still ends the turn ---------------------------------------------


async def test_a_disposal_that_outlasts_the_grace_still_ends_the_turn(rt, autojump_clock) -> None:
    rt.llm.register("scripted", ScriptedModel([
        reply(tool_calls=[("stubborn", {})]), reply("never"),
    ]))
    running = trio.Event()

    @rt.tools.tool
    async def stubborn() -> str:
        """Ignores cancellation for longer than the disposal grace."""
        running.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.sleep(45)
            raise
        return "never"

    h = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    h.agent.followup("go")
    await running.wait()
    await h.aclose()
    assert turn_ends(h.agent) == ["disposed"]
    check_log(h.agent.session.events)


# --- a cancel reaching a nursery of the turn's own code ---------------------------------------
# A hook or an adapter that waits in a nursery of its own, in the agent's task, sees the turn's
# cancel come out of that nursery as a group holding Cancelled, not a bare Cancelled. The turn
# must still end aborted (or with what else the group holds) and the agent go on.


async def _waiting_in_a_nursery(fail_on_cancel: bool = False) -> None:
    async def child() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            if fail_on_cancel:
                raise ValueError("cleanup failed") from None
            raise

    async with trio.open_nursery() as nursery:
        nursery.start_soon(child)
        await trio.sleep_forever()


async def test_a_cancel_ending_a_hooks_own_nursery_aborts_the_turn(rt, autojump_clock) -> None:
    rt.llm.register("scripted", ScriptedModel(["one", "two"]))
    first: list[int] = []

    async def pre_step(_: object) -> None:
        if not first:
            first.append(1)
            await _waiting_in_a_nursery()

    rt.events.on(ev.AgentPreStep, pre_step)
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        h.agent.followup("go")
        await trio.testing.wait_all_tasks_blocked()
        assert h.agent.cancel()
        await h.agent.wait_idle()
        assert h.agent.status == "idle"
        h.agent.followup("again")
        await h.agent.wait_idle()
        assert turn_ends(h.agent) == ["aborted", "completed"]
        check_log(h.agent.session.events)


async def test_a_cancel_ending_an_adapters_nursery_keeps_what_else_it_raised(
    rt, autojump_clock
) -> None:
    calls: list[int] = []

    async def stream(request: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            await _waiting_in_a_nursery(fail_on_cancel=True)
        yield TextDelta("fine")
        yield Finish("stop")

    rt.llm.register("scripted", FunctionModel(stream))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        h.agent.followup("go")
        await trio.testing.wait_all_tasks_blocked()
        assert h.agent.cancel()
        await h.agent.wait_idle()
        h.agent.followup("again")
        await h.agent.wait_idle()
        # The cancel's part of the group is gone (a group of Exceptions only, then): the
        # failure it caused is the turn's error.
        assert turn_ends(h.agent) == ["error", "completed"]
        assert of_type(h.agent, "turn/end")[0].data["error"]["type"] == "ExceptionGroup"


async def test_a_disposal_within_the_grace_ends_an_adapters_nursery_quietly(
    rt, autojump_clock, caplog: pytest.LogCaptureFixture
) -> None:
    async def stream(request: Any) -> Any:
        await _waiting_in_a_nursery()
        yield Finish("stop")

    rt.llm.register("scripted", FunctionModel(stream))
    h = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    h.agent.followup("go")
    await trio.testing.wait_all_tasks_blocked()
    start = trio.current_time()
    await h.aclose()
    assert trio.current_time() == start  # no wait for the grace
    assert turn_ends(h.agent) == ["disposed"]
    assert "ignored disposal" not in caplog.text


# --- a bare Agent is not a teardown capability -----------------------------------------------


async def test_a_bare_agent_gives_no_scope_away(rt, model) -> None:
    model.add("one", "two")

    async def setup(ctx: agentloop.Context) -> None:
        @ctx.tools.tool
        async def mine() -> str:
            """Only this agent's."""
            return "mine"

    async with await rt.agents.create(session_id="s", agent_options=OPTIONS, setup=setup) as h:
        other = rt.child("plugin:other")
        bare = other.agents.get("s")
        assert bare is h.agent
        assert getattr(bare, "ctx", None) is None
        # The handle holder keeps the scope.
        assert [t.name for t in h.ctx.tools.list()] == ["mine"]
        assert await h.agent.ask("hi") is not None


# --- same-id contenders: the winner keeps its setup child ------------------------------------


async def test_a_same_id_loser_never_takes_the_winners_setup_child(rt, model, autojump_clock):
    children: dict[str, agentloop.AgentHandle] = {}
    outcome: dict[str, str] = {}

    def setup_for(name: str, spawn_at: float | None, end_at: float) -> Any:
        async def setup(ctx: agentloop.Context) -> None:
            start = trio.current_time()
            if spawn_at is not None:
                await trio.sleep_until(start + spawn_at)
                children[name] = await ctx.subagents.spawn(session_id=f"child-of-{name}")
            await trio.sleep_until(start + end_at)

        return setup

    async def contender(name: str, delay: float, setup: Any) -> None:
        await trio.sleep(delay)
        try:
            h = await rt.agents.create(session_id="dup", agent_options=OPTIONS, setup=setup)
        except agentloop.SessionIdInUse:
            outcome[name] = "lost"
        else:
            outcome[name] = "won"
            winner.append(h)

    winner: list[agentloop.AgentHandle] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(contender, "A", 0, setup_for("A", 1, 2))
        nursery.start_soon(contender, "B", 0.5, setup_for("B", None, 5))
    assert outcome == {"A": "won", "B": "lost"}
    child = children["A"].agent
    assert child.status != "disposed"
    assert child.session.meta["parent_session_id"] == "dup"
    await winner[0].aclose()
    assert child.status == "disposed"


async def test_a_setup_child_runs_under_its_parents_actor(rt, model) -> None:
    model.add("child's answer")
    names: list[str] = []

    async def setup(ctx: agentloop.Context) -> None:
        await ctx.subagents.spawn(session_id="kid")

    @rt.tools.tool
    async def where() -> str:
        """Where am I."""
        return "here"

    async with await rt.agents.create(session_id="p", agent_options=OPTIONS, setup=setup):
        task = trio.lowlevel.current_root_task()
        assert task is not None

        def walk(t: trio.lowlevel.Task, path: tuple[str, ...]) -> None:
            for nursery in t.child_nurseries:
                for child in nursery.child_tasks:
                    if child.name == "agentloop.agent:kid":
                        names.append("/".join(path))
                    walk(child, (*path, child.name))

        walk(task, ())
    [path] = names
    assert path.endswith("agentloop.agent:p"), path


# --- a kept steer is never stranded ----------------------------------------------------------


def _stalling_first_call() -> FunctionModel:
    """A model whose first call stalls forever, and whose later calls answer at once."""
    calls: list[int] = []

    async def fn(request: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            await trio.sleep_forever()
        yield TextDelta("steered")
        yield Finish("stop")

    return FunctionModel(fn)


async def test_a_kept_steer_runs_after_a_keep_inbox_cancel(rt, autojump_clock) -> None:
    rt.llm.register("scripted", _stalling_first_call())
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        h.agent.followup("first")
        await trio.testing.wait_all_tasks_blocked()
        h.agent.steer("kept steer")
        assert h.agent.cancel(keep_inbox=True)
        with trio.fail_after(10):
            await h.agent.wait_idle()
        assert h.agent.inbox.next_step == () and h.agent.inbox.next_turn == ()
        steers = [e.data["content"] for e in of_type(h.agent, "steering/message")]
        assert steers == ["kept steer"]
        assert turn_ends(h.agent) == ["aborted", "completed"]


async def test_a_steer_cancelled_before_its_turn_began_still_runs(rt, autojump_clock) -> None:
    rt.llm.register("scripted", ScriptedModel(["steered"]))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        h.agent.steer("kept steer")  # admits a turn the driver has not started yet
        assert h.agent.cancel(keep_inbox=True)
        with trio.fail_after(10):
            await h.agent.wait_idle()
        assert h.agent.inbox.next_step == ()
        steers = [e.data["content"] for e in of_type(h.agent, "steering/message")]
        assert steers == ["kept steer"]
        assert turn_ends(h.agent) == ["completed"]


async def test_leaving_a_run_early_keeps_a_steer_running(rt, autojump_clock) -> None:
    rt.llm.register("scripted", _stalling_first_call())
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        async with h.agent.run("first"):
            await trio.testing.wait_all_tasks_blocked()
            h.agent.steer("kept steer")
        with trio.fail_after(10):
            await h.agent.wait_idle()
        assert h.agent.inbox.next_step == ()
        assert turn_ends(h.agent)[-1] == "completed"


# --- agent_loop.create of a stored id --------------------------------------------------------


async def test_agent_loop_create_refuses_a_stored_id(tmp_path: Path) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("scripted", ScriptedModel(["first"]))
        async with await rt.agents.create(session_id="x", agent_options=OPTIONS) as h:
            await h.agent.ask("hi")
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("scripted", ScriptedModel(["second"]))
        with pytest.raises(agentloop.SessionIdInUse, match="resume it instead"):
            rt.agent_loop.create("x", OPTIONS)
        assert rt.agents.get("x") is None
        # The id is free for a resume.
        async with await rt.agents.resume(resume_session_id="x", agent_options=OPTIONS) as h:
            assert (await h.agent.ask("again")).text == "second"


# --- errors and facts at the edges -----------------------------------------------------------


async def test_creating_through_a_closed_context_is_an_agentloop_error(rt, model) -> None:
    owner = rt.child("o")
    await owner.aclose()
    with pytest.raises(agentloop.AgentLoopError):
        await owner.agents.create(session_id="x", agent_options=OPTIONS)
    with pytest.raises(agentloop.AgentLoopError):
        owner.agent_loop.create("y", OPTIONS)


async def test_bad_options_are_an_agentloop_error(rt, model) -> None:
    with pytest.raises(agentloop.AgentLoopError, match="agent_options"):
        await rt.agents.create(session_id="x", agent_options="gpt")  # type: ignore[arg-type]
    with pytest.raises(agentloop.AgentLoopError, match="options"):
        rt.agent_loop.create("y", {"provider": "p"})  # type: ignore[arg-type]


async def test_provider_error_facts_are_read_only(rt) -> None:
    rt.llm.register("scripted", ScriptedModel([
        agentloop.ProviderError("busy", status=503, code="overloaded"), "ok",
    ]))
    tried: list[str] = []

    def tamper(e: ev.AgentRequestError) -> Any:
        tried.append(e.error.message)
        with pytest.raises(AttributeError):
            e.error.status = 999  # type: ignore[misc]
        with pytest.raises(AttributeError):
            e.error.code = "mine"  # type: ignore[misc]
        return agentloop.Retry()

    rt.events.on(ev.AgentRequestError, tamper)
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        assert (await h.agent.ask("hi")).text == "ok"
    [header] = [e for e in of_type(h.agent, "request/header") if e.data.get("after_error")]
    assert header.data["after_error"]["error"]["status"] == 503
    assert tried == ["busy"]


async def test_resuming_a_session_another_runtime_drives_is_session_id_in_use(
    tmp_path: Path,
) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    async with agentloop.open_runtime(config) as one, agentloop.open_runtime(config) as two:
        one.llm.register("scripted", ScriptedModel([]))
        async with await one.agents.create(session_id="x", agent_options=OPTIONS):
            with pytest.raises(agentloop.SessionIdInUse, match="already driven"):
                await two.agents.resume(resume_session_id="x", agent_options=OPTIONS)
