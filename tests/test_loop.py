"""The turn/step loop: the durable log, the completion anchor, failures and hooks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import attrs
import pytest
import trio
from conftest import OPTIONS, check_history_valid, check_log_invariants, of_type, turn_ends, types

import agentloop
from agentloop import events as ev
from agentloop.testing import (
    Finish,
    FunctionModel,
    ProviderError,
    ReasoningDelta,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    reply,
)


async def run_turn(rt: agentloop.Context, prompt: str = "hi", **kw: object) -> agentloop.Agent:
    handle = await rt.agents.create(session_id=str(kw.pop("sid", "s1")), agent_options=OPTIONS)
    handle.agent.followup(prompt)
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    return handle.agent


async def test_text_turn_log_shape(rt, model) -> None:
    model.add(reply("Hello there friend", usage={"input_tokens": 3, "output_tokens": 3}))
    agent = await run_turn(rt)
    assert types(agent) == [
        "turn/start", "user/message", "request/header",
        "assistant/chunk", "assistant/chunk", "assistant/chunk",
        "assistant/message", "turn/end",
    ]
    anchor = of_type(agent, "assistant/message")[0].data
    chunk_seqs = [e.seq for e in of_type(agent, "assistant/chunk")]
    assert anchor["content"] == "Hello there friend"
    assert list(anchor["source_event_seqs"]) == chunk_seqs
    assert anchor["finish_reason"] == "stop"
    assert anchor["usage"] == {"input_tokens": 3, "output_tokens": 3}
    assert anchor["interrupted"] is False
    assert turn_ends(agent) == ["completed"]
    header = of_type(agent, "request/header")[0].data
    assert (header["step"], header["provider"], header["model"]) == (1, "scripted", "m")
    assert [m.role for m in agent.session.messages()] == ["user", "assistant"]
    assert agent.session.messages()[-1].text == "Hello there friend"
    assert agent.status == "idle"


async def test_log_data_is_deep_frozen(rt, model) -> None:
    model.add(reply("ok", tool_calls=[("missing", {"a": [1, {"b": 2}]})]), reply("done"))
    agent = await run_turn(rt)
    call = of_type(agent, "tool/call")[0]
    with pytest.raises(TypeError):
        call.data["x"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        call.data["arguments"]["a"][1]["b"] = 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        call.seq = 9  # type: ignore[misc]


async def test_empty_completion_still_anchors_but_stays_out_of_history(rt, model) -> None:
    model.add(reply(""))
    agent = await run_turn(rt)
    anchors = of_type(agent, "assistant/message")
    assert len(anchors) == 1 and anchors[0].data["source_event_seqs"] == ()
    assert [m.role for m in agent.session.messages()] == ["user"]
    assert turn_ends(agent) == ["completed"]


async def test_max_tokens_turn(rt, model) -> None:
    model.add(reply("cut sh", finish="max_tokens"))
    agent = await run_turn(rt)
    assert of_type(agent, "assistant/message")[0].data["finish_reason"] == "max_tokens"
    assert turn_ends(agent) == ["max-tokens"]


async def test_max_tokens_sticks_when_the_turn_goes_on(rt, model) -> None:
    @rt.tools.tool
    async def ping() -> str:
        """Ping."""
        return "pong"

    model.add(reply("", tool_calls=[("ping", {})], finish="max_tokens"), reply("done"))
    agent = await run_turn(rt)
    assert turn_ends(agent) == ["max-tokens"]
    assert of_type(agent, "tool/result")[0].data["content"] == "pong"


async def test_tool_round_trip_and_history(rt, model) -> None:
    seen: list[int] = []

    @rt.tools.tool
    async def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        seen.append(a + b)
        return a + b

    model.add(reply("adding", tool_calls=[("add", {"a": 2, "b": 3}, "c1")]), reply("5"))
    agent = await run_turn(rt)
    assert seen == [5]
    result = of_type(agent, "tool/result")[0].data
    assert (result["call_id"], result["content"], result["is_error"]) == ("c1", "5", False)
    roles = [m.role for m in agent.session.messages()]
    assert roles == ["user", "assistant", "tool", "assistant"]
    second = model.requests[1]
    assert second.messages[-1].tool_call_id == "c1"
    assert [t.name for t in second.tools] == ["add"]
    assert second.tools[0].parameters["properties"]["a"] == {
        "type": "integer", "description": "the first."
    }
    check_log_invariants(agent.session.events)
    check_history_valid(agent.session.messages())


@pytest.mark.parametrize(
    ("call", "code", "fragment"),
    [
        (("nope", {}), "UNKNOWN_TOOL", "unknown tool 'nope'"),
        (("add", '{"a": 1,'), "INVALID_ARGUMENTS", "not a JSON object"),
        (("add", {"a": 1}), "INVALID_ARGUMENTS", "b"),
        (("add", {"a": "x", "b": 1}), "INVALID_ARGUMENTS", "a: expected integer"),
        (("add", {"a": 1, "b": 2, "c": 3}), "INVALID_ARGUMENTS", "c"),
    ],
)
async def test_bad_calls_become_error_results_and_the_body_never_runs(
    rt, model, call, code, fragment
) -> None:
    ran: list[object] = []

    @rt.tools.tool
    async def add(a: int, b: int) -> int:
        """Add."""
        ran.append((a, b))
        return a + b

    model.add(reply("", tool_calls=[call]), reply("sorry"))
    agent = await run_turn(rt)
    result = of_type(agent, "tool/result")[0].data
    assert result["is_error"] is True
    assert result["error_code"] == code
    assert fragment in result["content"]
    assert ran == []
    assert turn_ends(agent) == ["completed"]
    assert model.requests[1].messages[-1].is_error


async def test_tool_that_raises_is_an_error_result(rt, model) -> None:
    @rt.tools.tool
    async def boom() -> str:
        """Fail."""
        raise RuntimeError("disk on fire")

    model.add(reply("", tool_calls=[("boom", {})]), reply("noted"))
    agent = await run_turn(rt)
    result = of_type(agent, "tool/result")[0].data
    assert result["is_error"] and "disk on fire" in result["content"]
    assert turn_ends(agent) == ["completed"]


async def test_tool_timeout(rt, model, autojump_clock) -> None:
    @rt.tools.tool(timeout=5)
    async def slow() -> str:
        """Slow."""
        await trio.sleep(60)
        return "late"

    model.add(reply("", tool_calls=[("slow", {})]), reply("ok"))
    agent = await run_turn(rt)
    result = of_type(agent, "tool/result")[0].data
    assert result["error_code"] == "TIMEOUT"


async def test_explicit_tool_and_finalize_content(rt, model) -> None:
    async def run(text: str) -> str:
        return text * 100

    rt.tools.register(
        agentloop.Tool(
            "echo", "Echo text.", {"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"]},
            run, finalize_content=agentloop.truncate_content(10),
        )
    )
    model.add(reply("", tool_calls=[("echo", {"text": "ab"})]), reply("ok"))
    agent = await run_turn(rt)
    content = of_type(agent, "tool/result")[0].data["content"]
    assert content.startswith("ababababab\n[... truncated 190 characters]")


async def test_deny_and_ask(rt, model) -> None:
    ran: list[str] = []

    @rt.tools.tool
    async def rm(path: str) -> str:
        """Remove a file."""
        ran.append(path)
        return "removed"

    def policy(event: ev.ToolPreExecute) -> object:
        path = event.call.arguments["path"]
        if path == "/":
            return agentloop.Deny("not the root")
        if path == "/etc":
            return agentloop.Ask("remove /etc?")
        return None

    rt.events.on(ev.ToolPreExecute, policy)
    model.add(
        reply("", tool_calls=[("rm", {"path": "/"}), ("rm", {"path": "/etc"}),
                              ("rm", {"path": "/tmp/x"})]),
        reply("done"),
    )
    agent = await run_turn(rt)
    results = [e.data for e in of_type(agent, "tool/result")]
    # Without a tools/approval answer, Ask parks the call durably (contract section 8).
    assert [r["error_code"] for r in results] == ["DENIED", None]
    assert "not the root" in results[0]["content"]
    [pending] = agent.pending_approvals
    assert (pending.name, pending.prompt) == ("rm", "remove /etc?")
    assert agent.deny(pending.call_id, reason="nobody approved")
    await agent.wait_idle()
    results = [e.data for e in of_type(agent, "tool/result")]
    assert [r["error_code"] for r in results] == ["DENIED", None, "DENIED"]
    assert "nobody approved" in results[2]["content"]
    assert ran == ["/tmp/x"]


async def test_ask_approved(rt, model) -> None:
    @rt.tools.tool
    async def rm(path: str) -> str:
        """Remove."""
        return "removed " + path

    rt.events.on(ev.ToolPreExecute, lambda e: agentloop.Ask("sure?"))
    rt.events.on(ev.ToolApproval, lambda e: agentloop.Allow())
    model.add(reply("", tool_calls=[("rm", {"path": "a"})]), reply("ok"))
    agent = await run_turn(rt)
    assert of_type(agent, "tool/result")[0].data["content"] == "removed a"


async def test_guards_only_tighten(rt, model) -> None:
    @rt.tools.tool
    async def write(path: str) -> str:
        """Write."""
        return "ok"

    rt.tools.guard(lambda call, tool: agentloop.Deny("read-only") if call.name == "write" else None)

    async def setup(ctx: agentloop.Context) -> None:
        ctx.tools.guard(lambda call, tool: None)  # a nested scope cannot loosen

    model.add(reply("", tool_calls=[("write", {"path": "a"})]), reply("ok"))
    handle = await rt.agents.create(session_id="g", agent_options=OPTIONS, setup=setup)
    handle.agent.followup("go")
    await handle.agent.wait_idle()
    assert of_type(handle.agent, "tool/result")[0].data["error_code"] == "DENIED"


async def test_tools_execute_and_post_execute_hooks(rt, model) -> None:
    @rt.tools.tool
    async def f(x: int) -> int:
        """F."""
        return x

    rt.events.on(ev.ToolExecute, lambda e: agentloop.ToolResult(f"sandboxed {e.arguments['x']}"))

    async def post(e: ev.ToolPostExecute) -> agentloop.ToolResult:
        return attrs.evolve(e.result, content=e.result.content + "!")

    rt.events.on(ev.ToolPostExecute, post)
    observed: list[str] = []
    rt.events.on(ev.ToolResultEvent, lambda e: observed.append(e.result.content))
    model.add(reply("", tool_calls=[("f", {"x": 7})]), reply("ok"))
    agent = await run_turn(rt)
    assert of_type(agent, "tool/result")[0].data["content"] == "sandboxed 7!"
    assert observed == ["sandboxed 7!"]


async def test_reasoning_and_tool_call_deltas(rt) -> None:
    async def fn(request: agentloop.llm.LLMRequest) -> AsyncIterator[object]:
        yield ReasoningDelta("think ")
        yield ReasoningDelta("hard", signature="sig")
        yield TextDelta("answer")
        yield ToolCallDelta(0, id="t1", name="nope", arguments='{"a"')
        yield ToolCallDelta(0, arguments=": 1}")
        yield Finish("tool_calls", {"output_tokens": 4})

    rt.llm.register("scripted", FunctionModel(fn))
    rt.events.on(ev.AgentTurnContinuation, lambda e: False)
    agent = await run_turn(rt)
    anchor = of_type(agent, "assistant/message")[0].data
    assert anchor["reasoning"] == "think hard"
    assert anchor["reasoning_signature"] == "sig"
    assert anchor["tool_calls"] == ({"id": "t1", "name": "nope", "arguments": {"a": 1}},)
    kinds = [e.data["kind"] for e in of_type(agent, "assistant/chunk")]
    assert kinds == ["reasoning", "reasoning", "text", "tool_call", "tool_call"]
    last = agent.session.messages()[1]
    assert last.reasoning == "think hard" and last.tool_calls[0].arguments == {"a": 1}


async def test_unhandled_provider_error_ends_turn_with_error_and_commits_nothing(rt) -> None:
    async def fn(request: object) -> AsyncIterator[object]:
        yield TextDelta("partial ")
        raise ProviderError("overloaded", status=529, code="overloaded_error")

    rt.llm.register("scripted", FunctionModel(fn))
    agent = await run_turn(rt)
    assert turn_ends(agent) == ["error"]
    assert of_type(agent, "assistant/message") == []
    end = of_type(agent, "turn/end")[0].data
    assert end["error"]["status"] == 529 and end["error"]["code"] == "overloaded_error"
    assert [m.role for m in agent.session.messages()] == ["user"]
    # the loop survives: the next prompt runs
    rt.llm.register("scripted", ScriptedModel(["fine"]))
    agent.followup("again")
    await agent.wait_idle()
    assert turn_ends(agent) == ["error", "completed"]


async def test_request_error_hook_retries(rt, model) -> None:
    model.add(ProviderError("busy", status=429), "recovered")
    attempts: list[int] = []

    def on_error(e: ev.AgentRequestError) -> object:
        attempts.append(e.attempt)
        return agentloop.Retry()

    rt.events.on(ev.AgentRequestError, on_error)
    agent = await run_turn(rt)
    assert attempts == [1]
    assert turn_ends(agent) == ["completed"]
    assert len(of_type(agent, "request/header")) == 2


async def test_stream_without_finish_is_an_error(rt) -> None:
    async def fn(request: object) -> AsyncIterator[object]:
        yield TextDelta("hello")

    rt.llm.register("scripted", FunctionModel(fn))
    agent = await run_turn(rt)
    assert turn_ends(agent) == ["error"]
    assert of_type(agent, "turn/end")[0].data["error"]["code"] == "incomplete_stream"


async def test_no_adapter(rt) -> None:
    agent = await run_turn(rt)
    end = of_type(agent, "turn/end")[0].data
    assert end["reason"] == "error" and end["error"]["code"] == "NO_ADAPTER"


async def test_llm_stream_hook_serves_a_route_without_adapter(rt) -> None:
    served: list[str] = []

    def serve(e: ev.LlmStream) -> object:
        served.append(e.request.config.provider or "")
        return [TextDelta("cached"), Finish("stop")]

    rt.events.on(ev.LlmStream, serve)
    agent = await run_turn(rt)
    assert served == ["scripted"]
    assert agent.session.messages()[-1].text == "cached"


async def test_failing_hook_ends_the_turn_not_the_loop(rt, model) -> None:
    calls = 0

    def flaky(e: ev.AgentRequest) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("plugin bug")

    rt.events.on(ev.AgentRequest, flaky)
    model.add("works")
    agent = await run_turn(rt)
    assert turn_ends(agent) == ["error"]
    assert of_type(agent, "turn/end")[0].data["error"]["message"] == "plugin bug"
    agent.followup("again")
    await agent.wait_idle()
    assert turn_ends(agent) == ["error", "completed"]


async def test_pre_step_reject(rt, model) -> None:
    seen: list[tuple[str, ...]] = []

    def gate(e: ev.AgentPreStep) -> object:
        seen.append(tuple(m.content for m in e.messages))
        return agentloop.Reject("not now")

    rt.events.on(ev.AgentPreStep, gate)
    agent = await run_turn(rt, "blocked")
    assert seen == [("blocked",)]
    assert turn_ends(agent) == ["rejected"]
    assert of_type(agent, "request/header") == []
    assert model.requests == []
    assert agent.inbox.next_turn == ()


async def test_agent_request_waterfall_and_adapter_defaults(rt) -> None:
    model = ScriptedModel(
        [reply("", tool_calls=[("nope", {})]), "done"],
        defaults=agentloop.llm.AdapterDefaults(max_tokens=111, reasoning_effort="low"),
    )
    rt.llm.register("scripted", model)
    proposals: list[agentloop.CallConfig] = []

    def waterfall(e: ev.AgentRequest) -> agentloop.CallConfig:
        proposals.append(e.config)
        return attrs.evolve(e.config, model="m2")

    rt.events.on(ev.AgentRequest, waterfall)
    rt.events.on(ev.AgentRequest, lambda e: attrs.evolve(e.config, extra={"temperature": 0}))
    agent = await run_turn(rt)
    headers = [e.data for e in of_type(agent, "request/header")]
    assert [h["model"] for h in headers] == ["m2", "m2"]
    assert headers[0]["adapter_defaults"] == ("reasoning_effort", "max_tokens")
    assert headers[0]["config"]["max_tokens"] == 111
    assert headers[0]["config"]["extra"] == {"temperature": 0}
    # adapter-filled fields are removed before the next waterfall; explicit ones persist
    assert proposals[1].max_tokens is None and proposals[1].reasoning_effort is None
    assert proposals[1].model == "m2"
    assert model.requests[0].config.max_tokens == 111


async def test_explicit_options_are_not_marked_as_adapter_defaults(rt) -> None:
    model = ScriptedModel(["x"], defaults=agentloop.llm.AdapterDefaults(max_tokens=111))
    rt.llm.register("scripted", model)
    handle = await rt.agents.create(
        session_id="o", agent_options=attrs.evolve(OPTIONS, max_tokens=7)
    )
    handle.agent.followup("hi")
    await handle.agent.wait_idle()
    header = of_type(handle.agent, "request/header")[0].data
    assert header["config"]["max_tokens"] == 7 and header["adapter_defaults"] == ()


async def test_system_prompt_persona_override_and_variables(rt, model) -> None:
    rt.system_prompt.set("You run {model} via {provider} in {cwd}.")
    model.add("a", "b")

    async def setup(ctx: agentloop.Context) -> None:
        ctx.system_prompt.set("Override for {model}.")

    h1 = await rt.agents.create(session_id="p1", meta={"cwd": "/w"}, agent_options=OPTIONS)
    h2 = await rt.agents.create(session_id="p2", agent_options=OPTIONS, setup=setup)
    for h in (h1, h2):
        h.agent.followup("hi")
        await h.agent.wait_idle()
    assert model.requests[0].system == "You run m via scripted in /w."
    assert model.requests[1].system == "Override for m."


async def test_a_system_prompt_changed_between_steps_reaches_the_next_request(rt, model) -> None:
    # A turn's steps reuse the prompt rendered for its template and config until either
    # changes: a persona set by a tool mid-turn is the next step's.
    rt.system_prompt.set("First on {model}.")

    @rt.tools.tool
    async def switch() -> str:
        """Switch the persona."""
        rt.system_prompt.set("Then on {model}.")
        return "ok"

    model.add(reply("a", tool_calls=[("switch", {})]), reply("b", tool_calls=[("switch", {})]),
              "c")
    await run_turn(rt)
    assert [r.system for r in model.requests] == ["First on m.", "Then on m.", "Then on m."]


async def test_consecutive_requests_share_a_prefix(rt, model) -> None:
    @rt.tools.tool
    async def t() -> str:
        """T."""
        return "r"

    model.add(reply("a", tool_calls=[("t", {})]), reply("b", tool_calls=[("t", {})]), "c")
    await run_turn(rt)
    r1, r2, r3 = model.requests

    def wire(r: agentloop.llm.LLMRequest) -> list[str]:
        return [json.dumps([r.system, [attrs.asdict(t) for t in r.tools]])] + [
            json.dumps(attrs.asdict(m), sort_keys=True) for m in r.messages
        ]

    assert wire(r2)[: len(wire(r1))] == wire(r1)
    assert wire(r3)[: len(wire(r2))] == wire(r2)
    # the snapshot a request holds never changes afterwards
    assert len(r1.messages) == 1


async def test_invalid_content_changes_nothing(rt, model) -> None:
    handle = await rt.agents.create(session_id="v", agent_options=OPTIONS)
    agent = handle.agent
    cyclic: list[object] = []
    cyclic.append(cyclic)
    for bad in (float("nan"), [float("inf")], [{1: "x"}], cyclic, [object()], {"a": 1}):
        with pytest.raises(agentloop.InvalidContent):
            agent.send(bad)
    with pytest.raises(agentloop.InvalidContent):
        agent.followup("ok", source={"when": object()})
    assert agent.inbox.next_turn == () and agent.status == "idle"
    assert types(agent) == []


async def test_list_content_is_frozen_once_and_reaches_the_model(rt, model) -> None:
    model.add("seen")
    handle = await rt.agents.create(session_id="lc", agent_options=OPTIONS)
    parts = [{"type": "text", "text": "look "}, {"type": "text", "text": "here"}]
    handle.agent.followup(parts)
    parts[0]["text"] = "mutated"
    await handle.agent.wait_idle()
    msg = model.requests[0].messages[0]
    assert msg.text == "look here"
    with pytest.raises(TypeError):
        msg.content[0]["text"] = "x"  # type: ignore[index]


async def test_settings_validation(rt) -> None:
    key = "agent-loop.max_parallel_tool_calls"
    assert rt.settings.get(key) == 10
    for bad in (0, -1, True, 2.5, "3", None):
        with pytest.raises(agentloop.SettingsError, match="positive integer"):
            rt.settings.set(key, bad)
    assert rt.settings.get(key) == 10
    changes: list[object] = []
    rt.events.on(ev.SettingChanged, lambda e: changes.append((e.key, e.value)))
    rt.settings.set(key, 3)
    assert rt.settings.get(key) == 3 and changes == [(key, 3)]
    with pytest.raises(agentloop.SettingsError, match="unknown setting"):
        rt.settings.set("nope", 1)


async def test_settings_from_config() -> None:
    async with agentloop.open_runtime(
        {"settings": {"agent-loop": {"max_parallel_tool_calls": 4}}}
    ) as rt:
        assert rt.settings.get("agent-loop.max_parallel_tool_calls") == 4
    with pytest.raises(agentloop.SettingsError):
        async with agentloop.open_runtime(
            {"settings": {"agent-loop": {"max_parallel_tool_calls": 0}}}
        ):
            pass


async def test_agent_options_validation() -> None:
    with pytest.raises(agentloop.ConfigError, match="reasoning_effort"):
        agentloop.AgentOptions(reasoning_effort="")
    with pytest.raises(agentloop.ConfigError, match="max_tokens"):
        agentloop.AgentOptions(max_tokens=0)
    with pytest.raises(agentloop.ConfigError, match="max_tokens"):
        agentloop.AgentOptions(max_tokens=-5)


async def test_step_result_and_status_events(rt, model) -> None:
    statuses: list[tuple[str, str]] = []
    rt.events.on(ev.AgentStatus, lambda e: statuses.append((e.previous, e.status)))
    results: list[str] = []
    rt.events.on(ev.AgentStepResult, lambda e: results.append(e.text))
    model.add("hey")
    await run_turn(rt)
    assert statuses == [("idle", "running"), ("running", "idle")]
    assert results == ["hey"]


async def test_a_call_stays_pinned_to_the_registration_it_was_prepared_with(rt) -> None:
    first = ScriptedModel(["from the first"], defaults=agentloop.llm.AdapterDefaults(
        max_tokens=11))
    second = ScriptedModel(["from the second"], defaults=agentloop.llm.AdapterDefaults(
        max_tokens=22))
    rt.llm.register("scripted", first)

    def swap(e: ev.SessionEventAppended) -> None:
        # Re-register between preparation (header logged) and dispatch.
        if e.event.type == "request/header":
            rt.llm.register("scripted", second)

    rt.events.on(ev.SessionEventAppended, swap)
    agent = await run_turn(rt)
    header = of_type(agent, "request/header")[0].data
    assert header["config"]["max_tokens"] == 11
    assert agent.session.messages()[-1].text == "from the first"
    assert len(first.requests) == 1 and second.requests == []
