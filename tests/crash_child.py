"""A process to kill mid-turn: ``python crash_child.py DB MODE``.

It opens a runtime with SQLite persistence at ``DB``, creates session ``crashy`` and sends it a
prompt. In MODE ``tool`` the model calls the tool ``hang``, whose body never returns; in MODE
``stream`` the model streams a few text chunks and then never finishes. At that point the child
waits until every event logged so far is committed, prints ``READY`` and blocks forever, so a
parent can SIGKILL it at a known place in the log.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import trio

import agentloop
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta, reply

SESSION = "crashy"
CALL_ID = "call_hang"
CHUNKS = ("partial ", "answer ", "so far")
OPTIONS = agentloop.AgentOptions(provider="child", model="m")


async def ready_then_hang(rt: agentloop.Context) -> None:
    """Commit everything logged so far, announce READY, never return."""
    session = rt.sessions.get(SESSION)
    backend = rt.session_persistence
    assert session is not None and backend is not None
    await backend.flush(SESSION, session.last_seq)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    await trio.sleep_forever()


async def main(db: str, mode: str) -> None:
    config = {"persistence": {"backend": "sqlite", "path": db}}
    async with agentloop.open_runtime(config) as rt:
        if mode == "tool":

            @rt.tools.tool
            async def hang() -> str:
                """Wait forever."""
                await ready_then_hang(rt)
                return "unreachable"

            rt.llm.register(
                "child",
                ScriptedModel([reply("calling", tool_calls=[("hang", {}, CALL_ID)])]),
            )
        elif mode == "stream":

            async def stream(request: object) -> AsyncIterator[object]:
                for piece in CHUNKS:
                    yield TextDelta(piece)
                # The consumer asked for the next part, so every chunk above is logged.
                await ready_then_hang(rt)
                yield Finish("stop")

            rt.llm.register("child", FunctionModel(stream))  # type: ignore[arg-type]
        else:
            raise SystemExit(f"unknown mode {mode!r}; use 'tool' or 'stream'")
        handle = await rt.agents.create(
            session_id=SESSION, meta={"cwd": "/srv/crashy"}, agent_options=OPTIONS
        )
        handle.agent.followup("start working")
        await trio.sleep_forever()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: crash_child.py DB MODE")
    trio.run(main, sys.argv[1], sys.argv[2])
