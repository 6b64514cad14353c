"""``agentloop.report_progress`` inside a tool body: ``tools/progress`` control events for
subscribers, ``run.progress()``, never the log or the model's history; coalesced for slow
readers (the latest always arrives); an error outside a tool."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS

import agentloop
from agentloop import AgentLoopError
from agentloop._progress import BURST, RATE
from agentloop.events import Lagged, ToolProgress
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta, check_log


def calls_then_answers(*calls: tuple[str, str]) -> FunctionModel:
    """Calls the given ``(name, call_id)`` tools in the first step, then answers."""

    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        if request.messages[-1].role == "user":
            for i, (name, call_id) in enumerate(calls):
                yield ToolCallDelta(i, id=call_id, name=name, arguments="{}")
            yield Finish("tool_calls")
        else:
            yield TextDelta("done")
            yield Finish("stop")

    return FunctionModel(fn)


def drain(rx: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(rx.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


async def test_subscribers_see_each_report_and_nothing_is_logged() -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("work", "c1")))

        @rt.tools.tool
        async def work() -> str:
            """Work in three parts."""
            for i in range(3):
                agentloop.report_progress(f"part {i + 1} of 3", fraction=(i + 1) / 3)
                await trio.lowlevel.checkpoint()
            return "worked"

        async with rt.events.subscribe(ToolProgress) as rx:
            handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
            handle.agent.followup("go")
            with trio.fail_after(10):
                await handle.agent.wait_idle()
            seen = drain(rx)
        assert seen == [
            ToolProgress("s", "c1", "part 1 of 3", 1 / 3),
            ToolProgress("s", "c1", "part 2 of 3", 2 / 3),
            ToolProgress("s", "c1", "part 3 of 3", 1.0),
        ]
        session = handle.agent.session
        assert not any("part " in str(e.data) for e in session.events)
        assert not any("part " in m.text for m in session.messages())
        check_log(session)


async def test_run_progress_iterates_the_runs_tool_calls() -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("slow", "c1")))
        step = trio.Event()
        taken = trio.Event()

        @rt.tools.tool
        async def slow() -> str:
            """Report twice, waiting for the reader in between."""
            agentloop.report_progress("started", fraction=0.0)
            await step.wait()
            agentloop.report_progress("halfway", fraction=0.5)
            await taken.wait()
            return "ok"

        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        got: list[ToolProgress] = []
        with trio.fail_after(10):
            async with handle.agent.run("go") as run:
                async for event in run.progress():
                    got.append(event)
                    if event.message == "started":
                        step.set()
                    else:
                        taken.set()
                # The iteration ends with the run's turn.
                assert run.done
                result = await run.result()
        assert result.text == "done"
        assert [(e.call_id, e.message, e.fraction) for e in got] == [
            ("c1", "started", 0.0), ("c1", "halfway", 0.5)
        ]


async def test_run_progress_is_only_that_runs_turn() -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("tick", "c1")))

        @rt.tools.tool
        async def tick() -> str:
            """Report once."""
            agentloop.report_progress("tick")
            return "ok"

        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        with trio.fail_after(10):
            async with handle.agent.run("first") as first:
                await first.result()
            async with handle.agent.run("second") as second:
                progress = second.progress()
                await second.result()
                # The first run is over: its iteration is empty, the second's has its report.
                assert [e async for e in first.progress()] == []
                assert [e.message async for e in progress] == ["tick"]


async def test_outside_a_tool_it_raises() -> None:
    with pytest.raises(AgentLoopError, match="outside a tool body"):
        agentloop.report_progress("nope")
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("check", "c1")))
        seen: list[str] = []

        @rt.tools.tool
        async def check() -> str:
            """Report with bad values."""
            for fraction in (1.5, -0.1, math.nan, True, "half"):
                try:
                    agentloop.report_progress("x", fraction=fraction)  # type: ignore[arg-type]
                except AgentLoopError as exc:
                    seen.append(str(exc))
            return "ok"

        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        handle.agent.followup("go")
        with trio.fail_after(10):
            await handle.agent.wait_idle()
        assert len(seen) == 5
        assert all("fraction must be a number from 0 to 1" in m for m in seen)
    # The call's context does not leak into the runtime's own tasks.
    with pytest.raises(AgentLoopError):
        agentloop.report_progress("still nope")


async def test_parallel_calls_report_as_themselves() -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("job", "a"), ("job", "b")))

        @rt.tools.tool(concurrency="parallel")
        async def job() -> str:
            """Report from a worker thread and from the task."""
            await trio.to_thread.run_sync(agentloop.report_progress, "from a thread")
            agentloop.report_progress("from the task")
            return "ok"

        async with rt.events.subscribe(ToolProgress) as rx:
            handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
            handle.agent.followup("go")
            with trio.fail_after(10):
                await handle.agent.wait_idle()
            seen = drain(rx)
        results = [e.data for e in handle.agent.session.events if e.type == "tool/result"]
        assert not any(r.get("is_error") for r in results), results
        for call_id in ("a", "b"):
            assert [e.message for e in seen if e.call_id == call_id] == [
                "from a thread", "from the task"
            ]


async def test_a_flood_is_paced_and_the_latest_always_arrives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 10,000 reports over one (virtual) second: a burst, then about RATE a second, and the
    # very last one, whatever the reader does.
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("flood", "c1")))

        @rt.tools.tool
        async def flood() -> str:
            """Report ten thousand times."""
            for i in range(10_000):
                agentloop.report_progress(f"item {i}", fraction=(i + 1) / 10_000)
                await trio.sleep(0.0001)
            return "ok"

        async with rt.events.subscribe(ToolProgress, capacity=4) as slow_rx:
            handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
            got: list[str] = []
            with trio.fail_after(100):
                async with handle.agent.run("go") as run:
                    async for event in run.progress():
                        got.append(event.message)
            slow = drain(slow_rx)
        assert got[-1] == "item 9999"
        assert got[:BURST] == [f"item {i}" for i in range(BURST)]
        assert len(got) <= BURST + RATE * 1.1 + 2
        # A subscriber that never read kept the first few and was told of the rest.
        assert [type(e) for e in slow[:4]] == [ToolProgress] * 4
        assert isinstance(slow[4], Lagged)


async def test_the_latest_report_arrives_when_the_call_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("burst", "c1")))

        @rt.tools.tool
        async def burst() -> str:
            """Report more than a burst at once, then finish."""
            for i in range(BURST + 5):
                agentloop.report_progress(f"n{i}")
            return "ok"

        async with rt.events.subscribe(ToolProgress) as rx:
            handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
            handle.agent.followup("go")
            with trio.fail_after(10):
                await handle.agent.wait_idle()
            seen = [e.message for e in drain(rx)]
        assert seen == [f"n{i}" for i in range(BURST)] + [f"n{BURST + 4}"]


async def test_a_trailing_report_goes_out_when_the_pace_allows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("burst", "c1")))
        at: list[tuple[str, float]] = []

        @rt.tools.tool
        async def burst() -> str:
            """Report more than a burst at once, then keep working."""
            for i in range(BURST + 3):
                agentloop.report_progress(f"n{i}")
            await trio.sleep(10)
            return "ok"

        def on(event: ToolProgress) -> None:
            at.append((event.message, trio.current_time()))

        rt.events.on(ToolProgress, on)
        handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
        handle.agent.followup("go")
        with trio.fail_after(100):
            await handle.agent.wait_idle()
        start = at[0][1]
        assert [m for m, _ in at] == [f"n{i}" for i in range(BURST)] + [f"n{BURST + 2}"]
        assert at[-1][1] - start == pytest.approx(1 / RATE, abs=1e-6)


async def test_the_line_printer_shows_progress_once_a_second_at_most(
    autojump_clock: trio.testing.MockClock,
) -> None:
    import io

    from agentloop._cli import Printer

    out, err = io.StringIO(), io.StringIO()
    printer = Printer(out, err)
    printer.progress(ToolProgress("s", "c1", "reading", 0.1))
    printer.progress(ToolProgress("s", "c1", "reading more", 0.2))  # within the second
    await trio.sleep(1)
    printer.progress(ToolProgress("s", "c1", "reading more", 0.5))
    printer.progress(ToolProgress("s", "c1", "writing", None))
    assert err.getvalue().splitlines() == [
        "[progress] reading (10%)", "[progress] reading more (50%)"
    ]
    assert out.getvalue() == ""


async def test_the_terminal_printer_redraws_one_progress_line() -> None:
    import io

    from agentloop._cli import Printer

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, err = Tty(), Tty()
    printer = Printer(out, err)
    printer.color = False
    printer.progress(ToolProgress("s", "c1", "one", 0.5))
    printer.progress(ToolProgress("s", "c1", "two", 1.0))
    printer.note("[tool] done")
    assert err.getvalue() == (
        "\r\x1b[2K[progress] one (50%)\r\x1b[2K[progress] two (100%)\r\x1b[2K[tool] done\n"
    )


async def test_a_task_outliving_its_call_cannot_report() -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", calls_then_answers(("spawn", "c1")))
        later: list[str] = []
        go = trio.Event()

        async def leftover() -> None:
            await go.wait()
            try:
                agentloop.report_progress("too late")
            except AgentLoopError as exc:
                later.append(str(exc))

        @rt.tools.tool
        async def spawn() -> str:
            """Start work that outlives the call (in the test's nursery)."""
            nursery.start_soon(leftover)
            return "started"

        async with trio.open_nursery() as nursery:
            handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
            handle.agent.followup("go")
            with trio.fail_after(10):
                await handle.agent.wait_idle()
            go.set()
        assert len(later) == 1 and "call 'c1' has ended" in later[0]
