"""The actor shape, seen from trio's task tree (contract section 7).

The runtime runs one ``agentloop.supervisor`` task; every published agent is one
``agentloop.agent:<id>`` task under it, alive from publication to quiescence; tool bodies run in
``agentloop.tool:<call_id>`` tasks under their agent. Failures inside one agent never reach the
supervisor or another agent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS, check_history_valid, check_log_invariants, turn_ends
from hypothesis import given
from hypothesis import strategies as st

import agentloop
from agentloop import events as ev
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta, ToolCallDelta, reply


def walk(task: trio.lowlevel.Task | None = None) -> Iterator[trio.lowlevel.Task]:
    task = task or trio.lowlevel.current_root_task()
    assert task is not None
    yield task
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            yield from walk(child)


def named(prefix: str, under: trio.lowlevel.Task | None = None) -> list[trio.lowlevel.Task]:
    return [t for t in walk(under) if t.name.startswith(prefix)]


def parent_of(task: trio.lowlevel.Task) -> trio.lowlevel.Task:
    return task.parent_nursery.parent_task  # type: ignore[union-attr]


async def test_one_supervisor_and_one_actor_per_published_agent(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    [supervisor] = named("agentloop.supervisor")
    assert named("agentloop.agent:") == []
    handles = [await rt.agents.create(session_id=f"a{i}", agent_options=OPTIONS) for i in range(3)]
    synchronous = rt.agent_loop.create("sync")
    await trio.testing.wait_all_tasks_blocked()
    actors = named("agentloop.agent:")
    assert sorted(t.name for t in actors) == [
        "agentloop.agent:a0", "agentloop.agent:a1", "agentloop.agent:a2", "agentloop.agent:sync",
    ]
    assert all(parent_of(t) is supervisor for t in actors)
    # Idle actors wait on their inbox channel; none holds a turn.
    assert all(h.agent.status == "idle" for h in handles)
    await handles[1].aclose()
    assert "agentloop.agent:a1" not in [t.name for t in named("agentloop.agent:")]
    for h in handles:
        await h.aclose()
    assert [t.name for t in named("agentloop.agent:")] == ["agentloop.agent:sync"]
    assert synchronous.status == "idle"


async def test_an_idle_actor_wakes_for_a_followup_and_tools_run_under_it(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    inside = trio.Event()
    release = trio.Event()
    seen: list[trio.lowlevel.Task] = []

    @rt.tools.tool(concurrency="parallel")
    async def wait(n: int) -> str:
        """Wait.

        Args:
            n: which.
        """
        seen.append(trio.lowlevel.current_task())
        if len(seen) == 2:
            inside.set()
        await release.wait()
        return "ok"

    model.add(reply("", tool_calls=[("wait", {"n": 1}, "w1"), ("wait", {"n": 2}, "w2")]))
    model.add(reply("done"))
    handle = await rt.agents.create(session_id="busy", agent_options=OPTIONS)
    await trio.testing.wait_all_tasks_blocked()
    [actor] = named("agentloop.agent:busy")
    assert named("agentloop.tool:") == []
    handle.agent.followup("go")
    await inside.wait()
    assert sorted(t.name for t in named("agentloop.tool:", under=actor)) == [
        "agentloop.tool:w1", "agentloop.tool:w2",
    ]
    assert set(seen) == set(named("agentloop.tool:"))
    release.set()
    await handle.agent.wait_idle()
    assert named("agentloop.tool:") == []
    assert named("agentloop.agent:busy") == [actor]  # the same task, idle again
    await handle.aclose()
    assert named("agentloop.agent:") == []


async def test_nothing_is_left_after_runtime_exit() -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", ScriptedModel(["a", "b"]))
        for i in range(2):
            (await rt.agents.create(session_id=f"x{i}", agent_options=OPTIONS)).agent.followup("hi")
        rt.agent_loop.create("y")
    assert named("agentloop.") == []


async def test_a_status_handler_that_sends_when_the_agent_goes_idle_starts_the_next_turn(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(reply("first"))
    model.add(reply("second"))
    handle = await rt.agents.create(session_id="reentry", agent_options=OPTIONS)
    agent = handle.agent
    sent = []

    def on_status(event: ev.AgentStatus) -> None:
        if event.status == "idle" and not sent:
            sent.append(agent.followup("again"))

    rt.events.on(ev.AgentStatus, on_status)
    agent.followup("go")
    with trio.fail_after(5):
        while len(turn_ends(agent)) < 2:
            await agent.wait_idle()
    assert turn_ends(agent) == ["completed", "completed"]
    assert agent.status == "idle"
    await handle.aclose()


class BrokenLeases:
    """A store whose lease cannot be taken: an agent_loop agent's actor fails while attaching."""

    async def exists(self, session_id: str) -> bool:
        return False

    async def list(self) -> list[Any]:
        return []

    async def load(self, session_id: str) -> Any:
        raise agentloop.SessionNotFound(session_id)

    async def create(self, session_id: str, meta: object) -> None:
        pass

    def append(self, session_id: str, event: object) -> None:
        pass

    async def flush(self, session_id: str, seq: int) -> None:
        pass

    async def acquire(self, session_id: str, owner: str) -> None:
        if session_id.startswith("doomed"):
            raise RuntimeError("lease table is corrupt")

    async def release(self, session_id: str, owner: str) -> None:
        pass


async def test_a_failing_actor_is_disposed_and_nothing_else_notices(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def plugin(ctx: agentloop.Context) -> None:
        ctx.provide_persistence(BrokenLeases())  # type: ignore[arg-type]

    async with agentloop.open_runtime(plugins=[plugin]) as rt:
        rt.llm.register("scripted", ScriptedModel(["still fine"]))
        survivor = await rt.agents.create(session_id="survivor", agent_options=OPTIONS)
        disposed = []
        rt.events.on(ev.AgentDisposed, lambda e: disposed.append(e.agent_id))
        doomed = rt.agent_loop.create("doomed")
        await trio.testing.wait_all_tasks_blocked()
        assert doomed.status == "disposed"
        assert disposed == ["doomed"]
        assert rt.agents.get("doomed") is None
        assert "agent doomed failed" in caplog.text
        assert named("agentloop.supervisor")
        survivor.agent.followup("hello")
        await survivor.agent.wait_idle()
        assert turn_ends(survivor.agent) == ["completed"]


# --- property: failures injected anywhere stay inside the failing agent -------------------------

POINTS = ["hook-request", "hook-pre-execute", "hook-step-result", "tool", "adapter-open",
          "adapter-mid", "adapter-provider", "store-append", "store-flush", "hook-turn-end"]


class FlakyStore:
    """An in-memory backend that fails on demand for one session."""

    def __init__(self, fail: set[str]) -> None:
        self.fail = fail
        self.rows: dict[str, list[Any]] = {}

    async def exists(self, session_id: str) -> bool:
        return session_id in self.rows

    async def list(self) -> list[Any]:
        return []

    async def load(self, session_id: str) -> Any:
        raise agentloop.SessionNotFound(session_id)

    async def create(self, session_id: str, meta: object) -> None:
        self.rows[session_id] = []

    def append(self, session_id: str, event: Any) -> None:
        if session_id == "victim" and "store-append" in self.fail and event.type == "turn/end":
            raise agentloop.PersistenceError("disk gone")
        self.rows.setdefault(session_id, []).append(event)

    async def flush(self, session_id: str, seq: int) -> None:
        await trio.lowlevel.checkpoint()
        if session_id == "victim" and "store-flush" in self.fail:
            raise agentloop.PersistenceError("flush failed")

    async def acquire(self, session_id: str, owner: str) -> None:
        pass

    async def release(self, session_id: str, owner: str) -> None:
        pass


@pytest.mark.slow
@given(fail=st.sets(st.sampled_from(POINTS), min_size=1, max_size=4),
       turns=st.integers(1, 3), close_first=st.booleans())
def test_injected_failures_never_reach_the_supervisor_or_another_agent(
    fail: set[str], turns: int, close_first: bool
) -> None:
    def maybe(point: str, agent_id: str | None) -> None:
        if agent_id == "victim" and point in fail:
            raise RuntimeError(f"injected at {point}")

    async def fn(request: Any) -> AsyncIterator[object]:
        sid = request.session_id
        if sid == "victim" and "adapter-provider" in fail:
            raise agentloop.ProviderError("injected provider failure", status=500)
        maybe("adapter-open", sid)
        yield TextDelta("part ")
        maybe("adapter-mid", sid)
        if request.step == 1:
            yield ToolCallDelta(0, id=f"c{request.turn}", name="act", arguments='{"n": 1}')
            yield Finish("tool_calls")
        else:
            yield TextDelta("done")
            yield Finish("stop")

    async def main() -> None:
        store = FlakyStore(fail)

        async def plugin(ctx: agentloop.Context) -> None:
            ctx.provide_persistence(store)  # type: ignore[arg-type]

        async with agentloop.open_runtime(plugins=[plugin]) as rt:
            rt.llm.register("scripted", FunctionModel(fn))

            @rt.tools.tool
            async def act(n: int) -> str:
                """Act.

                Args:
                    n: anything.
                """
                maybe("tool", _current_id(rt))
                return "acted"

            def hook(point: str) -> Any:
                def handler(event: Any) -> None:
                    maybe(point, getattr(event, "agent_id", None))

                return handler

            rt.events.on(ev.AgentRequest, hook("hook-request"))
            rt.events.on(ev.ToolPreExecute, hook("hook-pre-execute"))
            rt.events.on(ev.AgentStepResult, hook("hook-step-result"))
            rt.events.on(ev.AgentTurnEnd, hook("hook-turn-end"))
            victim = await rt.agents.create(session_id="victim", agent_options=OPTIONS)
            bystander = await rt.agents.create(session_id="bystander", agent_options=OPTIONS)
            for i in range(turns):
                victim.agent.followup(f"v{i}")
                bystander.agent.followup(f"b{i}")
            with trio.fail_after(60):
                if close_first:
                    await victim.aclose()
                await victim.agent.wait_idle()
                await bystander.agent.wait_idle()
            [supervisor] = named("agentloop.supervisor")
            assert supervisor is not None
            assert turn_ends(bystander.agent) == ["completed"] * turns
            for handle in (victim, bystander):
                check_log_invariants(handle.agent.session.events)
                check_history_valid(handle.agent.session.messages())
            # The failed agent still takes input (unless it was closed) and stays valid.
            if not close_first:
                victim.agent.followup("after")
                with trio.fail_after(60):
                    await victim.agent.wait_idle()
                check_log_invariants(victim.agent.session.events)
                check_history_valid(victim.agent.session.messages())
            bystander.agent.followup("still there?")
            with trio.fail_after(60):
                await bystander.agent.wait_idle()
            assert turn_ends(bystander.agent)[-1] == "completed"
        assert named("agentloop.") == []

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _current_id(rt: agentloop.Context) -> str | None:
    agent = rt.agents.current()
    return agent.id if agent is not None else None
