"""The tool scheduler: model order, bounded parallelism, barriers, classification, aborts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from conftest import OPTIONS, check_history_valid, check_log_invariants, of_type, turn_ends
from hypothesis import given
from hypothesis import strategies as st

import agentloop
from agentloop import events as ev
from agentloop.testing import ScriptedModel, reply

BOUND = "agent-loop.max_parallel_tool_calls"
ABORTED_TEXT = "Error: tool call aborted before dispatch"

Span = tuple[float, float]


@attrs.define
class Recorder:
    """What the tool bodies saw: virtual start/end per call, a live counter, violations."""

    spans: dict[int, Span] = attrs.Factory(dict)
    started: list[int] = attrs.Factory(list)
    live: int = 0
    peak: int = 0
    exclusive_running: bool = False
    violations: list[str] = attrs.Factory(list)
    tasks: dict[int, trio.lowlevel.Task] = attrs.Factory(dict)
    changed: trio.Event = attrs.Factory(trio.Event)

    async def body(self, i: int, d: float, exclusive: bool) -> str:
        if self.exclusive_running:
            self.violations.append(f"call {i} started while an exclusive call ran")
        self.live += 1
        self.peak = max(self.peak, self.live)
        self.started.append(i)
        self.tasks[i] = trio.lowlevel.current_task()
        self.changed.set()
        self.changed = trio.Event()
        if exclusive:
            if self.live != 1:
                self.violations.append(f"exclusive call {i} started with {self.live} running")
            self.exclusive_running = True
        start = trio.current_time()
        try:
            await trio.sleep(d)
            if exclusive and self.live != 1:
                self.violations.append(f"exclusive call {i} ended with {self.live} running")
        finally:
            if exclusive:
                self.exclusive_running = False
            self.live -= 1
            self.spans[i] = (start, trio.current_time())
        return f"done {i}"

    async def wait_started(self, n: int) -> None:
        while len(self.started) < n:
            await self.changed.wait()


def register_work(ctx: agentloop.Context, rec: Recorder) -> None:
    """A tool ``work(i, d, mode)``: sleeps ``d`` virtual seconds; ``mode`` picks its class."""

    def by_mode(arguments: Mapping[str, Any]) -> str:
        return str(arguments["mode"])

    @ctx.tools.tool(concurrency="parallel", classify=by_mode)
    async def work(i: int, d: float, mode: str) -> str:
        """Work for a while.

        Args:
            i: the call number.
            d: seconds to work.
            mode: "parallel" or "exclusive".
        """
        return await rec.body(i, d, mode == "exclusive")


def calls(*specs: tuple[str, float]) -> list[tuple[str, dict[str, Any], str]]:
    """``("P", 2)`` -> a parallel call of 2 s; ids c1, c2, ... and ``i`` follow model order."""
    mode = {"P": "parallel", "E": "exclusive"}
    return [
        ("work", {"i": n, "d": d, "mode": mode[kind]}, f"c{n}")
        for n, (kind, d) in enumerate(specs, start=1)
    ]


async def start(ctx: agentloop.Context, prompt: str = "go") -> agentloop.AgentHandle:
    handle = await ctx.agents.create(session_id="s", agent_options=OPTIONS)
    handle.agent.followup(prompt)
    return handle


async def run_turn(ctx: agentloop.Context) -> tuple[agentloop.Agent, float]:
    """Run one turn; returns the agent and the virtual time it took."""
    t0 = trio.current_time()
    handle = await start(ctx)
    with trio.fail_after(1000):
        await handle.agent.wait_idle()
    return handle.agent, trio.current_time() - t0


def result_ids(agent: agentloop.Agent) -> list[str]:
    return [e.data["call_id"] for e in of_type(agent, "tool/result")]


def results(agent: agentloop.Agent) -> dict[str, Mapping[str, Any]]:
    return {e.data["call_id"]: e.data for e in of_type(agent, "tool/result")}


def overlaps(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def peak_overlap(spans: Sequence[Span]) -> int:
    """The most positive-length ``[start, end)`` intervals that share an instant."""
    edges = sorted(
        [(s, 1) for s, e in spans if e > s] + [(e, -1) for s, e in spans if e > s]
    )  # at a tie, ends (-1) sort before starts (+1): [start, end) intervals
    peak = live = 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    return peak


def check_turn(agent: agentloop.Agent, n: int) -> None:
    ids = [f"c{k}" for k in range(1, n + 1)]
    assert [e.data["call_id"] for e in of_type(agent, "tool/call")] == ids
    assert result_ids(agent) == ids
    check_log_invariants(agent.session.events)
    check_history_valid(agent.session.messages())


# --- order --------------------------------------------------------------------------------


async def test_results_keep_model_order_when_later_calls_finish_first(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 10)
    rec = Recorder()
    register_work(rt, rec)
    seen: list[str] = []
    rt.events.on(ev.ToolResultEvent, lambda e: seen.append(e.call.id))
    model.add(reply("", tool_calls=calls(("P", 4), ("P", 3), ("P", 2), ("P", 1))), reply("ok"))
    agent, elapsed = await run_turn(rt)
    # They really ran at once and finished in reverse order...
    assert [rec.spans[i] for i in (1, 2, 3, 4)] == [(0, 4), (0, 3), (0, 2), (0, 1)]
    assert elapsed == 4
    # ... yet every ordered record follows the model.
    check_turn(agent, 4)
    assert seen == ["c1", "c2", "c3", "c4"]
    assert [results(agent)[f"c{i}"]["content"] for i in (1, 2, 3, 4)] == [
        "done 1", "done 2", "done 3", "done 4"
    ]
    assert [m.tool_call_id for m in model.requests[1].messages[-4:]] == ["c1", "c2", "c3", "c4"]
    assert turn_ends(agent) == ["completed"]


async def test_a_finished_call_is_not_published_before_a_running_earlier_one(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 10)
    rec = Recorder()
    register_work(rt, rec)
    published: list[tuple[str, float]] = []
    rt.events.on(ev.ToolResultEvent, lambda e: published.append((e.call.id, trio.current_time())))
    model.add(reply("", tool_calls=calls(("P", 3), ("P", 1))), reply("ok"))
    agent, _ = await run_turn(rt)
    # c2 finished at 1 but waits for c1 (finished at 3); then both go out, in order.
    assert published == [("c1", 3), ("c2", 3)]
    check_turn(agent, 2)


# --- the bound ----------------------------------------------------------------------------


@pytest.mark.parametrize(("bound", "n"), [(3, 7), (1, 4), (4, 4), (10, 5), (2, 1)])
async def test_peak_concurrency_is_min_of_bound_and_calls(
    rt, model, autojump_clock, bound, n
) -> None:
    rt.settings.set(BOUND, bound)
    rec = Recorder()
    register_work(rt, rec)
    model.add(reply("", tool_calls=calls(*[("P", 1)] * n)), reply("ok"))
    agent, elapsed = await run_turn(rt)
    assert rec.peak == min(bound, n)
    assert peak_overlap(list(rec.spans.values())) == min(bound, n)
    assert elapsed == math.ceil(n / bound)
    # A rolling pool fills in model order: wave k holds calls k*bound+1 .. (k+1)*bound.
    assert [rec.spans[i][0] for i in range(1, n + 1)] == [(i - 1) // bound for i in range(1, n + 1)]
    assert rec.violations == []
    check_turn(agent, n)


async def test_pool_is_rolling_not_batched(rt, model, autojump_clock) -> None:
    rt.settings.set(BOUND, 2)
    rec = Recorder()
    register_work(rt, rec)
    # c3 takes c2's slot as soon as c2 ends at 1, without waiting for c1 (ends at 5).
    model.add(reply("", tool_calls=calls(("P", 5), ("P", 1), ("P", 1), ("P", 1))), reply("ok"))
    agent, elapsed = await run_turn(rt)
    assert [rec.spans[i] for i in (1, 2, 3, 4)] == [(0, 5), (0, 1), (1, 2), (2, 3)]
    assert elapsed == 5
    assert rec.peak == 2
    check_turn(agent, 4)


# --- barriers -----------------------------------------------------------------------------


async def test_exclusive_call_never_overlaps_anything(rt, model, autojump_clock) -> None:
    rt.settings.set(BOUND, 10)
    rec = Recorder()
    register_work(rt, rec)
    driver: list[trio.lowlevel.Task] = []
    rt.events.on(ev.ToolPreExecute, lambda e: driver.append(trio.lowlevel.current_task()))
    published: list[tuple[str, float]] = []
    rt.events.on(ev.ToolResultEvent, lambda e: published.append((e.call.id, trio.current_time())))
    model.add(
        reply("", tool_calls=calls(("P", 2), ("P", 1), ("E", 1), ("P", 1), ("P", 2))),
        reply("ok"),
    )
    agent, elapsed = await run_turn(rt)
    spans = rec.spans
    assert spans[3][0] >= max(spans[1][1], spans[2][1])  # everything before has finished
    assert min(spans[4][0], spans[5][0]) >= spans[3][1]  # nothing after has started
    assert [spans[i] for i in (1, 2, 3, 4, 5)] == [(0, 2), (0, 1), (2, 3), (3, 4), (3, 5)]
    assert all(not overlaps(spans[3], spans[i]) for i in (1, 2, 4, 5))
    assert rec.violations == []
    assert elapsed == 5
    # By the time the barrier starts, everything before it has been published.
    assert [c for c, t in published if t <= spans[3][0]] == ["c1", "c2"]
    # Preludes run on the agent's task; every body, the barrier's too, in a task named for
    # its call under it (contract section 7).
    assert len(set(driver)) == 1 and driver[0].name == "agentloop.agent:s"
    assert [rec.tasks[i].name for i in (1, 2, 3, 4, 5)] == [
        f"agentloop.tool:c{i}" for i in (1, 2, 3, 4, 5)
    ]
    assert all(rec.tasks[i].parent_nursery.parent_task is driver[0] for i in (1, 2, 3, 4, 5))
    check_turn(agent, 5)


async def test_earlier_results_are_published_before_a_barrier_runs(
    rt, model, autojump_clock
) -> None:
    rec = Recorder()
    register_work(rt, rec)
    trace: list[tuple[str, str]] = []

    async def approve(e: ev.ToolApproval) -> agentloop.Allow:
        await trio.sleep(2)  # a person takes a while to approve the barrier
        return agentloop.Allow()

    def gate(e: ev.ToolPreExecute) -> agentloop.Ask | None:
        return agentloop.Ask("run it?") if e.call.arguments["mode"] == "exclusive" else None

    rt.events.on(ev.ToolPreExecute, gate)
    rt.events.on(ev.ToolApproval, approve)
    for cls, kind in ((ev.ToolExecute, "execute"), (ev.ToolPostExecute, "post"),
                      (ev.ToolResultEvent, "result")):
        rt.events.on(cls, lambda e, kind=kind: trace.append((kind, e.call.id)))
    model.add(reply("", tool_calls=calls(("P", 1), ("E", 10))), reply("ok"))
    agent, _ = await run_turn(rt)
    assert rec.spans == {1: (0, 1), 2: (2, 12)}
    check_turn(agent, 2)
    # c1 finished at 1, while c2 waited for approval; its postlude belongs before the
    # barrier's body, not 10 s later.
    assert trace == [
        ("execute", "c1"), ("post", "c1"), ("result", "c1"),
        ("execute", "c2"), ("post", "c2"), ("result", "c2"),
    ]


async def test_tool_without_classify_uses_its_declared_concurrency(
    rt, model, autojump_clock
) -> None:
    spans: dict[str, Span] = {}

    async def timed(key: str, d: float) -> str:
        t = trio.current_time()
        await trio.sleep(d)
        spans[key] = (t, trio.current_time())
        return key

    @rt.tools.tool
    async def lock(k: str) -> str:
        """Exclusive by default."""
        return await timed(k, 1)

    @rt.tools.tool(concurrency="parallel")
    async def read(k: str) -> str:
        """Parallel."""
        return await timed(k, 1)

    model.add(
        reply("", tool_calls=[("read", {"k": "a"}, "c1"), ("read", {"k": "b"}, "c2"),
                              ("lock", {"k": "c"}, "c3"), ("read", {"k": "d"}, "c4")]),
        reply("ok"),
    )
    agent, elapsed = await run_turn(rt)
    assert spans == {"a": (0, 1), "b": (0, 1), "c": (1, 2), "d": (2, 3)}
    assert elapsed == 3
    check_turn(agent, 4)


# --- settings -----------------------------------------------------------------------------


async def test_bound_change_applies_to_the_next_group_after_a_barrier(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 3)
    rec = Recorder()

    def by_mode(arguments: Mapping[str, Any]) -> str:
        return str(arguments["mode"])

    @rt.tools.tool(concurrency="parallel", classify=by_mode)
    async def work(i: int, d: float, mode: str) -> str:
        """Work; call 1 lowers the bound to 1 as it starts."""
        if i == 1:
            rt.settings.set(BOUND, 1)
        return await rec.body(i, d, mode == "exclusive")

    model.add(
        reply("", tool_calls=calls(
            ("P", 1), ("P", 2), ("P", 3), ("P", 1), ("P", 1),  # group 1: read at 3, keeps 3
            ("E", 1),                                          # barrier
            ("P", 1), ("P", 1), ("P", 1),                      # group 2: reads 1
        )),
        reply("ok"),
    )
    agent, elapsed = await run_turn(rt)
    s = rec.spans
    # Group 1 kept its bound of 3 after the write: c4 took c1's slot at 1, and c5, dispatched
    # after the write, took the next free slot at 2 (with bound 1 it would wait until 3).
    assert [s[i] for i in (1, 2, 3, 4, 5)] == [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)]
    assert s[6] == (3, 4)
    # Group 2 runs one at a time.
    assert [s[i] for i in (7, 8, 9)] == [(4, 5), (5, 6), (6, 7)]
    assert peak_overlap([s[i] for i in (7, 8, 9)]) == 1
    assert elapsed == 7
    assert rt.settings.get(BOUND) == 1
    check_turn(agent, 9)


async def test_bound_change_applies_to_the_next_step(rt, model, autojump_clock) -> None:
    rt.settings.set(BOUND, 4)
    rec = Recorder()

    @rt.tools.tool(concurrency="parallel")
    async def work(i: int, d: float) -> str:
        """Work; call 1 lowers the bound to 1."""
        if i == 1:
            rt.settings.set(BOUND, 1)
        return await rec.body(i, d, False)

    first = [("work", {"i": i, "d": 1}, f"a{i}") for i in (1, 2, 3)]
    second = [("work", {"i": i, "d": 1}, f"b{i}") for i in (4, 5, 6)]
    model.add(reply("", tool_calls=first), reply("", tool_calls=second), reply("ok"))
    agent, elapsed = await run_turn(rt)
    assert [rec.spans[i] for i in (1, 2, 3)] == [(0, 1)] * 3
    assert [rec.spans[i] for i in (4, 5, 6)] == [(1, 2), (2, 3), (3, 4)]
    assert elapsed == 4
    check_log_invariants(agent.session.events)
    check_history_valid(agent.session.messages())


# --- classification -----------------------------------------------------------------------


async def test_classify_gets_parsed_arguments_and_reads_state_at_each_start(
    rt, model, autojump_clock
) -> None:
    locked = {1}
    classified: list[tuple[dict[str, Any], str]] = []
    rec = Recorder()

    def classify(arguments: Mapping[str, Any]) -> str:
        mode = "exclusive" if arguments["i"] in locked else "parallel"
        classified.append((dict(arguments), mode))
        return mode

    @rt.tools.tool(concurrency="parallel", classify=classify)
    async def work(i: int, d: float, lock: int = 0) -> str:
        """Work; ``lock`` makes a later call exclusive.

        Args:
            i: the call number.
            d: seconds to work.
            lock: a call number to make exclusive from now on.
        """
        if lock:
            locked.add(lock)
        return await rec.body(i, d, i in locked)

    model.add(
        reply("", tool_calls=[
            ("work", {"i": 1, "d": 1, "lock": 3}, "c1"),
            ("work", {"i": 2, "d": 2}, "c2"),
            ("work", {"i": 3, "d": 1}, "c3"),
            ("work", '{"i": 4, "d": 1}', "c4"),  # raw JSON text from the model
        ]),
        reply("ok"),
    )
    agent, elapsed = await run_turn(rt)
    # One classification per call, in model order, with parsed (typed) arguments.
    assert classified == [
        ({"i": 1, "d": 1, "lock": 3}, "exclusive"),
        ({"i": 2, "d": 2}, "parallel"),
        ({"i": 3, "d": 1}, "exclusive"),  # changed by c1's body, after the step began
        ({"i": 4, "d": 1}, "parallel"),
    ]
    assert all(type(args["i"]) is int for args, _ in classified)
    # c3 waited for c2 (a barrier); had it been classified up front it would start at 1.
    assert [rec.spans[i] for i in (1, 2, 3, 4)] == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert elapsed == 5
    assert rec.violations == []
    check_turn(agent, 4)


async def test_classify_runs_after_the_prelude_of_its_call(rt, model, autojump_clock) -> None:
    rt.settings.set(BOUND, 10)
    locked: set[int] = set()
    rec = Recorder()

    def classify(arguments: Mapping[str, Any]) -> str:
        return "exclusive" if arguments["i"] in locked else "parallel"

    @rt.tools.tool(concurrency="parallel", classify=classify)
    async def work(i: int, d: float) -> str:
        """Work; call 1 makes call 3 exclusive as soon as it starts."""
        if i == 1:
            locked.add(3)
        return await rec.body(i, d, i in locked)

    async def slow_review(e: ev.ToolPreExecute) -> None:
        if e.call.id == "c3":
            await trio.sleep(1)  # c1 and c2 are running meanwhile

    rt.events.on(ev.ToolPreExecute, slow_review)
    model.add(
        reply("", tool_calls=[("work", {"i": i, "d": 2}, f"c{i}") for i in (1, 2, 3)]),
        reply("ok"),
    )
    agent, _ = await run_turn(rt)
    # Classified at 1, after its review: exclusive, so it waits for c1 and c2 to end at 2.
    assert rec.spans[3] == (2, 4)
    assert rec.violations == []
    check_turn(agent, 3)


async def test_classify_returning_nonsense_fails_the_turn_cleanly(
    rt, model, autojump_clock
) -> None:
    rec = Recorder()
    register_work(rt, rec)
    nonsense = ("work", {"i": 3, "d": 1, "mode": "both"}, "c3")
    model.add(reply("", tool_calls=[*calls(("P", 2), ("P", 2)), nonsense]), reply("never"))
    agent, _ = await run_turn(rt)
    assert turn_ends(agent) == ["error"]
    assert "classify returned 'both'" in of_type(agent, "turn/end")[0].data["error"]["message"]
    got = results(agent)
    assert (got["c1"]["content"], got["c2"]["content"]) == ("done 1", "done 2")
    assert got["c3"]["error_code"] == "ABORTED_BEFORE_DISPATCH"
    assert 3 not in rec.spans
    check_turn(agent, 3)


# --- hooks --------------------------------------------------------------------------------


async def test_hooks_see_calls_in_model_order_on_one_task(rt, model, autojump_clock) -> None:
    rt.settings.set(BOUND, 10)
    rec = Recorder()
    register_work(rt, rec)
    trace: list[tuple[str, str]] = []
    tasks: set[trio.lowlevel.Task] = set()

    async def pre(e: ev.ToolPreExecute) -> None:
        tasks.add(trio.lowlevel.current_task())
        trace.append(("pre-enter", e.call.id))
        # Later calls review faster: concurrent reviews would finish in reverse order.
        await trio.sleep(0.1 * (5 - int(e.call.id[1:])))
        trace.append(("pre-exit", e.call.id))

    async def post(e: ev.ToolPostExecute) -> None:
        tasks.add(trio.lowlevel.current_task())
        trace.append(("post", e.call.id))

    rt.events.on(ev.ToolPreExecute, pre)
    rt.events.on(ev.ToolPostExecute, post)
    model.add(reply("", tool_calls=calls(("P", 4), ("P", 3), ("P", 2), ("P", 1))), reply("ok"))
    agent, _ = await run_turn(rt)
    ids = ["c1", "c2", "c3", "c4"]
    pres = [x for x in trace if x[0] != "post"]
    assert pres == [(kind, c) for c in ids for kind in ("pre-enter", "pre-exit")]
    assert [c for kind, c in trace if kind == "post"] == ids
    assert len(tasks) == 1  # the driver task
    assert all(rec.tasks[i] not in tasks for i in (2, 3))
    # The bodies still overlapped: each started once its own review was done.
    assert rec.peak >= 2
    check_turn(agent, 4)


# --- abort --------------------------------------------------------------------------------


async def test_cancel_mid_group_aborts_started_and_undispatched_calls(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 2)
    rec = Recorder()
    register_work(rt, rec)
    model.add(reply("", tool_calls=calls(*[("P", 10)] * 5)), reply("never"))
    handle = await start(rt)
    agent = handle.agent
    await rec.wait_started(2)
    await trio.sleep(1)
    assert agent.cancel() is True
    await agent.wait_idle()
    assert sorted(rec.started) == [1, 2]
    got = results(agent)
    for cid in ("c1", "c2"):
        assert got[cid]["error_code"] == "ABORTED"
        assert got[cid]["is_error"] is True
    for cid in ("c3", "c4", "c5"):
        assert got[cid]["error_code"] == "ABORTED_BEFORE_DISPATCH"
        assert got[cid]["content"] == ABORTED_TEXT
    check_turn(agent, 5)
    assert turn_ends(agent) == ["aborted"]
    assert len(model.requests) == 1


async def test_a_tool_that_cancels_its_own_turn_stops_it_before_the_hooks_after_tools(
    rt, model
) -> None:
    # The body cancels synchronously and returns at once: the step finds its call done
    # without waiting for it, and must still see the cancel before the turn goes on.
    holder: dict[str, agentloop.Agent] = {}
    seen: list[str] = []

    @rt.tools.tool(concurrency="parallel")
    async def stop_now() -> str:
        """Stop the turn."""
        holder["agent"].cancel()
        return "stopped"

    def stopping(e: ev.AgentTurnStopping) -> None:
        seen.append(f"stopping {e.point} {e.step}")

    def continuation(e: ev.AgentTurnContinuation) -> None:
        seen.append(f"continuation {e.step}")

    rt.events.on(ev.AgentTurnStopping, stopping)
    rt.events.on(ev.AgentTurnContinuation, continuation)
    model.add(reply("", tool_calls=[("stop_now", {}, "c1")]), reply("never"))
    handle = await start(rt)
    agent = holder["agent"] = handle.agent
    with trio.fail_after(5):
        await agent.wait_idle()
    assert [e.data["content"] for e in of_type(agent, "tool/result")] == ["stopped"]
    assert turn_ends(agent) == ["aborted"]
    assert of_type(agent, "turn/end")[0].data["cause"] == "user"
    assert seen == ["stopping pre-step 1"]
    assert len(model.requests) == 1


async def test_a_steer_kept_by_a_tools_cancel_runs_in_the_next_turn(rt, model) -> None:
    holder: dict[str, agentloop.Agent] = {}

    @rt.tools.tool(concurrency="parallel")
    async def steer_and_stop() -> str:
        """Steer, then stop the turn keeping the inbox."""
        holder["agent"].steer("a steer sent by the tool")
        holder["agent"].cancel(keep_inbox=True)
        return "stopped"

    model.add(reply("", tool_calls=[("steer_and_stop", {}, "c1")]), reply("steered"))
    handle = await start(rt)
    agent = holder["agent"] = handle.agent
    with trio.fail_after(5):
        await agent.wait_idle()
    assert turn_ends(agent) == ["aborted", "completed"]
    (steer,) = of_type(agent, "steering/message")
    assert steer.turn == 2
    assert [m.text for m in agent.session.messages()][-2:] == [
        "a steer sent by the tool", "steered"
    ]


@pytest.mark.parametrize("concurrency", ["parallel", "exclusive"])
@pytest.mark.parametrize("passes", [0, 1, 2])
async def test_a_steer_kept_by_a_cancel_while_the_calls_ran_runs_in_the_next_turn(
    passes: int, concurrency: Any,
) -> None:
    # Another task steers and cancels (keeping the inbox) a few schedule points after the
    # step started a call that does not wait: whenever that lands, the cancel ends the turn
    # before it claims the steer, which the next turn answers. trio orders the tasks of a
    # pass at random, so each spacing is tried a number of times; an exclusive call goes
    # through the general dispatcher, a parallel one through the plain step.
    for _ in range(15):
        async with agentloop.open_runtime() as ctx:
            model = ScriptedModel()
            ctx.llm.register("scripted", model)

            @ctx.tools.tool(concurrency=concurrency)
            async def quick() -> str:
                """Answer at once."""
                return "ok"

            # A cancel that lands once the next step's request is out cuts that request:
            # the next turn then takes the third reply.
            model.add(
                reply("", tool_calls=[("quick", {}, "c1")]), reply("steered"), reply("steered")
            )
            handle = await start(ctx)
            agent = handle.agent
            with trio.fail_after(5):
                while not of_type(agent, "tool/call"):
                    await trio.lowlevel.checkpoint()
                for _ in range(passes):
                    await trio.lowlevel.checkpoint()
                agent.steer("kept steer")
                agent.cancel(keep_inbox=True)
                await agent.wait_idle()
            assert result_ids(agent) == ["c1"]
            (steer,) = of_type(agent, "steering/message")
            assert steer.turn == 2, [(e.turn, e.type) for e in agent.session.events]
            assert turn_ends(agent) == ["aborted", "completed"]


async def test_a_shielded_body_keeps_its_real_result_on_cancel(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 2)
    running = trio.Event()

    @rt.tools.tool(concurrency="parallel")
    async def careful(i: int) -> str:
        """Finishes what it started."""
        with trio.CancelScope(shield=True):
            running.set()
            await trio.sleep(1)
        return f"kept {i}"

    @rt.tools.tool(concurrency="parallel")
    async def idle(i: int) -> str:
        """Waits forever."""
        await trio.sleep_forever()
        return "never"

    model.add(
        reply("", tool_calls=[("careful", {"i": 1}, "c1"), ("idle", {"i": 2}, "c2"),
                              ("careful", {"i": 3}, "c3"), ("idle", {"i": 4}, "c4")]),
        reply("never"),
    )
    handle = await start(rt)
    agent = handle.agent
    await running.wait()
    await trio.testing.wait_all_tasks_blocked()
    t0 = trio.current_time()
    agent.cancel()
    await agent.wait_idle()
    assert trio.current_time() - t0 == 1  # the abort waited for the shielded body
    got = results(agent)
    assert (got["c1"]["content"], got["c1"]["is_error"]) == ("kept 1", False)
    assert got["c2"]["error_code"] == "ABORTED"
    assert got["c3"]["error_code"] == got["c4"]["error_code"] == "ABORTED_BEFORE_DISPATCH"
    check_turn(agent, 4)
    assert turn_ends(agent) == ["aborted"]


async def test_cancel_during_an_exclusive_call_aborts_it_and_the_rest(
    rt, model, autojump_clock
) -> None:
    rec = Recorder()
    register_work(rt, rec)
    model.add(reply("", tool_calls=calls(("P", 1), ("E", 10), ("P", 1))), reply("never"))
    handle = await start(rt)
    await rec.wait_started(2)
    handle.agent.cancel()
    await handle.agent.wait_idle()
    got = results(handle.agent)
    assert got["c1"]["content"] == "done 1"
    assert got["c2"]["error_code"] == "ABORTED"
    assert got["c3"]["error_code"] == "ABORTED_BEFORE_DISPATCH"
    assert sorted(rec.started) == [1, 2]
    check_turn(handle.agent, 3)
    assert turn_ends(handle.agent) == ["aborted"]


# --- internal failure ---------------------------------------------------------------------


async def test_failing_prelude_stops_dispatch_and_drains_started_calls(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 10)
    rec = Recorder()
    register_work(rt, rec)

    async def review(e: ev.ToolPreExecute) -> None:
        if e.call.id == "c3":
            await trio.sleep(0.5)
            assert rec.live == 2  # c1 and c2 are running now
            raise RuntimeError("review crashed")

    rt.events.on(ev.ToolPreExecute, review)
    model.add(reply("", tool_calls=calls(("P", 2), ("P", 3), ("P", 1), ("P", 1))), reply("no"))
    agent, elapsed = await run_turn(rt)
    assert sorted(rec.started) == [1, 2]  # nothing dispatched after the failure
    assert rec.spans[1] == (0, 2) and rec.spans[2] == (0, 3)  # ran to completion
    got = results(agent)
    assert (got["c1"]["content"], got["c1"]["is_error"]) == ("done 1", False)
    assert (got["c2"]["content"], got["c2"]["is_error"]) == ("done 2", False)
    for cid in ("c3", "c4"):
        assert got[cid]["error_code"] == "ABORTED_BEFORE_DISPATCH"
        assert got[cid]["content"] == ABORTED_TEXT
    assert elapsed == 3
    assert turn_ends(agent) == ["error"]
    assert of_type(agent, "turn/end")[0].data["error"] == {
        "type": "RuntimeError", "message": "review crashed"
    }
    assert len(model.requests) == 1  # the turn went no further
    check_turn(agent, 4)


async def test_failing_post_execute_hook_still_closes_every_call(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 10)
    rec = Recorder()
    register_work(rt, rec)

    def post(e: ev.ToolPostExecute) -> None:
        if e.call.id == "c2":
            raise RuntimeError("post crashed")

    rt.events.on(ev.ToolPostExecute, post)
    model.add(reply("", tool_calls=calls(("P", 1), ("P", 1), ("P", 5))), reply("no"))
    agent, _ = await run_turn(rt)
    assert turn_ends(agent) == ["error"]
    assert results(agent)["c1"]["content"] == "done 1"
    check_turn(agent, 3)


# --- disposal -----------------------------------------------------------------------------


async def test_disposal_during_tools_ends_disposed_with_complete_pairs(
    rt, model, autojump_clock
) -> None:
    rt.settings.set(BOUND, 2)
    rec = Recorder()
    register_work(rt, rec)
    model.add(reply("", tool_calls=calls(("P", 100), ("P", 100), ("P", 1))), reply("never"))
    handle = await start(rt)
    agent = handle.agent
    await rec.wait_started(2)
    t0 = trio.current_time()
    await handle.aclose()
    assert trio.current_time() - t0 < 1  # the calls were cancelled, not waited for
    assert turn_ends(agent) == ["disposed"]
    assert agent.status == "disposed"
    got = results(agent)
    assert got["c1"]["error_code"] == got["c2"]["error_code"] == "ABORTED"
    assert got["c3"]["error_code"] == "ABORTED_BEFORE_DISPATCH"
    assert sorted(rec.started) == [1, 2]
    check_turn(agent, 3)


# --- property -----------------------------------------------------------------------------


def ideal_schedule(
    plan: Sequence[tuple[str, int]], bound: int
) -> tuple[list[Span], float]:
    """The rules, simulated: in-order rolling pool; an exclusive call is a barrier."""
    spans: list[Span] = []
    running: list[float] = []  # end times of started parallel calls
    now = 0.0
    for mode, d in plan:
        if mode == "exclusive":
            now = max([now, *running])
            running = []
        else:
            running.sort()
            while len(running) >= bound:
                now = max(now, running.pop(0))
            running.append(now + d)
        spans.append((now, now + d))
        if mode == "exclusive":
            now += d
    return spans, max([now, *running])


plans = st.lists(
    st.tuples(st.sampled_from(["parallel", "exclusive"]), st.integers(0, 5)),
    min_size=1, max_size=12,
)


@pytest.mark.slow
@given(plan=plans, bound=st.integers(1, 4))
def test_schedule_property(plan: list[tuple[str, int]], bound: int) -> None:
    async def main() -> None:
        rec = Recorder()
        classified: list[int] = []

        def classify(arguments: Mapping[str, Any]) -> str:
            classified.append(arguments["i"])
            return plan[arguments["i"]][0]

        async with agentloop.open_runtime() as ctx:
            ctx.settings.set(BOUND, bound)
            model = ScriptedModel()
            ctx.llm.register("scripted", model)

            @ctx.tools.tool(concurrency="parallel", classify=classify)
            async def work(i: int, d: int) -> str:
                """Work for ``d`` seconds."""
                return await rec.body(i, d, plan[i][0] == "exclusive")

            tool_calls = [("work", {"i": i, "d": d}, f"c{i}") for i, (_, d) in enumerate(plan)]
            model.add(reply("", tool_calls=tool_calls), reply("done"))
            agent, elapsed = await run_turn(ctx)

            n = len(plan)
            # In model order; a call that waited for a pool slot is classified again just
            # before it starts.
            assert list(dict.fromkeys(classified)) == list(range(n))
            assert rec.violations == []
            assert rec.peak <= bound
            spans = [rec.spans[i] for i in range(n)]
            assert peak_overlap(spans) <= bound
            for i, (mode, _) in enumerate(plan):
                if mode == "exclusive":
                    assert all(
                        not overlaps(spans[i], spans[j]) for j in range(n) if j != i
                    ), (i, spans)
            ids = [f"c{i}" for i in range(n)]
            assert result_ids(agent) == ids
            assert [e.data["call_id"] for e in of_type(agent, "tool/call")] == ids
            check_log_invariants(agent.session.events)
            check_history_valid(agent.session.messages())
            assert turn_ends(agent) == ["completed"]

            durations = [d for _, d in plan]
            assert max(durations) <= elapsed <= sum(durations)
            ideal, makespan = ideal_schedule(plan, bound)
            assert spans == ideal
            assert elapsed == makespan

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_call_that_waited_for_a_slot_is_reclassified_before_it_starts(
    rt, model, autojump_clock
) -> None:
    flags = {"exclusive": False}
    live = 0
    overlaps: list[int] = []

    def classify(arguments: Any) -> str:
        return "exclusive" if arguments["i"] == 3 and flags["exclusive"] else "parallel"

    @rt.tools.tool(classify=classify)
    async def work(i: int) -> str:
        """Work."""
        nonlocal live
        live += 1
        overlaps.append(live)
        if i == 2:
            flags["exclusive"] = True  # decided while call 3 waits for a slot
        await trio.sleep(3 if i == 2 else 1)
        live -= 1
        return str(i)

    rt.settings.set("agent-loop.max_parallel_tool_calls", 2)
    model.add(reply("", tool_calls=[("work", {"i": 1}), ("work", {"i": 2}),
                                    ("work", {"i": 3})]), reply("done"))
    handle = await rt.agents.create(session_id="rc", agent_options=OPTIONS)
    handle.agent.followup("go")
    await handle.agent.wait_idle()
    # call 3 became exclusive while it waited, so it ran alone
    assert overlaps == [1, 2, 1]


# --- the plain pass ------------------------------------------------------------------------


def tool_events(agent: agentloop.Agent) -> list[tuple[str, str]]:
    return [
        (e.type, e.data["call_id"]) for e in agent.session.events
        if e.type in ("tool/call", "tool/result")
    ]


@pytest.mark.parametrize(
    "script",
    [
        [("nap", {"i": 1, "d": 3}), ("nap", {"i": 2, "d": 1}), ("nap", {"i": 3, "d": 2})],
        [("nap", {"i": "x"}), ("nap", {"i": 2, "d": 1}), ("nap", {"i": "y", "d": 1})],
        [("nap", {"i": 1, "d": 2}), ("nap", {"i": "x"}), ("missing", {})],
        [("nap", {"i": "x"}), ("missing", {}), ("nap", {"i": 3, "d": 0})],
    ],
    ids=["reverse-finish", "refused-first", "refused-later", "refused-then-quick"],
)
async def test_the_plain_pass_logs_what_the_general_dispatcher_logs(
    autojump_clock: trio.testing.MockClock, script: list[tuple[str, dict[str, Any]]]
) -> None:
    """Tools with nobody to ask take the plain pass; a pre-execute hook that decides nothing
    sends the same calls through the general dispatcher. The logs must not differ."""
    logs = []
    for general in (False, True):
        async with agentloop.open_runtime() as ctx:
            m = ScriptedModel()
            ctx.llm.register("scripted", m)

            @ctx.tools.tool(concurrency="parallel")
            async def nap(i: int, d: float) -> str:
                """Sleep a while.

                Args:
                    i: the call number.
                    d: seconds to sleep.
                """
                await trio.sleep(d)
                return f"done {i}"

            if general:
                ctx.events.on(ev.ToolPreExecute, lambda e: None)
            tool_calls = [(name, args, f"c{n}") for n, (name, args) in enumerate(script, 1)]
            m.add(reply("", tool_calls=tool_calls), reply("ok"))
            agent, _ = await run_turn(ctx)
            check_log_invariants(agent.session.events)
            check_history_valid(agent.session.messages())
            logs.append((tool_events(agent), agent.session.messages(), turn_ends(agent)))
    plain, general_log = logs
    assert plain == general_log
    assert plain[2] == ["completed"]
