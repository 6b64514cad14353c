"""A multi-step turn with parallel tools, to kill anywhere: ``python crash_continue_child.py
STORE EFFECTS STOP``.

STORE is a SQLite path or a PostgreSQL DSN. The model (:func:`script`) takes three steps: text
and three parallel calls (``fetch`` twice, idempotent; ``charge``, not), then text and one
more ``fetch``, then the answer. Every tool body records what it did in the file EFFECTS (one
line per body started, flushed before the body goes on), and the model and the bodies pass
named checkpoints. At checkpoint number STOP the child prints ``AT <name>`` and waits to be
killed; a parent kills it there and resumes the session with ``crashed_turn="continue"``. With
STOP ``-1`` the child prints ``READY`` once the turn is durable and then dawdles a few
milliseconds at every checkpoint, so that a kill after a random delay lands anywhere.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

import agentloop
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

SESSION = "long-run"
OPTIONS = agentloop.AgentOptions(provider="child", model="m")
ANSWER = "All three fetched; the charge is settled."
# Each step's text pieces and calls: (id, name, arguments).
STEPS: tuple[tuple[tuple[str, ...], tuple[tuple[str, str, dict[str, Any]], ...]], ...] = (
    (("Looking ", "things ", "up."), (
        ("c_a", "fetch", {"key": "a"}), ("c_b", "fetch", {"key": "b"}),
        ("c_pay", "charge", {"amount": 5}),
    )),
    (("One ", "more."), (("c_c", "fetch", {"key": "c"}),)),
    (("All three fetched; ", "the charge is settled."), ()),
)
CHECKPOINTS: tuple[str, ...] = (
    *(f"stream1-{i}" for i in range(4)),
    "fetch-a-start", "fetch-a-end", "fetch-b-start", "fetch-b-end",
    "charge-start", "charge-end",
    *(f"stream2-{i}" for i in range(3)),
    "fetch-c-start", "fetch-c-end",
    *(f"stream3-{i}" for i in range(2)),
)


DAWDLE = 0.01  # seconds at each checkpoint when killed at a random time


def step_of(request: Any) -> int:
    """Which step the history asks for: one more than the completed tool steps."""
    done = sum(1 for m in request.messages if m.role == "assistant" and m.tool_calls)
    return min(done, len(STEPS) - 1)


class Child:
    def __init__(self, rt: agentloop.Context, stop: int) -> None:
        self.rt = rt
        self.stop = stop

    async def checkpoint(self, name: str) -> None:
        if name == CHECKPOINTS[0]:
            # The turn and its prompt are durable before anything can be killed: what
            # continues is a turn the store knows.
            session, backend = self.rt.sessions.get(SESSION), self.rt.session_persistence
            assert session is not None and backend is not None
            await backend.flush(SESSION, session.last_seq)
            if self.stop < 0:
                sys.stdout.write("READY\n")
                sys.stdout.flush()
        if self.stop >= 0 and CHECKPOINTS[self.stop] == name:
            sys.stdout.write(f"AT {name}\nREADY\n")
            sys.stdout.flush()
            await trio.sleep_forever()
        if self.stop < 0:
            # Not synchronisation: it spreads the turn over time for a randomly timed kill.
            await trio.sleep(DAWDLE)
        await trio.lowlevel.checkpoint()


def script(child: Child | None) -> FunctionModel:
    async def stream(request: Any) -> AsyncIterator[object]:
        step = step_of(request)
        texts, calls = STEPS[step]
        for i, text in enumerate(texts):
            if child is not None:
                await child.checkpoint(f"stream{step + 1}-{i}")
            yield TextDelta(text)
        for n, (call_id, name, arguments) in enumerate(calls):
            yield ToolCallDelta(n, id=call_id, name=name, arguments=_json(arguments))
        if child is not None:
            await child.checkpoint(f"stream{step + 1}-{len(texts)}")
        yield Finish("tool_calls" if calls else "stop")

    return FunctionModel(stream)  # type: ignore[arg-type]


def _json(value: dict[str, Any]) -> str:
    import json

    return json.dumps(value)


def register_tools(rt: agentloop.Context, child: Child | None, effects: Path) -> None:
    def record(line: str) -> None:
        with effects.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    @rt.tools.tool(concurrency="parallel", idempotent=True)
    async def fetch(key: str) -> str:
        """Fetch a value (safe to repeat)."""
        record(f"fetch {key}")
        if child is not None:
            await child.checkpoint(f"fetch-{key}-start")
            await child.checkpoint(f"fetch-{key}-end")
        return f"value of {key}"

    @rt.tools.tool(concurrency="parallel")
    async def charge(amount: int) -> str:
        """Charge an amount (must not happen twice)."""
        record(f"charge {amount}")
        if child is not None:
            await child.checkpoint("charge-start")
            await child.checkpoint("charge-end")
        return f"charged {amount}"


def config(store: str) -> dict[str, Any]:
    if store.startswith("postgresql://"):
        return {"persistence": {"backend": "postgres", "dsn": store, "lease_seconds": 5}}
    return {"persistence": {"backend": "sqlite", "path": store}}


async def main(store: str, effects: Path, stop: int) -> None:
    async with agentloop.open_runtime(config(store)) as rt:
        child = Child(rt, stop)
        rt.llm.register("child", script(child))
        register_tools(rt, child, effects)
        handle = await rt.agents.create(session_id=SESSION, agent_options=OPTIONS)
        handle.agent.followup("do the long job")
        await handle.agent.wait_idle()
        sys.stdout.write("FINISHED\n" if stop < 0 else "FINISHED\nREADY\n")
        sys.stdout.flush()
        await trio.sleep_forever()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: crash_continue_child.py STORE EFFECTS STOP")
    trio.run(main, sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
