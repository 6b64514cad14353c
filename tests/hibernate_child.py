"""A process to kill while its agent is hibernated: ``python hibernate_child.py DB``.

It opens a runtime with SQLite persistence at ``DB`` and ``hibernate_after_seconds`` set,
creates session ``sleepy``, runs one turn, and once the agent has hibernated (its log stored,
its actor gone) prints ``READY`` and blocks forever, so a parent can SIGKILL it there.
"""

from __future__ import annotations

import sys

import trio

import agentloop
from agentloop import events as ev
from agentloop.testing import ScriptedModel

SESSION = "sleepy"
OPTIONS = agentloop.AgentOptions(provider="child", model="m")


async def main(db: str) -> None:
    config = {
        "persistence": {"backend": "sqlite", "path": db},
        "settings": {"agent-loop": {"hibernate_after_seconds": 0.01}},
    }
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("child", ScriptedModel(["first answer"]))
        rested = trio.Event()
        rt.events.on(ev.AgentHibernated, lambda e: rested.set())
        handle = await rt.agents.create(session_id=SESSION, agent_options=OPTIONS)
        handle.agent.followup("remember this")
        await rested.wait()
        assert handle.agent.status == "hibernated"
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
