"""A process to kill mid-turn: ``python crash_child.py DB MODE``.

It opens a runtime with SQLite persistence at ``DB``, creates session ``crashy`` and sends it a
prompt. In MODE ``tool`` the model calls the tool ``hang``, whose body never returns; in MODE
``stream`` the model streams a few text chunks and then never finishes; in MODE ``approval``
the model calls ``echo`` and ``rm`` in one step, ``rm`` needs approval and nobody answers, so
``echo`` runs and ``rm`` stays parked. At that point the child waits until every event logged
so far is committed, prints ``READY`` and blocks forever, so a parent can SIGKILL it at a
known place in the log. MODE ``approval-exit`` parks two calls (``rm`` and ``chmod``) beside
``echo`` and leaves with ``os._exit`` the moment ``wait_idle()`` returns, flushing nothing itself:
what the turn reported as pending must already be durable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator

import trio

import agentloop
from agentloop import events as ev
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta, reply

SESSION = "crashy"
CALL_ID = "call_hang"
ECHO_ID, RM_ID, CHMOD_ID = "call_echo", "call_rm", "call_chmod"
RM_PROMPT = "remove /srv/data?"
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
        elif mode in ("approval", "approval-exit"):

            @rt.tools.tool
            async def echo(text: str) -> str:
                """Say it back."""
                return text

            @rt.tools.tool
            async def rm(path: str) -> str:
                """Remove a path."""
                raise AssertionError("rm must not run before it is approved")

            @rt.tools.tool
            async def chmod(path: str) -> str:
                """Change a path's mode."""
                raise AssertionError("chmod must not run before it is approved")

            rt.events.on(
                ev.ToolPreExecute,
                lambda e: agentloop.Ask(RM_PROMPT) if e.call.name in ("rm", "chmod") else None,
            )
            calls = [("echo", {"text": "hi"}, ECHO_ID), ("rm", {"path": "/srv/data"}, RM_ID)]
            if mode == "approval-exit":
                calls.append(("chmod", {"path": "/srv/data"}, CHMOD_ID))
            rt.llm.register("child", ScriptedModel([reply("on it", tool_calls=calls)]))
        else:
            raise SystemExit(
                f"unknown mode {mode!r}; use 'tool', 'stream', 'approval' or 'approval-exit'"
            )
        handle = await rt.agents.create(
            session_id=SESSION, meta={"cwd": "/srv/crashy"}, agent_options=OPTIONS
        )
        handle.agent.followup("start working")
        if mode == "approval":
            await handle.agent.wait_idle()  # returns once the turn waits only for a person
            await ready_then_hang(rt)
        elif mode == "approval-exit":
            await handle.agent.wait_idle()
            pending = " ".join(p.call_id for p in handle.agent.pending_approvals)
            sys.stdout.write(f"PENDING {pending}\n")
            sys.stdout.flush()
            os._exit(0)
        await trio.sleep_forever()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: crash_child.py DB MODE")
    trio.run(main, sys.argv[1], sys.argv[2])
