"""LangGraph on the peer workloads, with a fake chat model.

The agent is LangGraph's documented tool loop: a ``StateGraph`` over a message list, a model
node, the prebuilt ``ToolNode`` and ``tools_condition``. The model is a langchain-core
``BaseChatModel`` whose ``_astream`` yields the text chunks (one ``asyncio.sleep(0)`` each) and
then, but for the last step, one tool-call chunk for ``noop``; no network. The graph is run
with ``stream_mode="messages"``, so the chunks are streamed out of it, and every one consumed.

W2 runs ``CONCURRENT`` streams of one compiled graph in one ``asyncio.gather``; their model is
shared, so it answers from the messages it is sent (a final answer once they carry the
``ToolMessage`` of every earlier step).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, TypedDict

import _common as c
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.tools import tool
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition


class FakeChat(BaseChatModel):
    """Streams the canned chunks of one step per call."""

    steps: int
    shared: bool = False
    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "fake-bench"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self

    def _generate(self, messages: list[BaseMessage], stop: Any = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        raise NotImplementedError("the workloads stream every request")

    async def _astream(self, messages: list[BaseMessage], stop: Any = None,
                       run_manager: Any = None, **kwargs: Any
                       ) -> AsyncIterator[ChatGenerationChunk]:
        self.calls += 1
        if self.shared:
            done = sum(isinstance(m, ToolMessage) for m in messages)
            call, more = done + 1, done < self.steps - 1
        else:
            call, more = self.calls, self.calls % self.steps != 0
        for piece in c.PIECES:
            await asyncio.sleep(0)
            # langchain-core reports each chunk to the streaming callbacks itself.
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        if more:
            yield ChatGenerationChunk(message=AIMessageChunk(
                content="",
                tool_call_chunks=[{"name": "noop", "args": "{}", "id": f"call_{call}",
                                   "index": 0}],
            ))


@tool
async def noop() -> str:
    """Do nothing."""
    return "ok"


class State(TypedDict):
    messages: Annotated[list[BaseMessage], add_messages]


def make_agent(model: FakeChat) -> Any:
    bound = model.bind_tools([noop])

    async def call_model(state: State) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(State)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([noop]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


def history(messages: int) -> list[BaseMessage]:
    return [HumanMessage(c.history_text(i)) if role == "user" else AIMessage(c.history_text(i))
            for i, role in enumerate(c.history_roles(messages))]


async def main(workload: str, sizes: c.Sizes) -> None:
    agent = make_agent(FakeChat(steps=sizes.steps))
    config = {"recursion_limit": 2 * sizes.steps + 5}

    def turn_on(messages: int) -> c.Turn:
        seeded = history(messages)

        async def turn() -> None:
            chunks = 0
            async for _ in agent.astream({"messages": [*seeded, HumanMessage("go")]},
                                         config=config, stream_mode="messages"):
                chunks += 1
            # Every text chunk, every tool-call chunk and every tool message came out.
            assert chunks >= sizes.steps * c.CHUNKS + 2 * (sizes.steps - 1), chunks

        return turn

    shared = make_agent(FakeChat(steps=sizes.w2_steps, shared=True))
    w2_config = {"recursion_limit": 2 * sizes.w2_steps + 5}

    async def one_run() -> int:
        chunks = 0
        async for _ in shared.astream({"messages": [HumanMessage("go")]}, config=w2_config,
                                      stream_mode="messages"):
            chunks += 1
        return chunks

    async def batch(n: int) -> None:
        counts = await asyncio.gather(*(one_run() for _ in range(n)))
        least = sizes.w2_steps * c.CHUNKS + 2 * (sizes.w2_steps - 1)
        assert all(k >= least for k in counts), (least, counts[0])

    if workload == "w1":
        c.report(us_per_step=await c.time_turns(turn_on(0), sizes))
    elif workload == "w2":
        c.report(**await c.time_concurrent(batch, sizes))
    elif workload == "w4":
        c.report(**await c.time_histories(turn_on, sizes))
    else:
        model = FakeChat(steps=sizes.steps)

        def build() -> object:
            return [(make_agent(model), history(2)) for _ in range(sizes.idle)]

        make_agent(model)
        c.report(bytes_per_agent=c.traced_bytes_per(sizes.idle, build))
    c.report(versions=c.versions("langgraph", "langchain-core"))


if __name__ == "__main__":
    _, workload, sizes = c.parse_args(["langgraph"])
    asyncio.run(main(workload, sizes))
