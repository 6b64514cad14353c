"""A parent killed with its sub-agents mid-turn: resuming it closes the whole tree's turns.

Run as a script (``python test_subagents_crash.py DB``: a SQLite path, or a PostgreSQL DSN for
``tests/test_postgres.py``) this file is the process to kill: a parent ``boss`` with the
``subagent`` plugin starts a background job whose child calls ``hang``, and in the same reply
delegates a task whose child delegates again, to a grandchild that calls ``hang`` too. Once
both ``hang`` bodies run and everything logged is committed it prints ``READY`` and blocks, so
the test can SIGKILL it with four turns open in a real SQLite file, then resume ``boss`` in
this process.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from agentloop_subagent import subagents

import agentloop
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

OPTIONS = agentloop.AgentOptions(provider="fn", model="m")
BOSS = "boss"
Part = TextDelta | ToolCallDelta | Finish


def config(db: Path | str) -> dict[str, Any]:
    """SQLite at a path, or PostgreSQL at a ``postgresql://`` DSN (``tests/test_postgres.py``
    runs the same crash against its throwaway cluster)."""
    if str(db).startswith("postgresql://"):
        return {"persistence": {"backend": "postgres", "dsn": str(db)}}
    return {"persistence": {"backend": "sqlite", "path": str(db)}}


def call(name: str, args: dict[str, Any], call_id: str) -> list[Part]:
    return [ToolCallDelta(0, id=call_id, name=name, arguments=json.dumps(args)),
            Finish("tool_calls")]


# --- the process to kill ----------------------------------------------------------------------


async def doomed(db: str, deliver: bool = False) -> None:
    async with agentloop.open_runtime(config(db), plugins=[subagents(deliver=deliver)]) as rt:
        arrived = 0

        @rt.tools.tool(concurrency="parallel")
        async def hang() -> str:
            """Wait forever."""
            nonlocal arrived
            arrived += 1
            if arrived == 2:
                # Both hanging calls run: let everything else settle, commit, announce.
                await trio.testing.wait_all_tasks_blocked()
                backend = rt.session_persistence
                assert backend is not None
                for session in rt.sessions.list():
                    await backend.flush(session.id, session.last_seq)
                sys.stdout.write("READY\n")
                sys.stdout.flush()
            await trio.sleep_forever()
            return "unreachable"

        async def fn(request: LLMRequest) -> AsyncIterator[Part]:
            task = request.messages[0].text
            if task == "start":  # the boss: a job and a delegation in one reply
                yield ToolCallDelta(0, id="call_job", name="subagent_start",
                                    arguments=json.dumps({"task": "background"}))
                yield ToolCallDelta(1, id="call_delegate", name="subagent",
                                    arguments=json.dumps({"task": "middle"}))
                yield Finish("tool_calls")
            elif task == "middle":
                for part in call("subagent", {"task": "deep"}, "call_deeper"):
                    yield part
            else:  # "background" and "deep"
                for part in call("hang", {}, "call_hang"):
                    yield part

        rt.llm.register("fn", FunctionModel(fn))
        handle = await rt.agents.create(session_id=BOSS, agent_options=OPTIONS)
        handle.agent.followup("start")
        await trio.sleep_forever()


# --- the test ---------------------------------------------------------------------------------


async def run_until_ready_then_kill(db: Path | str, log: Path, *args: str) -> None:
    from conftest import kill_when_ready

    await kill_when_ready([sys.executable, __file__, str(db), *args], log)


def stored(db: Path) -> dict[str, tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]]:
    """Every session in the file, read with plain sqlite3: its meta and (type, data) rows."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        metas = dict(conn.execute("SELECT id, meta FROM sessions").fetchall())
        out = {}
        for sid, meta in metas.items():
            rows = conn.execute(
                "SELECT type, data FROM events WHERE session_id = ? ORDER BY seq", (sid,)
            ).fetchall()
            out[sid] = (json.loads(meta), [(t, json.loads(d)) for t, d in rows])
        return out


def leases(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return sorted(sid for (sid,) in conn.execute("SELECT session_id FROM leases"))


def first_prompt(rows: list[tuple[str, dict[str, Any]]]) -> Any:
    return next((d["content"] for t, d in rows if t == "user/message"), None)


def ends(rows: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str | None]]:
    return [(d["reason"], d.get("cause")) for t, d in rows if t == "turn/end"]


@pytest.mark.slow
async def test_resuming_a_killed_parent_closes_its_tree_and_reports_the_lost_job(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sessions.db"
    await run_until_ready_then_kill(db, tmp_path / "child.log")

    before = stored(db)
    by_task = {first_prompt(rows): sid for sid, (_, rows) in before.items()}
    job_child, middle, deep = by_task["background"], by_task["middle"], by_task["deep"]
    assert set(before) == {BOSS, job_child, middle, deep}
    job_id = before[job_child][0]["job_id"]
    assert before[middle][0]["parent_session_id"] == BOSS
    assert (before[deep][0]["parent_session_id"], before[deep][0]["depth"]) == (middle, 2)
    # Killed with every turn open and every lease held.
    assert all(ends(rows) == [] for _, rows in before.values())
    assert leases(db) == sorted(before)
    boss_results = [d for t, d in before[BOSS][1] if t == "tool/result"]
    assert [json.loads(d["content"])["job_id"] for d in boss_results] == [job_id]

    with trio.fail_after(15):
        async with agentloop.open_runtime(config(db), plugins=[subagents()]) as rt:

            async def fn(request: LLMRequest) -> AsyncIterator[Part]:
                if request.messages[-1].role == "user":
                    yield ToolCallDelta(0, id="call_status", name="subagent_status",
                                        arguments=json.dumps({"job_id": job_id}))
                    yield ToolCallDelta(1, id="call_result", name="subagent_result",
                                        arguments=json.dumps({"job_id": job_id}))
                    yield Finish("tool_calls")
                    return
                yield TextDelta("noted")
                yield Finish("stop")

            rt.llm.register("fn", FunctionModel(fn))
            handle = await rt.agents.resume(resume_session_id=BOSS, agent_options=OPTIONS)
            agent = handle.agent

            # Every descendant's open turn is closed (cause crash) and committed, its
            # hanging calls answered, and its lease given back; only the boss is driven.
            after = stored(db)
            for sid in (job_child, middle, deep):
                rows = after[sid][1]
                assert rows[: len(before[sid][1])] == before[sid][1]
                assert ends(rows) == [("aborted", "crash")], sid
                results = [d for t, d in rows if t == "tool/result"]
                assert [(d["error_code"], d["is_error"]) for d in results] == [
                    ("INTERRUPTED", True)
                ]
            assert leases(db) == [BOSS]
            assert rt.agents.get(job_child) is None and rt.agents.get(deep) is None

            # The job that was running is failed, not unknown.
            job = handle.ctx.jobs.get(job_id)
            assert job is not None
            assert (job.status, job.session_id) == ("failed", job_child)
            assert [j.id for j in handle.ctx.jobs.list()] == [job_id]
            with pytest.raises(agentloop.JobFailed, match="crash"):
                await job.result()

            # ... and so the model reads it through the subagent tools.
            assert (await agent.ask("how is the job?")).text == "noted"
            status, result = [
                e.data for e in agent.session.events
                if e.type == "tool/result" and e.data["call_id"] in ("call_status", "call_result")
            ]
            assert json.loads(status["content"]) == {"job_id": job_id, "status": "failed"}
            assert result["is_error"] and "lost" in result["content"]
            assert "crash" in result["content"]
            await handle.aclose()
        # The lost job leaves with its owner.
        assert rt._supervisor.jobs == {}

    # Resuming again finds nothing left to close.
    again = stored(db)
    async with agentloop.open_runtime(config(db), plugins=[subagents()]) as rt:
        rt.llm.register("fn", FunctionModel(fn))
        handle = await rt.agents.resume(resume_session_id=BOSS, agent_options=OPTIONS)
        assert handle.ctx is not None
        [job] = handle.ctx.jobs.list()
        assert job.status == "failed"
        await handle.aclose()
    assert {sid: rows for sid, (_, rows) in stored(db).items() if sid != BOSS} == {
        sid: rows for sid, (_, rows) in again.items() if sid != BOSS
    }


@pytest.mark.slow
async def test_a_job_lost_at_a_crash_delivers_its_failure_when_it_was_to_deliver(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sessions.db"
    await run_until_ready_then_kill(db, tmp_path / "child.log", "deliver")
    before = stored(db)
    job_child = {first_prompt(rows): sid for sid, (_, rows) in before.items()}["background"]
    meta = before[job_child][0]
    assert meta["job_deliver"] is True
    job_id = meta["job_id"]

    async def fn(request: LLMRequest) -> AsyncIterator[Part]:
        yield TextDelta("noted")
        yield Finish("stop")

    with trio.fail_after(15):
        async with agentloop.open_runtime(config(db), plugins=[subagents()]) as rt:
            rt.llm.register("fn", FunctionModel(fn))
            handle = await rt.agents.resume(resume_session_id=BOSS, agent_options=OPTIONS)
            agent = handle.agent
            # Its answer never came: the owner is told the job was lost, once.
            [owed] = agent.inbox.next_step
            assert owed.source == {"job": job_id, "status": "failed", "session_id": job_child}
            assert isinstance(owed.content, str)
            assert "lost" in owed.content and "crash" in owed.content
            assert (await agent.ask("go on")).text == "noted"
            assert deliveries(agent) == [job_id]
            await handle.aclose()
        # The next resume finds the job's turn closed already: nothing is delivered again.
        async with agentloop.open_runtime(config(db), plugins=[subagents()]) as rt:
            rt.llm.register("fn", FunctionModel(fn))
            handle = await rt.agents.resume(resume_session_id=BOSS, agent_options=OPTIONS)
            assert handle.agent.inbox.next_step == ()
            await handle.aclose()


# --- in one process: what a resume rebuilds, and what it leaves alone ----------------------


def echo_model(gate: trio.Event | None = None) -> FunctionModel:
    async def fn(request: LLMRequest) -> AsyncIterator[Part]:
        task = request.messages[-1].text
        if task == "wait" and gate is not None:
            await gate.wait()
        yield TextDelta(f"did {task}")
        yield Finish("stop")

    return FunctionModel(fn)


async def test_a_resumed_parent_answers_for_its_finished_jobs(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with agentloop.open_runtime(config(db)) as rt:
        gate = trio.Event()
        rt.llm.register("fn", echo_model(gate))
        handle = await rt.agents.create(session_id=BOSS, agent_options=OPTIONS)
        assert handle.ctx is not None
        jobs = handle.ctx.jobs
        done = await jobs.start("report")
        assert (await done.result()).text == "did report"
        cut = await jobs.start("wait")
        await trio.testing.wait_all_tasks_blocked()
        assert cut.cancel()
        ids = [done.id, cut.id]
        await handle.aclose()
    async with agentloop.open_runtime(config(db)) as rt:
        rt.llm.register("fn", echo_model())
        handle = await rt.agents.resume(resume_session_id=BOSS, agent_options=OPTIONS)
        assert handle.ctx is not None
        jobs = handle.ctx.jobs
        assert [(j.id, j.status) for j in jobs.list()] == [
            (ids[0], "done"), (ids[1], "cancelled"),
        ]
        job = jobs.get(ids[0])
        assert job is not None and job.session_id == done.session_id
        result = await job.result()
        assert (result.text, result.reason, result.turn) == ("did report", "completed", 1)
        with pytest.raises(agentloop.JobCancelled):
            await jobs.list()[1].result()
        assert not jobs.list()[1].cancel()  # finished: nothing to cancel
        await handle.aclose()
        assert rt._supervisor.jobs == {}


def deliveries(agent: agentloop.Agent) -> list[str]:
    """The job ids of the deliveries claimed into ``agent``'s log, in order."""
    return [
        e.data["source"]["job"] for e in agent.session.events
        if e.type in ("user/message", "steering/message")
        and isinstance(e.data.get("source"), dict | agentloop.FrozenDict)
        and "job" in e.data["source"]
    ]


async def test_a_finished_job_delivered_before_a_resume_is_not_delivered_again(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.db"
    async with agentloop.open_runtime(config(db)) as rt:
        rt.llm.register("fn", echo_model())
        handle = await rt.agents.create(session_id=BOSS, agent_options=OPTIONS)
        agent = handle.agent
        claimed = await handle.ctx.jobs.start("report", deliver=True)
        await claimed.result()
        await agent.ask("next")  # the turn claims the delivery
        assert deliveries(agent) == [claimed.id]
        removed = await handle.ctx.jobs.start("later", deliver=True)
        await removed.result()
        [pending] = agent.inbox.next_step
        assert pending.source["job"] == removed.id
        assert agent.remove(pending.id)  # the owner's choice: it stays removed
        await handle.aclose()

    async with agentloop.open_runtime(config(db)) as rt:
        rt.llm.register("fn", echo_model())
        handle = await rt.agents.resume(resume_session_id=BOSS, agent_options=OPTIONS)
        agent = handle.agent
        assert [j.status for j in handle.ctx.jobs.list()] == ["done", "done"]
        assert agent.inbox.next_step == ()
        await agent.ask("and now?")
        assert deliveries(agent) == [claimed.id]
        await handle.aclose()


async def test_a_resume_leaves_a_descendant_that_a_live_driver_holds(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    gate = trio.Event()
    async with agentloop.open_runtime(config(db)) as first:
        first.llm.register("fn", echo_model(gate))
        handle = await first.agents.create(session_id=BOSS, agent_options=OPTIONS)
        assert handle.ctx is not None
        kid = await handle.ctx.subagents.spawn(session_id="kid")
        await handle.aclose()
        assert kid.agent.status == "disposed"
    async with (
        agentloop.open_runtime(config(db)) as driver,
        agentloop.open_runtime(config(db)) as resumer,
    ):
        driver.llm.register("fn", echo_model(gate))
        resumer.llm.register("fn", echo_model())
        kid = await driver.agents.resume(resume_session_id="kid", agent_options=OPTIONS)
        kid.agent.followup("wait")
        await trio.testing.wait_all_tasks_blocked()
        held = list(kid.agent.session.events)
        assert [e.type for e in held][-1] == "request/header"
        # The kid's turn is open, but another runtime drives it: not this resume's to close.
        boss = await resumer.agents.resume(resume_session_id=BOSS, agent_options=OPTIONS)
        assert list(kid.agent.session.events) == held
        assert ends(stored(db)["kid"][1]) == []
        gate.set()
        await kid.agent.wait_idle()
        assert [e.data["reason"] for e in kid.agent.session.events if e.type == "turn/end"] \
            == ["completed"]
        await kid.aclose()
        await boss.aclose()


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["deliver"]):
        raise SystemExit("usage: test_subagents_crash.py DB [deliver]")
    trio.run(doomed, sys.argv[1], sys.argv[2:] == ["deliver"])
