"""AutoGen AgentChat on the peer workloads, with a fake ``ChatCompletionClient``.

The agent is an ``AssistantAgent`` with ``model_client_stream=True`` and
``max_tool_iterations`` set to the number of steps, so one ``run_stream`` is the whole turn.
The client's ``create_stream`` yields the text chunks (one ``asyncio.sleep(0)`` each) and ends
with a ``CreateResult`` carrying, but for the last step, one ``noop`` function call; no network.
An ``AssistantAgent`` keeps its conversation in its model context, so every turn gets a fresh
agent (seeded with the history for W4), made before the clock starts.

W2 runs ``CONCURRENT`` such agents, made before the clock, one ``run_stream`` each, in one
``asyncio.gather``; their client is shared, so it answers from the messages it is sent (a final
answer once they carry the function results of all earlier steps).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import _common as c
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import TaskResult
from autogen_core import FunctionCall
from autogen_core.model_context import UnboundedChatCompletionContext
from autogen_core.models import (
    AssistantMessage,
    ChatCompletionClient,
    CreateResult,
    FunctionExecutionResultMessage,
    ModelInfo,
    RequestUsage,
    UserMessage,
)
from autogen_core.models import ModelCapabilities as _Capabilities
from autogen_core.tools import FunctionTool

NO_USAGE = RequestUsage(prompt_tokens=0, completion_tokens=0)


class FakeClient(ChatCompletionClient):
    """Streams the canned chunks of one step per call."""

    def __init__(self, steps: int, *, shared: bool = False) -> None:
        self.steps = steps
        self.shared = shared
        self.calls = 0

    async def create(self, *args: Any, **kwargs: Any) -> CreateResult:
        raise NotImplementedError("the workloads stream every request")

    async def create_stream(self, messages: Sequence[Any], **kwargs: Any
                            ) -> AsyncGenerator[str | CreateResult, None]:
        self.calls += 1
        if self.shared:
            done = sum(isinstance(m, FunctionExecutionResultMessage) for m in messages)
            call, more = done + 1, done < self.steps - 1
        else:
            call, more = self.calls, self.calls % self.steps != 0
        for piece in c.PIECES:
            await asyncio.sleep(0)
            yield piece
        if more:
            yield CreateResult(
                finish_reason="function_calls", usage=NO_USAGE, cached=False, thought=c.TEXT,
                content=[FunctionCall(id=f"call_{call}", name="noop", arguments="{}")],
            )
        else:
            yield CreateResult(finish_reason="stop", content=c.TEXT, usage=NO_USAGE,
                               cached=False)

    async def close(self) -> None:
        pass

    def actual_usage(self) -> RequestUsage:
        return NO_USAGE

    def total_usage(self) -> RequestUsage:
        return NO_USAGE

    def count_tokens(self, messages: Sequence[Any], **kwargs: Any) -> int:
        return 0

    def remaining_tokens(self, messages: Sequence[Any], **kwargs: Any) -> int:
        return 1_000_000

    @property
    def capabilities(self) -> _Capabilities:  # type: ignore[override]
        return _Capabilities(vision=False, function_calling=True, json_output=False)

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(vision=False, function_calling=True, json_output=False,
                         family="unknown", structured_output=False)

    def _to_config(self) -> Mapping[str, Any]:
        return {}


async def noop() -> str:
    """Do nothing."""
    return "ok"


NOOP = FunctionTool(noop, description="Do nothing.")


def make_agent(client: FakeClient, seeded: list[Any], steps: int) -> AssistantAgent:
    return AssistantAgent(
        "bench", model_client=client, tools=[NOOP], model_client_stream=True,
        max_tool_iterations=steps, reflect_on_tool_use=False,
        model_context=UnboundedChatCompletionContext(initial_messages=list(seeded)),
    )


def history(messages: int) -> list[Any]:
    return [UserMessage(content=c.history_text(i), source="user") if role == "user"
            else AssistantMessage(content=c.history_text(i), source="bench")
            for i, role in enumerate(c.history_roles(messages))]


async def main(workload: str, sizes: c.Sizes) -> None:
    client = FakeClient(sizes.steps)

    def turn_on(messages: int) -> c.Turn:
        seeded = history(messages)

        async def turn() -> int:
            agent = make_agent(client, seeded, sizes.steps)
            result, chunks = None, 0
            start = time.perf_counter_ns()
            async for item in agent.run_stream(task="go"):
                result = item
                chunks += 1
            elapsed = time.perf_counter_ns() - start
            assert isinstance(result, TaskResult)
            executed = [m for m in result.messages if m.type == "ToolCallExecutionEvent"]
            assert len(executed) == sizes.steps - 1, len(executed)
            assert chunks > sizes.steps * c.CHUNKS, chunks
            assert result.messages[-1].to_text() == c.TEXT, result.messages[-1]
            return elapsed

        return turn

    shared = FakeClient(sizes.w2_steps, shared=True)

    async def one_run(agent: AssistantAgent) -> TaskResult | None:
        result = None
        async for item in agent.run_stream(task="go"):
            result = item
        return result if isinstance(result, TaskResult) else None

    async def batch(n: int) -> int:
        agents = [make_agent(shared, [], sizes.w2_steps) for _ in range(n)]
        start = time.perf_counter_ns()
        results = await asyncio.gather(*(one_run(a) for a in agents))
        elapsed = time.perf_counter_ns() - start
        for result in results:
            assert result is not None
            assert result.messages[-1].to_text() == c.TEXT, result.messages[-1]
        assert results[-1] is not None
        executed = [m for m in results[-1].messages if m.type == "ToolCallExecutionEvent"]
        assert len(executed) == sizes.w2_steps - 1, len(executed)
        return elapsed

    if workload == "w1":
        c.report(us_per_step=await c.time_turns(turn_on(0), sizes))
    elif workload == "w2":
        c.report(**await c.time_concurrent(batch, sizes))
    elif workload == "w4":
        c.report(**await c.time_histories(turn_on, sizes))
    else:
        conversation = history(2)

        def build() -> object:
            return [make_agent(client, conversation, sizes.steps) for _ in range(sizes.idle)]

        make_agent(client, conversation, sizes.steps)
        c.report(bytes_per_agent=c.traced_bytes_per(sizes.idle, build))
    c.report(versions=c.versions("autogen-agentchat", "autogen-core"))


if __name__ == "__main__":
    _, workload, sizes = c.parse_args(["autogen"])
    asyncio.run(main(workload, sizes))
