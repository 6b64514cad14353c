"""Agent lifecycle as transactions: creation, rollback, arbitration, ownership, quiescence."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator

import pytest
import trio
import trio.lowlevel
import trio.testing
from conftest import OPTIONS, of_type, turn_ends

import agentloop
from agentloop import events as ev
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta


def record(rt: agentloop.Context, *classes: type[ev.Event]) -> list[str]:
    out: list[str] = []
    for cls in classes:
        def note(e: ev.Event, cls: type[ev.Event] = cls) -> None:
            who = getattr(e, "agent_id", "") or getattr(e, "session_id", "")
            out.append(f"{cls.name}:{who}")

        rt.events.on(cls, note)
    return out


LIFECYCLE = (ev.SessionCreated, ev.AgentCreated, ev.AgentSessionStart, ev.AgentDisposed,
             ev.SessionDisposed)


async def test_creation_announces_in_order_then_starts(rt, model) -> None:
    log = record(rt, *LIFECYCLE)
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    assert log == ["session/created:s", "agent/created:s", "agent/session-start:s"]
    assert rt.agents.get("s") is handle.agent and rt.sessions.get("s") is handle.agent.session
    assert handle.agent.id == handle.agent.session.id == "s"
    await handle.aclose()
    assert log[3:] == ["agent/disposed:s", "session/disposed:s"]
    assert rt.agents.get("s") is None and rt.sessions.get("s") is None


async def test_setup_runs_unpublished_and_scopes_its_registrations(rt, model) -> None:
    model.add(agentloop.testing.reply("", tool_calls=[("private", {})]), "ok", "other")
    seen_by_hook: list[str] = []

    async def setup(ctx: agentloop.Context) -> None:
        assert rt.agents.get("mine") is None  # not published yet
        agent_ids = [a.id for a in ctx.agents.list()]
        assert "mine" not in agent_ids

        @ctx.tools.tool
        async def private() -> str:
            """Only this agent sees me."""
            return "secret"

        ctx.events.on(ev.AgentRequest, lambda e: seen_by_hook.append(e.agent_id))

    h1 = await rt.agents.create(session_id="mine", agent_options=OPTIONS, setup=setup)
    h2 = await rt.agents.create(session_id="other", agent_options=OPTIONS)
    h1.agent.followup("x")
    await h1.agent.wait_idle()
    h2.agent.followup("y")
    await h2.agent.wait_idle()
    assert of_type(h1.agent, "tool/result")[0].data["content"] == "secret"
    assert [t.name for t in model.requests[0].tools] == ["private"]
    assert model.requests[2].tools == ()
    assert seen_by_hook == ["mine", "mine"]
    await h1.aclose()
    assert rt.tools.get("private") is None


async def test_each_request_shows_the_tools_registered_by_then_for_its_agent(rt, model) -> None:
    # Agents without tools of their own share the specs shown to the model: one agent's own
    # tool, a later global tool and that agent's disposal must each reach the next request.
    model.add("a1", "b1", "a2", "b2", "a3")

    async def setup(ctx: agentloop.Context) -> None:
        @ctx.tools.tool
        async def private() -> str:
            """Only this agent sees me."""
            return "secret"

    async def turn(handle: agentloop.AgentHandle) -> tuple[str, ...]:
        handle.agent.followup("x")
        await handle.agent.wait_idle()
        return tuple(t.name for t in model.requests[-1].tools)

    a = await rt.agents.create(session_id="a", agent_options=OPTIONS)
    assert await turn(a) == ()
    b = await rt.agents.create(session_id="b", agent_options=OPTIONS, setup=setup)
    assert await turn(b) == ("private",)
    assert await turn(a) == ()

    @rt.tools.tool
    async def shared() -> str:
        """Everyone sees me."""
        return "shared"

    assert await turn(b) == ("private", "shared")
    await b.aclose()
    assert await turn(a) == ("shared",)


async def test_driving_an_unpublished_agent_is_an_error(rt, model) -> None:
    refused: list[str] = []

    async def setup(ctx: agentloop.Context) -> None:
        # The agent under construction is reachable only through internals; it refuses input.
        # Its own scope's agent, as the supervisor holds it while it is being prepared.
        unpublished = rt._supervisor.agent_of(ctx)
        with pytest.raises(agentloop.AgentNotPublished, match="still being set up"):
            unpublished.followup("x")
        refused.append("u")

    await rt.agents.create(session_id="u", agent_options=OPTIONS, setup=setup)
    assert refused == ["u"]


def test_agents_and_handles_have_no_public_constructor() -> None:
    for cls in (agentloop.Agent, agentloop.AgentHandle):
        with pytest.raises(TypeError, match="has no public constructor"):
            cls(None, None)
    assert agentloop.ConfigError.__module__ == "agentloop"


async def test_setup_failure_rolls_back_and_the_id_is_reusable(rt, model) -> None:
    log = record(rt, *LIFECYCLE)

    async def setup(ctx: agentloop.Context) -> None:
        @ctx.tools.tool
        async def leftover() -> str:
            """Leftover."""
            return ""

        raise ValueError("setup broke")

    with pytest.raises(ValueError, match="setup broke"):
        await rt.agents.create(session_id="r", agent_options=OPTIONS, setup=setup)
    assert log == [] and rt.agents.get("r") is None and rt.sessions.get("r") is None
    assert rt.tools.get("leftover") is None
    handle = await rt.agents.create(session_id="r", agent_options=OPTIONS)
    assert rt.agents.get("r") is handle.agent


async def test_caller_cancellation_during_setup_rolls_back(rt, model) -> None:
    log = record(rt, *LIFECYCLE)
    entered = trio.Event()

    async def setup(ctx: agentloop.Context) -> None:
        entered.set()
        await trio.sleep_forever()

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: rt.agents.create(session_id="c", agent_options=OPTIONS,
                                                        setup=setup))
            await entered.wait()
            scope.cancel()
    assert scope.cancelled_caught
    assert log == [] and rt.agents.get("c") is None
    await rt.agents.create(session_id="c", agent_options=OPTIONS)


async def test_caller_scope_no_longer_matters_once_the_handle_is_returned(rt, model) -> None:
    model.add("still here")
    with trio.CancelScope() as scope:
        handle = await rt.agents.create(session_id="k", agent_options=OPTIONS)
        scope.cancel()
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    assert turn_ends(handle.agent) == ["completed"]


async def test_same_id_arbitration_exactly_one_wins(rt, model) -> None:
    outcomes: list[str] = []
    created = record(rt, ev.AgentCreated)

    async def contender(i: int) -> None:
        async def setup(ctx: agentloop.Context) -> None:
            await trio.lowlevel.checkpoint()

        try:
            await rt.agents.create(session_id="dup", agent_options=OPTIONS, setup=setup)
            outcomes.append("won")
        except agentloop.SessionIdInUse:
            outcomes.append("lost")

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(contender, i)
    assert sorted(outcomes) == ["lost"] * 4 + ["won"]
    assert created == ["agent/created:dup"]


async def test_stale_handle_never_removes_a_replacement(rt, model) -> None:
    first = await rt.agents.create(session_id="x", agent_options=OPTIONS)
    await first.aclose()
    second = await rt.agents.create(session_id="x", agent_options=OPTIONS)
    await first.aclose()  # memoized: no effect on the replacement
    assert rt.agents.get("x") is second.agent
    assert second.agent.status == "idle"


async def test_quiescence_is_one_memoized_boundary(rt) -> None:
    release = trio.Event()
    streaming = trio.Event()

    async def fn(request: object) -> AsyncIterator[object]:
        yield TextDelta("partial")
        streaming.set()
        with trio.CancelScope(shield=True):
            await release.wait()  # ignores cancellation for a while
        yield Finish("stop")

    rt.llm.register("scripted", FunctionModel(fn))
    handle = await rt.agents.create(session_id="q", agent_options=OPTIONS)
    handle.agent.followup("go")
    await streaming.wait()
    returned: list[int] = []

    async def closer(i: int) -> None:
        await handle.aclose()
        assert rt.agents.get("q") is None
        returned.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(closer, i)
        await trio.testing.wait_all_tasks_blocked()
        assert returned == []  # none returns before quiescence
        release.set()
    assert sorted(returned) == [0, 1, 2]
    assert turn_ends(handle.agent) == ["disposed"]


async def test_closing_events_reach_observers_before_the_session_is_detached(rt) -> None:
    streaming = trio.Event()

    async def fn(request: object) -> AsyncIterator[object]:
        yield TextDelta("x")
        streaming.set()
        await trio.sleep_forever()
        yield Finish("stop")

    rt.llm.register("scripted", FunctionModel(fn))
    order: list[str] = []
    rt.events.on(ev.SessionEventAppended, lambda e: order.append(e.event.type))

    async def flush(e: ev.SessionFlush) -> None:
        order.append(f"flush:{e.seq}")

    rt.events.on(ev.SessionFlush, flush)
    rt.events.on(ev.AgentDisposed, lambda e: order.append("agent/disposed"))
    rt.events.on(ev.SessionDisposed, lambda e: order.append("session/disposed"))
    handle = await rt.agents.create(session_id="t", agent_options=OPTIONS)
    handle.agent.followup("go")
    await streaming.wait()
    await handle.aclose()
    end = order.index("turn/end")
    assert order[end + 1].startswith("flush:")
    assert order[-2:] == ["agent/disposed", "session/disposed"]
    assert end < order.index("agent/disposed")


async def test_owner_scope_closing_disposes_its_agents(rt, model) -> None:
    ctx = rt.child("owner")
    agent = ctx.agent_loop.create("owned", OPTIONS)
    handle = await ctx.agents.create(session_id="owned2", agent_options=OPTIONS)
    assert rt.agents.get("owned") is agent
    await ctx.aclose()
    assert rt.agents.get("owned") is None and rt.agents.get("owned2") is None
    assert agent.status == "disposed" and handle.agent.status == "disposed"


async def test_a_plugins_agents_die_with_the_plugin(autojump_clock) -> None:
    made: list[agentloop.Agent] = []

    async def plugin(ctx: agentloop.Context, task_status=trio.TASK_STATUS_IGNORED) -> None:
        made.append(ctx.agent_loop.create("plugin-agent", OPTIONS))
        task_status.started()
        await trio.sleep(1)
        raise RuntimeError("plugin crashed")

    failures: list[str] = []

    async def observer(ctx: agentloop.Context, task_status=trio.TASK_STATUS_IGNORED) -> None:
        ctx.events.on(ev.PluginFailed, lambda e: failures.append(e.plugin))
        task_status.started()

    with trio.fail_after(5):
        async with agentloop.open_runtime(plugins=[observer, plugin]) as rt:
            assert rt.agents.get("plugin-agent") is made[0]
            disposed = trio.Event()
            rt.events.on(ev.AgentDisposed, lambda e: disposed.set())
            await disposed.wait()
            assert rt.agents.get("plugin-agent") is None
            assert failures == ["plugin"]


async def test_runtime_exit_disposes_everything_and_refuses_new_agents() -> None:
    streaming = trio.Event()

    async def fn(request: object) -> AsyncIterator[object]:
        yield TextDelta("x")
        streaming.set()
        await trio.sleep_forever()
        yield Finish("stop")

    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", FunctionModel(fn))
        handle = await rt.agents.create(session_id="z", agent_options=OPTIONS)
        bare = rt.agent_loop.create("z2", OPTIONS)
        handle.agent.followup("go")
        await streaming.wait()
    assert handle.agent.status == "disposed" and bare.status == "disposed"
    assert turn_ends(handle.agent) == ["disposed"]
    with pytest.raises(agentloop.RuntimeClosed):
        await rt.agents.create(session_id="late", agent_options=OPTIONS)


async def test_shutdown_waits_for_an_in_flight_create() -> None:
    entered = trio.Event()
    release = trio.Event()
    result: list[object] = []

    async def setup(ctx: agentloop.Context) -> None:
        entered.set()
        with trio.CancelScope(shield=True):
            await release.wait()

    async def creator(rt: agentloop.Context) -> None:
        try:
            result.append(await rt.agents.create(session_id="w", agent_options=OPTIONS,
                                                 setup=setup))
        except agentloop.AgentLoopError as exc:
            result.append(exc)

    async with trio.open_nursery() as nursery:
        async with agentloop.open_runtime() as rt:
            nursery.start_soon(creator, rt)
            await entered.wait()
            release.set()
        # the racing create settled before shutdown finished, and published nothing after it
        assert len(result) == 1
        assert isinstance(result[0], agentloop.RuntimeClosed)
        assert rt._supervisor.agents == {}


async def test_resume_without_persistence(rt) -> None:
    with pytest.raises(agentloop.PersistenceUnavailable):
        await rt.agents.resume(resume_session_id="s")


async def test_invalid_meta_and_seed(rt) -> None:
    with pytest.raises(agentloop.InvalidContent, match="meta"):
        await rt.agents.create(session_id="m", meta={"x": float("nan")})
    with pytest.raises(agentloop.InvalidContent, match=r"seed\[0\]"):
        await rt.agents.create(session_id="m", seed=[{"type": "", "data": {}}])
    assert rt.agents.get("m") is None


async def test_seed_reconstructs_a_forked_prefix(rt, model) -> None:
    model.add("continuing")
    seed = [
        {"type": "turn/start", "turn": 1, "data": {"turn": 1}},
        {"type": "user/message", "turn": 1,
         "data": {"message_id": "m1", "content": "earlier", "source": None}},
        {"type": "turn/end", "turn": 1, "data": {"turn": 1, "reason": "completed"}},
    ]
    handle = await rt.agents.create(session_id="fork", seed=seed, agent_options=OPTIONS,
                                    meta={"parent": "p1"})
    handle.agent.followup("now")
    await handle.agent.wait_idle()
    assert [e.turn for e in of_type(handle.agent, "turn/start")] == [1, 2]
    assert [m.text for m in model.requests[0].messages] == ["earlier", "now"]
    assert handle.agent.session.meta == {"parent": "p1"}


async def test_current_agent_is_visible_to_tools_and_hooks(rt, model) -> None:
    seen: list[str | None] = []

    @rt.tools.tool
    async def who() -> str:
        """Who runs me."""
        current = rt.agents.current()
        seen.append(current.id if current else None)
        return "me"

    rt.events.on(ev.AgentRequest, lambda e: seen.append(rt.agents.current().id))  # type: ignore[union-attr]
    model.add(agentloop.testing.reply("", tool_calls=[("who", {})]), "ok")
    handle = await rt.agents.create(session_id="cur", agent_options=OPTIONS)
    handle.agent.followup("x")
    await handle.agent.wait_idle()
    assert seen == ["cur", "cur", "cur"]
    assert rt.agents.current() is None


async def test_config_agents_get_fresh_labelled_sessions() -> None:
    cfg = {"agents": [{"id": "scout", "provider": "scripted", "model": "m"}]}
    async with agentloop.open_runtime(cfg) as rt:
        (agent,) = rt.agents.list()
        assert agent.id.startswith("scout-session-")
        rt.llm.register("scripted", ScriptedModel(["hi"]))
        agent.followup("x")
        await agent.wait_idle()
        assert turn_ends(agent) == ["completed"]
    async with agentloop.open_runtime(cfg) as rt2:
        assert rt2.agents.list()[0].id != agent.id


async def test_config_session_id_is_resume_or_create(tmp_path) -> None:
    cfg = {
        "persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")},
        "agents": [{"id": "a", "session_id": "stable", "provider": "scripted", "model": "m",
                    "cwd": "/work"}],
    }
    async with agentloop.open_runtime(cfg) as rt:
        rt.llm.register("scripted", ScriptedModel(["one"]))
        agent = rt.agents.get("stable")
        assert agent is not None and agent.session.meta["cwd"] == "/work"
        agent.followup("x")
        await agent.wait_idle()
    async with agentloop.open_runtime(cfg) as rt:
        agent = rt.agents.get("stable")
        assert agent is not None and agent.resumed
        assert [m.text for m in agent.session.messages()] == ["x", "one"]


async def test_config_resume_session_id_requires_a_stored_session(tmp_path) -> None:
    cfg = {
        "persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")},
        "agents": [{"id": "a", "resume_session_id": "missing"}],
    }
    with pytest.raises(agentloop.SessionNotFound):
        async with agentloop.open_runtime(cfg):
            pass


async def test_an_error_in_the_body_propagates_unwrapped() -> None:
    with pytest.raises(KeyError):
        async with agentloop.open_runtime():
            raise KeyError("mine")


async def test_unknown_plugin_name_is_a_config_error() -> None:
    with pytest.raises(agentloop.ConfigError, match="'nope'"):
        async with agentloop.open_runtime({"plugins": ["nope"]}):
            pass


async def test_agent_scoped_observers_see_their_session_events_only(rt, model) -> None:
    model.add("a", "b")
    seen: list[tuple[str, str]] = []

    async def flush(e: ev.SessionFlush) -> None:
        seen.append(("flush", e.session_id))

    async def setup(ctx: agentloop.Context) -> None:
        ctx.events.on(ev.SessionEventAppended, lambda e: seen.append((e.event.type, e.session_id)))
        ctx.events.on(ev.SessionFlush, flush)

    h1 = await rt.agents.create(session_id="one", agent_options=OPTIONS, setup=setup)
    h2 = await rt.agents.create(session_id="two", agent_options=OPTIONS)
    for h in (h1, h2):
        h.agent.followup("x")
        await h.agent.wait_idle()
    assert {who for _, who in seen} == {"one"}
    assert ("turn/end", "one") in seen and ("flush", "one") in seen


async def test_dispose_requested_during_the_created_notification_stays_paired(rt, model) -> None:
    owner = rt.child("owner")
    order: list[str] = []

    async with trio.open_nursery() as nursery:

        def on_created(e: ev.AgentCreated) -> None:
            order.append("created")
            # The owner closes (disposing its agent) from inside the notification.
            nursery.start_soon(owner.aclose)
            order.append("created-returned")

        rt.events.on(ev.AgentCreated, on_created)
        rt.events.on(ev.AgentSessionStart, lambda e: order.append("session-start"))
        rt.events.on(ev.AgentDisposed, lambda e: order.append("disposed"))
        await owner.agents.create(session_id="n", agent_options=OPTIONS)
    assert order == ["created", "created-returned", "session-start", "disposed"]
    assert rt.agents.get("n") is None


def test_an_agents_options_are_not_kept_once_its_runtime_closed() -> None:
    """The options are the caller's (with the prompt and classes they name): nothing of the
    runtime keeps them once their agents and the runtime are gone."""

    async def main() -> weakref.ref[agentloop.AgentOptions]:
        options = agentloop.AgentOptions(provider="scripted", model="m", system_prompt="hi")
        async with agentloop.open_runtime() as rt:
            rt.llm.register("scripted", ScriptedModel(["one"]))
            async with await rt.agents.create(session_id="s", agent_options=options) as h:
                h.agent.followup("go")
                await h.agent.wait_idle()
        return weakref.ref(options)

    options = trio.run(main)
    gc.collect()
    assert options() is None


def test_a_calls_config_is_not_kept_once_its_runtime_closed() -> None:
    """The JSON of a call's config is shared between agents through a module-level memo:
    the memo holds the config weakly, so nothing keeps it once the runtime is gone."""
    seen: list[weakref.ref[agentloop.CallConfig]] = []

    async def main() -> None:
        async def stream(request: LLMRequest) -> AsyncIterator[object]:
            seen.append(weakref.ref(request.config))
            yield TextDelta("one")
            yield Finish("stop")

        options = agentloop.AgentOptions(provider="fn", model="m", max_tokens=100)
        async with agentloop.open_runtime() as rt:
            rt.llm.register("fn", FunctionModel(stream))
            async with await rt.agents.create(session_id="s", agent_options=options) as h:
                h.agent.followup("go")
                await h.agent.wait_idle()

    trio.run(main)
    gc.collect()
    assert seen and all(ref() is None for ref in seen)


class _StepsOf(trio.abc.Instrument):
    """Counts the scheduler passes one task takes."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task, self.steps = task, 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def test_waiting_on_many_settled_agents_takes_few_scheduler_passes(rt, model) -> None:
    from agentloop._agent import IDLE_RETURNS_PER_YIELD

    handles = [
        await rt.agents.create(session_id=f"s{i}", agent_options=OPTIONS) for i in range(200)
    ]
    await trio.testing.wait_all_tasks_blocked()
    steps = _StepsOf(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        for h in handles:
            await h.agent.wait_idle()
    finally:
        trio.lowlevel.remove_instrument(steps)
    # One pass every IDLE_RETURNS_PER_YIELD settled returns, where each used to take one.
    assert 0 < steps.steps <= len(handles) // IDLE_RETURNS_PER_YIELD + 1


async def test_a_loop_of_wait_idle_on_a_settled_agent_still_lets_others_run(rt, model) -> None:
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    done = []

    async def other() -> None:
        done.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        with trio.fail_after(5):
            while not done:
                await handle.agent.wait_idle()


async def test_wait_idle_on_a_settled_agent_checks_for_cancellation(rt, model) -> None:
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    with trio.CancelScope() as scope:
        scope.cancel()
        await handle.agent.wait_idle()
        pytest.fail("wait_idle returned in a cancelled scope")
    assert scope.cancelled_caught


async def test_an_idle_actor_holds_no_cancel_scope_of_its_last_turn(rt, model) -> None:
    """An agent that ran a turn and went idle keeps nothing of the turn's cancel: a scope
    an idle agent held would cost every idle agent its size, and the cycle collector a visit."""
    model.add(*["done"] * 8)

    def scopes() -> int:
        gc.collect()
        return sum(isinstance(o, trio.CancelScope) for o in gc.get_objects())

    handles = [
        await rt.agents.create(session_id=f"idle{i}", agent_options=OPTIONS) for i in range(8)
    ]
    await trio.testing.wait_all_tasks_blocked()
    before = scopes()
    for h in handles:
        h.agent.followup("go")
    for h in handles:
        await h.agent.wait_idle()
    await trio.testing.wait_all_tasks_blocked()
    assert all(h.agent.status == "idle" for h in handles)
    assert scopes() == before
    for h in handles:
        await h.aclose()
