"""The README's quick start: an agent with one tool, driven by a scripted model."""

import trio

import agentloop
from agentloop.testing import ScriptedModel, reply


async def main() -> None:
    async with agentloop.open_runtime() as rt:
        # Any adapter works here: agentloop.llm.OpenAIChatAdapter("https://api.openai.com/v1",
        # api_key=...), AnthropicAdapter(...), or a scripted model for tests and demos.
        rt.llm.register("scripted", ScriptedModel([
            reply("Let me add those.", tool_calls=[("add", {"a": 2, "b": 3})]),
            reply("2 + 3 = 5."),
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
            agent.followup("What is 2 + 3?")
            await agent.wait_idle()
            for event in agent.session.events:
                print(event.seq, event.type, dict(event.data))
            print(agent.session.messages()[-1].text)


trio.run(main)
