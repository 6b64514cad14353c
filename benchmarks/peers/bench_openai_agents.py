"""The OpenAI Agents SDK (``openai-agents``) on the peer workloads, with a fake ``Model``.

The SDK ships no test model, so this one implements its ``Model`` interface: it streams
Responses-API events (the text deltas, one ``asyncio.sleep(0)`` each, then
``response.completed`` carrying the message and, but for the last step, one ``noop`` function
call). The events are built with ``model_construct`` (no validation), since a real client's
parsing is the wire's cost, not the runtime's. Tracing is off (it would export over the
network). The run is streamed and every event consumed, as a UI would.

W2 runs ``CONCURRENT`` streamed runs of one agent in one ``asyncio.gather``; their model is
shared, so it answers from the input it is sent (a final answer once it carries the
``function_call_output`` items of all earlier steps).
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

    def __init__(self, steps: int, *, shared: bool = False) -> None:
        self.steps = steps
        self.shared = shared
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

    async def stream_response(self, instructions: str | None, given: str | list[Any],
                              *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        self.calls += 1
        if self.shared:
            items = given if isinstance(given, list) else []
            done = sum(1 for item in items if _kind(item) == "function_call_output")
            call, more = done + 1, done < self.steps - 1
        else:
            call, more = self.calls, self.calls % self.steps != 0
        for delta in self.deltas:
            await asyncio.sleep(0)
            yield delta
        output: list[Any] = [ResponseOutputMessage.model_construct(
            id=f"msg_{call}", role="assistant", status="completed", type="message",
            content=[ResponseOutputText.model_construct(
                annotations=[], text=c.TEXT, type="output_text", logprobs=None)],
        )]
        if more:
            output.append(ResponseFunctionToolCall.model_construct(
                arguments="{}", call_id=f"call_{call}", name="noop",
                type="function_call", id=f"fc_{call}", status="completed",
            ))
        yield ResponseCompletedEvent.model_construct(
            response=Response.model_construct(
                id=f"resp_{call}", created_at=0.0, model="fake", object="response",
                output=output, parallel_tool_calls=True, tool_choice="auto", tools=[],
                usage=None, status="completed",
            ),
            sequence_number=len(self.deltas), type="response.completed",
        )


def _kind(item: Any) -> Any:
    return item.get("type") if isinstance(item, dict) else getattr(item, "type", None)


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

    shared = make_agent(FakeModel(sizes.w2_steps, shared=True))

    async def one_run() -> Any:
        result = Runner.run_streamed(shared, "go", max_turns=sizes.w2_steps + 1,
                                     run_config=RUN_CONFIG)
        async for _ in result.stream_events():
            pass
        return result

    async def batch(n: int) -> None:
        results = await asyncio.gather(*(one_run() for _ in range(n)))
        assert all(r.final_output == c.TEXT for r in results), results[0].final_output
        outputs = [i for i in results[-1].new_items if i.type == "tool_call_output_item"]
        assert len(outputs) == sizes.w2_steps - 1, len(outputs)

    if workload == "w1":
        c.report(us_per_step=await c.time_turns(turn_on(0), sizes))
    elif workload == "w2":
        c.report(**await c.time_concurrent(batch, sizes))
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
