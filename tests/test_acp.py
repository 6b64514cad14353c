"""``agentloop acp`` driven as an editor drives it: a subprocess spoken to over its stdio, every
message checked against the ``agent-client-protocol`` package's schema models.

The model is the fake OpenAI server of ``fake_openai.py``; the tool is the real
``mcp-server-time``, reached through the ``mcp`` plugin and parked for approval by
``[acp] ask``.
"""

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

pytest.importorskip("acp.schema")
pytest.importorskip("mcp")
pytest.importorskip("mcp_server_time")

from acp import schema
from fake_openai import FakeOpenAI, Reply

# Slow: a real editor session over ACP, the command line in subprocesses.
pytestmark = [pytest.mark.mcp, pytest.mark.slow]


class Editor:
    """The editor's end of the pipe: JSON-RPC requests out, everything it reads kept."""

    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self.stdin = proc.stdin
        self.stdout = proc.stdout
        self.buffer = b""
        self.next_id = 0
        self.updates: list[schema.SessionNotification] = []

    async def send(self, message: dict[str, Any]) -> None:
        await self.stdin.send_all((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())

    async def request(self, method: str, params: dict[str, Any]) -> int:
        self.next_id += 1
        await self.send({"id": self.next_id, "method": method, "params": params})
        return self.next_id

    async def read(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = await self.stdout.receive_some()
            assert chunk, "the agent closed its stdout"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        assert message["jsonrpc"] == "2.0"
        if message.get("method") == "session/update":
            self.updates.append(schema.SessionNotification.model_validate(message["params"]))
        return message

    async def answer(self, request_id: int) -> dict[str, Any]:
        """Read until the answer to ``request_id``; fails on a request from the agent."""
        while True:
            message = await self.read()
            if message.get("id") == request_id and "method" not in message:
                return message
            assert "id" not in message, f"unexpected request from the agent: {message}"

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        answer = await self.answer(await self.request(method, params))
        assert "error" not in answer, answer
        return answer["result"]

    def texts(self, kind: str) -> str:
        return "".join(
            u.update.content.text for u in self.updates if u.update.session_update == kind
        )

    def of(self, kind: str) -> list[Any]:
        return [u.update for u in self.updates if u.update.session_update == kind]


@pytest.fixture
def config(tmp_path: Path, fake: FakeOpenAI) -> Path:
    path = tmp_path / "agentloop.toml"
    path.write_text(f"""
plugins = ["mcp"]

[mcp]
separator = "_"

[[mcp.servers]]
name = "time"
command = {json.dumps(sys.executable)}
args = ["-m", "mcp_server_time"]

[acp]
ask = ["time_*"]

[providers.fake]
kind = "openai"
base_url = "{fake.url}"
model = "fake-model"

[[agents]]
id = "coder"
provider = "fake"
""")
    return path


@asynccontextmanager
async def _editor(config: Path, tmp_path: Path) -> AsyncIterator[Editor]:
    argv = [sys.executable, "-m", "agentloop", "acp", "--config", str(config),
            "--db", str(tmp_path / "sessions.db")]
    with (tmp_path / "acp.log").open("ab") as log:
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=dict(os.environ)
        )
    editor = Editor(proc)
    try:
        init = await editor.call("initialize", {
            "protocolVersion": 1, "clientCapabilities": {"fs": {"readTextFile": False}},
        })
        parsed = schema.InitializeResponse.model_validate(init)
        assert parsed.protocol_version == 1
        assert parsed.agent_capabilities.load_session is True
        yield editor
        await editor.stdin.aclose()  # the editor quits: the agent exits cleanly
        with trio.fail_after(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


async def test_an_editor_session_prompt_permission_cancel_and_reload(
    tmp_path: Path, fake: FakeOpenAI, config: Path
) -> None:
    gate = threading.Event()
    fake.replies = [
        Reply(reasoning=["The user wants the time."], chunks=["Checking."],
              tool=("time_get_current_time", {"timezone": "UTC"})),
        Reply(chunks=["It", " is", " noon", " in", " UTC."]),
        Reply(chunks=["Once", " upon", " a", " time"], gate=gate),
        Reply(chunks=["Still", " here."]),
    ]
    with trio.fail_after(120):
        async with _editor(config, tmp_path) as editor:
            new = schema.NewSessionResponse.model_validate(
                await editor.call("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            )
            session_id = new.session_id

            # A prompt whose tool call needs the user's permission.
            prompt_id = await editor.request("session/prompt", {
                "sessionId": session_id,
                "prompt": [{"type": "text", "text": "What time is it?"}],
            })
            while True:
                message = await editor.read()
                if message.get("method") == "session/request_permission":
                    break
                assert "id" not in message, message
            asked = schema.RequestPermissionRequest.model_validate(message["params"])
            assert asked.session_id == session_id
            assert asked.tool_call.title == "time_get_current_time"
            assert asked.tool_call.raw_input == {"timezone": "UTC"}
            assert [o.kind for o in asked.options] == [
                "allow_once", "allow_always", "reject_once"
            ]
            await editor.send({"id": message["id"], "result": {
                "outcome": {"outcome": "selected", "optionId": "allow"},
            }})
            done = schema.PromptResponse.model_validate(
                (await editor.answer(prompt_id))["result"]
            )
            assert done.stop_reason == "end_turn"
            assert editor.texts("agent_thought_chunk") == "The user wants the time."
            assert editor.texts("agent_message_chunk") == "Checking.It is noon in UTC."
            (call,) = editor.of("tool_call")
            (result,) = editor.of("tool_call_update")
            assert (call.tool_call_id, call.status) == (result.tool_call_id, "pending")
            assert result.status == "completed"
            assert '"timezone":"UTC"' in result.content[0].content.text

            # A cancel in the middle of a streamed answer.
            editor.updates.clear()
            prompt_id = await editor.request("session/prompt", {
                "sessionId": session_id, "prompt": [{"type": "text", "text": "A story?"}],
            })
            while not editor.texts("agent_message_chunk"):
                assert "id" not in await editor.read()
            assert editor.texts("agent_message_chunk") == "Once"
            await editor.send({"method": "session/cancel", "params": {"sessionId": session_id}})
            cancelled = schema.PromptResponse.model_validate(
                (await editor.answer(prompt_id))["result"]
            )
            assert cancelled.stop_reason == "cancelled"
    gate.set()

    # Another editor process loads the stored session: its history is replayed.
    with trio.fail_after(120):
        async with _editor(config, tmp_path) as editor:
            loaded = await editor.call("session/load", {
                "sessionId": session_id, "cwd": str(tmp_path), "mcpServers": [],
            })
            schema.LoadSessionResponse.model_validate(loaded)
            assert editor.texts("user_message_chunk") == "What time is it?A story?"
            assert editor.texts("agent_message_chunk") == "Checking.It is noon in UTC.Once"
            assert [u.status for u in editor.of("tool_call_update")] == ["completed"]
            editor.updates.clear()
            again = await editor.call("session/prompt", {
                "sessionId": session_id, "prompt": [{"type": "text", "text": "Still there?"}],
            })
            assert schema.PromptResponse.model_validate(again).stop_reason == "end_turn"
            assert editor.texts("agent_message_chunk") == "Still here."
    # The reloaded session carried its history to the model.
    contents = [m.get("content") for m in fake.requests[-1]["messages"]]
    assert "What time is it?" in contents and "Still there?" in contents


async def test_a_refused_permission_and_bad_requests(
    tmp_path: Path, fake: FakeOpenAI, config: Path
) -> None:
    fake.replies = [
        Reply(chunks=[], tool=("time_get_current_time", {"timezone": "UTC"})),
        Reply(chunks=["Fine."]),
    ]
    with trio.fail_after(120):
        async with _editor(config, tmp_path) as editor:
            unknown = await editor.answer(await editor.request("session/fly", {}))
            assert unknown["error"]["code"] == -32601
            bad = await editor.answer(await editor.request("session/new", {"cwd": 3}))
            assert bad["error"]["code"] == -32602
            assert "cwd" in bad["error"]["message"]
            missing = await editor.answer(await editor.request("session/load", {
                "sessionId": "nothing-here", "cwd": "/", "mcpServers": [],
            }))
            assert missing["error"]["message"] == "no stored session 'nothing-here'"
            session_id = (await editor.call("session/new", {"cwd": "/", "mcpServers": []}))[
                "sessionId"
            ]
            prompt_id = await editor.request("session/prompt", {
                "sessionId": session_id, "prompt": [{"type": "text", "text": "Time?"}],
            })
            while (message := await editor.read()).get("method") != "session/request_permission":
                pass
            await editor.send({"id": message["id"], "result": {
                "outcome": {"outcome": "selected", "optionId": "reject"},
            }})
            done = (await editor.answer(prompt_id))["result"]
            assert done["stopReason"] == "end_turn"
            (result,) = editor.of("tool_call_update")
            assert result.status == "failed"
            assert "the user rejected the call" in result.content[0].content.text


async def test_a_permission_left_unanswered_is_asked_again_when_the_session_is_loaded(
    tmp_path: Path, fake: FakeOpenAI, config: Path
) -> None:
    fake.replies = [
        Reply(chunks=["Let", " me", " look."], tool=("time_get_current_time", {"timezone": "UTC"})),
        Reply(chunks=["Done", " now."]),
    ]
    with trio.fail_after(120):
        async with _editor(config, tmp_path) as editor:
            session_id = (await editor.call("session/new", {"cwd": "/", "mcpServers": []}))[
                "sessionId"
            ]
            await editor.request("session/prompt", {
                "sessionId": session_id, "prompt": [{"type": "text", "text": "Time?"}],
            })
            while (await editor.read()).get("method") != "session/request_permission":
                pass
            # The editor quits without answering: the turn is suspended, the call stays parked.

    with trio.fail_after(120):
        async with _editor(config, tmp_path) as editor:
            load_id = await editor.request("session/load", {
                "sessionId": session_id, "cwd": "/", "mcpServers": [],
            })
            loaded = asked = None
            while loaded is None or asked is None:
                message = await editor.read()
                if message.get("id") == load_id:
                    loaded = message
                elif message.get("method") == "session/request_permission":
                    asked = message
            assert "error" not in loaded
            assert editor.texts("agent_message_chunk") == "Let me look."
            params = schema.RequestPermissionRequest.model_validate(asked["params"])
            assert params.tool_call.title == "time_get_current_time"
            editor.updates.clear()
            await editor.send({"id": asked["id"], "result": {
                "outcome": {"outcome": "selected", "optionId": "allow"},
            }})
            # The continued turn streams as a prompt's would.
            while editor.texts("agent_message_chunk") != "Done now.":
                assert "id" not in await editor.read()
            (result,) = editor.of("tool_call_update")
            assert result.status == "completed"
