"""The protocol pages (docs/mcp.md, docs/mcp-serve.md, docs/acp.md) say what runs: every TOML
block loads as a config, every JSON block parses, every Python block runs, and the recorded
ACP transcript is valid ACP."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from agentloop import load_config

# Slow: the MCP and ACP pages' programs in subprocesses.
pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = ["mcp.md", "mcp-serve.md", "acp.md"]


def blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


@pytest.mark.parametrize("page", PAGES)
def test_every_toml_block_is_a_valid_config(page: str) -> None:
    found = blocks(page, "toml")
    assert found, f"{page} has no config"
    for block in found:
        data = tomllib.loads(block)
        config = load_config(data)
        if "mcp" in data:
            from agentloop_mcp._config import Section

            assert config.section("mcp", Section).server_configs()
        if "acp" in data:
            assert set(data["acp"]) == {"ask"}
            assert all(isinstance(p, str) for p in data["acp"]["ask"])


@pytest.mark.parametrize("page", PAGES)
def test_every_json_block_parses(page: str) -> None:
    for block in blocks(page, "json"):
        json.loads(block)


def _run(code: str, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "docs_example"})
    return out.getvalue()


def test_the_mcp_page_runs() -> None:
    pytest.importorskip("mcp")
    pytest.importorskip("mcp_server_time")
    (code,) = blocks("mcp.md", "python")
    assert '"timezone":"UTC"' in _run(code, "docs/mcp.md")


def test_the_mcp_serve_page_runs(
    tmp_path: Path, fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mcp")
    pytest.importorskip("mcp_server_time")
    from fake_openai import Reply

    (config,) = blocks("mcp-serve.md", "toml")
    # The page's config as written, its model server swapped for the suite's fake one.
    (tmp_path / "agentloop.toml").write_text(
        config.replace("http://127.0.0.1:8080/v1", fake.url)
    )
    fake.replies = [Reply(chunks=["Yes", ", a typo."])]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    (code,) = blocks("mcp-serve.md", "python")
    out = _run(code, "docs/mcp-serve.md")
    assert out.splitlines() == ["['ask_reviewer', 'ask_writer']", "Yes, a typo.", "Yes, a typo."]
    assert fake.requests[0]["model"] == "qwen2.5-7b-instruct"


def test_the_acp_transcript_is_valid_acp() -> None:
    schema = pytest.importorskip("acp.schema")
    (transcript,) = [b for b in blocks("acp.md", "text") if b.startswith("-> ")]
    kinds = []
    for line in transcript.splitlines():
        message = json.loads(line[3:])
        method = message.get("method")
        if method == "session/update":
            kinds.append(
                schema.SessionNotification.model_validate(message["params"]).update.session_update
            )
        elif method == "session/request_permission":
            schema.RequestPermissionRequest.model_validate(message["params"])
        elif method == "session/prompt":
            schema.PromptRequest.model_validate(message["params"])
    assert kinds[:3] == ["agent_thought_chunk", "agent_message_chunk", "tool_call"]
    assert "tool_call_update" in kinds
    assert json.loads(transcript.splitlines()[-1][3:])["result"] == {"stopReason": "end_turn"}
