"""Delegation: a parent agent hands two tasks to sub-agents, which work on them in parallel.

The parent calls the ``subagent`` tool twice in one reply (the ``subagent`` plugin); each call
runs a fresh child agent, a child actor of the parent, and returns its answer. A function model
stands in for real models here: it plays the parent (delegate, then summarise) and the
children (answer after a short delay). The tree is printed as it changes, and an observer
following the whole tree (``ctx.subagents.subscribe_tree``) prints each child's answer as it
lands in the child's log.
"""

import json
from collections.abc import AsyncIterator

import trio

import agentloop
from agentloop.events import AgentDisposed, AgentStatus, SessionCreated
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta, ToolCallDelta

TASKS = ["list three prime numbers", "name the largest planet"]
ANSWERS = {TASKS[0]: "2, 3 and 5.", TASKS[1]: "Jupiter."}


async def main() -> None:
    async with agentloop.open_runtime(config={"plugins": ["subagent"]}) as rt:
        depth: dict[str, int] = {}

        async def model(request: LLMRequest) -> AsyncIterator[TextDelta | ToolCallDelta | Finish]:
            last = request.messages[-1]
            if depth.get(request.session_id, 0) > 0:
                await trio.sleep(0.05)  # a child at work
                yield TextDelta(ANSWERS.get(last.text, "I do not know."))
            elif last.role == "user":
                for i, task in enumerate(TASKS):
                    yield ToolCallDelta(i, id=f"call_{i}", name="subagent",
                                        arguments=json.dumps({"task": task}))
                yield Finish("tool_calls")
                return
            else:
                answers = [m.text for m in request.messages if m.role == "tool"]
                yield TextDelta("My helpers say: " + " / ".join(answers))
            yield Finish("stop")

        rt.llm.register("fn", FunctionModel(model))

        def created(event: SessionCreated) -> None:
            meta = event.meta
            depth[event.session_id] = level = int(meta.get("depth", 0))
            via = f"  (for {meta['parent_call_id']})" if "parent_call_id" in meta else ""
            print(f"{'  ' * level}+ {event.session_id}{via}")

        def status(event: AgentStatus) -> None:
            print(f"{'  ' * depth.get(event.agent_id, 0)}  {event.agent_id}: {event.status}")

        def disposed(event: AgentDisposed) -> None:
            print(f"{'  ' * depth.get(event.agent_id, 0)}- {event.agent_id}")

        rt.events.on(SessionCreated, created)
        rt.events.on(AgentStatus, status)
        rt.events.on(AgentDisposed, disposed)

        handle = await rt.agents.create(
            session_id="parent", agent_options=agentloop.AgentOptions(provider="fn", model="m")
        )
        async def follow(rx: trio.MemoryReceiveChannel[agentloop.TreeEvent]) -> None:
            async for item in rx:
                if item.depth > 0 and item.event.type == "assistant/message":
                    print(f"{'  ' * (item.depth + 1)}{item.session_id} answered: "
                          f"{item.event.data['content']}")

        async with handle, trio.open_nursery() as nursery:
            async with rt.subagents.subscribe_tree("parent") as rx:
                nursery.start_soon(follow, rx)
                answer = await handle.agent.ask("Please find out two things for me.")
            # The subscription has ended: the observer finishes what was queued, then exits.
            print(answer.text)


trio.run(main)
