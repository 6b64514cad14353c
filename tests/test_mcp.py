"""MCP servers as tools, against the real ``mcp-server-time`` and ``mcp-server-git``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("mcp")
pytest.importorskip("mcp_server_time")
pytest.importorskip("mcp_server_git")

import mcp.types as mt
from agentloop_mcp import ServerConfig, ServerError, mcp
from agentloop_mcp._client import render_result
from agentloop_mcp._config import Section

from agentloop import AgentOptions, ConfigError, Context, open_runtime
from agentloop._config import load_config
from agentloop.events import McpServerFailed
from agentloop.testing import ScriptedModel, reply

# Slow: real MCP servers from PyPI.
pytestmark = [pytest.mark.mcp, pytest.mark.slow]

TIME = ServerConfig(name="time", command=sys.executable, args=["-m", "mcp_server_time"])
HAS_PROC = os.path.isdir("/proc/self")

FAKE_SERVER = textwrap.dedent(
    """
    import os

    from mcp.server.mcpserver import MCPServer

    app = MCPServer("fake")


    @app.tool()
    def where() -> str:
        \"\"\"Where the server runs, and what its environment says.\"\"\"
        return f"{os.getcwd()}|{os.environ.get('AGENTLOOP_MCP_TEST')}"


    @app.tool()
    def point(x: int, y: int) -> dict[str, int]:
        \"\"\"A point.\"\"\"
        return {"x": x, "y": y}


    app.run()
    """
)


class _Failures:
    """Collects ``mcp/server-failed`` events; load it before the plugins it watches."""

    def __init__(self) -> None:
        self.seen: list[McpServerFailed] = []
        self._changed = trio.Event()

    def _record(self, event: McpServerFailed) -> None:
        self.seen.append(event)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.seen) < count:
            await self._changed.wait()

    @property
    def plugin(self) -> Callable[[Context], Coroutine[Any, Any, None]]:
        async def watch_failures(ctx: Context) -> None:
            ctx.events.on(McpServerFailed, self._record)

        return watch_failures


def _children() -> set[int]:
    """Live (not zombie) child processes of this process, from /proc."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name is parenthesized and may hold spaces: split after it.
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == me and state != "Z":
            found.add(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _names(rt: Context) -> set[str]:
    return {tool.name for tool in rt.tools.list()}


async def test_configured_servers_register_prefixed_tools() -> None:
    config = {
        "plugins": ["mcp"],
        "mcp": {"servers": [{"name": "time", "command": sys.executable,
                             "args": ["-m", "mcp_server_time"]}]},
    }
    with trio.fail_after(60):
        async with open_runtime(config) as rt:
            assert {"time.get_current_time", "time.convert_time"} <= _names(rt)
            tool = rt.tools.get("time.get_current_time")
            assert tool is not None
            assert tool.description
            assert tool.parameters["required"] == ("timezone",)
            # mcp-server-time marks its tools read-only
            assert tool.concurrency == "parallel"


async def test_agent_calls_mcp_tools() -> None:
    model = ScriptedModel([
        reply(tool_calls=[
            ("time.get_current_time", {"timezone": "UTC"}, "c1"),
            ("time.get_current_time", {"timezone": "Nowhere/Atlantis"}, "c2"),
        ]),
        reply("done"),
    ])
    with trio.fail_after(60):
        async with open_runtime(plugins=[mcp([TIME])]) as rt:
            rt.llm.register("scripted", model)
            handle = await rt.agents.create(
                session_id="s1", agent_options=AgentOptions(provider="scripted", model="m")
            )
            async with handle:
                handle.agent.followup("what time is it?")
                await handle.agent.wait_idle()
                results = {
                    e.data["call_id"]: e.data for e in handle.agent.session.events
                    if e.type == "tool/result"
                }
    assert "time.get_current_time" in {spec.name for spec in model.requests[0].tools}
    good, bad = results["c1"], results["c2"]
    assert good["is_error"] is False
    assert str(datetime.now(UTC).year) in good["content"]
    assert '"timezone":"UTC"' in good["content"]  # structured content, compact
    assert bad["is_error"] is True
    assert bad["error_code"] == "MCP_ERROR"
    assert "Nowhere/Atlantis" in bad["content"]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with one commit and one untracked file, ``b.txt``."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=n"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    (repo / "a.txt").write_text("hello\n")
    subprocess.run([*git, "add", "a.txt"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], cwd=repo, check=True)
    (repo / "b.txt").write_text("new\n")
    return repo


async def test_git_server_on_a_temporary_repository(repo: Path) -> None:
    server = ServerConfig(
        name="git", command=sys.executable, args=["-m", "mcp_server_git", "--repository", "."],
        cwd=repo,
    )
    with trio.fail_after(60):
        async with open_runtime(plugins=[mcp([server])]) as rt:
            status = rt.tools.get("git.git_status")
            commit = rt.tools.get("git.git_commit")
            assert status is not None and commit is not None
            assert status.concurrency == "parallel"
            assert commit.concurrency == "exclusive"
            result = await status.run(repo_path=str(repo))
    assert result.is_error is False
    assert "b.txt" in result.content


async def test_env_cwd_and_rendering_with_a_small_server(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(FAKE_SERVER)
    workdir = tmp_path / "work"
    workdir.mkdir()
    server = ServerConfig(
        name="fake", command=sys.executable, args=[str(script)],
        env={"AGENTLOOP_MCP_TEST": "from-env"}, cwd=str(workdir),
    )
    with trio.fail_after(60):
        async with open_runtime(plugins=[mcp([server], separator="__")]) as rt:
            assert _names(rt) == {"fake__where", "fake__point"}
            where = rt.tools.get("fake__where")
            point = rt.tools.get("fake__point")
            assert where is not None and point is not None
            assert where.concurrency == "exclusive"
            # A bare string result: the server also sends {"result": ...}; the text wins.
            assert (await where.run()).content == f"{workdir}|from-env"
            assert (await point.run(x=1, y=2)).content == '{"x":1,"y":2}'
            wrong = await point.run(x="a", y=2)
            assert wrong.is_error and wrong.error_code == "MCP_ERROR"


async def test_a_server_that_cannot_start_is_reported_and_others_keep_running() -> None:
    failures = _Failures()
    missing = ServerConfig(name="missing", command="/nonexistent/agentloop-mcp-server")
    crashing = ServerConfig(
        name="crashing", command=sys.executable,
        args=["-c", "import sys; sys.stderr.write('boom: bad setup\\n'); sys.exit(3)"],
    )
    with trio.fail_after(60):
        async with open_runtime(plugins=[failures.plugin, mcp([missing, TIME, crashing])]) as rt:
            assert _names(rt) == {"time.get_current_time", "time.convert_time"}
            by_server = {f.server: f.error for f in failures.seen}
            assert set(by_server) == {"missing", "crashing"}
            assert not any(f.restarting for f in failures.seen)
            assert "MCP server 'missing' failed to start" in failures.seen[0].message
            error = by_server["missing"]
            assert isinstance(error, ServerError)
            assert error.server == "missing"
            assert "failed to start" in str(error)
            assert "FileNotFoundError" in str(error)
            crashed = by_server["crashing"]
            assert isinstance(crashed, ServerError)
            assert "boom: bad setup" in crashed.stderr
            tool = rt.tools.get("time.get_current_time")
            assert tool is not None
            assert not (await tool.run(timezone="UTC")).is_error


async def test_a_server_that_never_answers_times_out() -> None:
    failures = _Failures()
    # Reads its stdin to the end without answering; exits once the client closes it.
    silent = ServerConfig(
        name="silent", command=sys.executable, args=["-c", "import sys; sys.stdin.read()"],
        startup_timeout=0.5,
    )
    with trio.fail_after(60):
        async with open_runtime(plugins=[failures.plugin, mcp([silent])]) as rt:
            assert _names(rt) == set()
            assert [f.server for f in failures.seen] == ["silent"]
            assert "no answer within 0.5 s" in str(failures.seen[0].error)


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
async def test_a_server_that_dies_and_cannot_come_back_is_reported_and_its_tools_go() -> None:
    failures = _Failures()
    before = _children()
    no_restart = ServerConfig(name="time", command=sys.executable,
                              args=["-m", "mcp_server_time"], max_restarts=0)
    with trio.fail_after(60):
        async with open_runtime(plugins=[failures.plugin, mcp([no_restart])]) as rt:
            (pid,) = _children() - before
            tool = rt.tools.get("time.get_current_time")
            assert tool is not None
            os.kill(pid, signal.SIGKILL)
            await failures.wait_for(1)
            assert _names(rt) == set()
            assert [(f.server, f.restarting) for f in failures.seen] == [("time", False)]
            assert "MCP server 'time' stopped" in str(failures.seen[0].error)
            late = await tool.run(timezone="UTC")
            assert late.is_error and late.error_code == "MCP_UNAVAILABLE"
            assert "'time'" in late.content
            # The runtime itself is unaffected.
            rt.llm.register("scripted", ScriptedModel(["still here"]))
            handle = await rt.agents.create(
                session_id="s2", agent_options=AgentOptions(provider="scripted", model="m")
            )
            async with handle:
                handle.agent.followup("hello")
                await handle.agent.wait_idle()
    assert _gone(pid)


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
async def test_unloading_terminates_the_server_processes(tmp_path: Path) -> None:
    before = _children()
    servers = [TIME, ServerConfig(name="time2", command=sys.executable,
                                  args=["-m", "mcp_server_time"])]
    with trio.fail_after(60):
        async with open_runtime(plugins=[mcp(servers)]) as rt:
            pids = _children() - before
            assert len(pids) == 2
            assert "time2.convert_time" in _names(rt)
    assert all(_gone(pid) for pid in pids)
    assert not (_children() & pids)


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
async def test_cancelling_while_servers_start_leaves_no_process() -> None:
    before = _children()
    spawned: set[int] = set()
    registered: list[bool] = []

    # A child process is not an event trio can wait on: watch /proc for it, and cancel the
    # startup as soon as it exists (a fixed deadline lost the race on a loaded machine).
    async def spy(startup: trio.CancelScope) -> None:
        while not spawned:
            spawned.update(_children() - before)
            await trio.sleep(0.005)
        startup.cancel()

    async def watch_tools(ctx: Context) -> None:
        registered.append(bool(_names(ctx)))

    with trio.fail_after(60):
        with trio.CancelScope() as startup:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(spy, startup)
                async with open_runtime(plugins=[mcp([TIME]), watch_tools]):
                    await trio.sleep_forever()
    assert startup.cancelled_caught
    assert spawned
    # The runtime never finished opening: the server was cancelled while it started.
    assert registered == []
    assert all(_gone(pid) for pid in spawned)


# --- configuration --------------------------------------------------------------------------


def parse_section(table: dict[str, Any]) -> tuple[tuple[ServerConfig, ...], str]:
    section = load_config({"mcp": table}).section("mcp", Section)
    return section.server_configs(), section.separator


def _config_error(section: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_section(section)
    return str(info.value)


def test_config_forms_and_defaults() -> None:
    servers, separator = parse_section({})
    assert servers == () and separator == "."
    assert load_config(None).section("mcp", Section) == Section()
    array = {"servers": ({"name": "git", "command": "mcp-server-git", "args": ("-v",),
                          "env": {"A": "1"}, "cwd": "/tmp", "tool_timeout": 5},)}
    (git,), _ = parse_section(array)
    assert git == ServerConfig(name="git", command="mcp-server-git", args=["-v"],
                               env={"A": "1"}, cwd="/tmp", tool_timeout=5)
    assert git.startup_timeout == 30.0
    table = {"servers": {"fs": {"command": "mcp-fs"}}, "separator": "_"}
    (fs,), separator = parse_section(table)
    assert fs.name == "fs" and separator == "_"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"servers": [{"name": "a", "command": "x"}, {"name": "b", "command": "y", "args": "-v"}]},
         "mcp.servers[1].args: must be a list of strings, got '-v'"),
        ({"servers": [{"name": "a", "command": "x", "args": ["ok", 3]}]},
         "mcp.servers[0].args: must be a list of strings, got ('ok', 3)"),
        ({"servers": [{"name": "a b", "command": "x"}]},
         "mcp.servers[0].name: must be letters, digits, '_' or '-', got 'a b'"),
        ({"servers": [{"command": "x"}]}, "mcp.servers[0].name: is required"),
        ({"servers": [{"name": "a"}]},
         ("mcp.servers[0].command: give either command (a stdio server) or url "
         "(streamable HTTP), got neither")),
        ({"servers": [{"name": "a", "command": "x", "url": "http://127.0.0.1/mcp"}]},
         "got both"),
        ({"servers": [{"name": "a", "url": "ftp://example/mcp"}]},
         "mcp.servers[0].url: must be an http:// or https:// URL, got 'ftp://example/mcp'"),
        ({"servers": [{"name": "a", "url": "http://h/mcp", "args": ["x"]}]},
         "mcp.servers[0].args: only for a stdio server (command), not a url"),
        ({"servers": [{"name": "a", "command": "x", "headers": {"A": "b"}}]},
         "mcp.servers[0].headers: only for an HTTP server (url), not a command"),
        ({"servers": [{"name": "a", "command": "x", "resources": "yes"}]},
         "mcp.servers[0].resources: expected true or false, got 'yes'"),
        ({"servers": [{"name": "a", "command": "x", "max_restarts": -1}]},
         "mcp.servers[0].max_restarts: must be a non-negative integer, got -1"),
        ({"servers": [{"name": "a", "command": ""}]},
         "mcp.servers[0].command: must be a non-empty string, got ''"),
        ({"servers": [{"name": "a", "command": "x", "env": {"K": 1}}]},
         "mcp.servers[0].env: must be a table of strings"),
        ({"servers": [{"name": "a", "command": "x", "startup_timeout": 0}]},
         "mcp.servers[0].startup_timeout: must be a positive number, got 0"),
        ({"servers": [{"name": "a", "command": "x", "tool_timeout": True}]},
         "mcp.servers[0].tool_timeout: expected a number, got True"),
        ({"servers": [{"name": "a", "command": "x", "tool_timeout": -1}]},
         "mcp.servers[0].tool_timeout: must be a positive number, got -1"),
        ({"servers": [{"name": "a", "command": "x", "comand": "y"}]},
         "mcp.servers[0].comand: unknown key; did you mean 'command'?"),
        ({"servers": [{"name": "a", "command": "x"}, {"name": "a", "command": "y"}]},
         "mcp.servers[1].name: duplicate server name 'a'"),
        ({"servers": {"fs": {"name": "other", "command": "x"}}},
         "mcp.servers.fs.name: differs from the table's key 'fs', got 'other'"),
        ({"servers": {"fs": {"command": 3}}},
         "mcp.servers.fs.command: expected a string, got 3"),
        ({"servers": {"fs": {"command": ""}}},
         "mcp.servers.fs.command: must be a non-empty string, got ''"),
        ({"servers": {"a b": {"command": "x"}}},
         "mcp.servers.a b: its key is its name, which must be letters, digits, '_' or '-'"),
        ({"servers": ["x"]}, "mcp.servers[0]: expected a table, got 'x'"),
        ({"servers": "x"}, "mcp.servers: expected an array or a table, got 'x'"),
        ({"separator": ""}, "mcp.separator: must be a non-empty string, got ''"),
        ({"server": []}, "mcp.server: unknown key; did you mean 'servers'?"),
    ],
)
def test_config_errors_name_the_path_and_value(section: dict[str, Any], message: str) -> None:
    assert message in _config_error(section)


def test_config_errors_mask_secrets() -> None:
    message = _config_error(
        {"servers": [{"name": "a", "command": "x", "env": {"API_TOKEN": 12345, "B": "2"}}]}
    )
    assert "mcp.servers[0].env: must be a table of strings, got FrozenDict({'API_TOKEN': ***" in (
        message
    )
    assert "12345" not in message


def test_programmatic_config_errors() -> None:
    with pytest.raises(ConfigError, match="args: must be a list of strings, got 3"):
        ServerConfig(name="a", command="x", args=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"servers\[1\].name: duplicate server name 'a'"):
        mcp([ServerConfig(name="a", command="x"), ServerConfig(name="a", command="y")])
    with pytest.raises(ConfigError, match=r"servers\[0\]: must be an agentloop_mcp.ServerConfig"):
        mcp([{"name": "a", "command": "x"}])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="separator: must be a non-empty string"):
        mcp([], separator="")


async def test_invalid_config_stops_open_runtime() -> None:
    config = {"plugins": ["mcp"], "mcp": {"servers": [{"name": "a", "command": "x",
                                                       "args": "-v"}]}}
    with trio.fail_after(60), pytest.raises(ConfigError, match=r"mcp\.servers\[0\]\.args"):
        async with open_runtime(config):
            pass


# --- result rendering -----------------------------------------------------------------------


def _result(*blocks: Any, structured: Any = None, is_error: bool = False) -> mt.CallToolResult:
    return mt.CallToolResult(content=list(blocks), structured_content=structured,
                             is_error=is_error)


def test_rendering_of_content_blocks() -> None:
    text = mt.TextContent(text="first")
    image = mt.ImageContent(data="aGVsbG8h", mime_type="image/png")
    link = mt.ResourceLink(uri="file:///a.txt", name="a.txt")
    embedded = mt.EmbeddedResource(
        resource=mt.TextResourceContents(uri="file:///b.txt", text="inside")
    )
    rendered = render_result(_result(text, image, link, embedded))
    assert rendered.content == (
        "first\n[image: image/png, 6 bytes]\n[resource link: file:///a.txt (a.txt)]\n"
        "[resource: file:///b.txt]\ninside"
    )
    assert rendered.is_error is False


def test_structured_content_replaces_only_its_own_serialization() -> None:
    data = {"a": [1, 2], "b": "é"}
    serialized = mt.TextContent(text='{\n  "a": [1, 2],\n  "b": "é"\n}')
    assert render_result(_result(serialized, structured=data)).content == '{"a":[1,2],"b":"é"}'
    assert render_result(_result(structured=data)).content == '{"a":[1,2],"b":"é"}'
    summary = mt.TextContent(text="two items")
    assert render_result(_result(summary, structured=data)).content == "two items"


def test_error_results() -> None:
    failed = render_result(_result(mt.TextContent(text="disk full"), is_error=True))
    assert (failed.content, failed.is_error, failed.error_code) == (
        "Error: disk full", True, "MCP_ERROR"
    )
    silent = render_result(_result(is_error=True))
    assert silent.content == "Error: the tool reported an error"
