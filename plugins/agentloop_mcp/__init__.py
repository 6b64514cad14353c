"""MCP servers as agentloop tools (needs the ``mcp`` extra: ``pip install 'agentloop[mcp]'``).

Configure servers in TOML and load the plugin (``docs/mcp.md`` has the whole story)::

    plugins = ["mcp"]

    [[mcp.servers]]
    name = "git"
    command = "mcp-server-git"      # a stdio server
    args = ["--repository", "."]
    env = { GIT_PAGER = "cat" }     # optional
    cwd = "/srv/repo"               # optional

    [[mcp.servers]]
    name = "docs"
    url = "https://mcp.example.com/mcp"     # a streamable HTTP server
    headers_env = { Authorization = "Bearer ${DOCS_TOKEN}" }
    resources = true

(a table keyed by name, ``[mcp.servers.git]``, works too), or programmatically::

    from agentloop_mcp import ServerConfig, mcp

    async with agentloop.open_runtime(plugins=[mcp(servers=[
        ServerConfig(name="time", command="mcp-server-time"),
    ])]) as rt:
        ...

Each server runs as an actor inside the plugin's scope. Its tools are listed at start and
registered as ``"{server}.{tool}"``: ``git.git_status``. The plugin reports itself started only
after every server has registered its tools or failed, so agents created once the runtime is
open see them. A tool is ``"exclusive"`` unless the server marks it read-only
(``annotations.readOnlyHint``), then ``"parallel"``. ``resources = true`` adds the tools
``{server}_list_resources`` and ``{server}_read_resource``.

Results: text blocks are rendered as text, one per line, other blocks as a bracketed note
(``[image: image/png, 5120 bytes]``). Structured content replaces them, as compact JSON, only when
the text is empty or merely its serialization (what the spec asks servers to send for older
clients): both then say the same, and the compact form costs fewer tokens. Otherwise the text
wins, being what the server wrote for the model (server frameworks wrap a bare return value as
``{"result": ...}``, which reads worse than the value). ``isError`` gives ``is_error=True`` with
``error_code="MCP_ERROR"``, as does a protocol error (an unknown tool, for one); a call that
finds the server gone gives ``"MCP_UNAVAILABLE"``, and one not answered within
``tool_timeout`` gives ``"TIMEOUT"``; each message names the server.

A server that fails to start or to list its tools is reported: a log record on
``agentloop.mcp`` and the control event ``mcp/server-failed``
(:class:`agentloop.events.McpServerFailed`, whose error is a :class:`ServerError` carrying the
last lines of a stdio server's stderr); everything else keeps running. A server that goes away
later is restarted (stdio) or reconnected (HTTP) with doubling delays, ``max_restarts`` times in
a row; meanwhile its tools stay registered and answer ``MCP_UNAVAILABLE``, and when the plugin
gives up they are unregistered. Unloading the plugin (leaving ``open_runtime``) closes each
stdio server's stdin and, when it does not exit within the SDK's grace period, terminates its
process group. Each line a server writes to its stderr is logged at DEBUG on ``agentloop.mcp``.
Header values are never logged.

An invalid ``[mcp]`` table raises :class:`agentloop.ConfigError` naming the path and the value
(``mcp.servers[1].args: must be a list of strings, got '-v'``); see :class:`ServerConfig` for the
fields, and for the environment a server gets.

Tool names: many providers accept only names matching ``^[a-zA-Z0-9_-]{1,64}$`` (OpenAI and
Anthropic among them) and refuse a request that offers ``git.git_status``. With those providers
set ``separator = "_"`` (TOML ``[mcp] separator = "_"`` or ``mcp(servers, separator="_")``) and
keep server and tool names short enough for the 64-character limit.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from agentloop import Context, Plugin

from ._client import ServerError, start_servers
from ._config import DEFAULT_SEPARATOR, Section, ServerConfig

__all__ = ["ServerConfig", "ServerError", "mcp", "plugin"]


def mcp(servers: Sequence[ServerConfig], *, separator: str = DEFAULT_SEPARATOR) -> Plugin:
    """A plugin that runs ``servers`` and registers their tools as ``server{separator}tool``.

    Raises :class:`agentloop.ConfigError` at once for an entry that is not a
    :class:`ServerConfig`, for two servers with one name, or for an empty separator.
    """
    section = Section(servers=tuple(servers), separator=separator)

    async def mcp_servers(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await _serve(ctx, section, task_status)

    return mcp_servers


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form: runs the servers of the ``[mcp]`` table (see the module doc)."""
    await _serve(ctx, ctx.config.section("mcp", Section), task_status)


async def _serve(ctx: Context, section: Section, task_status: trio.TaskStatus[None]) -> None:
    async with trio.open_nursery() as nursery:
        await start_servers(nursery, ctx, section.server_configs(), section.separator)
        task_status.started()
