"""End-to-end durability: agents driven through a real SQLite store.

Every test opens the runtime on a file under ``tmp_path`` (config ``[persistence]``) and checks
what reaches the file with plain ``sqlite3``, independently of the store's own reader.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import loopback
import pytest
import trio
import trio.testing
from conftest import (
    OPTIONS,
    check_history_valid,
    check_log_invariants,
    kill_when_ready,
    of_type,
    turn_ends,
)

import agentloop
from agentloop.events import AgentRequestError, AgentTurnEnd
from agentloop.testing import (
    Finish,
    FunctionModel,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    reply,
)

CHILD = Path(__file__).with_name("crash_child.py")

Row = tuple[int, str, "int | None", Any]


def sqlite_config(db: Path, **more: Any) -> dict[str, Any]:
    return {"persistence": {"backend": "sqlite", "path": str(db)}, **more}


def plain(value: object) -> Any:
    """Deep-frozen data as the JSON values the file holds (tuples become lists)."""
    return json.loads(json.dumps(value))


def rows_of(events: Any) -> list[Row]:
    return [(e.seq, e.type, e.turn, plain(e.data)) for e in events]


@contextlib.contextmanager
def raw(db: Path) -> Any:
    """A plain sqlite3 connection to the store's file, closed on exit."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        yield conn


def stored_rows(db: Path, session_id: str) -> list[Row]:
    with raw(db) as conn:
        found = conn.execute(
            "SELECT seq, type, turn, data FROM events WHERE session_id = ? ORDER BY seq",
            (session_id,),
        ).fetchall()
    return [(seq, type_, turn, json.loads(text)) for seq, type_, turn, text in found]


def lease_pids(db: Path, session_id: str) -> list[int]:
    with raw(db) as conn:
        return [
            pid
            for (pid,) in conn.execute("SELECT pid FROM leases WHERE session_id = ?", (session_id,))
        ]


async def idle_after(agent: agentloop.Agent, prompt: str) -> None:
    agent.followup(prompt)
    await agent.wait_idle()


# --- 1. resume round trip --------------------------------------------------------------------


async def test_a_session_resumes_in_a_new_runtime_exactly_as_it_was_left(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    meta = {"cwd": "/home/u/project", "parent": "origin-session", "label": "round"}
    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:

            @rt.tools.tool
            async def add(a: int, b: int) -> int:
                """Add two integers."""
                return a + b

            rt.llm.register(
                "scripted",
                ScriptedModel([
                    reply("let me add", tool_calls=[("add", {"a": 2, "b": 3}, "call_add")]),
                    reply("it is 5", usage={"input_tokens": 12, "output_tokens": 3}),
                    reply("you are welcome"),
                ]),
            )
            handle = await rt.agents.create(session_id="round", meta=meta, agent_options=OPTIONS)
            first = handle.agent
            await idle_after(first, "what is 2 + 3?")
            await idle_after(first, "thanks")
            assert turn_ends(first) == ["completed", "completed"]
            [result] = of_type(first, "tool/result")
            assert (result.data["call_id"], result.data["is_error"]) == ("call_add", False)
            before = list(first.session.events)
            history = tuple(first.session.messages())
            assert [m.role for m in history] == [
                "user", "assistant", "tool", "assistant", "user", "assistant"
            ]

        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            model = ScriptedModel(["welcome back"])
            rt.llm.register("scripted", model)

            with pytest.raises(agentloop.SessionNotFound, match="'unknown'"):
                await rt.agents.resume(resume_session_id="unknown", agent_options=OPTIONS)
            with pytest.raises(agentloop.SessionIdInUse, match="'round'"):
                await rt.agents.create(session_id="round", agent_options=OPTIONS)
            assert rt.agents.list() == [] and rt.sessions.list() == []
            assert stored_rows(db, "round") == rows_of(before)

            handle = await rt.agents.resume(resume_session_id="round", agent_options=OPTIONS)
            agent = handle.agent
            assert agent.resumed and rt.agents.get("round") is agent
            await trio.testing.wait_all_tasks_blocked()
            # The same log, event for event, and the same derived history.
            assert list(agent.session.events) == before
            assert tuple(agent.session.messages()) == history
            assert dict(agent.session.meta) == meta
            assert agent.cwd == "/home/u/project"

            await idle_after(agent, "one more thing")
            new = agent.session.events[len(before):]
            assert new[0].type == "turn/start" and new[0].data["turn"] == 3
            assert {e.turn for e in new} == {3}
            assert turn_ends(agent) == ["completed", "completed", "completed"]
            [request] = model.requests
            assert tuple(request.messages[: len(history)]) == history
            assert len(request.messages) == len(history) + 1
            assert (request.messages[-1].role, request.messages[-1].text) == (
                "user", "one more thing"
            )
            check_log_invariants(agent.session.events)
            check_history_valid(agent.session.messages())
            final = list(agent.session.events)

        # Everything, the resumed turn included, is in the file.
        assert stored_rows(db, "round") == rows_of(final)


# --- 2. the flush barrier at turn/end --------------------------------------------------------


async def test_every_turn_end_is_committed_before_turn_end_hooks_run(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    seen: list[dict[str, Any]] = []
    stalled = trio.Event()

    async def answer() -> AsyncIterator[Any]:
        yield TextDelta("fine")
        yield Finish("stop")

    async def call_tool() -> AsyncIterator[Any]:
        yield TextDelta("checking")
        yield ToolCallDelta(0, id="call_1", name="probe", arguments="{}")
        yield Finish("tool_calls")

    async def fail() -> AsyncIterator[Any]:
        raise agentloop.ProviderError("upstream is down", status=503, code="overloaded")
        yield Finish("stop")  # pragma: no cover - makes this a generator

    async def stall() -> AsyncIterator[Any]:
        yield TextDelta("thinking about it")
        stalled.set()
        await trio.sleep_forever()
        yield Finish("stop")  # pragma: no cover

    script: list[Callable[[], AsyncIterator[Any]]] = [answer, call_tool, answer, fail, stall]

    def stream(request: Any) -> AsyncIterator[Any]:
        return script.pop(0)()

    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:

            @rt.tools.tool
            async def probe() -> str:
                """Probe."""
                return "ok"

            rt.llm.register("scripted", FunctionModel(stream))

            async def on_turn_end(event: AgentTurnEnd) -> None:
                agent = rt.agents.get(event.agent_id)
                assert agent is not None
                end = agent.session.events[-1]
                with raw(db) as conn:
                    (max_seq,) = conn.execute(
                        "SELECT max(seq) FROM events WHERE session_id = ?", (event.agent_id,)
                    ).fetchone()
                seen.append({
                    "turn": event.turn,
                    "reason": event.reason,
                    "end": (end.type, end.turn, end.seq),
                    "max_seq": max_seq,
                    "in_memory": rows_of(agent.session.events),
                    "stored": stored_rows(db, event.agent_id),
                })

            rt.events.on(AgentTurnEnd, on_turn_end)
            handle = await rt.agents.create(session_id="barrier", agent_options=OPTIONS)
            agent = handle.agent
            await idle_after(agent, "one")  # completed
            await idle_after(agent, "two")  # a tool round trip, completed
            await idle_after(agent, "three")  # error
            agent.followup("four")
            await stalled.wait()
            assert agent.cancel()
            await agent.wait_idle()  # aborted
            assert turn_ends(agent) == ["completed", "completed", "error", "aborted"]

    assert [(s["turn"], s["reason"]) for s in seen] == [
        (1, "completed"), (2, "completed"), (3, "error"), (4, "aborted")
    ]
    for s in seen:
        kind, turn, seq = s["end"]
        assert (kind, turn) == ("turn/end", s["turn"])
        assert s["max_seq"] == seq, s
        assert s["stored"] == s["in_memory"]


# --- 3. disposal mid-stream is durable when aclose returns -----------------------------------


async def test_disposing_mid_stream_has_committed_the_disposed_turn_end(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    streaming = trio.Event()

    async def stream(request: Any) -> AsyncIterator[Any]:
        yield TextDelta("half ")
        yield TextDelta("done")
        streaming.set()
        await trio.sleep_forever()
        yield Finish("stop")  # pragma: no cover

    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", FunctionModel(stream))
            handle = await rt.agents.create(session_id="mid", agent_options=OPTIONS)
            agent = handle.agent
            agent.followup("write an essay")
            await streaming.wait()
            assert lease_pids(db, "mid") != []

            await handle.aclose()

            # Read before the runtime (and its store) goes away.
            stored = stored_rows(db, "mid")
            assert stored == rows_of(agent.session.events)
            *_, anchor, end = stored
            assert anchor[1] == "assistant/message"
            assert (anchor[3]["content"], anchor[3]["interrupted"]) == ("half done", True)
            assert (end[1], end[3]["reason"]) == ("turn/end", "disposed")
            assert rt.agents.get("mid") is None and rt.sessions.get("mid") is None
            assert lease_pids(db, "mid") == []
            check_log_invariants(agent.session.events)


# --- 4. a killed process: its open turn is closed on resume ----------------------------------


async def _run_child_until_ready(db: Path, mode: str, log: Path) -> int:
    """Run crash_child.py until it says READY, SIGKILL it, reap it; return its pid."""
    return await kill_when_ready([sys.executable, str(CHILD), str(db), mode], log, ready_within=15)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tool", "stream"])
async def test_a_turn_open_when_the_process_was_killed_is_closed_on_resume(
    tmp_path: Path, mode: str
) -> None:
    db = tmp_path / "sessions.db"
    pid = await _run_child_until_ready(db, mode, tmp_path / "child.log")

    left = stored_rows(db, "crashy")
    # The killed driver still holds the lease, and its turn is open.
    assert lease_pids(db, "crashy") == [pid]
    assert [r[1] for r in left].count("turn/end") == 0
    if mode == "tool":
        last = left[-1]
        assert (last[1], last[3]["call_id"], last[3]["name"]) == ("tool/call", "call_hang", "hang")
    else:
        chunks = [r[3]["delta"] for r in left if r[1] == "assistant/chunk"]
        assert chunks == ["partial ", "answer ", "so far"]
        assert left[-1][1] == "assistant/chunk"

    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            model = ScriptedModel(["picking up where we left off"])
            rt.llm.register("scripted", model)
            handle = await rt.agents.resume(resume_session_id="crashy", agent_options=OPTIONS)
            agent = handle.agent
            await trio.testing.wait_all_tasks_blocked()

            events = agent.session.events
            assert rows_of(events[: len(left)]) == left
            recovered = events[len(left):]
            if mode == "tool":
                result, end = recovered
                assert (result.type, result.turn) == ("tool/result", 1)
                assert result.data["call_id"] == "call_hang"
                assert result.data["name"] == "hang"
                assert result.data["is_error"] is True
                assert result.data["error_code"] == "INTERRUPTED"
            else:
                anchor, end = recovered
                # What the user saw of the cut stream stays, as after a cancel.
                assert anchor.type == "assistant/message"
                assert anchor.data["interrupted"] is True
                assert anchor.data["content"] == "partial answer so far"
                chunk_seqs = tuple(e.seq for e in of_type(agent, "assistant/chunk"))
                assert anchor.data["source_event_seqs"] == chunk_seqs
                assert agent.session.messages()[-1].interrupted
                assert of_type(agent, "tool/call") == []
            assert (end.type, end.turn) == ("turn/end", 1)
            assert (end.data["reason"], end.data["cause"]) == ("aborted", "crash")
            check_log_invariants(events)
            check_history_valid(agent.session.messages())
            assert agent.session.meta["cwd"] == "/srv/crashy"

            await idle_after(agent, "continue")
            assert turn_ends(agent) == ["aborted", "completed"]
            [request] = model.requests
            check_history_valid(request.messages)
            assert (request.messages[-1].role, request.messages[-1].text) == ("user", "continue")
            if mode == "tool":
                [tool_message] = [m for m in request.messages if m.role == "tool"]
                assert (tool_message.tool_call_id, tool_message.is_error) == ("call_hang", True)
            check_log_invariants(agent.session.events)
            final = list(agent.session.events)
            assert lease_pids(db, "crashy") == [os.getpid()]

    assert stored_rows(db, "crashy") == rows_of(final)
    assert lease_pids(db, "crashy") == []


# --- 5. one live driver per session ----------------------------------------------------------


async def test_a_session_driven_by_one_runtime_is_refused_to_another(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    with trio.fail_after(10):
        async with (
            agentloop.open_runtime(sqlite_config(db)) as a,
            agentloop.open_runtime(sqlite_config(db)) as b,
        ):
            a.llm.register("scripted", ScriptedModel(["from a", "again from a"]))
            b_model = ScriptedModel(["from b"])
            b.llm.register("scripted", b_model)
            handle_a = await a.agents.create(session_id="shared", agent_options=OPTIONS)
            await idle_after(handle_a.agent, "hello")

            with pytest.raises(agentloop.AgentLoopError, match="'shared' is already driven") as err:
                await b.agents.resume(resume_session_id="shared", agent_options=OPTIONS)
            assert isinstance(err.value, agentloop.PersistenceError)
            assert b.agents.get("shared") is None and b.sessions.get("shared") is None
            with pytest.raises(agentloop.SessionIdInUse):
                await b.agents.create(session_id="shared", agent_options=OPTIONS)

            # The refused attempt left the live driver alone.
            await idle_after(handle_a.agent, "still there?")
            assert turn_ends(handle_a.agent) == ["completed", "completed"]
            left_by_a = list(handle_a.agent.session.events)

            await handle_a.aclose()
            handle_b = await b.agents.resume(resume_session_id="shared", agent_options=OPTIONS)
            assert list(handle_b.agent.session.events) == left_by_a
            await idle_after(handle_b.agent, "hello b")
            assert turn_ends(handle_b.agent) == ["completed"] * 3
            assert b_model.requests[0].messages[-1].text == "hello b"

            # ... and now it is A that is refused.
            with pytest.raises(agentloop.PersistenceError, match="'shared' is already driven"):
                await a.agents.resume(resume_session_id="shared", agent_options=OPTIONS)
            final = list(handle_b.agent.session.events)

    assert stored_rows(db, "shared") == rows_of(final)


# --- 6. API keys never reach the log, the file, reprs or errors ------------------------------

KEY = "sk-SECRET-123"


def _unauthorized(kind: str) -> loopback.Handler:
    if kind == "plain text":
        return loopback.plain_error(401, f"invalid api key {KEY}")
    if kind == "error message":
        return loopback.json_error(401, {"error": {
            "message": f"Incorrect API key provided: {KEY}.",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }})
    return loopback.json_error(401, {"error": {"message": "denied", "code": f"bad_key:{KEY}"}})


@pytest.mark.parametrize(
    "echo",
    [
        "error message",
        "plain text",
        "error code",
    ],
)
async def test_the_api_key_appears_nowhere(
    tmp_path: Path, echo: str, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "sessions.db"
    handlers = [loopback.replay_fixture("openai-chat-text-with-usage.sse"), _unauthorized(echo)]

    async def handler(request: loopback.Request, stream: trio.SocketStream) -> None:
        await handlers.pop(0)(request, stream)

    texts: list[str] = []
    blobs: list[bytes] = []

    def file_bytes() -> None:
        for path in (db, Path(f"{db}-wal")):
            if path.exists():
                blobs.append(path.read_bytes())

    caplog.set_level(logging.DEBUG, logger="agentloop")
    with trio.fail_after(10):
        async with loopback.serve(handler) as server:
            config = sqlite_config(
                db,
                providers={"fake": {"kind": "openai", "base_url": server.url, "api_key": KEY}},
                agents=[{"id": "keyed", "provider": "fake", "model": "gpt-4o",
                         "session_id": "keyed-session"}],
            )
            async with agentloop.open_runtime(config) as rt:
                agent = rt.agents.get("keyed-session")
                assert agent is not None

                async def on_error(event: AgentRequestError) -> None:
                    texts.extend([str(event.error), repr(event.error),
                                  json.dumps(event.error.to_json()), repr(event)])

                rt.events.on(AgentRequestError, on_error)
                await idle_after(agent, "hello")
                await idle_after(agent, "hello again")
                assert turn_ends(agent) == ["completed", "error"]
                error = of_type(agent, "turn/end")[-1].data["error"]
                assert error["status"] == 401
                # The key did go over the wire, and came back in the error body.
                assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in server.requests)
                assert len(server.requests) == 2 and texts

                await agent.wait_idle()
                backend = rt.session_persistence
                assert backend is not None
                await backend.flush(agent.id, agent.session.last_seq)
                file_bytes()
                texts.extend(json.dumps(e.data) for e in agent.session.events)
                texts.extend(str(e.data) for e in agent.session.events)
                texts.extend(repr(m) for m in agent.session.messages())
                texts.append(repr(rt.llm.adapter("fake")))
                texts.append(repr(rt.config))
                texts.append(repr(rt.config.providers["fake"]))
        file_bytes()

    texts.extend(r.getMessage() for r in caplog.records)
    texts.extend(
        logging.Formatter().formatException(r.exc_info) for r in caplog.records if r.exc_info
    )
    if echo != "error code":
        assert "***" in error["message"]
    leaks = [t for t in texts if KEY in t]
    assert leaks == []
    assert len(blobs) >= 2 and all(KEY.encode() not in blob for blob in blobs)


# --- 7. session ids the store cannot hold ----------------------------------------------------

BAD_IDS = ["../etc/passwd", "", "x" * 300, "bad\nid", "y" * 200, ".hidden", "a/b", "has space"]


@pytest.mark.parametrize("bad", BAD_IDS, ids=lambda s: repr(s)[:24])
async def test_an_invalid_session_id_is_refused_at_create(tmp_path: Path, bad: str) -> None:
    db = tmp_path / "sessions.db"
    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", ScriptedModel(["hi"]))
            with pytest.raises(ValueError, match=re.escape(repr(bad))):
                await rt.agents.create(session_id=bad, agent_options=OPTIONS)
            assert rt.agents.list() == [] and rt.sessions.list() == []
            # Nothing was stored, and a valid id still works afterwards.
            handle = await rt.agents.create(session_id="valid-id", agent_options=OPTIONS)
            await idle_after(handle.agent, "hi")
            assert turn_ends(handle.agent) == ["completed"]
    with raw(db) as conn:
        assert conn.execute("SELECT id FROM sessions").fetchall() == [("valid-id",)]
        assert conn.execute("SELECT count(*) FROM leases").fetchone() == (0,)


async def test_agent_loop_create_refuses_an_invalid_session_id_up_front(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", ScriptedModel(["hi"]))
            with pytest.raises(ValueError, match=re.escape(repr("../etc/passwd"))):
                rt.agent_loop.create("../etc/passwd", OPTIONS)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.agents.list() == []


async def test_agent_loop_create_of_a_stored_id_does_not_take_the_runtime_down(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sessions.db"
    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", ScriptedModel(["hi"]))
            agent = rt.agent_loop.create("main", OPTIONS)
            await idle_after(agent, "first run")
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", ScriptedModel(["hi"]))
            with contextlib.suppress(agentloop.AgentLoopError):
                rt.agent_loop.create("main", OPTIONS)
            await trio.testing.wait_all_tasks_blocked()
            # The runtime is still usable.
            handle = await rt.agents.create(session_id="other", agent_options=OPTIONS)
            await idle_after(handle.agent, "hi")
            assert turn_ends(handle.agent) == ["completed"]


async def test_a_store_that_cannot_open_fails_the_runtime_start(tmp_path: Path) -> None:
    db = tmp_path / "broken.db"
    db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(agentloop.PersistenceError, match=r"broken\.db"):
        async with agentloop.open_runtime(sqlite_config(db)):
            pass
