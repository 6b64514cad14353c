"""pydantic ``BaseModel`` output types: the schema from the model, the value from
``model_validate``, and what the model refuses sent back as a correction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import OPTIONS, check_history_valid, check_log_invariants
from fake_openai import FakeOpenAI, Reply

import agentloop
from agentloop._output import rebuild_output
from agentloop.testing import ScriptedModel, reply

pydantic = pytest.importorskip("pydantic", reason="pydantic is not installed (the mcp extra)")


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(description="the city's name")
    postcode: str | None = None


class Person(pydantic.BaseModel):
    name: str
    home: Address
    work: Address | None = None
    tags: list[str] = pydantic.Field(default_factory=list)

    @pydantic.field_validator("name")
    @classmethod
    def _capitalised(cls, value: str) -> str:
        if not value[:1].isupper():
            raise ValueError("must start with a capital letter")
        return value


class Tree(pydantic.BaseModel):
    label: str
    children: list[Tree] = pydantic.Field(default_factory=list)


def _final(arguments: object, call_id: str = "call_out") -> Any:
    return reply(tool_calls=[("final_result", arguments, call_id)])


def _errors(agent: agentloop.Agent) -> list[str]:
    return [
        e.data["content"] for e in agent.session.events
        if e.type == "tool/result" and e.data.get("error_code") == "OUTPUT_INVALID"
    ]


async def test_a_nested_model_with_optional_fields_is_the_output(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(_final({"name": "Ada", "home": {"city": "London"}}))
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        result = await h.agent.ask("who?", output_type=Person)
        assert result.output == Person(name="Ada", home=Address(city="London"))
        assert type(result.output) is Person
        assert type(result.output.home) is Address
        # The tool's parameters are the model's schema, with the nested model inlined so
        # that every field is checked by path.
        [request] = model.requests
        [tool] = [t for t in request.tools if t.name == "final_result"]
        params = tool.parameters
        assert params["required"] == ("name", "home")
        home = params["properties"]["home"]
        assert home["properties"]["city"]["description"] == "the city's name"
        assert "$defs" not in params and "$ref" not in repr(params)
        check_log_invariants(h.agent.session.events)


async def test_a_refused_output_is_retried_then_fixed(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(
        _final({"name": "Ada", "home": {"postcode": 7}}, "c1"),  # the schema's check
        _final({"name": "ada", "home": {"city": "London"}}, "c2"),  # the model's validator
        _final({"name": "Ada", "home": {"city": "London"}, "tags": ["maths"]}, "c3"),
    )
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        result = await h.agent.ask("who?", output_type=Person)
        assert result.output == Person(
            name="Ada", home=Address(city="London"), tags=["maths"]
        )
        assert result.turn == 1
        first, second = _errors(h.agent)
        assert "home.city: missing required field" in first
        assert "home.postcode: expected string or null, got integer 7" in first
        assert "The output does not match the required schema" in second
        assert "name: Value error, must start with a capital letter" in second
        check_log_invariants(h.agent.session.events)
        check_history_valid(h.agent.session.messages())


async def test_a_recursive_model_keeps_its_references(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    model.add(
        _final({"label": "a", "children": [{"label": 1}]}, "c1"),
        _final({"label": "a", "children": [{"label": "b"}]}, "c2"),
    )
    async with await rt.agents.create(session_id="s", agent_options=OPTIONS) as h:
        result = await h.agent.ask("tree", output_type=Tree)
        assert result.output == Tree(label="a", children=[Tree(label="b")])
        [error] = _errors(h.agent)
        assert "children.0.label: Input should be a valid string" in error
        params = model.requests[0].tools[-1].parameters
        assert params["type"] == "object" and "Tree" in params["$defs"]


async def test_a_stored_output_is_read_back_as_the_model(tmp_path: Path) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    with trio.fail_after(10):
        async with agentloop.open_runtime(config) as rt:
            rt.llm.register("scripted", ScriptedModel([_final({"label": "r"})]))
            async with await rt.agents.create(session_id="r", agent_options=OPTIONS) as h:
                assert (await h.agent.ask("tree", output_type=Tree)).output == Tree(label="r")
        async with agentloop.open_runtime(config) as rt:
            rt.llm.register("scripted", ScriptedModel())
            async with await rt.agents.resume(resume_session_id="r", agent_options=OPTIONS) as h:
                [stored] = [
                    e.data["output"] for e in h.agent.session.events
                    if e.type == "assistant/message" and "output" in e.data
                ]
                assert rebuild_output(Tree, stored) == Tree(label="r")


async def test_a_model_pydantic_cannot_describe_is_refused_before_any_call() -> None:
    class Handle:
        pass

    class Opaque(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        handle: Handle

    model = ScriptedModel()
    with pytest.raises(agentloop.ToolDefinitionError, match="Opaque: pydantic cannot give"):
        async with agentloop.open_agent(model, output_type=Opaque):
            pass
    assert model.requests == []


async def test_a_pydantic_model_over_an_openai_compatible_server(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native route: the schema as ``response_format``, the reply text the output."""
    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    fake.replies += [
        Reply(chunks=['{"name": "Ada", "home": ', '{"city": 3}}']),
        Reply(chunks=['{"name": "Ada", "home": {"city": "London", "postcode": "N1"}}']),
    ]
    async with agentloop.open_agent("openai:m", output_type=Person) as agent:
        result = await agent.ask("who?")
    assert result.output == Person(name="Ada", home=Address(city="London", postcode="N1"))
    first, second = fake.requests
    schema = first["response_format"]["json_schema"]
    assert schema["name"] == "Person"
    assert schema["schema"]["properties"]["home"]["required"] == ["city"]
    assert "tools" not in first
    correction = second["messages"][-1]
    assert correction["role"] == "user"
    assert "home.city: expected string, got integer 3" in correction["content"]
