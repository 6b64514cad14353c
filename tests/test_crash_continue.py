"""A crashed turn that continues (``resume(..., crashed_turn="continue")``).

A real child process (``crash_continue_child.py``) runs a three-step turn with parallel tools
and is SIGKILLed at each of its checkpoints in turn: before, during and after the model's
streams and the tool bodies. The session is then resumed here, a fresh process, with
``crashed_turn="continue"``: the turn ends, its history is valid for both providers, every
idempotent call has its result, the non-idempotent one ran at most once, and the answer
arrives. The PostgreSQL variant is in ``test_postgres.py``.
"""

from __future__ import annotations

import random
import signal
import sys
from pathlib import Path

import pytest
import trio
from conftest import kill_when_ready, ready_child
from crash_continue_child import (
    ANSWER,
    CHECKPOINTS,
    OPTIONS,
    SESSION,
    config,
    register_tools,
    script,
)

import agentloop
from agentloop.testing import check_history, check_log

CHILD = Path(__file__).with_name("crash_continue_child.py")


async def crash_then_continue(
    store: str, effects: Path, stop: int, log: Path, *, after: float = 0.0
) -> None:
    """Kill the child at checkpoint ``stop`` (or ``after`` seconds into its turn when
    ``stop`` is -1), resume and continue; check everything."""
    argv = [sys.executable, str(CHILD), store, str(effects), str(stop)]
    if stop >= 0:
        await kill_when_ready(argv, log)
    else:
        async with ready_child(argv, log) as proc:
            await trio.sleep(after)  # the random moment of the kill, not synchronisation
            proc.send_signal(signal.SIGKILL)
            with trio.fail_after(5):
                await proc.wait()
    async with agentloop.open_runtime(config(store)) as rt:
        rt.llm.register("child", script(None))
        register_tools(rt, None, effects)
        handle = await rt.agents.resume(
            resume_session_id=SESSION, agent_options=OPTIONS, crashed_turn="continue"
        )
        agent = handle.agent
        with trio.fail_after(20):
            await agent.wait_idle()
        check_outcome(agent, effects, CHECKPOINTS[stop] if stop >= 0 else f"{after:.3f} s")
        await handle.aclose()


def check_outcome(agent: agentloop.Agent, effects: Path, where: str) -> None:
    events = agent.session.events
    check_log(agent.session)
    ends = [e.data["reason"] for e in events if e.type == "turn/end"]
    assert ends == ["completed"], f"killed at {where}: the turn ended {ends}"
    resumed = [e.turn for e in events if e.type == "turn/resumed"]
    assert resumed == [1] or (resumed == [] and where.endswith(" s")), where
    history = agent.session.messages()
    check_history(history, "openai")
    check_history(history, "anthropic")
    assert history[-1].role == "assistant" and history[-1].text == ANSWER, where
    results = {e.data["call_id"]: e.data for e in events if e.type == "tool/result"}
    calls = [e.data for e in events if e.type == "tool/call"]
    for call in calls:
        result = results[call["call_id"]]
        if call["name"] == "fetch":
            # No idempotent call lost: each has its real result.
            assert not result["is_error"], f"killed at {where}: {result}"
        else:
            assert result["error_code"] in (None, "INTERRUPTED_BY_CRASH"), result
    done = effects.read_text().splitlines()
    assert done.count("charge 5") <= 1, f"killed at {where}, the charge ran twice: {done}"
    charged = [r for r in results.values() if r["name"] == "charge"]
    if not any(r["error_code"] == "INTERRUPTED_BY_CRASH" for r in charged):
        assert done.count("charge 5") == 1
    for key in "abc":
        assert f"fetch {key}" in done, where
    if where.startswith("charge"):
        # Its body started, and its call was stored before: answered, never run again.
        assert [r["error_code"] for r in charged] == ["INTERRUPTED_BY_CRASH"], where
    if where.startswith("fetch"):
        # Its body started and its result was lost: run again.
        assert done.count(f"fetch {where[6]}") == 2, f"killed at {where}: {done}"


@pytest.mark.slow
@pytest.mark.parametrize("stop", range(len(CHECKPOINTS)), ids=list(CHECKPOINTS))
async def test_a_turn_killed_anywhere_continues_in_a_fresh_process_on_sqlite(
    tmp_path: Path, stop: int
) -> None:
    await crash_then_continue(
        str(tmp_path / "sessions.db"), tmp_path / "effects", stop, tmp_path / "child.log"
    )


@pytest.mark.slow
async def test_the_setting_makes_a_configured_agent_continue_its_crashed_turn(
    tmp_path: Path,
) -> None:
    db, effects = tmp_path / "sessions.db", tmp_path / "effects"
    stop = CHECKPOINTS.index("charge-start")
    await kill_when_ready(
        [sys.executable, str(CHILD), str(db), str(effects), str(stop)], tmp_path / "child.log"
    )

    async def model_and_tools(ctx: agentloop.Context) -> None:
        # A plugin: registered before the configured agents start (and continue).
        ctx.llm.register("child", script(None))
        register_tools(ctx, None, effects)

    settings = {
        **config(str(db)),
        "agent-loop": {"crashed_turn": "continue"},
        "agents": [{"id": "worker", "provider": "child", "model": "m", "session_id": SESSION}],
    }
    async with agentloop.open_runtime(settings, plugins=[model_and_tools]) as rt:
        agent = rt.agents.get(SESSION)
        assert agent is not None
        with trio.fail_after(20):
            await agent.wait_idle()
        check_outcome(agent, effects, "charge-start")


async def test_crashed_turn_must_be_close_or_continue(tmp_path: Path) -> None:
    async with agentloop.open_runtime(config(str(tmp_path / "s.db"))) as rt:
        with pytest.raises(agentloop.SettingsError, match="'close' or 'continue'"):
            rt.settings.set("agent-loop.crashed_turn", "resume")
        assert rt.settings.get("agent-loop.crashed_turn") == "close"
        with pytest.raises(agentloop.InvalidOptions, match="'close' or 'continue', got 'later'"):
            await rt.agents.resume(
                resume_session_id="nobody", crashed_turn="later"  # type: ignore[arg-type]
            )


async def test_continue_on_a_session_without_an_open_turn_resumes_it_idle(
    tmp_path: Path,
) -> None:
    cfg = config(str(tmp_path / "s.db"))
    async with agentloop.open_runtime(cfg) as rt:
        rt.llm.register("child", script(None))
        register_tools(rt, None, tmp_path / "effects")
        handle = await rt.agents.create(session_id=SESSION, agent_options=OPTIONS)
        result = await handle.agent.ask("do the long job")
        assert result.text == ANSWER
        await handle.aclose()
        handle = await rt.agents.resume(
            resume_session_id=SESSION, agent_options=OPTIONS, crashed_turn="continue"
        )
        await handle.agent.wait_idle()
        assert handle.agent.status == "idle"
        assert not [e for e in handle.agent.session.events if e.type == "turn/resumed"]
        await handle.aclose()


RANDOM_KILLS = 8


@pytest.mark.slow
@pytest.mark.parametrize("run", range(RANDOM_KILLS))
async def test_a_turn_killed_at_a_random_moment_continues_on_sqlite(
    tmp_path: Path, run: int
) -> None:
    # The turn takes about 0.15 s once it dawdles; a kill that lands after it ended leaves
    # nothing to continue, which is checked too.
    after = random.Random(f"crash-continue-{run}").uniform(0.0, 0.14)
    await crash_then_continue(
        str(tmp_path / "sessions.db"), tmp_path / "effects", -1, tmp_path / "child.log",
        after=after,
    )
