"""Tails: ``ctx.sessions.tail(session_id, from_seq=...)`` and ``agentloop sessions tail``.

A tail reads a session's events from a seq, then live, from memory when this runtime drives
the session and from the store otherwise, woken by the bus and by the store's notifications
(SQLite: every store of the process on the same file). Real SQLite files, real subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS

import agentloop
from agentloop import events as ev
from agentloop.testing import ScriptedModel, reply

with contextlib.suppress(pytest.skip.Exception):
    # The throwaway PostgreSQL cluster of the PostgreSQL tests (they skip without one).
    from test_postgres import cluster, dsn, schema  # noqa: F401


def config(db: Path, after: float | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"persistence": {"backend": "sqlite", "path": str(db)}}
    if after is not None:
        cfg["settings"] = {"agent-loop": {"hibernate_after_seconds": after}}
    return cfg


@contextlib.asynccontextmanager
async def runtime(db: Path, after: float | None = None) -> AsyncIterator[
    tuple[agentloop.Context, ScriptedModel]
]:
    async with agentloop.open_runtime(config(db, after)) as rt:
        model = ScriptedModel()
        rt.llm.register("scripted", model)
        yield rt, model


class Reader:
    """A tail read in a task of its own, every event kept, and a way to wait for a seq."""

    def __init__(self, tail: Any) -> None:
        self.tail = tail
        self.events: list[agentloop.SessionEvent] = []
        self._more = trio.Event()

    async def run(self) -> None:
        async with self.tail:
            async for event in self.tail:
                self.events.append(event)
                self._more.set()
                self._more = trio.Event()

    async def until(self, seq: int) -> None:
        with trio.fail_after(10):
            while not self.events or self.events[-1].seq < seq:
                await self._more.wait()


async def turn(agent: agentloop.Agent, text: str) -> None:
    agent.followup(text)
    with trio.fail_after(10):
        await agent.wait_idle()


async def test_from_a_seq_then_live(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db") as (rt, model):
        model.add(reply("one"), reply("two"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        await turn(handle.agent, "first")
        reader = Reader(rt.sessions.tail("s1", from_seq=3))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await reader.until(6)
            await turn(handle.agent, "second")
            last = handle.agent.session.last_seq
            await reader.until(last)
            nursery.cancel_scope.cancel()
        assert [e.seq for e in reader.events] == list(range(3, last + 1))
        assert reader.events == list(handle.agent.session.events[2:])


async def test_from_zero_and_one_mean_the_start(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db") as (rt, model):
        model.add(reply("one"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        await turn(handle.agent, "first")
        for start in (0, 1):
            async with rt.sessions.tail("s1", from_seq=start) as tail:
                first = await tail.__anext__()
            assert first.seq == 1


async def test_a_hibernated_session_is_read_from_the_store_without_a_wake(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db", after=0.01) as (rt, model):
        rested = trio.Event()
        woken: list[Any] = []
        rt.events.on(ev.AgentHibernated, lambda e: rested.set())
        rt.events.on(ev.AgentWoken, woken.append)
        model.add(reply("one"), reply("two"))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        await turn(handle.agent, "first")
        with trio.fail_after(10):
            await rested.wait()
        reader = Reader(rt.sessions.tail("s1"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await reader.until(6)
            assert handle.agent.status == "hibernated"
            assert woken == []
            # Input wakes it; the tail goes on with what the woken agent writes.
            await turn(handle.agent, "second")
            await reader.until(12)
            nursery.cancel_scope.cancel()
        assert [e.seq for e in reader.events] == list(range(1, 13))
        assert [e.type for e in reader.events][6:8] == ["turn/start", "user/message"]


async def test_a_session_written_by_another_runtime_of_the_process(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with runtime(db) as (reader_rt, _), runtime(db) as (writer_rt, model):
        model.add(reply("one"), reply("two"))
        handle = await writer_rt.agents.create(session_id="elsewhere", agent_options=OPTIONS)
        await turn(handle.agent, "first")
        assert reader_rt.sessions.get("elsewhere") is None
        reader = Reader(reader_rt.sessions.tail("elsewhere"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await reader.until(6)
            await turn(handle.agent, "second")
            # Told by the store once the writer committed (its turn's flush).
            await reader.until(12)
            nursery.cancel_scope.cancel()
        assert [e.seq for e in reader.events] == list(range(1, 13))
        assert reader.events == list(handle.agent.session.events)


async def test_a_slow_tail_never_holds_up_the_driver_and_loses_nothing(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db") as (rt, model):
        turns = 30
        model.add(*(reply(f"answer {i}") for i in range(turns)))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        tail = rt.sessions.tail("s1")
        async with tail:
            await turn(handle.agent, "prompt 0")
            first = await tail.__anext__()
            # Nobody reads it while the agent writes hundreds of events.
            for i in range(1, turns):
                await turn(handle.agent, f"prompt {i}")
            events = handle.agent.session.events
            assert len(events) >= 6 * turns
            assert tail.next_seq == 2
            rest = [await tail.__anext__() for _ in range(len(events) - 1)]
        assert [first, *rest] == list(events)


async def test_an_unknown_session_or_a_bad_seq(tmp_path: Path) -> None:
    async with runtime(tmp_path / "s.db") as (rt, _):
        with pytest.raises(agentloop.SessionNotFound):
            async with rt.sessions.tail("nobody") as tail:
                await tail.__anext__()
        with pytest.raises(agentloop.InvalidContent, match="from_seq"):
            rt.sessions.tail("nobody", from_seq=-1)
    async with agentloop.open_runtime() as rt:
        with pytest.raises(agentloop.SessionNotFound, match="no store"):
            async with rt.sessions.tail("nobody") as tail:
                await tail.__anext__()


async def test_without_a_store_a_session_driven_here_is_tailed(autojump_clock: Any) -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", ScriptedModel(["one"]))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        reader = Reader(rt.sessions.tail("s1"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await turn(handle.agent, "first")
            await reader.until(6)
            nursery.cancel_scope.cancel()
        assert reader.events == list(handle.agent.session.events)


# --- the command line -------------------------------------------------------------------------


async def stored_session(db: Path, turns: int = 2) -> list[agentloop.SessionEvent]:
    async with runtime(db) as (rt, model):
        model.add(*(reply(f"answer {i}") for i in range(turns)))
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        for i in range(turns):
            await turn(handle.agent, f"prompt {i}")
        events = list(handle.agent.session.events)
        await handle.aclose()
    return events


def tail_cli(db: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentloop", "sessions", "tail", *args, "--db", str(db)],
        capture_output=True, text=True, timeout=60, check=False,
    )


async def test_the_command_prints_from_a_seq(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    events = await stored_session(db)
    done = await trio.to_thread.run_sync(tail_cli, db, "s1", "--json", "--from-seq", "4")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["seq"] for line in lines] == [e.seq for e in events[3:]]
    assert lines[0] == {"seq": 4, "type": events[3].type, "turn": 1,
                        "data": json.loads(json.dumps(events[3].data))}
    done = await trio.to_thread.run_sync(tail_cli, db, "s1")
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()
    assert len(rows) == len(events)
    assert rows[0].split()[:4] == ["1", "turn/start", "turn", "1"]
    done = await trio.to_thread.run_sync(tail_cli, db, "nobody")
    assert done.returncode == 2
    assert "nobody" in done.stderr


async def test_the_command_follows_until_interrupted(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    events = await stored_session(db)
    argv = [sys.executable, "-m", "agentloop", "sessions", "tail", "s1", "--follow", "--json",
            "--db", str(db)]
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        seen = b""
        with trio.fail_after(30):
            while seen.count(b"\n") < len(events):
                chunk = await proc.stdout.receive_some()
                assert chunk, "the tail ended before printing the stored events"
                seen += chunk
        # It follows: still running once the backlog is out, until interrupted.
        assert proc.returncode is None
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            await proc.wait()
        assert proc.returncode == 130
        assert [json.loads(line)["seq"] for line in seen.splitlines()] == [e.seq for e in events]
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


# --- PostgreSQL: a tail in one runtime of a session another runtime drives --------------------


async def test_postgres_a_tail_follows_a_session_driven_by_another_runtime(
    request: pytest.FixtureRequest,
) -> None:
    pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
    dsn = request.getfixturevalue("dsn")  # the throwaway cluster of test_postgres.py
    cfg = {"persistence": {"backend": "postgres", "dsn": dsn}}
    async with agentloop.open_runtime(cfg) as writer, agentloop.open_runtime(cfg) as reader:
        model = ScriptedModel([reply("one"), reply("two")])
        writer.llm.register("scripted", model)
        handle = await writer.agents.create(session_id="far", agent_options=OPTIONS)
        await turn(handle.agent, "first")
        tail = Reader(reader.sessions.tail("far", from_seq=2))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tail.run)
            await tail.until(6)
            # Told by NOTIFY when the writer's batch commits (its turn's flush at the latest).
            await turn(handle.agent, "second")
            await tail.until(12)
            nursery.cancel_scope.cancel()
        assert tail.events == list(handle.agent.session.events[1:])
        await handle.aclose()


async def test_postgres_a_tail_reads_a_batch_not_the_whole_log(
    request: pytest.FixtureRequest,
) -> None:
    pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
    from agentloop_postgres import PostgresSessionStore

    dsn = request.getfixturevalue("dsn")
    cfg = {"persistence": {"backend": "postgres", "dsn": dsn}}
    async with agentloop.open_runtime(cfg) as writer:
        writer.llm.register("scripted", ScriptedModel([reply("one"), reply("two")]))
        handle = await writer.agents.create(session_id="batch", agent_options=OPTIONS)
        await turn(handle.agent, "first")
        await turn(handle.agent, "second")
        expected = handle.agent.session.events
        await handle.aclose()
    async with PostgresSessionStore(dsn) as store:
        assert await store.read_events("batch", 3, 4) == list(expected[2:6])
        assert await store.read_events("batch", 0, 2) == list(expected[:2])
        assert await store.read_events("batch", len(expected) + 1, 5) == []
        assert await store.read_events("nobody", 1, 5) == []
