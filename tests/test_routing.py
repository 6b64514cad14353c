"""``ctx.sessions.send``: input for a session, delivered to whichever runtime drives it.

Routing between runtimes needs a store that routes (the PostgreSQL one; its tests are in
``test_postgres.py``); without one, a session this runtime does not drive is an error.
"""

from __future__ import annotations

import pytest
from conftest import OPTIONS, turn_ends

import agentloop
from agentloop.testing import ScriptedModel


async def test_input_for_a_local_session_goes_to_its_agent(rt: agentloop.Context) -> None:
    rt.llm.register("scripted", ScriptedModel(["hi"]))
    handle = await rt.agents.create(session_id="here", agent_options=OPTIONS)
    message_id = await rt.sessions.send("here", "hello")
    await handle.agent.wait_idle()
    [claimed] = [e for e in handle.agent.session.events if e.type == "user/message"]
    assert claimed.data["message_id"] == message_id
    assert turn_ends(handle.agent) == ["completed"]
    await handle.aclose()


async def test_a_session_nobody_here_drives_without_routing_is_not_found(
    rt: agentloop.Context,
) -> None:
    with pytest.raises(agentloop.SessionNotFound, match="does not route input"):
        await rt.sessions.send("elsewhere", "hello")
