"""``agentloop ui``: the inspector's JSON API, its token, its escaping, and ``POST /agui``,
over real HTTP on loopback (Hypercorn on trio). The page itself is driven in a real browser by
``test_inspector_browser.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from conftest import OPTIONS, turn_ends

import agentloop
from agentloop import ProviderError
from agentloop import events as ev
from agentloop.testing import ScriptedModel, reply

pytest.importorskip("hypercorn", reason="the inspector needs the ui extra (hypercorn)")
pytest.importorskip("markdown_it", reason="the inspector needs the ui extra (markdown-it-py)")
pytest.importorskip("ag_ui", reason="the inspector needs the ui extra (ag-ui-protocol)")

from agentloop._cli_ui import Inspector, serve, shown_store

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-live-7f3a9c01-SECRET-b2e4"
PASSWORD = "pw-5e1d-SECRET-77aa"
SCRIPT = "<script>window.pwned = 1</script>"


@attrs.define
class Served:
    rt: agentloop.Context
    model: ScriptedModel
    inspector: Inspector
    base: str
    token: str
    client: httpx.AsyncClient

    def url(self, path: str) -> str:
        return f"{self.base}{path}"

    async def get(self, path: str) -> httpx.Response:
        return await self.client.get(self.url(path), params={"token": self.token})

    async def post(self, path: str, body: object) -> httpx.Response:
        return await self.client.post(
            self.url(path), json=body, headers={"Authorization": f"Bearer {self.token}"}
        )


@contextlib.asynccontextmanager
async def served(tmp_path: Path, *, config: dict[str, Any] | None = None) -> AsyncIterator[Served]:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")},
              **(config or {})}
    async with agentloop.open_runtime(config) as rt, trio.open_nursery() as nursery:
        model = ScriptedModel()
        rt.llm.register("scripted", model)
        token = "t0ken-" + "x" * 20
        inspector = Inspector(rt, token=token, store="sessions.db",
                              agent_options=OPTIONS)
        base = await nursery.start(lambda task_status: serve(
            inspector, host="127.0.0.1", port=0, task_status=task_status))
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                yield Served(rt, model, inspector, base, token, client)
        finally:
            await inspector.aclose()
            nursery.cancel_scope.cancel()


async def finished(agent: agentloop.Agent) -> None:
    with trio.fail_after(10):
        await agent.wait_idle()


# --- the token ------------------------------------------------------------------------------


async def test_every_request_needs_the_token(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        for path in ("/", "/api/sessions", "/api/sessions/x", "/api/sessions/x/stream",
                     "/nowhere"):
            assert (await s.client.get(s.url(path))).status_code == 403, path
            bad = await s.client.get(s.url(path), params={"token": s.token[:-1] + "y"})
            assert bad.status_code == 403, path
        for path in ("/api/sessions/x/messages", "/api/sessions/x/approvals/c", "/agui"):
            assert (await s.client.post(s.url(path), json={})).status_code == 403, path
        page = await s.get("/")
        assert page.status_code == 200
        assert "agentloop" in page.text
        # The first page load leaves a cookie for the page's own requests.
        cookie = page.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        again = await s.client.get(s.url("/api/sessions"),
                                   headers={"Cookie": f"agentloop_ui={s.token}"})
        assert again.status_code == 200
        # A cross-site form cannot post JSON; the API refuses anything else.
        form = await s.client.post(s.url("/api/sessions/x/messages"), data={"content": "hi"},
                                   headers={"Cookie": f"agentloop_ui={s.token}"})
        assert form.status_code == 415


def test_a_dsn_is_shown_without_its_password() -> None:
    assert shown_store(f"postgresql://agent:{PASSWORD}@db.local:5433/agents?sslmode=require") \
        == "postgresql://agent@db.local:5433/agents"
    assert shown_store(f"postgresql://db.local/agents?password={PASSWORD}") \
        == "postgresql://db.local/agents"
    assert shown_store("/var/lib/agentloop/sessions.db") == "/var/lib/agentloop/sessions.db"


# --- reading --------------------------------------------------------------------------------


async def test_sessions_as_a_tree_and_a_log_rendered_and_escaped(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        s.model.add(
            reply("", tool_calls=[("delegate", {"task": "t"}, "d1")]),
            reply("child says **hi**"),
            reply(f"Done: `code` and **bold** and {SCRIPT}",
                  usage={"input_tokens": 9, "output_tokens": 3}),
        )

        @s.rt.tools.tool
        async def delegate(task: str) -> str:
            """Ask a sub-agent."""
            return (await s.rt.subagents.run(task, session_id="kid")).text

        handle = await s.rt.agents.create(session_id="top", agent_options=OPTIONS)
        async with handle:
            handle.agent.followup(f"please {SCRIPT}")
            await finished(handle.agent)
            listing = (await s.get("/api/sessions")).json()["sessions"]
            rows = {r["id"]: r for r in listing}
            assert rows["top"]["live"] is True and rows["top"]["parent"] is None
            assert rows["kid"]["parent"] == "top"
            log = (await s.get("/api/sessions/top")).json()
        assert log["live"] is True
        by_type = {e["type"]: e for e in log["events"]}
        user = by_type["user/message"]["data"]
        assert user["content"] == f"please {SCRIPT}"
        assert "<script>" not in user["html"] and "&lt;script&gt;" in user["html"]
        answer = by_type["assistant/message"]["data"]
        assert "<strong>bold</strong>" in answer["html"] and "<code>code</code>" in answer["html"]
        assert "<script>" not in answer["html"]
        assert by_type["turn/end"]["data"]["usage"]["input_tokens"] == 9
        # Disposed now: read back from the store.
        stored = (await s.get("/api/sessions/top")).json()
        assert stored["live"] is False
        assert [e["seq"] for e in stored["events"]] == [e["seq"] for e in log["events"]]
        assert (await s.get("/api/sessions/nobody")).status_code == 404


async def sse(response: httpx.Response) -> AsyncIterator[tuple[str, Any]]:
    name, data = "message", ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif not line and data:
            yield name, json.loads(data)
            name, data = "message", ""


async def test_the_stream_replays_the_log_then_goes_live(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        s.model.add("first answer", reply("second answer streams in words", chunk_size=7))
        handle = await s.rt.agents.create(session_id="live", agent_options=OPTIONS)
        async with handle:
            handle.agent.followup("one")
            await finished(handle.agent)
            before = len(handle.agent.session.events)
            seen: list[dict[str, Any]] = []
            with trio.fail_after(10):
                async with s.client.stream(
                    "GET", s.url("/api/sessions/live/stream"), params={"token": s.token}
                ) as response:
                    assert response.headers["content-type"] == "text/event-stream"
                    async with contextlib.aclosing(sse(response)) as stream:
                        async for name, data in stream:
                            if name == "ready":
                                assert len(seen) == before
                                posted = await s.post("/api/sessions/live/messages",
                                                      {"content": "two"})
                                assert posted.status_code == 200
                                continue
                            seen.append(data)
                            if data["type"] == "turn/end" and data["turn"] == 2:
                                break
        assert [e["seq"] for e in seen] == list(range(1, len(seen) + 1))
        chunks = [e["data"]["delta"] for e in seen
                  if e["type"] == "assistant/chunk" and e["turn"] == 2]
        assert "".join(chunks) == "second answer streams in words" and len(chunks) > 1


async def test_approve_and_deny_and_a_follow_up_resume_a_stored_session(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        s.rt.events.on(ev.ToolPreExecute, lambda e: agentloop.Ask(f"run {e.call.name}?"))
        ran: list[str] = []

        @s.rt.tools.tool(concurrency="parallel")
        async def rm(path: str) -> str:
            """Remove a path."""
            ran.append(path)
            return f"removed {path}"

        s.model.add(reply("", tool_calls=[("rm", {"path": "a"}, "c1"),
                                          ("rm", {"path": "b"}, "c2")]), "ok, one of two")
        handle = await s.rt.agents.create(session_id="ap", agent_options=OPTIONS)
        await_agent = handle.agent
        await_agent.followup("clean")
        await finished(await_agent)
        assert {p.call_id for p in await_agent.pending_approvals} == {"c1", "c2"}
        await handle.aclose()  # suspended, stored: the inspector resumes it to answer

        assert (await s.post("/api/sessions/ap/approvals/c9", {"approve": True})).status_code \
            == 409
        assert (await s.post("/api/sessions/ap/approvals/c1", {"yes": 1})).status_code == 400
        ok = await s.post("/api/sessions/ap/approvals/c1", {"approve": True})
        assert ok.json() == {"call_id": "c1", "approved": True}
        no = await s.post("/api/sessions/ap/approvals/c2",
                          {"approve": False, "reason": "not b"})
        assert no.status_code == 200
        agent = s.rt.agents.get("ap")
        assert agent is not None
        await finished(agent)
        assert ran == ["a"]
        results = {e.data["call_id"]: e.data for e in agent.session.events
                   if e.type == "tool/result"}
        assert results["c2"]["error_code"] == "DENIED"
        s.model.add("more")
        assert (await s.post("/api/sessions/ap/messages", {"content": "more?"})).status_code \
            == 200
        await finished(agent)
        assert turn_ends(agent) == ["suspended", "completed", "completed"]
        assert (await s.post("/api/sessions/none/messages", {"content": "x"})).status_code \
            == 404


async def test_no_key_is_ever_served(tmp_path: Path) -> None:
    config = {"providers": {"vendor": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1",
                                       "api_key": KEY, "model": "m"}}}
    async with served(tmp_path, config=config) as s:
        handle = await s.rt.agents.create(session_id="k", agent_options=agentloop.AgentOptions(
            provider="vendor", model="m"))
        async with handle:
            handle.agent.followup("hello")
            await finished(handle.agent)
            assert turn_ends(handle.agent) == ["error"]
            texts = [(await s.get(p)).text for p in ("/", "/api/sessions", "/api/sessions/k")]
    fragments = {KEY[i:i + 6] for i in range(len(KEY) - 5)}
    for text in texts:
        assert not [f for f in fragments if f in text]


# --- AG-UI ----------------------------------------------------------------------------------


def run_input(thread: str, text: str) -> dict[str, Any]:
    from ag_ui.core import RunAgentInput, UserMessage

    value = RunAgentInput(thread_id=thread, run_id="run-1", state={}, tools=[], context=[],
                          forwarded_props={},
                          messages=[UserMessage(id="u1", role="user", content=text)])
    return value.model_dump(mode="json", by_alias=True, exclude_none=True)


async def agui_events(s: Served, body: dict[str, Any]) -> list[Any]:
    from ag_ui.core import Event
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(Event)
    events = []
    with trio.fail_after(10):
        async with s.client.stream(
            "POST", s.url("/agui"), json=body, headers={"Authorization": f"Bearer {s.token}"}
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for _, data in sse(response):
                events.append(adapter.validate_python(data))
    return events


async def test_agui_streams_a_turn_as_agui_events(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        @s.rt.tools.tool
        async def add(a: int, b: int) -> int:
            """Add."""
            return a + b

        s.model.add(reply("Adding.", tool_calls=[("add", {"a": 2, "b": 3}, "t1")]),
                    reply("It is 5."))
        events = await agui_events(s, run_input("thread-1", "2 + 3?"))
        kinds = [e.type.value for e in events]
        assert kinds[0] == "RUN_STARTED" and kinds[-1] == "RUN_FINISHED"
        assert kinds == [
            "RUN_STARTED",
            "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
            "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT",
            "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
            "RUN_FINISHED",
        ]
        assert events[0].thread_id == "thread-1" and events[0].run_id == "run-1"
        start = events[4]
        assert (start.tool_call_id, start.tool_call_name) == ("t1", "add")
        assert start.parent_message_id == events[1].message_id
        assert json.loads(events[5].delta) == {"a": 2, "b": 3}
        assert events[7].content == "5"
        text = "".join(e.delta for e in events if e.type.value == "TEXT_MESSAGE_CONTENT")
        assert text == "Adding.It is 5."
        # The thread is a session like any other: stored, and shown by the inspector.
        agent = s.rt.agents.get("thread-1")
        assert agent is not None and agent.session.messages()[0].text == "2 + 3?"

        s.model.add(ProviderError("bad request", status=400, code="invalid_request"))
        failed = await agui_events(s, run_input("thread-1", "again"))
        assert [e.type.value for e in failed] == ["RUN_STARTED", "RUN_ERROR"]
        assert failed[1].code == "invalid_request"

        refused = await s.post("/agui", {"threadId": "t"})
        assert refused.status_code == 400


# --- the command ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def ui_process(argv: list[str]) -> AsyncIterator[str]:
    """``agentloop ui ARGV`` in a process of its own; yields the URL it prints, then stops it
    with SIGINT (a person's Ctrl-C) and checks it exits as interrupted."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "agentloop", "ui", "--port", "0", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                assert chunk, "the command exited before printing its URL"
                line += chunk
        yield line.decode().split(": ", 1)[1].strip()
        process.send_signal(signal.SIGINT)
        with trio.fail_after(20):
            assert await process.wait() == 130
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGABRT)
            await process.wait()
            assert process.stderr is not None
            print((await process.stderr.receive_some(100000)).decode())


@pytest.mark.slow
async def test_the_command_prints_a_tokened_loopback_url(tmp_path: Path) -> None:
    config = tmp_path / "agentloop.toml"
    config.write_text(
        f'[persistence]\nbackend = "sqlite"\npath = "{tmp_path / "s.db"}"\n'
        '[providers.fake]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
        f'api_key = "{KEY}"\n'
    )
    argv = ["--config", str(config), "--provider", "fake"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    refused = await trio.run_process(
        [sys.executable, "-m", "agentloop", "ui", *argv, "--host", "0.0.0.0"],
        capture_stdout=True, capture_stderr=True, env=env, check=False,
    )
    assert refused.returncode != 0 and b"--public" in refused.stderr
    async with ui_process(argv) as url:
        assert url.startswith("http://127.0.0.1:") and "?token=" in url
        base, token = url.split("/?token=")
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(base + "/")).status_code == 403
            page = await client.get(url)
            assert page.status_code == 200 and "agentloop" in page.text
            assert KEY[:10] not in page.text
            assert (await client.get(base + "/api/sessions",
                                     params={"token": token})).json() == {"sessions": []}
