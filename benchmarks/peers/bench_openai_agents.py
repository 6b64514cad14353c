"""The OpenAI Agents SDK (``openai-agents``) on the peer workloads, with a fake ``Model``.

The SDK ships no test model, so this one implements its ``Model`` interface: it streams
Responses-API events (the text deltas, one ``asyncio.sleep(0)`` each, then
``response.completed`` carrying the message and, but for the last step, one ``noop`` function
call). The events are built with ``model_construct`` (no validation), since a real client's
parsing is the wire's cost, not the runtime's. Tracing is off (it would export over the
network). The run is streamed and every event consumed, as a UI would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import _common as c
from agents import Agent, Model, ModelResponse, RunConfig, Runner, function_tool
from agents.tracing import set_tracing_disabled
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
)

RUN_CONFIG = RunConfig(tracing_disabled=True)


class FakeModel(Model):
    """Streams the canned chunks of one step per call; no network."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls = 0
        self.deltas = [
            ResponseTextDeltaEvent.model_construct(
                content_index=0, delta=piece, item_id="msg", logprobs=[], output_index=0,
                sequence_number=i, type="response.output_text.delta",
            )
            for i, piece in enumerate(c.PIECES)
        ]

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        raise NotImplementedError("the workloads stream every request")

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        self.calls += 1
        for delta in self.deltas:
            await asyncio.sleep(0)
            yield delta
        output: list[Any] = [ResponseOutputMessage.model_construct(
            id=f"msg_{self.calls}", role="assistant", status="completed", type="message",
            content=[ResponseOutputText.model_construct(
                annotations=[], text=c.TEXT, type="output_text", logprobs=None)],
        )]
        if self.calls % self.steps:
            output.append(ResponseFunctionToolCall.model_construct(
                arguments="{}", call_id=f"call_{self.calls}", name="noop",
                type="function_call", id=f"fc_{self.calls}", status="completed",
            ))
        yield ResponseCompletedEvent.model_construct(
            response=Response.model_construct(
                id=f"resp_{self.calls}", created_at=0.0, model="fake", object="response",
                output=output, parallel_tool_calls=True, tool_choice="auto", tools=[],
                usage=None, status="completed",
            ),
            sequence_number=len(self.deltas), type="response.completed",
        )


@function_tool
async def noop() -> str:
    """Do nothing."""
    return "ok"


def make_agent(model: Model) -> Agent[Any]:
    return Agent(name="bench", instructions=None, tools=[noop], model=model)


def history(messages: int) -> list[Any]:
    return [{"role": role, "content": c.history_text(i)}
            for i, role in enumerate(c.history_roles(messages))]


async def main(workload: str, sizes: c.Sizes) -> None:
    set_tracing_disabled(True)
    agent = make_agent(FakeModel(sizes.steps))

    def turn_on(messages: int) -> c.Turn:
        seeded = history(messages)

        async def turn() -> None:
            result = Runner.run_streamed(
                agent, [*seeded, {"role": "user", "content": "go"}],
                max_turns=sizes.steps + 1, run_config=RUN_CONFIG,
            )
            async for _ in result.stream_events():
                pass
            assert result.final_output == c.TEXT, result.final_output
            outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
            assert len(outputs) == sizes.steps - 1, len(outputs)

        return turn

    if workload == "w1":
        c.report(us_per_step=await c.time_turns(turn_on(0), sizes))
    elif workload == "w4":
        c.report(**await c.time_histories(turn_on, sizes))
    else:
        model = FakeModel(sizes.steps)

        def build() -> object:
            return [(make_agent(model), history(2)) for _ in range(sizes.idle)]

        make_agent(model)
        c.report(bytes_per_agent=c.traced_bytes_per(sizes.idle, build))
    c.report(versions=c.versions("openai-agents", "openai"))


if __name__ == "__main__":
    _, workload, sizes = c.parse_args(["openai-agents"])
    asyncio.run(main(workload, sizes))
