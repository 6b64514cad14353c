"""MCP servers over streamable HTTP, restarts and reconnections, resources, timeouts, and a
server run from its own virtualenv. The HTTP server is built with the ``mcp`` package's own
server API (``tests/mcp_http_server.py``) and runs in a child process on loopback."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
import venv
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

pytest.importorskip("mcp")
pytest.importorskip("uvicorn")

from agentloop_mcp import ServerConfig, mcp
from conftest import ready_child

from agentloop import Context, open_runtime
from agentloop.events import McpServerFailed

# Slow: real MCP servers, killed and restarted.
pytestmark = [pytest.mark.mcp, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
HTTP_SERVER = HERE / "mcp_http_server.py"
TOKEN = "tok-3f9a1c-never-shown"

CRASHING_STDIO_SERVER = textwrap.dedent(
    """
    import os
    import signal

    import anyio
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("crashy")


    @app.tool()
    def pid() -> str:
        \"\"\"This server's process id.\"\"\"
        return str(os.getpid())


    @app.tool()
    def crash() -> str:
        \"\"\"Kills this server in the middle of the call.\"\"\"
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"


    @app.tool()
    async def hang() -> str:
        \"\"\"Never answers.\"\"\"
        await anyio.sleep_forever()
        return "unreachable"


    app.run()
    """
)


class _Watch:
    """Records ``mcp/server-failed`` events and the plugin's "is back" log lines."""

    def __init__(self) -> None:
        self.failures: list[McpServerFailed] = []
        self.back = 0
        self._changed = trio.Event()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _failed(self, event: McpServerFailed) -> None:
        self.failures.append(event)
        self._poke()

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    @property
    def plugin(self) -> Callable[[Context], Coroutine[Any, Any, None]]:
        async def watch_mcp(ctx: Context) -> None:
            ctx.events.on(McpServerFailed, self._failed)

        return watch_mcp


@pytest.fixture
def watch() -> Iterator[_Watch]:
    watch = _Watch()

    class Back(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "is back" in record.getMessage():
                watch.back += 1
                watch._poke()

    handler = Back()
    logger = logging.getLogger("agentloop.mcp")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield watch
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@attrs.define
class HttpServer:
    tmp: Path
    port: int = 0
    proc: trio.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[trio.Process]:
        port_file = self.tmp / "port"
        argv = [sys.executable, str(HTTP_SERVER), str(port_file), "--token", TOKEN,
                "--port", str(self.port)]
        async with ready_child(argv, self.tmp / "http-server.log", within=30) as proc:
            self.port = int(port_file.read_text())
            self.proc = proc
            yield proc


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[HttpServer]:
    server = HttpServer(tmp_path)
    async with server.running():
        yield server


def _http_config(server: HttpServer, **fields: Any) -> ServerConfig:
    fields.setdefault("headers", {"Authorization": f"Bearer {TOKEN}"})
    return ServerConfig(name="web", url=server.url, **fields)


def _names(rt: Context) -> set[str]:
    return {tool.name for tool in rt.tools.list()}


async def _call(rt: Context, name: str, **arguments: Any) -> Any:
    tool = rt.tools.get(name)
    assert tool is not None, f"no tool {name!r} among {sorted(_names(rt))}"
    return await tool.run(**arguments)


# --- streamable HTTP ------------------------------------------------------------------------


async def test_an_http_server_with_a_token_from_the_environment_and_its_resources(
    http: HttpServer, watch: _Watch, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("AGENTLOOP_TEST_MCP_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    config = {
        "plugins": ["mcp"],
        "mcp": {"servers": [{
            "name": "web", "url": http.url, "resources": True,
            "headers_env": {"Authorization": "Bearer ${AGENTLOOP_TEST_MCP_TOKEN}"},
        }]},
    }
    with trio.fail_after(60):
        async with open_runtime(config, plugins=[watch.plugin]) as rt:
            assert _names(rt) == {"web.echo", "web.hang", "web.crash",
                                  "web_list_resources", "web_read_resource"}
            assert (await _call(rt, "web.echo", text="hi")).content == "echo: hi"
            listed = await _call(rt, "web_list_resources")
            assert "note://greeting  greeting (text/plain): A short note." in listed.content
            read = await _call(rt, "web_read_resource", uri="note://greeting")
            assert read.content == "hello from a resource"
            missing = await _call(rt, "web_read_resource", uri="note://nothing")
            assert missing.is_error and missing.error_code == "MCP_ERROR"
    assert watch.failures == []
    assert TOKEN not in caplog.text


async def test_a_refused_token_is_reported_once_without_its_value(
    http: HttpServer, watch: _Watch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "Bearer wrong-secret-value"
    server = _http_config(http, headers={"Authorization": wrong})
    with trio.fail_after(60):
        async with open_runtime(plugins=[watch.plugin, mcp([server])]) as rt:
            assert _names(rt) == set()
    (failure,) = watch.failures
    assert failure.server == "web" and not failure.restarting
    assert failure.message.startswith("MCP server 'web' failed to start: ")
    assert "401" in failure.message
    shown = caplog.text + failure.message + str(failure.error) + repr(server)
    assert "wrong-secret-value" not in shown


async def test_a_missing_environment_variable_is_named(watch: _Watch) -> None:
    server = ServerConfig(name="web", url="http://127.0.0.1:9/mcp",
                          headers_env={"X-Api-Key": "AGENTLOOP_TEST_UNSET_VARIABLE"})
    os.environ.pop("AGENTLOOP_TEST_UNSET_VARIABLE", None)
    with trio.fail_after(30):
        async with open_runtime(plugins=[watch.plugin, mcp([server])]):
            pass
    (failure,) = watch.failures
    assert "header 'X-Api-Key' needs the environment variable AGENTLOOP_TEST_UNSET_VARIABLE" in (
        failure.message
    )


async def test_an_http_server_killed_mid_call_is_reconnected_when_it_is_back(
    http: HttpServer, watch: _Watch
) -> None:
    server = _http_config(http, restart_delay=0.05, max_restarts=1000)
    with trio.fail_after(90):
        async with open_runtime(plugins=[watch.plugin, mcp([server])]) as rt:
            crashed = await _call(rt, "web.crash")
            assert crashed.is_error and crashed.error_code == "MCP_UNAVAILABLE"
            assert "MCP server 'web'" in crashed.content
            await watch.until(lambda: bool(watch.failures))
            assert watch.failures[0].restarting
            # Meanwhile its tools stay offered and answer an error that names the server.
            meanwhile = await _call(rt, "web.echo", text="anyone?")
            assert meanwhile.error_code == "MCP_UNAVAILABLE"
            assert "MCP server 'web'" in meanwhile.content
            async with http.running():  # the same port again
                await watch.until(lambda: watch.back >= 1)
                assert (await _call(rt, "web.echo", text="again")).content == "echo: again"


async def test_an_http_tool_that_never_answers_times_out_naming_the_server(
    http: HttpServer,
) -> None:
    server = _http_config(http, tool_timeout=0.5)
    with trio.fail_after(60):
        async with open_runtime(plugins=[mcp([server])]) as rt:
            result = await _call(rt, "web.hang")
            assert (result.is_error, result.error_code) == (True, "TIMEOUT")
            assert result.content == "Error: MCP server 'web' did not answer hang within 0.5 s"
            # The connection is still good.
            assert (await _call(rt, "web.echo", text="x")).content == "echo: x"


# --- stdio restarts -------------------------------------------------------------------------


@pytest.fixture
def crashy(tmp_path: Path) -> Path:
    script = tmp_path / "crashy.py"
    script.write_text(CRASHING_STDIO_SERVER)
    return script


async def test_a_stdio_server_killed_mid_call_is_restarted(crashy: Path, watch: _Watch) -> None:
    server = ServerConfig(name="crashy", command=sys.executable, args=[str(crashy)],
                          restart_delay=0.05)
    with trio.fail_after(90):
        async with open_runtime(plugins=[watch.plugin, mcp([server])]) as rt:
            first = (await _call(rt, "crashy.pid")).content
            crashed = await _call(rt, "crashy.crash")
            assert crashed.is_error and crashed.error_code == "MCP_UNAVAILABLE"
            assert "MCP server 'crashy'" in crashed.content
            await watch.until(lambda: watch.back >= 1)
            (failure,) = watch.failures
            assert failure.restarting
            assert failure.message == (
                "MCP server 'crashy' stopped: it closed the connection; trying again"
            )
            second = (await _call(rt, "crashy.pid")).content
            assert second.isdigit() and second != first


async def test_a_stdio_server_that_stays_down_answers_errors_then_gives_up(
    crashy: Path, watch: _Watch, tmp_path: Path
) -> None:
    # The script is gone after the first start, so every restart fails.
    server = ServerConfig(name="crashy", command=sys.executable, args=[str(crashy)],
                          restart_delay=0.05, max_restarts=2)
    with trio.fail_after(60):
        async with open_runtime(plugins=[watch.plugin, mcp([server])]) as rt:
            await trio.Path(crashy).unlink()
            await _call(rt, "crashy.crash")
            meanwhile = await _call(rt, "crashy.pid")
            assert meanwhile.error_code == "MCP_UNAVAILABLE"
            assert meanwhile.content == (
                "Error: MCP server 'crashy' is restarting; try again shortly"
            )
            await watch.until(lambda: any(not f.restarting for f in watch.failures))
            assert [f.restarting for f in watch.failures] == [True, True, False]
            assert "could not be restarted" in watch.failures[-1].message
            assert _names(rt) == set()


async def test_a_stdio_tool_that_never_answers_times_out(crashy: Path) -> None:
    server = ServerConfig(name="crashy", command=sys.executable, args=[str(crashy)],
                          tool_timeout=0.5)
    with trio.fail_after(60):
        async with open_runtime(plugins=[mcp([server])]) as rt:
            result = await _call(rt, "crashy.hang")
            assert result.error_code == "TIMEOUT"
            assert result.content == "Error: MCP server 'crashy' did not answer hang within 0.5 s"
            assert (await _call(rt, "crashy.pid")).content.isdigit()


# --- a server that pins another ``mcp`` -----------------------------------------------------


@pytest.fixture(scope="session")
def calculator_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv of its own for ``mcp-server-calculator``, which pins ``mcp<2``."""
    root = tmp_path_factory.mktemp("calculator-venv")
    venv.create(root, with_pip=True)
    binary = root / "bin" / "mcp-server-calculator"
    done = subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "mcp-server-calculator"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"mcp-server-calculator could not be installed: {done.stderr[-500:]}")
    return binary


@pytest.mark.slow
async def test_a_server_pinned_to_mcp_1_runs_from_its_own_virtualenv(
    calculator_venv: Path,
) -> None:
    config = {"plugins": ["mcp"], "mcp": {"servers": [
        {"name": "calc", "command": str(calculator_venv)},
    ]}}
    with trio.fail_after(60):
        async with open_runtime(config) as rt:
            result = await _call(rt, "calc.calculate", expression="6 * 7")
    assert not result.is_error
    assert "42" in result.content


async def test_a_crashing_server_warns_on_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "agentloop.toml"
    config.write_text(textwrap.dedent(f"""
        plugins = ["mcp"]

        [[mcp.servers]]
        name = "broken"
        command = "{sys.executable}"
        args = ["-c", "import sys; sys.exit('no database at ./missing.db')"]

        [providers.nowhere]
        kind = "openai"
        base_url = "http://127.0.0.1:9/v1"
        model = "m"
    """))
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "agentloop", "run", "--config", str(config),
             "--no-persist", "-q", "hello"],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    warnings = [line for line in done.stderr.decode().splitlines() if "warning" in line]
    assert warnings == [
        ("agentloop: warning: MCP server 'broken' failed to start: it closed the connection "
        "(last line of its stderr: no database at ./missing.db)")
    ]
