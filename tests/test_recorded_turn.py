"""A recorded conversation stays byte-identical: the log, the events and the results.

The hot path is optimised by rewriting code that every turn runs; this test is what says the
rewrite changed nothing a user can observe. One conversation exercising the per-step paths
(streamed text and reasoning, parallel and exclusive tools, coerced arguments, invalid
arguments, an unknown tool, a failing tool, usage, structured output, a follow-up and a
steer) is run and compared byte for byte with ``fixtures/recorded/conversation.json``.

After an intended change of behaviour, regenerate the fixture and read its diff:

    AGENTLOOP_RECORD=1 python -m pytest tests/test_recorded_turn.py
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

import agentloop
from agentloop.events import ALL_EVENTS, Event
from agentloop.testing import ScriptedModel, reply

FIXTURE = Path(__file__).parent / "fixtures" / "recorded" / "conversation.json"


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


@attrs.frozen
class Forecast:
    city: str
    high: int


def _recorded(cls: type[Event]) -> bool:
    # What is emitted without a handler deciding anything: registering a decision or
    # waterfall handler would itself change the path under test.
    return cls.mode == "notify" and cls.name != "session/event"


def plain(value: object) -> Any:
    """A JSON value for anything an event carries, stable across runs."""
    if attrs.has(type(value)):
        fields = attrs.fields(type(value))  # type: ignore[arg-type]
        return {"_": type(value).__name__} | {
            f.name: plain(getattr(value, f.name)) for f in fields if not f.name.startswith("_")
        }
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return f"<{type(value).__name__}>"


def normalise(text: str) -> str:
    """Message ids are random per run: numbered in order of first appearance instead."""
    seen: dict[str, str] = {}

    def number(match: re.Match[str]) -> str:
        return seen.setdefault(match[0], f"msg_{len(seen) + 1}")

    return re.sub(r"msg_[0-9a-f]{20}", number, text)


async def record() -> str:
    events: list[Any] = []
    async with agentloop.open_runtime() as rt:
        for cls in ALL_EVENTS:
            if _recorded(cls):
                rt.events.on(cls, lambda e: events.append(plain(e)))

        async def weather(city: str, days: int = 1, unit: Unit = Unit.C) -> dict[str, Any]:
            """The forecast.

            Args:
                city: where.
                days: how many days.
                unit: degrees.
            """
            return {"city": city, "days": days, "unit": unit.value, "highs": [21.5] * days}

        async def note(text: str) -> str:
            """Write a note."""
            return f"noted {len(text)} characters"

        async def broken() -> str:
            """Always fails."""
            raise RuntimeError("the sensor is offline")

        rt.tools.tool(weather, concurrency="parallel")
        rt.tools.tool(note)
        rt.tools.tool(broken, concurrency="parallel")
        usage = {"input_tokens": 120, "output_tokens": 30}
        model = ScriptedModel([
            reply("Let me look.", reasoning="The user wants weather. Two cities.",
                  tool_calls=[("weather", {"city": "Oslo", "days": 2.0, "unit": "fahrenheit"}),
                              ("weather", {"city": "Rome"}),
                              ("note", {"text": "asked about Oslo and Rome"})],
                  usage=usage),
            reply(tool_calls=[("weather", {"city": 7}), ("nowhere", {}), ("broken", {}),
                              ("weather", '{"city": "Bergen", "days": ')], usage=usage),
            reply("Oslo is **cold**, Rome is warm.", usage=usage, chunk_size=4),
            reply("Noted: you asked twice.", usage=usage),
            reply("Still here.", usage=usage),
            reply(tool_calls=[("final_result", {"city": "Oslo", "high": 3})], usage=usage),
        ])
        rt.llm.register("scripted", model)
        handle = await rt.agents.create(
            session_id="recorded",
            agent_options=agentloop.AgentOptions(provider="scripted", model="m1"),
        )
        results = []
        async with handle:
            agent = handle.agent
            results.append(plain(await agent.ask("Weather in Oslo and Rome?")))
            async with agent.run("And again?") as run:
                agent.steer("briefly")
                results.append(plain(await run.result()))
            results.append(plain(await agent.ask("Anything else?")))
            results.append(plain(await agent.ask("Forecast for Oslo", output_type=Forecast)))
            log = [plain(e) for e in agent.session.events]
    return normalise(json.dumps(
        {"log": log, "events": events, "results": results}, indent=1, ensure_ascii=False,
    )) + "\n"


def test_a_recorded_conversation_is_byte_identical() -> None:
    got = trio.run(record)
    if os.environ.get("AGENTLOOP_RECORD"):
        FIXTURE.write_text(got, encoding="utf-8")
    want = FIXTURE.read_text(encoding="utf-8")
    assert got == want, "the conversation changed; see this test's docstring"


def test_the_recording_is_deterministic() -> None:
    assert trio.run(record) == trio.run(record)
