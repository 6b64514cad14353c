"""The model-call boundary: registration, prepare_call, PreparedCall.open and Finish reasons."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from conftest import OPTIONS, of_type, turn_ends

import agentloop
from agentloop import events as ev
from agentloop._bus import EventBus
from agentloop._llm import LLMService
from agentloop.llm import (
    AdapterDefaults,
    Finish,
    LLMRequest,
    ModelAdapter,
    OpenAIChatAdapter,
    RetryPolicy,
    TextDelta,
)
from agentloop.testing import FunctionModel, ProviderError, ScriptedModel, block_network, reply

ALLOWED = ("stop", "tool_calls", "max_tokens", "content_filter", "refusal", "error")


def request_for(config: agentloop.CallConfig) -> LLMRequest:
    return LLMRequest(system="", messages=(), tools=(), config=config)


async def drain(stream: AsyncIterator[Any]) -> list[Any]:
    return [part async for part in stream]


class Recording(ModelAdapter):
    """Counts validate calls and keeps every config it sees."""

    def __init__(self, defaults: AdapterDefaults) -> None:
        self.defaults = defaults
        self.validated: list[agentloop.CallConfig] = []
        self.streamed: list[agentloop.CallConfig] = []

    def validate(self, config: agentloop.CallConfig) -> None:
        self.validated.append(config)
        if config.model == "refused":
            raise ProviderError("no such model", code="invalid_config")

    async def stream(self, request: LLMRequest) -> AsyncIterator[Any]:
        self.streamed.append(request.config)
        await trio.lowlevel.checkpoint()
        yield Finish("stop")


class StreamOnly:
    """An adapter written before ModelAdapter had defaults: it has nothing but stream."""

    def __init__(self) -> None:
        self.requests: list[LLMRequest] = []

    def __repr__(self) -> str:
        return "StreamOnly()"

    async def stream(self, request: LLMRequest) -> AsyncIterator[Any]:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        yield TextDelta("bare")
        yield Finish("end_turn")


# --- prepare_call ---------------------------------------------------------------------------


async def test_prepare_call_fills_defaults_once_validates_once_and_records_them() -> None:
    service = LLMService(EventBus())
    adapter = Recording(AdapterDefaults(reasoning_effort="low", max_tokens=50))
    service.register("p", adapter)
    prepared = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
    assert (prepared.config.reasoning_effort, prepared.config.max_tokens) == ("low", 50)
    assert prepared.adapter_defaults == ("reasoning_effort", "max_tokens")
    assert adapter.validated == [prepared.config]  # once, and after filling
    parts = await drain((await prepared.serve(request_for(prepared.config), agent_id="a"))[0])
    assert parts == [Finish("stop")]
    assert adapter.streamed == [prepared.config]
    assert len(adapter.validated) == 1


async def test_explicit_values_win_and_are_not_recorded_as_defaults() -> None:
    service = LLMService(EventBus())
    service.register("p", Recording(AdapterDefaults(reasoning_effort="low", max_tokens=50)))
    config = agentloop.CallConfig(provider="p", model="m", max_tokens=7)
    prepared = await service.prepare_call(config)
    assert (prepared.config.reasoning_effort, prepared.config.max_tokens) == ("low", 7)
    assert prepared.adapter_defaults == ("reasoning_effort",)


async def test_a_validation_failure_comes_from_prepare_call() -> None:
    service = LLMService(EventBus())
    service.register("p", Recording(AdapterDefaults()))
    with pytest.raises(ProviderError) as info:
        await service.prepare_call(agentloop.CallConfig(provider="p", model="refused"))
    assert info.value.code == "invalid_config"


def test_invalid_adapter_defaults_fail_when_built() -> None:
    with pytest.raises(agentloop.ConfigError, match="max_tokens"):
        AdapterDefaults(max_tokens=0)
    with pytest.raises(agentloop.ConfigError, match="reasoning_effort"):
        AdapterDefaults(reasoning_effort=" ")


# --- registration ---------------------------------------------------------------------------


async def test_an_object_with_only_stream_serves_a_turn(rt: agentloop.Context) -> None:
    bare = StreamOnly()
    rt.llm.register("scripted", bare)  # type: ignore[arg-type]
    served = rt.llm.adapter("scripted")
    assert isinstance(served, ModelAdapter)
    assert served.defaults == AdapterDefaults()
    assert repr(served) == "StreamOnly()"
    handle = await rt.agents.create(session_id="bare", agent_options=OPTIONS)
    handle.agent.followup("hi")
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    assert turn_ends(handle.agent) == ["completed"]
    anchor = of_type(handle.agent, "assistant/message")[0].data
    assert (anchor["content"], anchor["finish_reason"]) == ("bare", "stop")
    assert len(bare.requests) == 1


async def test_a_bare_objects_own_defaults_and_validate_are_kept() -> None:
    checked: list[agentloop.CallConfig] = []

    class Partial(StreamOnly):
        defaults = AdapterDefaults(max_tokens=9)

        def validate(self, config: agentloop.CallConfig) -> None:
            checked.append(config)

    service = LLMService(EventBus())
    service.register("p", Partial())  # type: ignore[arg-type]
    prepared = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
    assert prepared.config.max_tokens == 9 and prepared.adapter_defaults == ("max_tokens",)
    assert checked == [prepared.config]


class WrongDefaults(StreamOnly):
    defaults = ("max_tokens", 5)


class StreamAttribute:
    stream = 3


@pytest.mark.parametrize(
    ("candidate", "problem"),
    [
        (object(), "has no stream(request) method"),
        (StreamAttribute(), "has no stream(request) method"),
        (WrongDefaults(), "defaults must be an AdapterDefaults"),
    ],
    ids=["no stream", "stream not callable", "defaults not AdapterDefaults"],
)
def test_registering_a_non_adapter_raises(candidate: object, problem: str) -> None:
    service = LLMService(EventBus())
    with pytest.raises(TypeError, match=re.escape(problem)):
        service.register("p", candidate)  # type: ignore[arg-type]
    assert service.providers() == []


def test_model_adapter_requires_stream() -> None:
    class Forgetful(ModelAdapter):
        pass

    with pytest.raises(TypeError, match="stream"):
        Forgetful()  # type: ignore[abstract]


# --- PreparedCall.open ----------------------------------------------------------------------


async def test_open_uses_the_registration_pinned_at_preparation() -> None:
    service = LLMService(EventBus())
    first, second = ScriptedModel(["first"]), ScriptedModel(["second"])
    dispose_first = service.register("p", first)
    prepared = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
    service.register("p", second)
    dispose_first()
    parts = await drain((await prepared.serve(request_for(prepared.config), agent_id="a"))[0])
    assert [p.text for p in parts if isinstance(p, TextDelta)] == ["first"]
    assert len(first.requests) == 1 and second.requests == []


async def test_open_without_an_adapter_raises_no_adapter() -> None:
    service = LLMService(EventBus())
    service.register("other", ScriptedModel())
    prepared = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
    assert prepared.registration is None and prepared.adapter_defaults == ()
    with pytest.raises(ProviderError) as info:
        await prepared.serve(request_for(prepared.config), agent_id="a")
    assert info.value.code == "NO_ADAPTER"
    assert "'p'" in info.value.message and "registered: other" in info.value.message


async def test_an_llm_stream_handler_is_asked_first_and_may_decline() -> None:
    bus = EventBus()
    service = LLMService(bus)
    model = ScriptedModel(["from the adapter"])
    service.register("p", model)
    seen: list[tuple[str, bool]] = []
    answer: list[object] = [[TextDelta("cached"), Finish("stop")], None]

    def serve(e: ev.LlmStream) -> object:
        seen.append((e.agent_id, e.has_adapter))
        return answer.pop(0)

    bus.on(ev.LlmStream, serve)
    for expected in ("cached", "from the adapter"):
        prepared = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
        parts = await drain((await prepared.serve(request_for(prepared.config), agent_id="a1"))[0])
        assert "".join(p.text for p in parts if isinstance(p, TextDelta)) == expected
    assert seen == [("a1", True), ("a1", True)]
    assert len(model.requests) == 1


# --- Finish reasons -------------------------------------------------------------------------


@pytest.mark.parametrize("reason", ALLOWED)
def test_the_runtime_reasons_are_kept(reason: str) -> None:
    assert Finish(reason).reason == reason


@pytest.mark.parametrize(
    ("spelling", "reason"),
    [("end_turn", "stop"), ("stop_sequence", "stop"), ("length", "max_tokens"),
     ("tool_use", "tool_calls"), ("function_call", "tool_calls")],
)
def test_older_provider_spellings_are_normalised(spelling: str, reason: str) -> None:
    finish = Finish(spelling, {"output_tokens": 1})
    assert finish == Finish(reason, {"output_tokens": 1})
    assert finish.reason == reason


@pytest.mark.parametrize("bad", ["pause_turn", "", "STOP", None])
def test_an_unknown_reason_raises_naming_the_allowed_ones(bad: Any) -> None:
    with pytest.raises(ValueError, match="unknown finish reason") as info:
        Finish(bad)
    assert all(repr(name) in str(info.value) for name in ALLOWED)


def test_a_scripted_reply_checks_its_reason_when_written() -> None:
    assert reply("x", finish="length").finish == "max_tokens"
    with pytest.raises(ValueError, match="unknown finish reason"):
        reply("x", finish="done")


async def test_a_function_models_unknown_reason_ends_the_turn_with_an_error(
    rt: agentloop.Context,
) -> None:
    async def fn(request: LLMRequest) -> AsyncIterator[Any]:
        yield TextDelta("so far")
        yield Finish("pause_turn")

    rt.llm.register("scripted", FunctionModel(fn))
    handle = await rt.agents.create(session_id="f", agent_options=OPTIONS)
    handle.agent.followup("hi")
    with trio.fail_after(10):
        await handle.agent.wait_idle()
    assert turn_ends(handle.agent) == ["error"]
    end = of_type(handle.agent, "turn/end")[0].data
    # Reaches agent/request-error as a provider failure, the original named in the message.
    assert end["error"]["code"] == "adapter_error"
    assert "ValueError" in end["error"]["message"]
    assert of_type(handle.agent, "assistant/message") == []


# --- the retry policy a registration captures ---------------------------------------------


async def test_a_registration_captures_the_retry_policy_and_the_prepared_call_keeps_it() -> None:
    service = LLMService(EventBus())
    own = RetryPolicy(max_attempts=2)
    given = RetryPolicy(max_attempts=9)
    adapter = Recording(AdapterDefaults())
    adapter.retry = own
    service.register("p", adapter)
    first = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
    assert first.retry is own
    service.register("p", adapter, retry=given)  # a re-registration: the latest wins
    second = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
    assert second.retry is given
    assert first.retry is own  # pinned with its registration
    service.register("q", Recording(AdapterDefaults()))
    third = await service.prepare_call(agentloop.CallConfig(provider="q", model="m"))
    assert third.retry is None
    unserved = await service.prepare_call(agentloop.CallConfig(provider="r", model="m"))
    assert unserved.retry is None


async def test_an_adopted_objects_retry_is_captured_too() -> None:
    service = LLMService(EventBus())
    bare = StreamOnly()
    bare.retry = RetryPolicy(max_attempts=3)  # type: ignore[attr-defined]
    service.register("p", bare)  # type: ignore[arg-type]
    prepared = await service.prepare_call(agentloop.CallConfig(provider="p", model="m"))
    assert prepared.retry == RetryPolicy(max_attempts=3)


def test_a_retry_that_is_not_a_policy_is_refused_at_registration() -> None:
    service = LLMService(EventBus())
    with pytest.raises(TypeError, match="retry must be a RetryPolicy"):
        service.register("p", Recording(AdapterDefaults()), retry={"max_attempts": 2})  # type: ignore[arg-type]
    adapter = Recording(AdapterDefaults())
    adapter.retry = 3  # type: ignore[assignment]
    with pytest.raises(TypeError, match="retry must be a RetryPolicy"):
        service.register("p", adapter)


# --- adapter-owned fields -------------------------------------------------------------------


class Picky(Recording):
    """Owns reasoning_effort: only "low" and "high"."""

    def validate(self, config: agentloop.CallConfig) -> None:
        super().validate(config)
        if config.reasoning_effort not in (None, "low", "high"):
            raise agentloop.ConfigError(
                f"provider {config.provider!r}: reasoning_effort "
                f"{config.reasoning_effort!r} is not supported; allowed: low, high"
            )


async def test_an_adapters_config_error_is_a_failed_call_with_invalid_config() -> None:
    service = LLMService(EventBus())
    service.register("p", Picky(AdapterDefaults()))
    with pytest.raises(ProviderError) as info:
        await service.prepare_call(
            agentloop.CallConfig(provider="p", model="m", reasoning_effort="max")
        )
    assert info.value.code == "invalid_config"
    assert "'p'" in info.value.message and "allowed: low, high" in info.value.message
    assert isinstance(info.value.__cause__, agentloop.ConfigError)


async def test_a_refused_per_agent_value_ends_the_turn_with_a_clear_error(
    rt: agentloop.Context,
) -> None:
    rt.llm.register("openai", OpenAIChatAdapter("https://api.openai.com/v1", api_key="k"))
    seen: list[ev.AgentRequestError] = []
    rt.events.on(ev.AgentRequestError, seen.append)
    handle = await rt.agents.create(session_id="s1", agent_options=agentloop.AgentOptions(
        provider="openai", model="gpt-5", reasoning_effort="extreme"))
    async with handle:
        with block_network():
            handle.agent.followup("hi")
            await handle.agent.wait_idle()
        assert turn_ends(handle.agent) == ["error"]
        error = of_type(handle.agent, "turn/end")[0].data["error"]
    assert error["code"] == "invalid_config"
    assert error["message"] == (
        "provider 'openai' (the openai adapter at https://api.openai.com/v1): reasoning_effort "
        "'extreme' is not supported; allowed: none, minimal, low, medium, high, xhigh"
    )
    assert [e.error.code for e in seen] == ["invalid_config"]
    assert of_type(handle.agent, "request/header") == []  # refused before anything was sent
