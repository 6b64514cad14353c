"""Sub-agents as child actors, background jobs, limits, and the ``subagent`` plugin."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from agentloop_subagent import Profile, subagents
from hypothesis import given
from hypothesis import strategies as st

import agentloop
from agentloop import AgentOptions, Context
from agentloop.events import (
    AgentCreated,
    AgentDisposed,
    AgentTurnEnd,
    SessionCreated,
    SessionEventAppended,
)
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, ProviderError, TextDelta, ToolCallDelta

OPTIONS = AgentOptions(provider="fn", model="m")
Part = TextDelta | ToolCallDelta | Finish
Child = Callable[[LLMRequest], Awaitable[str]]


def meta_of(rt: Context, request: LLMRequest) -> Any:
    session = rt.sessions.get(request.session_id)
    assert session is not None
    return session.meta


def tree_model(
    rt: Context, calls: list[tuple[str, dict[str, Any]]], child: Child | None = None
) -> FunctionModel:
    """Top-level agents call ``calls`` (in one reply), then report the tool results; children
    answer with ``child(request)`` (default: echo the task)."""

    async def fn(request: LLMRequest) -> AsyncIterator[Part]:
        last = request.messages[-1]
        if "parent_session_id" in meta_of(rt, request):
            text = await child(request) if child is not None else f"did: {last.text}"
            yield TextDelta(text)
        elif last.role == "user" and calls:
            for i, (name, args) in enumerate(calls):
                yield ToolCallDelta(i, id=f"call_{i}", name=name, arguments=json.dumps(args))
            yield Finish("tool_calls")
            return
        else:
            yield TextDelta("|".join(m.text for m in request.messages if m.role == "tool"))
        yield Finish("stop")

    return FunctionModel(fn)


def tool_results(agent: agentloop.Agent) -> list[Any]:
    return [e.data for e in agent.session.events if e.type == "tool/result"]


def turn_ends(session: agentloop.Session) -> list[Any]:
    return [e.data for e in session.events if e.type == "turn/end"]


def remember_sessions(rt: Context) -> dict[str, agentloop.Session]:
    """Every session created from now on, kept after its agent is gone."""
    found: dict[str, agentloop.Session] = {}

    def created(event: AgentCreated) -> None:
        agent = rt.agents.get(event.agent_id)
        assert agent is not None
        found[event.agent_id] = agent.session

    rt.events.on(AgentCreated, created)
    return found


def children_of(sessions: dict[str, agentloop.Session], parent: str) -> list[agentloop.Session]:
    return [s for s in sessions.values() if s.meta.get("parent_session_id") == parent]


async def parent(rt: Context, session_id: str = "p", **kw: Any) -> agentloop.AgentHandle:
    return await rt.agents.create(session_id=session_id, agent_options=OPTIONS, **kw)


# --- ctx.subagents.run / spawn -------------------------------------------------------------


async def test_run_returns_the_answer_and_disposes_the_child(rt: Context) -> None:
    rt.llm.register("fn", tree_model(rt, []))
    sessions = remember_sessions(rt)
    handle = await parent(rt)
    result = None

    @rt.tools.tool()
    async def delegate(task: str) -> str:
        """Delegate.

        Args:
            task: the task.
        """
        nonlocal result
        result = await rt.subagents.run(task)
        return result.text

    handle.agent.followup("x")
    rt.llm.register("fn", tree_model(rt, [("delegate", {"task": "sum"})]))
    await handle.agent.wait_idle()
    assert isinstance(result, agentloop.RunResult)
    assert (result.text, result.reason, result.turn) == ("did: sum", "completed", 1)
    assert tool_results(handle.agent)[0]["content"] == "did: sum"
    [child] = children_of(sessions, "p")
    # Disposed when run() returned, and its options were the parent's.
    assert rt.agents.get(child.id) is None and [a.id for a in rt.agents.list()] == ["p"]
    assert [e.data["config"]["provider"] for e in child.events if e.type == "request/header"] \
        == ["fn"]
    await handle.aclose()


async def test_lineage_is_in_the_child_session_meta(rt: Context) -> None:
    sessions = remember_sessions(rt)
    kept: list[agentloop.AgentHandle] = []

    @rt.tools.tool()
    async def spawn(task: str) -> str:
        """Spawn a child that spawns a grandchild.

        Args:
            task: the task.
        """
        async def grandchild(child: Context) -> None:
            kept.append(await child.subagents.spawn())

        kept.append(await rt.subagents.spawn(task, setup=grandchild))
        return "ok"

    rt.llm.register("fn", tree_model(rt, [("spawn", {"task": "t"})]))
    handle = await parent(rt, meta={"cwd": "/work"})
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    grandchild_handle, child_handle = kept
    child, grandchild = child_handle.agent, grandchild_handle.agent
    assert dict(child.session.meta) == {
        "parent_session_id": "p", "parent_call_id": "call_0", "depth": 1, "cwd": "/work",
    }
    # Spawned from its parent's setup: no tool call, one level deeper.
    assert dict(grandchild.session.meta) == {
        "parent_session_id": child.id, "depth": 2, "cwd": "/work",
    }
    await child.wait_idle()
    assert turn_ends(child.session)[0]["reason"] == "completed"
    assert set(sessions) == {"p", child.id, grandchild.id}
    await handle.aclose()
    assert rt.agents.list() == []


async def test_the_child_actor_runs_under_the_parent_actor_task(rt: Context) -> None:
    ancestry: list[str] = []

    async def child(request: LLMRequest) -> str:
        task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        while task is not None:
            ancestry.append(task.name)
            nursery = task.parent_nursery
            task = nursery.parent_task if nursery is not None else None
        await trio.lowlevel.checkpoint()
        return "ok"

    @rt.tools.tool()
    async def delegate() -> str:
        """Delegate."""
        return (await rt.subagents.run("go")).text

    rt.llm.register("fn", tree_model(rt, [("delegate", {})], child))
    handle = await parent(rt)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    child_tasks = [n for n in ancestry if n.startswith("agentloop.agent:sub-")]
    assert len(child_tasks) == 1
    assert ancestry.index(child_tasks[0]) < ancestry.index("agentloop.agent:p") \
        < ancestry.index("agentloop.supervisor")
    await handle.aclose()


async def test_disposing_the_parent_disposes_its_children_first(rt: Context) -> None:
    order: list[str] = []
    rt.events.on(AgentDisposed, lambda e: order.append(e.agent_id))
    release = trio.Event()

    async def child(request: LLMRequest) -> str:
        await release.wait()
        return "never"

    @rt.tools.tool()
    async def spawn() -> str:
        """Spawn two children with a grandchild each."""
        async def nested(c: Context) -> None:
            await c.subagents.spawn("work")

        for _ in range(2):
            await rt.subagents.spawn("work", setup=nested)
        return "ok"

    rt.llm.register("fn", tree_model(rt, [("spawn", {})], child))
    sessions = remember_sessions(rt)
    handle = await parent(rt)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    assert len(rt.agents.list()) == 5
    await handle.aclose()
    assert order[-1] == "p" and len(order) == 5
    for s in sessions.values():
        up = s.meta.get("parent_session_id")
        if up is not None:
            assert order.index(s.id) < order.index(up)  # depth-first, children first
            assert turn_ends(s)[-1]["reason"] == "disposed"
    assert rt.agents.list() == [] and rt.sessions.list() == []


async def test_cancelling_the_parent_turn_aborts_an_awaited_child(rt: Context) -> None:
    started = trio.Event()

    async def child(request: LLMRequest) -> str:
        started.set()
        await trio.sleep_forever()
        raise AssertionError

    @rt.tools.tool()
    async def delegate() -> str:
        """Delegate."""
        return (await rt.subagents.run("go")).text

    rt.llm.register("fn", tree_model(rt, [("delegate", {})], child))
    sessions = remember_sessions(rt)
    handle = await parent(rt)
    handle.agent.followup("x")
    with trio.fail_after(5):
        await started.wait()
        assert handle.agent.cancel()
        await handle.agent.wait_idle()
    [child_session] = children_of(sessions, "p")
    assert turn_ends(child_session) == [{"turn": 1, "reason": "aborted", "cause": "parent"}]
    assert turn_ends(handle.agent.session)[-1]["reason"] == "aborted"
    assert [a.id for a in rt.agents.list()] == ["p"]
    await handle.aclose()


async def test_cancelling_the_parent_turn_aborts_a_spawned_child(rt: Context) -> None:
    release = trio.Event()

    async def child(request: LLMRequest) -> str:
        await release.wait()
        return "late"

    kept: list[agentloop.AgentHandle] = []
    spawned = trio.Event()

    @rt.tools.tool()
    async def spawn() -> str:
        """Spawn a child, then wait."""
        kept.append(await rt.subagents.spawn("work"))
        spawned.set()
        await trio.sleep_forever()
        raise AssertionError

    rt.llm.register("fn", tree_model(rt, [("spawn", {})], child))
    handle = await parent(rt)
    handle.agent.followup("x")
    with trio.fail_after(5):
        await spawned.wait()
        await trio.testing.wait_all_tasks_blocked()
        handle.agent.cancel()
        await handle.agent.wait_idle()
        await kept[0].agent.wait_idle()
    assert turn_ends(kept[0].agent.session) == [
        {"turn": 1, "reason": "aborted", "cause": "parent"}
    ]
    # The child lives on (owned by the parent) and takes new work.
    release.set()
    kept[0].agent.followup("again")
    await kept[0].agent.wait_idle()
    assert turn_ends(kept[0].agent.session)[-1]["reason"] == "completed"
    await handle.aclose()


async def test_the_parent_cancel_ends_children_before_its_own_turn_unwinds(
    rt: Context,
) -> None:
    async def child(request: LLMRequest) -> str:
        await trio.sleep_forever()
        raise AssertionError

    kept: list[agentloop.AgentHandle] = []
    jobs: list[agentloop.Job] = []
    spawned = trio.Event()
    unwind = trio.Event()

    @rt.tools.tool()
    async def spawn() -> str:
        """Spawn a child and a job, then wait; unwinding takes until ``unwind`` is set."""
        kept.append(await rt.subagents.spawn("work"))
        jobs.append(await rt.jobs.start("job"))
        spawned.set()
        try:
            await trio.sleep_forever()
        finally:
            # The parent's turn cannot end (nor its turn/end be written) before this.
            with trio.CancelScope(shield=True):
                await unwind.wait()
        raise AssertionError

    order: list[tuple[str, str]] = []
    rt.events.on(AgentTurnEnd, lambda e: order.append((e.agent_id, e.reason)))
    rt.llm.register("fn", tree_model(rt, [("spawn", {})], child))
    handle = await parent(rt)
    handle.agent.followup("x")
    with trio.fail_after(5):
        await spawned.wait()
        await trio.testing.wait_all_tasks_blocked()
        job_child = rt.agents.get(jobs[0].session_id)
        assert job_child is not None
        assert handle.agent.cancel()
        await trio.testing.wait_all_tasks_blocked()
        children = {kept[0].agent.id, job_child.id}
        assert set(order) == {(a, "aborted") for a in children}
        for session in (kept[0].agent.session, job_child.session):
            assert turn_ends(session) == [{"turn": 1, "reason": "aborted", "cause": "parent"}]
        assert turn_ends(handle.agent.session) == []
        assert jobs[0].status == "cancelled"
        unwind.set()
        await handle.agent.wait_idle()
    assert order[-1] == (handle.agent.id, "aborted")
    assert turn_ends(handle.agent.session)[-1]["cause"] == "user"
    await handle.aclose()


async def test_a_failing_child_is_the_tool_error_result(rt: Context) -> None:
    async def child(request: LLMRequest) -> str:
        await trio.lowlevel.checkpoint()
        raise ProviderError("the child's model is down", code="DOWN")

    @rt.tools.tool()
    async def delegate() -> str:
        """Delegate."""
        return (await rt.subagents.run("go")).text

    rt.llm.register("fn", tree_model(rt, [("delegate", {})], child))
    handle = await parent(rt)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    [result] = tool_results(handle.agent)
    assert result["is_error"] and "TurnFailed" in result["content"]
    assert turn_ends(handle.agent.session) == [{"turn": 1, "reason": "completed"}]
    await handle.aclose()


# --- limits --------------------------------------------------------------------------------


def plugin_runtime(**kw: Any) -> Any:
    return agentloop.open_runtime(plugins=[subagents(**kw)])


async def test_depth_beyond_the_limit_is_an_error_result_the_model_reads() -> None:
    async with plugin_runtime() as rt:
        rt.llm.register("fn", tree_model(rt, [("subagent", {"task": "deeper"})]))
        # A session at the deepest allowed level (default 3) may not delegate further.
        handle = await parent(rt, meta={"depth": 3})
        handle.agent.followup("x")
        await handle.agent.wait_idle()
        [result] = tool_results(handle.agent)
        assert result["is_error"]
        assert "SubagentLimitExceeded" in result["content"]
        assert "subagents.max_depth" in result["content"]
        assert [a.id for a in rt.agents.list()] == ["p"]
        await handle.aclose()


async def test_live_children_beyond_the_limit_are_refused(rt: Context) -> None:
    refused: list[BaseException] = []
    kept: list[agentloop.AgentHandle] = []

    @rt.tools.tool()
    async def spawn() -> str:
        """Spawn nine children."""
        for _ in range(9):
            try:
                kept.append(await rt.subagents.spawn())
            except agentloop.SubagentLimitExceeded as exc:
                refused.append(exc)
        # Closing one frees a place.
        await kept[0].aclose()
        kept.append(await rt.subagents.spawn())
        return "ok"

    rt.llm.register("fn", tree_model(rt, [("spawn", {})]))
    handle = await parent(rt)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    assert len(refused) == 1 and "subagents.max_children" in str(refused[0])
    assert isinstance(refused[0], agentloop.AgentLoopError)
    assert len(rt.agents.list()) == 1 + 8
    assert tool_results(handle.agent)[0]["content"] == "ok"
    await handle.aclose()


async def test_concurrent_spawns_never_exceed_the_limit(rt: Context) -> None:
    outcomes: list[str] = []

    @rt.tools.tool()
    async def spawn() -> str:
        """Spawn twelve children at once."""
        async def one() -> None:
            try:
                await rt.subagents.spawn()
                outcomes.append("ok")
            except agentloop.SubagentLimitExceeded:
                outcomes.append("refused")

        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(one)
        return "ok"

    rt.llm.register("fn", tree_model(rt, [("spawn", {})]))
    handle = await parent(rt)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    assert sorted(outcomes) == ["ok"] * 8 + ["refused"] * 4
    await handle.aclose()


def test_limit_values_are_validated() -> None:
    from agentloop._agents import MAX_CHILDREN, check_limit

    assert check_limit(4, MAX_CHILDREN) == 4
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(agentloop.SettingsError, match=r"subagents\.max_children"):
            check_limit(bad, MAX_CHILDREN)


# --- ctx.jobs ------------------------------------------------------------------------------


async def test_a_job_runs_in_the_background_and_delivers(rt: Context) -> None:
    release = trio.Event()

    async def child(request: LLMRequest) -> str:
        await release.wait()
        return "background answer"

    jobs: list[agentloop.Job] = []

    @rt.tools.tool()
    async def start() -> str:
        """Start a job."""
        job = await rt.jobs.start("work", deliver=True)
        jobs.append(job)
        assert rt.jobs.get(job.id) is job and rt.jobs.list() == [job]
        return job.id

    rt.llm.register("fn", tree_model(rt, [("start", {})], child))
    handle = await parent(rt)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    [job] = jobs
    # The parent's turn is over; the job still runs. It is the parent's, not the root's.
    assert job.status == "running" and rt.jobs.list() == []
    release.set()
    result = await job.result()
    assert (job.status, result.text, result.reason) == ("done", "background answer", "completed")
    [delivered] = handle.agent.inbox.next_step
    assert delivered.content == f"[background job {job.id} done]\nbackground answer"
    assert delivered.source == {"job": job.id, "status": "done", "session_id": job.session_id}
    await trio.testing.wait_all_tasks_blocked()
    assert rt.agents.get(job.session_id) is None  # a finished job's child is disposed
    await handle.aclose()
    assert rt._supervisor.jobs == {}


def answering(child: Child) -> FunctionModel:
    async def fn(request: LLMRequest) -> AsyncIterator[Part]:
        yield TextDelta(await child(request))
        yield Finish("stop")

    return FunctionModel(fn)


async def test_cancelling_a_job_and_jobs_dying_with_their_owner(rt: Context) -> None:
    async def child(request: LLMRequest) -> str:
        await trio.sleep_forever()
        raise AssertionError

    rt.llm.register("fn", answering(child))
    job = await rt.jobs.start("work", agent_options=OPTIONS)
    assert rt.jobs.list() == [job] and job.status == "running"
    assert job.cancel() and not job.cancel()
    assert job.status == "cancelled"
    with pytest.raises(agentloop.JobCancelled):
        await job.result()
    scope = rt.child("owner")
    other = await scope.jobs.start("work", agent_options=OPTIONS)
    assert scope.jobs.list() == [other] and rt.jobs.get(other.id) is None
    await trio.testing.wait_all_tasks_blocked()
    await scope.aclose()
    assert other.status == "cancelled" and rt.agents.list() == []
    with pytest.raises(agentloop.JobCancelled):
        await other.result()


async def test_a_failed_job(rt: Context) -> None:
    async def child(request: LLMRequest) -> str:
        await trio.lowlevel.checkpoint()
        raise ProviderError("down")

    rt.llm.register("fn", answering(child))
    job = await rt.jobs.start("work", agent_options=OPTIONS)
    with pytest.raises(agentloop.TurnFailed):
        await job.result()
    assert job.status == "failed"


async def test_jobs_die_with_the_agent_that_started_them(rt: Context) -> None:
    async def child(request: LLMRequest) -> str:
        await trio.sleep_forever()
        raise AssertionError

    jobs: list[agentloop.Job] = []

    @rt.tools.tool()
    async def start() -> str:
        """Start two jobs."""
        jobs.extend([await rt.jobs.start("a"), await rt.jobs.start("b")])
        return "ok"

    rt.llm.register("fn", tree_model(rt, [("start", {})], child))
    handle = await parent(rt)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    assert [j.status for j in jobs] == ["running", "running"]
    with pytest.raises(ValueError, match="owning agent"):
        await rt.jobs.start("c", agent_options=OPTIONS, deliver=True)
    await handle.aclose()
    assert [j.status for j in jobs] == ["cancelled", "cancelled"]
    assert rt.agents.list() == [] and rt._supervisor.jobs == {}


async def test_a_child_seeded_with_a_prefix_of_the_parent_history(rt: Context) -> None:
    seen: list[LLMRequest] = []

    async def child(request: LLMRequest) -> str:
        seen.append(request)
        await trio.lowlevel.checkpoint()
        return "ok"

    rt.llm.register("fn", tree_model(rt, [], child))
    handle = await parent(rt)
    await handle.agent.ask("the parent's question")
    prefix = list(handle.agent.session.events)

    @rt.tools.tool()
    async def fork() -> str:
        """Fork."""
        return (await rt.subagents.run("and now?", seed=prefix)).text

    rt.llm.register("fn", tree_model(rt, [("fork", {})], child))
    await handle.agent.ask("fork it")
    [request] = seen
    texts = [m.text for m in request.messages]
    assert texts[0] == "the parent's question" and texts[-1] == "and now?"
    assert request.messages[0].role == "user"
    with pytest.raises(agentloop.InvalidContent, match="seed"):
        await rt.subagents.spawn(seed=[{"type": ""}])
    await handle.aclose()


# --- the plugin ----------------------------------------------------------------------------


async def test_the_subagent_tool_runs_two_children_in_parallel() -> None:
    async with plugin_runtime() as rt:
        active, peak = 0, 0

        async def child(request: LLMRequest) -> str:
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            await trio.sleep(0.01)
            active -= 1
            return f"answer to {request.messages[-1].text}"

        rt.llm.register("fn", tree_model(
            rt, [("subagent", {"task": "a"}), ("subagent", {"task": "b"})], child
        ))
        handle = await parent(rt)
        result = await handle.agent.ask("x")
        assert result.text == "answer to a|answer to b"
        assert peak == 2
        [spec] = [t for t in rt.tools.list() if t.name == "subagent"]
        assert spec.parameters["required"] == ("task",)
        await handle.aclose()


async def test_background_tools_by_job_id() -> None:
    async with plugin_runtime() as rt:
        sessions = remember_sessions(rt)
        step = 0

        async def fn(request: LLMRequest) -> AsyncIterator[Part]:
            nonlocal step
            if "parent_session_id" in meta_of(rt, request):
                yield TextDelta("bg done")
                yield Finish("stop")
                return
            step += 1
            tool_texts = [m.text for m in request.messages if m.role == "tool"]
            if step == 1:
                call = ("subagent_start", {"task": "t"})
            elif step == 2:
                job_id = json.loads(tool_texts[-1])["job_id"]
                call = ("subagent_result", {"job_id": job_id})
            elif step == 3:
                call = ("subagent_status", {"job_id": job_id_of(tool_texts[0])})
            elif step == 4:
                call = ("subagent_result", {"job_id": "job-nope", "wait": False})
            else:
                yield TextDelta("|".join(tool_texts))
                yield Finish("stop")
                return
            yield ToolCallDelta(0, id=f"c{step}", name=call[0], arguments=json.dumps(call[1]))
            yield Finish("tool_calls")

        def job_id_of(text: str) -> str:
            return str(json.loads(text)["job_id"])

        rt.llm.register("fn", FunctionModel(fn))
        handle = await parent(rt)
        result = await handle.agent.ask("x")
        start, answer, status, unknown = result.text.split("|")
        assert json.loads(start)["status"] == "running"
        assert answer == "bg done"
        assert json.loads(status)["status"] == "done"
        assert "unknown job id 'job-nope'" in unknown
        assert len(children_of(sessions, "p")) == 1
        await handle.aclose()


async def test_profiles_from_config_choose_model_and_tools() -> None:
    config = {
        "plugins": ["subagent"],
        "subagent": {"profiles": [
            {"name": "writer", "model": "m2", "system_prompt": "Write well.", "tools": []},
        ]},
    }
    async with agentloop.open_runtime(config=config) as rt:
        seen: list[LLMRequest] = []

        async def child(request: LLMRequest) -> str:
            seen.append(request)
            await trio.lowlevel.checkpoint()
            return "written"

        rt.llm.register("fn", tree_model(
            rt, [("subagent", {"task": "write", "agent": "writer"})], child
        ))
        handle = await parent(rt)
        assert (await handle.agent.ask("x")).text == "written"
        [request] = seen
        assert request.config.model == "m2" and request.system == "Write well."
        assert request.tools == ()  # an empty allow-list offers the model nothing
        [spec] = [t for t in rt.tools.list() if t.name == "subagent"]
        assert spec.parameters["properties"]["agent"]["enum"] == ("writer",)
        await handle.aclose()


async def test_a_profile_allow_list_hides_the_other_tools_from_the_childs_requests() -> None:
    profiles = [Profile("adder", tools=("add", "nowhere")), Profile("free")]
    async with plugin_runtime(profiles=profiles) as rt:
        seen: dict[str, list[LLMRequest]] = {}

        @rt.tools.tool()
        async def add(a: int, b: int) -> int:
            """Add two numbers."""
            return a + b

        @rt.tools.tool()
        async def other() -> str:
            """Another tool."""
            return "ran"

        async def child(request: LLMRequest) -> str:
            seen.setdefault(request.messages[0].text, []).append(request)
            await trio.lowlevel.checkpoint()
            return "ok"

        rt.llm.register("fn", tree_model(rt, [
            ("subagent", {"task": "restricted", "agent": "adder"}),
            ("subagent", {"task": "open", "agent": "free"}),
            ("subagent", {"task": "like me"}),
        ], child))
        handle = await parent(rt)
        await handle.agent.ask("x")
        names = {task: [t.name for t in reqs[0].tools] for task, reqs in seen.items()}
        # Only the allowed tools that exist, in the registry's order; the parent's request
        # and the unrestricted children keep everything.
        assert names["restricted"] == ["add"]
        everything = [t.name for t in rt.tools.list()]
        assert "other" in everything and "subagent" in everything
        assert names["open"] == names["like me"] == everything
        await handle.aclose()


async def test_duplicate_profile_names_are_a_config_error() -> None:
    with pytest.raises(agentloop.ConfigError, match="unique"):
        subagents(profiles=[Profile("a"), Profile("a")])
    config = {"plugins": ["subagent"], "subagent": {"profiles": [{"name": "a", "nope": 1}]}}
    with pytest.raises(agentloop.ConfigError, match="nope"):
        async with agentloop.open_runtime(config=config):
            pass


async def test_an_unknown_profile_and_a_denied_tool_are_error_results() -> None:
    async with plugin_runtime(profiles=[Profile("solo", tools=("add",))]) as rt:
        calls: list[Any] = []

        @rt.tools.tool()
        async def other() -> str:
            """Another tool."""
            return "ran"

        async def fn(request: LLMRequest) -> AsyncIterator[Part]:
            last = request.messages[-1]
            meta = meta_of(rt, request)
            if last.role == "user":
                call = ("other", {}) if "parent_session_id" in meta else (
                    "subagent", {"task": "t", "agent": calls.pop(0)})
                yield ToolCallDelta(0, id="c", name=call[0], arguments=json.dumps(call[1]))
                yield Finish("tool_calls")
                return
            yield TextDelta(last.text)
            yield Finish("stop")

        rt.llm.register("fn", FunctionModel(fn))
        handle = await parent(rt)
        calls.extend(["ghost", "solo"])
        bad = await handle.agent.ask("x")
        assert "must be one of 'solo', got 'ghost'" in bad.text  # the schema's enum
        # The child may call only "add": its call of "other" is denied, which it reports.
        good = await handle.agent.ask("y")
        assert "may only call: add" in good.text
        await handle.aclose()


# --- the command line ----------------------------------------------------------------------


def test_sessions_list_shows_children_under_their_parent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentloop_sqlite import SqliteSessionStore

    from agentloop._cli_main import main

    db = tmp_path / "s.db"

    async def build() -> None:
        config = {"persistence": {"backend": "sqlite", "path": str(db)}}
        async with agentloop.open_runtime(config=config) as rt:
            rt.llm.register("fn", tree_model(rt, [("delegate", {})]))

            @rt.tools.tool()
            async def delegate() -> str:
                """Delegate twice, once nested."""
                async def nested(c: Context) -> None:
                    await c.subagents.spawn(session_id="grandchild")

                await rt.subagents.spawn("t", session_id="child-a", setup=nested)
                await rt.subagents.run("t", session_id="child-b")
                return "ok"

            await (await parent(rt, "aaa")).agent.ask("x")
            await parent(rt, "zzz")

    trio.run(build)

    async def no_log(self: object, session_id: str) -> None:
        raise AssertionError(f"the listing loaded the log of {session_id!r}")

    # The lineage comes with the listing (SessionInfo.parent_session_id): no log is read.
    with monkeypatch.context() as patched:
        patched.setattr(SqliteSessionStore, "load", no_log)
        assert main(["sessions", "list", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = [(line.split()[0], len(line) - len(line.lstrip())) for line in lines]
    ids = [sid for sid, _ in rows]
    assert set(ids) == {"aaa", "child-a", "child-b", "grandchild", "zzz"}
    indent = dict(rows)
    assert (indent["aaa"], indent["zzz"]) == (0, 0)
    assert indent["child-a"] == indent["child-b"] == 2 and indent["grandchild"] == 4
    # The listing's order (latest activity first) holds among siblings; each subtree follows
    # its root.
    start = ids.index("aaa")
    assert set(ids[start + 1:start + 4]) == {"child-a", "child-b", "grandchild"}
    assert ids.index("grandchild") == ids.index("child-a") + 1

    assert main(["sessions", "show", "aaa", "--tree", "--db", str(db)]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if "session " in line]
    assert heads[0] == "session aaa"
    assert set(heads[1:]) == {"  session child-a", "  session child-b", "    session grandchild"}
    assert heads.index("    session grandchild") == heads.index("  session child-a") + 1
    assert main(["sessions", "show", "child-a", "--tree", "--db", str(db)]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if "session " in line]
    assert heads == ["session child-a", "  session grandchild"]


# --- the tree property ---------------------------------------------------------------------


Op = tuple[str, int]
OPS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["spawn", "run", "job", "crash"]), st.integers(0, 1)),
        st.tuples(st.sampled_from(["cancel", "close-parent", "close-child", "sleep"]),
                  st.integers(0, 3)),
    ),
    max_size=14,
)


async def tree_example(ops: list[Op]) -> None:
    order: list[tuple[str, str, Any]] = []  # one global order for every session
    jobs: list[agentloop.Job] = []
    kept: list[agentloop.AgentHandle] = []
    async with agentloop.open_runtime() as rt:
        supervisor = rt._supervisor

        def appended(event: SessionEventAppended) -> None:
            order.append(("event", event.session_id, event.event))

        rt.events.on(SessionEventAppended, appended)
        rt.events.on(SessionCreated, lambda e: order.append(("created", e.session_id, e.meta)))
        rt.events.on(AgentDisposed, lambda e: order.append(("gone", e.agent_id, None)))

        async def child(request: LLMRequest) -> str:
            task = request.messages[-1].text
            await trio.sleep(abs(float(task)))
            if task.startswith("-"):
                raise ProviderError("an injected model failure")
            return "ok"

        async def fn(request: LLMRequest) -> AsyncIterator[Part]:
            last = request.messages[-1]
            if "parent_session_id" in meta_of(rt, request):
                yield TextDelta(await child(request))
            elif last.role == "user":
                kind, delay = last.text.split(":")
                yield ToolCallDelta(0, id="c", name=kind, arguments=json.dumps({"d": delay}))
                yield Finish("tool_calls")
                return
            else:
                yield TextDelta("done")
            yield Finish("stop")

        rt.llm.register("fn", FunctionModel(fn))

        @rt.tools.tool()
        async def spawn(d: str) -> str:
            """Spawn a child and keep the turn open a while."""
            kept.append(await rt.subagents.spawn(d))
            await trio.sleep(abs(float(d)) / 2)
            return "ok"

        @rt.tools.tool()
        async def run(d: str) -> str:
            """Run a child."""
            return (await rt.subagents.run(d)).text

        @rt.tools.tool()
        async def job(d: str) -> str:
            """Start a job."""
            jobs.append(await rt.jobs.start(d))
            return "ok"

        @rt.tools.tool()
        async def crash(d: str) -> str:
            """Spawn a child, then fail."""
            kept.append(await rt.subagents.spawn(d))
            raise RuntimeError("the tool crashed")

        # One observer follows p0's whole tree from before p0 exists.
        async with rt.subagents.subscribe_tree("p0") as tree_rx:
            parents = [await parent(rt, f"p{i}") for i in range(2)]
            await apply_tree_ops(ops, parents, kept, order)
            cut = len(order)
            followed: list[agentloop.TreeEvent] = []
            while True:
                try:
                    followed.append(tree_rx.receive_nowait())
                except trio.WouldBlock:
                    break
        check_followed(order[:cut], followed)
    # Runtime exit: every registry is empty.
    assert supervisor.agents == {} and supervisor.sessions == {}
    assert supervisor.children == {} and supervisor.parent_of == {}
    assert supervisor.jobs == {} and supervisor.preparing("any") is None
    check_tree(order, jobs)
    for job in jobs:
        # The one final status and the outcome agree.
        expected: Any = {
            "cancelled": agentloop.JobCancelled, "failed": agentloop.TurnFailed,
        }.get(job.status)
        if expected is None:
            assert (await job.result()).reason == "completed"
        else:
            with pytest.raises(expected):
                await job.result()


async def apply_tree_ops(
    ops: list[Op], parents: list[agentloop.AgentHandle], kept: list[agentloop.AgentHandle],
    order: list[tuple[str, str, Any]],
) -> None:
    for op, arg in ops:
        if op in ("spawn", "run", "job", "crash"):
            agent = parents[arg].agent
            if agent.status == "idle":
                # Varied delays; every fifth child's model fails after its delay.
                delay = 0.5 * (1 + len(order) % 3) * (-1 if len(order) % 5 == 0 else 1)
                agent.followup(f"{op}:{delay}")
        elif op == "cancel":
            agent = parents[arg % 2].agent
            if agent.cancel():
                order.append(("cancel", agent.id, None))
        elif op == "close-parent":
            await parents[arg % 2].aclose()
        elif op == "close-child" and kept:
            await kept[arg % len(kept)].aclose()
        elif op == "sleep":
            await trio.sleep(arg / 2)
        await trio.testing.wait_all_tasks_blocked()


def check_followed(
    order: list[tuple[str, str, Any]], followed: list[agentloop.TreeEvent]
) -> None:
    """The tree subscription got exactly the events of p0 and its descendants, each session's
    in seq order, with their lineage, and in the one emission order."""
    tree: dict[str, str | None] = {"p0": None}
    for kind, sid, item in order:
        if kind == "created" and item.get("parent_session_id") in tree:
            tree[sid] = item["parent_session_id"]
    expected = [(sid, e) for kind, sid, e in order if kind == "event" and sid in tree]
    assert [(i.session_id, i.event) for i in followed] == expected
    for item in followed:
        assert item.parent_session_id == tree[item.session_id]
        assert item.depth == (0 if item.parent_session_id is None else 1)


def check_tree(order: list[tuple[str, str, Any]], jobs: list[agentloop.Job]) -> None:
    parent_of: dict[str, str] = {}
    gone: dict[str, int] = {}
    open_turn: dict[str, int] = {}  # session -> index of its open turn/start
    spans: list[tuple[str, int, int, Any]] = []  # (session, start, end, turn/end data)
    for i, (kind, sid, item) in enumerate(order):
        if kind == "gone":
            gone[sid] = i
        elif kind == "created" and "parent_session_id" in item:
            parent_of[sid] = item["parent_session_id"]
        elif kind == "event":
            if item.type == "turn/start":
                assert sid not in open_turn
                open_turn[sid] = i
            elif item.type == "turn/end":
                spans.append((sid, open_turn.pop(sid), i, item.data))
    assert open_turn == {}, "every turn/start has its turn/end"
    cancels = [(i, sid) for i, (kind, sid, _) in enumerate(order) if kind == "cancel"]
    for sid, start, end, data in spans:
        up = parent_of.get(sid)
        cancelled_while_running = any(p == up and start < i < end for i, p in cancels)
        if data.get("cause") == "parent":
            assert data["reason"] == "aborted" and cancelled_while_running, (
                f"{sid}: cause parent, but its parent's turn was not cancelled while it ran"
            )
        else:
            # Each operation runs once every task is blocked, so no child is half-way through
            # finishing when its parent's turn is cancelled.
            assert not cancelled_while_running, (
                f"{sid}: its parent's turn was cancelled while it ran, yet it ended {data}"
            )
    for child, up in parent_of.items():
        assert gone[child] < gone[up], f"{child} outlived its parent {up}"
    for job in jobs:
        assert job.status in ("done", "failed", "cancelled")


@pytest.mark.slow
@given(OPS)
def test_tree_property(ops: list[Op]) -> None:
    """Random trees: two parents whose turns spawn, run, start jobs or crash after spawning;
    cancels of a parent's turn, closing parents and children, time passing, runtime exit.

    No child outlives its parent; every child's turns pair; a child's turn ends with cause
    ``parent`` exactly when its parent's turn was cancelled while it ran; every job ends
    with one final status that agrees with its result; every registry is empty at exit; an
    observer of p0's tree receives exactly the events of p0 and its children, in order.
    """
    trio.run(tree_example, ops, clock=trio.testing.MockClock(autojump_threshold=0))
