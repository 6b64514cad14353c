"""Adversarial input, round two: each bad input is refused with an error naming what is
wrong, or handled correctly; nothing accepted is lost (one regression test per defect)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from agentloop_subagent import Profile, subagents

import agentloop
from agentloop import AgentOptions, Context
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

OPTIONS = AgentOptions(provider="fn", model="m")
Part = TextDelta | ToolCallDelta | Finish


def depth_of(rt: Context, request: LLMRequest) -> int:
    session = rt.sessions.get(request.session_id)
    assert session is not None
    return int(session.meta.get("depth", 0))


# --- High: a sub-agent sandbox holds down the whole tree ----------------------------------


@pytest.mark.parametrize("grandchild_profile", [None, "wide"])
async def test_a_profile_allow_list_reaches_the_childs_own_sub_agents(
    grandchild_profile: str | None,
) -> None:
    profiles = [Profile("limited", tools=("subagent", "safe")),
                Profile("wide", tools=("subagent", "safe", "danger"))]
    ran: list[str] = []
    offered: dict[int, list[str]] = {}
    async with agentloop.open_runtime(plugins=[subagents(profiles=profiles)]) as rt:

        @rt.tools.tool()
        async def safe() -> str:
            """Harmless."""
            ran.append("safe")
            return "safe ran"

        @rt.tools.tool()
        async def danger() -> str:
            """Must never run below a sandbox that leaves it out."""
            ran.append("danger")
            return "danger ran"

        async def fn(request: LLMRequest) -> AsyncIterator[Part]:
            depth = depth_of(rt, request)
            last = request.messages[-1]
            offered.setdefault(depth, [t.name for t in request.tools])
            if last.role == "user":
                if depth == 0:
                    call = ("subagent", {"task": "go", "agent": "limited"})
                elif depth == 1:
                    args: dict[str, Any] = {"task": "go deeper"}
                    if grandchild_profile is not None:
                        args["agent"] = grandchild_profile
                    call = ("subagent", args)
                else:
                    call = ("danger", {})
                yield ToolCallDelta(0, id=f"c{depth}", name=call[0],
                                    arguments=json.dumps(call[1]))
                yield Finish("tool_calls")
                return
            yield TextDelta(last.text)
            yield Finish("stop")

        rt.llm.register("fn", FunctionModel(fn))
        async with await rt.agents.create(session_id="p", agent_options=OPTIONS) as handle:
            result = await handle.agent.ask("x")
    assert "danger" in offered[0]
    assert sorted(offered[1]) == ["safe", "subagent"]
    assert sorted(offered[2]) == ["safe", "subagent"]  # inherited, never widened
    assert ran == []
    assert "may only call: safe, subagent" in result.text
