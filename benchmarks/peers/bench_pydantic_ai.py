"""pydantic-ai on the peer workloads, with its own test model (``FunctionModel``).

The stream function yields the text chunks (one ``asyncio.sleep(0)`` each, as every fake model
in this folder does) and then one ``DeltaToolCall`` for ``noop``; the run is made with an
``event_stream_handler`` so that every model request is a streamed one, and the handler
consumes every event, as a UI would.

W2 runs ``CONCURRENT`` ``agent.run`` calls of one agent in one ``asyncio.gather``; its stream
function is shared by all of them, so it answers from the messages it is sent (a final answer
once they carry the tool returns of all earlier steps).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import _common as c
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.usage import UsageLimits

NO_LIMITS = UsageLimits(request_limit=None)


def make_model(steps: int) -> FunctionModel:
    calls = 0

    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        nonlocal calls
        calls += 1
        for piece in c.PIECES:
            await asyncio.sleep(0)
            yield piece
        if calls % steps:
            yield {0: DeltaToolCall(name="noop", json_args="{}", tool_call_id=f"call_{calls}")}

    return FunctionModel(stream_function=stream)


def shared_model(steps: int) -> FunctionModel:
    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        done = sum(isinstance(part, ToolReturnPart)
                   for m in messages if isinstance(m, ModelRequest) for part in m.parts)
        for piece in c.PIECES:
            await asyncio.sleep(0)
            yield piece
        if done < steps - 1:
            yield {0: DeltaToolCall(name="noop", json_args="{}", tool_call_id=f"call_{done}")}

    return FunctionModel(stream_function=stream)


async def noop() -> str:
    """Do nothing."""
    return "ok"


def make_agent(model: FunctionModel) -> Agent[None, str]:
    agent = Agent(model, output_type=str)
    agent.tool_plain(noop)
    return agent


def history(messages: int) -> list[Any]:
    out: list[Any] = []
    for i, role in enumerate(c.history_roles(messages)):
        if role == "user":
            out.append(ModelRequest(parts=[UserPromptPart(c.history_text(i))]))
        else:
            out.append(ModelResponse(parts=[TextPart(c.history_text(i))]))
    return out


async def consume(ctx: RunContext[None], events: AsyncIterable[Any]) -> None:
    async for _ in events:
        pass


async def main(workload: str, sizes: c.Sizes) -> None:
    agent = make_agent(make_model(sizes.steps))

    def turn_on(messages: int) -> c.Turn:
        seeded = history(messages)

        async def turn() -> None:
            result = await agent.run("go", message_history=seeded or None,
                                     event_stream_handler=consume, usage_limits=NO_LIMITS)
            assert result.output == c.TEXT, result.output
            assert len(result.new_messages()) == 2 * sizes.steps

        return turn

    shared = make_agent(shared_model(sizes.w2_steps))

    async def batch(n: int) -> None:
        results = await asyncio.gather(*(
            shared.run("go", event_stream_handler=consume, usage_limits=NO_LIMITS)
            for _ in range(n)
        ))
        assert all(r.output == c.TEXT for r in results), results[0].output
        assert all(len(r.new_messages()) == 2 * sizes.w2_steps for r in results)

    if workload == "w1":
        c.report(us_per_step=await c.time_turns(turn_on(0), sizes))
    elif workload == "w2":
        c.report(**await c.time_concurrent(batch, sizes))
    elif workload == "w4":
        c.report(**await c.time_histories(turn_on, sizes))
    else:
        model = make_model(sizes.steps)

        def build() -> object:
            return [(make_agent(model), history(2)) for _ in range(sizes.idle)]

        make_agent(model)
        c.report(bytes_per_agent=c.traced_bytes_per(sizes.idle, build))
    c.report(versions=c.versions("pydantic-ai-slim"))


if __name__ == "__main__":
    _, workload, sizes = c.parse_args(["pydantic-ai"])
    asyncio.run(main(workload, sizes))
