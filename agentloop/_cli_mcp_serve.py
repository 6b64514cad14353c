"""``agentloop mcp-serve``: the configured agents as an MCP server over stdio (needs the
``mcp`` extra).

Each agent is one tool, ``ask(prompt: str) -> str`` (``ask_{id}`` when several agents are
served), and each call is one turn of that agent's session: calls to one agent queue as
follow-ups, calls to different agents run side by side. The answer streams as MCP progress
notifications (one per text delta) when the client asks for progress; a client that cancels
its request cancels the turn. A call that would need approval is denied, as in ``run``: an MCP
client has no way to answer it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Awaitable, Callable
from typing import TextIO

from agentloop import Agent, TurnFailed, __version__

from ._cli import EXIT_OK, EXIT_USAGE, PROG, CliError, Plan, cli_runtime, open_cli_agent
from ._cli_agents import offered_agents

__all__ = ["mcp_serve", "tool_names"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def tool_names(ids: list[str]) -> list[str]:
    """``ask`` for one agent; ``ask_{id}`` for each of several."""
    if len(ids) == 1:
        return ["ask"]
    return [f"ask_{_UNSAFE.sub('_', agent_id)}" for agent_id in ids]


def _ask_tool(agent: Agent, label: str) -> Callable[..., Awaitable[str]]:
    from mcp.server.mcpserver import Context as McpContext

    async def ask(prompt: str, ctx: McpContext) -> str:
        """Ask the agent; the answer is its final text for this turn."""
        async with agent.run(prompt) as run:
            streamed = 0
            async for event in run.events():
                if event.type == "tool/approval-requested":
                    agent.deny(
                        event.data["call_id"],
                        f"{PROG} mcp-serve cannot ask for approval; the call is refused",
                    )
                elif (
                    event.type == "assistant/chunk"
                    and event.data.get("kind") == "text"
                    and event.data.get("delta")
                ):
                    streamed += len(event.data["delta"])
                    await ctx.report_progress(streamed, message=event.data["delta"])
            try:
                result = await run.result()
            except TurnFailed as exc:
                raise CliError(f"the turn failed: {exc}", 1) from None
        if result.reason != "completed":
            raise CliError(f"the turn ended {result.reason}", 1)
        return result.text

    ask.__doc__ = f"Ask the agent {label!r}; each call is one turn of its session."
    # The SDK resolves the annotations by name: the context parameter must be found as such.
    ask.__annotations__["ctx"] = McpContext
    return ask


async def mcp_serve(args: argparse.Namespace, plan: Plan, out: TextIO, err: TextIO) -> int:
    try:
        from mcp.server.mcpserver import MCPServer
    except ImportError:
        raise CliError(
            f"{PROG} mcp-serve needs the mcp extra: pip install 'agentloop[mcp]'", EXIT_USAGE
        ) from None
    offered = offered_agents(args, plan)
    names = tool_names([a.id for a in offered])
    async with cli_runtime(plan, os.environ, err) as rt, contextlib.AsyncExitStack() as stack:
        server = MCPServer(
            "agentloop",
            version=__version__,
            instructions="Each tool asks one agentloop agent; a call is one turn of its session.",
            log_level="WARNING",
        )
        for agent_cfg, name in zip(offered, names, strict=True):
            session_id = agent_cfg.session_id or agent_cfg.fresh_session_id()
            handle = await open_cli_agent(rt, plan, session_id, agent_cfg.options, "mcp-serve")
            await stack.enter_async_context(handle)
            server.add_tool(
                _ask_tool(handle.agent, agent_cfg.id),
                name=name,
                description=f"Ask the agent {agent_cfg.id!r} "
                f"({agent_cfg.options.provider}/{agent_cfg.options.model}); "
                "each call is one turn of its session, and the answer is its reply.",
            )
            if not plan.quiet:
                err.write(f"{PROG}: mcp-serve: tool {name} -> agent {agent_cfg.id} "
                          f"({agent_cfg.options.provider}/{agent_cfg.options.model}), "
                          f"session {handle.agent.id}\n")
                err.flush()
        await server.run_stdio_async()
    return EXIT_OK
