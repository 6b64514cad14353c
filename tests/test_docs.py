"""Every Python block of the README and of ``docs/`` runs, and every TOML block loads.

How a block runs is decided by the block itself, or by an HTML comment on the line before it:

- a block that calls ``trio.run(`` is a program: it runs in a fresh interpreter, in a
  temporary directory, with ``OPENAI_BASE_URL`` pointing at a fake OpenAI-compatible server on
  loopback (``OPENAI_API_KEY`` set), so ``open_agent("openai:...")`` makes real HTTP calls;
- any other block is a fragment: it runs with top-level ``await`` inside a trio test, in a
  namespace holding ``agentloop``, ``trio``, ``events``, ``os``, a runtime ``rt`` (also ``ctx``)
  whose provider ``scripted`` answers "Hello.", and an ``agent`` on it, with the same
  environment and working directory;
- ``<!-- docs: continue -->`` runs the block after the one before it, as one piece;
- ``<!-- docs: run by tests/test_x.py -->``: that test file runs this block (it must exist and
  name the page); a block starting ``# example: NAME KIND`` is one of ``docs/testing.md``'s
  worked examples, run by ``tests/test_kit_plugins.py``.

A TOML block is a config file: ``agentloop.load_config`` must accept it as written.
"""

from __future__ import annotations

import ast
import contextlib
import http.server
import os
import re
import sys
import threading
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from fake_openai import FakeOpenAI, Reply, _handler

import agentloop
from agentloop import events
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(
    r"(?:<!-- docs: (?P<mode>[^>]*?) -->\n)?^```(?P<lang>python|toml)\n(?P<body>.*?)^```",
    re.DOTALL | re.MULTILINE,
)


@attrs.frozen
class Block:
    page: Path
    line: int
    lang: str
    mode: str
    body: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found: list[Block] = []
    for page in PAGES:
        text = page.read_text()
        previous: Block | None = None
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("body"))
            mode = (match["mode"] or "").strip()
            body = match["body"]
            if mode == "continue":
                assert previous is not None, f"{page}:{line}: nothing to continue"
                body = previous.body + "\n" + body
            block = Block(page, line, match["lang"], mode, body)
            if block.lang == "python":
                previous = block
            found.append(block)
    return found


BLOCKS = blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]
TOML = [b for b in BLOCKS if b.lang == "toml"]
# A block that another block continues is run as part of that one.
CONTINUED = {
    (b.page, b.body) for b in PYTHON for c in PYTHON
    if c.mode == "continue" and c.page == b.page and c.body.startswith(b.body + "\n")
}
RUN_HERE = [b for b in PYTHON if (b.page, b.body) not in CONTINUED]


# Programs whose output shows they did what the page says (a block containing the key must
# print the value).
PRINTS = {
    # The approval is answered inside the run block, so the approved call runs.
    "async def deploy(service": "completed Shipped.",
    # The child does not see the tool that spawned it, so it answers instead of recursing.
    "async def lead(ctx": "My helper says: Structured concurrency.",
    # open_agent("openai:...") reached the server named by OPENAI_BASE_URL.
    '"openai:gpt-4o-mini", instructions="Be brief."': "Hello from the fake model.",
    # The tree's budget stopped the helpers, and the lead's model is told so.
    '"scope": "tree", "max_tokens_per_turn": 3000': "BUDGET Error: the sub-agent was stopped",
}


def test_the_pages_have_blocks() -> None:
    for marker in PRINTS:
        assert any(marker in b.body for b in PYTHON), f"no block has {marker!r}"
    assert len(PYTHON) >= 10
    assert len(TOML) >= 2


@pytest.mark.parametrize("block", TOML, ids=lambda b: b.name)
def test_every_toml_block_loads(block: Block) -> None:
    agentloop.load_config(tomllib.loads(block.body))


@pytest.fixture
def env(fake: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-docs")
    monkeypatch.chdir(tmp_path)
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def hello() -> FunctionModel:
    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        yield TextDelta("Hello.")
        yield Finish("stop")

    return FunctionModel(fn)


async def run_fragment(block: Block) -> None:
    code = compile(
        block.body, block.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )
    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", hello())
        handle = await rt.agents.create(
            session_id="docs", agent_options=agentloop.AgentOptions(provider="scripted", model="m")
        )
        async with handle:
            namespace: dict[str, Any] = {
                "__name__": "docs_block", "agentloop": agentloop, "trio": trio,
                "events": events, "os": os, "rt": rt, "ctx": rt, "agent": handle.agent,
            }
            with trio.fail_after(60):
                result = eval(code, namespace)
                if result is not None:
                    await result


@pytest.mark.parametrize("block", RUN_HERE, ids=lambda b: b.name)
async def test_every_python_block_runs(block: Block, env: dict[str, str]) -> None:
    mode = block.mode
    if block.body.startswith("# example: ") and not mode:
        # docs/testing.md's worked examples (racy, property, fix), which that test runs in
        # threes: each property must fail on the racy version and pass on the fix.
        mode = "run by tests/test_kit_plugins.py"
    if mode.startswith("run by "):
        test_file = ROOT / mode.removeprefix("run by ")
        assert test_file.is_file(), f"{block.name}: {test_file} does not exist"
        assert block.page.name in test_file.read_text(), f"{test_file} does not run {block.name}"
        return
    assert block.mode in ("", "continue"), f"{block.name}: unknown mode {block.mode!r}"
    if "trio.run(" not in block.body:
        await run_fragment(block)
        return
    done = await trio.run_process(
        [sys.executable, "-c", block.body], env=env, capture_stdout=True, capture_stderr=True,
        check=False,
    )
    assert done.returncode == 0, f"{block.name} failed:\n{done.stderr.decode()}"
    for marker, expected in PRINTS.items():
        if marker in block.body:
            assert expected in done.stdout.decode(), f"{block.name} did not print {expected!r}"


@contextlib.contextmanager
def another_server() -> Iterator[FakeOpenAI]:
    state = FakeOpenAI()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_the_readme_fallback_config_moves_a_failed_call_to_the_next_route(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    (block,) = [b for b in TOML if b.page.name == "README.md" and "[fallback]" in b.body]
    raw = tomllib.loads(block.body)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-a")
    monkeypatch.setenv("DEEPSEEK_API_KEY", "sk-b")
    with another_server() as backup:
        # Only the endpoints change: the servers stand in for the two vendors.
        raw["providers"]["openai"]["base_url"] = fake.url
        raw["providers"]["deepseek"]["base_url"] = backup.url
        fake.replies.append(Reply(status=400, error="this model is not available"))
        async with agentloop.open_agent("openai:gpt-4o-mini", config=raw) as agent:
            with trio.fail_after(30):
                result = await agent.ask("hi")
    assert result.text == "Hello from the fake model."
    assert [r["model"] for r in fake.requests] == ["gpt-4o-mini"]
    assert [r["model"] for r in backup.requests] == ["deepseek-chat"]


def _reference_tables() -> dict[str, dict[str, str]]:
    """The config reference's tables: section marker -> key -> default column."""
    tables: dict[str, dict[str, str]] = {}
    current = ""
    for line in (ROOT / "docs" / "reference" / "config.md").read_text().splitlines():
        if line.startswith("#") or (line.startswith("`[") and line.endswith(":")):
            current = line.lstrip("# ").rstrip(":")
        elif line.startswith("| `") and current:
            cells = [c.strip() for c in line.strip("|").split("|")]
            tables.setdefault(current, {})[cells[0].strip("`")] = cells[2]
    return tables


def _default_text(value: object) -> str:
    if value is attrs.NOTHING:
        return "required"
    if isinstance(value, attrs.Factory):  # type: ignore[arg-type]
        value = value.factory()
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (tuple, list)) and not value:
        return "`[]`"
    if isinstance(value, dict) or (hasattr(value, "items") and not value):
        return "`{}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def test_the_config_reference_has_every_key_with_its_default() -> None:
    import agentloop_budget
    import agentloop_compact
    import agentloop_fallback
    import agentloop_fleet
    import agentloop_mcp
    import agentloop_retry
    import agentloop_subagent

    from agentloop import _settings
    from agentloop._prices import Price

    local = pytest.importorskip("agentloop_local")
    tables = _reference_tables()
    classes: dict[str, Any] = {
        "Top level": agentloop.Config,
        "`[persistence]`": agentloop.PersistenceConfig,
        "`[providers.NAME]`": agentloop.ProviderConfig,
        "`[[agents]]`": agentloop.AgentConfig,
        "`[retry]`": agentloop_retry.RetrySettings,
        "`[fallback]`": agentloop_fallback.FallbackPolicy,
        "`[budget]`": agentloop_budget.BudgetPolicy,
        "`[compact]`": agentloop_compact.CompactPolicy,
        "`[local]`": local._Options,
        "`[mcp]`": agentloop_mcp.Section,
        "`[[mcp.servers]]`": agentloop_mcp.ServerConfig,
        "`[fleet]`": agentloop_fleet.FleetConfig,
        "`[subagent]`": agentloop_subagent.SubagentConfig,
        "`[[subagent.profiles]]`": agentloop_subagent.Profile,
        '`[prices."PROVIDER:MODEL"]`': Price,
    }
    for marker, cls in classes.items():
        documented = tables.get(marker, {})
        for field in attrs.fields(cls):
            if field.name == "sections" or field.metadata.get("config") is False:
                continue
            assert field.name in documented, f"config.md: {marker} lacks {field.name}"
            assert documented[field.name].startswith(_default_text(field.default)), (
                f"{marker} {field.name}: documented default {documented[field.name]!r}, "
                f"the code's is {_default_text(field.default)}"
            )
    settings = tables["`[settings]`"]
    for key, (_, default) in _settings._SCHEMA.items():
        assert key in settings, f"docs/reference/config.md: [settings] lacks {key}"
        assert settings[key].startswith(_default_text(default)), key
