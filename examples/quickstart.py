"""The README's quick start: an agent with one tool, driven by a scripted model."""

import trio

import agentloop
from agentloop.testing import ScriptedModel, reply


async def main() -> None:
    async with agentloop.open_runtime() as rt:
        # Any adapter works here: agentloop.llm.OpenAIChatAdapter("https://api.openai.com/v1",
        # api_key=...), AnthropicAdapter(...), or a scripted model for tests and demos.
        rt.llm.register("scripted", ScriptedModel([
            reply("Let me add those. ", tool_calls=[("add", {"a": 2, "b": 3})]),
            reply("2 + 3 = 5."),
            reply("3 + 4 = 7."),
        ]))

        @rt.tools.tool(concurrency="parallel")
        async def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first number.
                b: the second number.
            """
            return a + b

        handle = await rt.agents.create(
            session_id="demo",
            agent_options=agentloop.AgentOptions(provider="scripted", model="demo"),
        )
        async with handle:  # disposes the agent (to quiescence) on exit
            agent = handle.agent
            async with agent.run("What is 2 + 3?") as run:  # queues it; this turn only
                async for delta in run.text():  # streamed as the model writes it
                    print(delta, end="", flush=True)
            print()
            result = await run.result()  # RunResult(text, output, reason, turn, usage)
            print(f"{result.reason} in turn {result.turn}")
            for event in agent.session.events:  # the durable log the run was read from
                print(event.seq, event.type, dict(event.data))
            answer = await agent.ask("And 3 + 4?")  # run + result in one call
            print(answer.text)


trio.run(main)
