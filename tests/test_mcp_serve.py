"""``agentloop mcp-serve``: a real subprocess driven by the ``mcp`` package's own client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("mcp")

from fake_openai import FakeOpenAI, Reply
from mcp import Client, StdioServerParameters

# Slow: the command line serving MCP in subprocesses.
pytestmark = [pytest.mark.mcp, pytest.mark.slow]


def _config(tmp_path: Path, fake: FakeOpenAI, agents: str, top: str = "") -> Path:
    path = tmp_path / "agentloop.toml"
    path.write_text(
        top
        + f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "fake-model"\n\n'
        + agents
    )
    return path


HELPER = '[[agents]]\nid = "helper"\nprovider = "fake"\nsession_id = "helper-1"\n'


@asynccontextmanager
async def _serving(config: Path, tmp_path: Path, *extra: str) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "agentloop", "mcp-serve", "--config", str(config),
              "--db", str(tmp_path / "sessions.db"), *extra],
        env=dict(os.environ),
    )
    async with Client(params) as client:
        yield client


def _log(tmp_path: Path, session_id: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "agentloop", "sessions", "show", session_id, "--json",
         "--db", str(tmp_path / "sessions.db")],
        capture_output=True, text=True, check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


def _turn_ends(events: list[dict[str, Any]]) -> list[str]:
    return [e["data"]["reason"] for e in events if e["type"] == "turn/end"]


async def test_each_call_is_a_turn_of_the_agents_session(tmp_path: Path, fake: FakeOpenAI) -> None:
    fake.replies = [Reply(chunks=["Paris."]), Reply(chunks=["About 2.1 million."])]
    config = _config(tmp_path, fake, HELPER)
    with trio.fail_after(60):
        async with _serving(config, tmp_path) as client:
            tools = (await client.list_tools()).tools
            assert [t.name for t in tools] == ["ask"]
            assert tools[0].input_schema["required"] == ["prompt"]
            first = await client.call_tool("ask", {"prompt": "Capital of France?"})
            second = await client.call_tool("ask", {"prompt": "Its population?"})
    assert [first.is_error, second.is_error] == [False, False]
    assert first.content[0].text == "Paris."
    assert second.content[0].text == "About 2.1 million."
    # One session: the second call's request carries the first exchange.
    history = [(m["role"], m.get("content")) for m in fake.requests[1]["messages"]]
    assert ("user", "Capital of France?") in history
    assert ("assistant", "Paris.") in history
    assert _turn_ends(_log(tmp_path, "helper-1")) == ["completed", "completed"]


async def test_a_cancelled_call_cancels_the_turn(tmp_path: Path, fake: FakeOpenAI) -> None:
    gate = threading.Event()
    fake.replies = [Reply(chunks=["Once", " upon", " a", " time"], gate=gate),
                    Reply(chunks=["Short."])]
    config = _config(tmp_path, fake, HELPER)
    progress: list[str | None] = []
    with trio.fail_after(60):
        async with _serving(config, tmp_path) as client:
            with trio.CancelScope() as scope:

                async def first_text(done: float, total: float | None, message: str | None) -> None:
                    progress.append(message)
                    scope.cancel()  # the answer has begun to stream: the client gives up

                await client.call_tool("ask", {"prompt": "A long story"},
                                       progress_callback=first_text)
            assert scope.cancelled_caught
            # The first reply stays stalled: only a cancelled turn lets the next one through.
            with trio.fail_after(20):
                after = await client.call_tool("ask", {"prompt": "A short one"})
            gate.set()
    assert progress == ["Once"]
    assert after.content[0].text == "Short."
    assert _turn_ends(_log(tmp_path, "helper-1")) == ["aborted", "completed"]


async def test_several_agents_and_the_agent_flag(tmp_path: Path, fake: FakeOpenAI) -> None:
    agents = HELPER + '\n[[agents]]\nid = "critic"\nprovider = "fake"\n'
    config = _config(tmp_path, fake, agents)
    with trio.fail_after(60):
        async with _serving(config, tmp_path) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
        async with _serving(config, tmp_path, "--agent", "critic") as client:
            only = [t.name for t in (await client.list_tools()).tools]
            answer = await client.call_tool("ask", {"prompt": "hi"})
    assert names == ["ask_critic", "ask_helper"]
    assert only == ["ask"]
    assert answer.content[0].text == "Hello from the fake model."


def test_an_unknown_agent_is_one_error_line(tmp_path: Path, fake: FakeOpenAI) -> None:
    config = _config(tmp_path, fake, HELPER)
    done = subprocess.run(
        [sys.executable, "-m", "agentloop", "mcp-serve", "--config", str(config),
         "--no-persist", "--agent", "nobody"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60, check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "agentloop: error: no agent 'nobody' in the config (agents: helper)"
    ]


ASKING_PLUGIN = '''
import agentloop
from agentloop.events import ToolPreExecute


async def plugin(ctx, task_status=None):
    async def touch(path: str) -> str:
        """Create a file."""
        return f"touched {path}"

    ctx.tools.register(agentloop.Tool("touch", "Create a file.", {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
    }, touch))
    ctx.events.on(ToolPreExecute, lambda e: agentloop.Ask("touch it?"))
    if task_status is not None:
        task_status.started()
'''


async def test_a_call_that_needs_approval_is_refused(
    tmp_path: Path, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "agentloop_asking.py").write_text(ASKING_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    fake.replies = [Reply(chunks=[], tool=("touch", {"path": "x"})), Reply(chunks=["Refused."])]
    config = _config(tmp_path, fake, HELPER, top='plugins = ["asking"]\n\n')
    with trio.fail_after(60):
        async with _serving(config, tmp_path) as client:
            answer = await client.call_tool("ask", {"prompt": "Touch x"})
    assert answer.content[0].text == "Refused."
    (result,) = [e["data"] for e in _log(tmp_path, "helper-1") if e["type"] == "tool/result"]
    assert result["error_code"] == "DENIED"
    assert "agentloop mcp-serve cannot ask for approval" in result["content"]
