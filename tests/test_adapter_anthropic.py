"""AnthropicAdapter over real HTTP on loopback."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import attrs
import loopback
import pytest
import trio
from loopback import Hang, serve

from agentloop._bus import EventBus
from agentloop._errors import ProviderError
from agentloop._json import freeze
from agentloop._llm import LLMService
from agentloop._model import (
    CallConfig,
    Finish,
    LLMRequest,
    Message,
    ReasoningDelta,
    StreamPart,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
)
from agentloop.llm import AnthropicAdapter
from agentloop.llm._base import AdapterDefaults
from agentloop.llm._wire import dumps

KEY = "sk-ant-test-0123456789-SECRET"


frozen = freeze


def make_request(*args: Any, **config: Any) -> LLMRequest:
    """A full config, as prepare_call hands it over (the adapter fills nothing itself)."""
    config.setdefault("model", "claude-test")
    config.setdefault("max_tokens", 4096)
    return loopback.make_request(*args, **config)


collect = loopback.collect


async def collect_prepared(adapter: AnthropicAdapter, request: LLMRequest) -> list[StreamPart]:
    """One call as the runtime makes it: defaults filled and validated once, then streamed."""
    service = LLMService(EventBus())
    service.register("p", adapter)
    prepared = await service.prepare_call(attrs.evolve(request.config, provider="p"))
    stream, _ = await prepared.serve(attrs.evolve(request, config=prepared.config), agent_id="a")
    return [part async for part in stream]


async def run(handler: loopback.Handler, request: LLMRequest | None = None) -> list[StreamPart]:
    with trio.fail_after(10):
        async with serve(handler) as server:
            adapter = AnthropicAdapter(server.url, api_key=KEY)
            return await collect(adapter, request or make_request())


async def failure(handler: loopback.Handler) -> ProviderError:
    with trio.fail_after(10):
        async with serve(handler) as server:
            adapter = AnthropicAdapter(server.url, api_key=KEY)
            with pytest.raises(ProviderError) as info:
                await collect(adapter, make_request())
    for text in (str(info.value), repr(info.value), repr(adapter)):
        assert KEY not in text
    return info.value


def text_of(parts: list[StreamPart]) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextDelta))


def finish_of(parts: list[StreamPart]) -> Finish:
    assert [p for p in parts if isinstance(p, Finish)] == [parts[-1]]
    finish = parts[-1]
    assert isinstance(finish, Finish)
    return finish


def arguments(parts: list[StreamPart], index: int) -> str:
    return "".join(p.arguments for p in parts if isinstance(p, ToolCallDelta) and p.index == index)


def message_start(input_tokens: int = 3) -> tuple[str, object]:
    usage = {"input_tokens": input_tokens, "output_tokens": 1}
    return "message_start", {"type": "message_start", "message": {"usage": usage}}


def text_block(index: int, text: str) -> list[tuple[str, object]]:
    return [
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": text},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


def tool_block(index: int, call_id: str, name: str, *fragments: str) -> list[tuple[str, object]]:
    start = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
    return [
        (
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": start},
        ),
        *(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": f},
                },
            )
            for f in fragments
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


def message_end(reason: str = "end_turn", output_tokens: int = 9) -> list[tuple[str, object]]:
    delta = {"stop_reason": reason, "stop_sequence": None}
    return [
        (
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": output_tokens}},
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


# --- the project's own fixtures (tests/fixtures/streams) ------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 1, 29])
async def test_text_fixture_without_final_blank_line(chunk_size: int | None) -> None:
    parts = await run(loopback.replay_fixture("anthropic-messages-text.sse", chunk_size=chunk_size))
    usage = {
        "input_tokens": 17,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 11,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
    }
    assert parts == [
        TextDelta("Bonjour"),
        TextDelta(" from the loopback"),
        TextDelta(" \u2014 \u00e7a marche \u2713"),
        Finish("stop", usage),
    ]


@pytest.mark.parametrize("chunk_size", [None, 11])
async def test_tool_use_fixture(chunk_size: int | None) -> None:
    parts = await run(
        loopback.replay_fixture("anthropic-messages-tool-use.sse", chunk_size=chunk_size)
    )
    assert text_of(parts) == "Let me read the first lines of the README."
    calls = [p for p in parts if isinstance(p, ToolCallDelta)]
    assert calls[0] == ToolCallDelta(0, "toolu_al_fixture_read_01", "read_file", "")
    assert [c.arguments for c in calls[1:]] == ['{"path": "REA', 'DME.md", "li', 'nes": [1, 40]}']
    assert all(c.index == 0 and c.id is None and c.name is None for c in calls[1:])
    assert json.loads(arguments(parts, 0)) == {"path": "README.md", "lines": [1, 40]}
    finish = finish_of(parts)
    assert finish.reason == "tool_calls"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (402, 58)


async def test_thinking_and_signature_fixture() -> None:
    parts = await run(loopback.replay_fixture("anthropic-messages-thinking.sse", chunk_size=17))
    signature = "YWdlbnRsb29wIGZpeHR1cmUgc2lnbmF0dXJlLCBub3QgYSByZWFsIG9uZQ=="
    assert parts[:-1] == [
        ReasoningDelta("", format="anthropic", fields={"type": "thinking"}),
        ReasoningDelta("The user asks for 12 \u00d7 12."),
        ReasoningDelta(" Ten twelves are 120, plus two"),
        ReasoningDelta(" more is 144."),
        ReasoningDelta("", signature=signature),
        TextDelta("12 \u00d7 12 = 144."),
    ]
    finish = finish_of(parts)
    assert finish.reason == "stop"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (31, 54)


async def test_tool_input_cut_off_by_max_tokens_fixture() -> None:
    parts = await run(loopback.replay_fixture("anthropic-messages-max-tokens-tool-input.sse"))
    assert text_of(parts) == "Writing the checklist now."
    first = next(p for p in parts if isinstance(p, ToolCallDelta))
    assert (first.index, first.id, first.name) == (0, "toolu_al_fixture_write_01", "write_file")
    assert arguments(parts, 0) == '{"path": "checklist.md", "lines": ["Back up the data'
    finish = finish_of(parts)
    assert finish.reason == "max_tokens"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (380, 40)
    assert finish.usage["cache_read_input_tokens"] == 256


async def test_error_event_fixture() -> None:
    exc = await failure(loopback.replay_fixture("anthropic-messages-error.sse"))
    assert (exc.message, exc.code, exc.status) == ("Overloaded", "overloaded_error", None)


async def test_incomplete_stream_fixture() -> None:
    received: list[StreamPart] = []
    error: ProviderError | None = None
    with trio.fail_after(10):
        async with serve(loopback.replay_fixture("anthropic-messages-incomplete.sse")) as server:
            adapter = AnthropicAdapter(server.url, api_key=KEY)
            async with contextlib.aclosing(adapter.stream(make_request())) as parts:
                try:
                    async for part in parts:
                        received.append(part)
                except ProviderError as exc:
                    error = exc
    assert received == [TextDelta("The stream stops"), TextDelta(" right here")]
    assert error is not None and error.code == "incomplete_stream"


# --- third-party captures (../shared/streams, skipped when absent) ---------------------------


@loopback.needs_captures
@pytest.mark.parametrize("chunk_size", [None, 1, 29])
async def test_text_capture_without_final_blank_line(chunk_size: int | None) -> None:
    parts = await run(loopback.replay("anthropic-messages-text.sse", chunk_size=chunk_size))
    assert parts == [
        TextDelta("Hello"),
        TextDelta(" there"),
        TextDelta("!"),
        Finish("stop", {"input_tokens": 11, "output_tokens": 6}),
    ]


@loopback.needs_captures
async def test_tool_use_capture() -> None:
    parts = await run(loopback.replay("anthropic-messages-tool-use.sse"))
    assert text_of(parts) == "I'll check the current weather in Paris for you."
    calls = [p for p in parts if isinstance(p, ToolCallDelta)]
    assert calls[0] == ToolCallDelta(0, "toolu_01NRLabsLyVHZPKxbKvkfSMn", "get_weather", "")
    assert all(c.index == 0 and c.id is None and c.name is None for c in calls[1:])
    assert all(c.arguments for c in calls[1:])  # the empty fragment is dropped
    assert json.loads(arguments(parts, 0)) == {"location": "Paris"}
    finish = finish_of(parts)
    assert finish.reason == "tool_calls"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (377, 65)


@loopback.needs_captures
async def test_tool_input_cut_off_by_max_tokens_capture() -> None:
    parts = await run(loopback.replay("anthropic-messages-incomplete-partial-json.sse"))
    assert text_of(parts).startswith("I'll create a comprehensive tax guide")
    first = next(p for p in parts if isinstance(p, ToolCallDelta))
    assert (first.index, first.id, first.name) == (0, "toolu_01EKqbqmZrGRXy18eN7m9kvY", "make_file")
    assert arguments(parts, 0).startswith('{"filename": "taxes.txt", "lines_of_text": [')
    assert arguments(parts, 0).endswith('\n"Filing taxes')
    finish = finish_of(parts)
    assert finish.reason == "max_tokens"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (450, 124)
    assert finish.usage["cache_read_input_tokens"] == 0


@loopback.needs_captures
async def test_thinking_signature_and_refusal_capture() -> None:
    parts = await run(loopback.replay("anthropic-messages-thinking-padded-synthetic.sse"))
    reasoning = [p for p in parts if isinstance(p, ReasoningDelta)]
    assert "".join(r.text for r in reasoning).startswith("Simple educational question")
    assert reasoning[0] == ReasoningDelta("", format="anthropic", fields={"type": "thinking"})
    assert all(r.text for r in reasoning[1:-1])
    assert reasoning[-1] == ReasoningDelta(
        "", signature="c3ludGhldGljLXNpZ25hdHVyZS1maXh0dXJlLWEtbm90LWEtcmVhbC1zaWduYXR1cmU="
    )
    assert parts.index(reasoning[-1]) < parts.index(TextDelta("Hi"))
    finish = finish_of(parts)
    assert finish.reason == "refusal"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (28, 106)
    assert finish.usage["thinking_tokens"] == 67


# --- stream variations ----------------------------------------------------------------------


async def test_tool_indexes_count_tool_calls_not_blocks() -> None:
    events = [
        message_start(),
        *text_block(0, "Two lookups."),
        ("ping", {"type": "ping"}),
        *tool_block(1, "toolu_a", "lookup", '{"q":', '"a"}'),
        ("future_event", {"type": "future_event", "anything": [1, 2]}),
        *tool_block(2, "toolu_b", "lookup", '{"q":"b"}'),
        *message_end("tool_use"),
    ]
    parts = await run(loopback.sse_body(loopback.named_sse(*events)))
    starts = [p for p in parts if isinstance(p, ToolCallDelta) and p.id is not None]
    assert starts == [ToolCallDelta(0, "toolu_a", "lookup"), ToolCallDelta(1, "toolu_b", "lookup")]
    assert (arguments(parts, 0), arguments(parts, 1)) == ('{"q":"a"}', '{"q":"b"}')
    assert finish_of(parts) == Finish("tool_calls", {"input_tokens": 3, "output_tokens": 9})


@pytest.mark.parametrize(
    ("raw", "mapped"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("tool_use", "tool_calls"),
        ("max_tokens", "max_tokens"),
        ("model_context_window_exceeded", "max_tokens"),
        ("refusal", "refusal"),
        ("pause_turn", "error"),
        ("a_reason_from_the_future", "error"),
    ],
)
async def test_stop_reasons(raw: str, mapped: str) -> None:
    events = [message_start(), *text_block(0, "x"), *message_end(raw)]
    parts = await run(loopback.sse_body(loopback.named_sse(*events)))
    assert finish_of(parts).reason == mapped


async def test_error_event_in_the_stream() -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    body = loopback.named_sse(message_start(), *text_block(0, "par"), ("error", error))
    exc = await failure(loopback.sse_body(body))
    assert (exc.message, exc.code, exc.status) == ("Overloaded", "overloaded_error", None)


async def test_stream_without_message_stop_is_incomplete() -> None:
    body = loopback.named_sse(message_start(), *text_block(0, "x"), *message_end()[:1])
    exc = await failure(loopback.sse_body(body))
    assert exc.code == "incomplete_stream"


async def test_empty_200_body_is_incomplete() -> None:
    assert (await failure(loopback.sse_body(b""))).code == "incomplete_stream"


async def test_malformed_json() -> None:
    body = loopback.named_sse(message_start(), ("content_block_delta", '{"type": "content_'))
    assert (await failure(loopback.sse_body(body))).code == "malformed_stream"


# --- HTTP failures --------------------------------------------------------------------------


async def test_429_with_retry_after() -> None:
    payload = {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "Number of requests exceeded"},
    }
    exc = await failure(loopback.json_error(429, payload, headers=[("retry-after", "2.5")]))
    assert (exc.status, exc.code, exc.retry_after) == (429, "rate_limit_error", 2.5)
    assert exc.message == "Number of requests exceeded"


async def test_529_overloaded() -> None:
    payload = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    exc = await failure(loopback.json_error(529, payload))
    assert (exc.status, exc.code, exc.retry_after) == (529, "overloaded_error", None)


async def test_401_echoing_the_key_is_scrubbed() -> None:
    payload = {"type": "error", "error": {"type": "authentication_error", "message": KEY}}
    exc = await failure(loopback.json_error(401, payload))
    assert (exc.status, exc.message) == (401, "***")


async def test_connection_dropped_mid_stream() -> None:
    body = loopback.fixture("anthropic-messages-tool-use.sse")
    exc = await failure(loopback.drop_mid_stream(body, after=700))
    assert exc.code == "connection_error"


async def test_cancellation_mid_stream_closes_the_connection() -> None:
    hang = Hang(loopback.named_sse(message_start(), *text_block(0, "first")))
    received: list[StreamPart] = []
    with trio.fail_after(10):
        async with serve(hang) as server:
            adapter = AnthropicAdapter(server.url, api_key=KEY)
            with trio.move_on_after(0.3) as scope:
                async with contextlib.aclosing(adapter.stream(make_request())) as parts:
                    async for part in parts:
                        received.append(part)
            assert scope.cancelled_caught
            with trio.fail_after(2):
                await hang.disconnected.wait()
    assert received == [TextDelta("first")]


# --- lone surrogates -----------------------------------------------------------------------


async def test_a_lone_surrogate_in_the_stream_is_delivered_as_sent() -> None:
    events = [
        message_start(),
        *text_block(0, "a\ud83d"),
        *tool_block(1, "toolu_s", "lookup", '{"q": "\udc00"}'),
        *message_end("tool_use"),
    ]
    body = loopback.named_sse(*events)
    assert b'"a\\ud83d"' in body
    parts = await run(loopback.sse_body(body))
    assert parts[0] == TextDelta("a\ud83d")
    assert arguments(parts, 0) == '{"q": "\udc00"}'
    assert finish_of(parts).reason == "tool_calls"


async def test_a_lone_surrogate_in_the_history_is_sent_as_a_replacement_character() -> None:
    history = (
        Message("user", "half \ud83d an emoji"),
        Message("assistant", "x\ude00", reasoning="r\ud83d", reasoning_signature="sig"),
        Message("user", "fine"),
    )
    body = loopback.named_sse(message_start(), *message_end())
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            await collect(AnthropicAdapter(server.url, api_key=KEY), make_request(history))
    [sent] = server.requests
    got = json.loads(sent.body.decode("utf-8"))
    assert got["messages"] == [
        {"role": "user", "content": "half \ufffd an emoji"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "r\ufffd", "signature": "sig"},
                {"type": "text", "text": "x\ufffd"},
            ],
        },
        {"role": "user", "content": "fine"},
    ]


# --- requests -------------------------------------------------------------------------------

WEATHER = ToolSpec(
    "get_weather",
    "Weather for a city.",
    frozen({"type": "object", "properties": {"city": {"type": "string"}}}),
)

HISTORY = (
    Message("user", "Weather in Paris and Rome?"),
    Message(
        "assistant",
        "Checking.",
        tool_calls=(
            ToolCall("toolu_1", "get_weather", frozen({"city": "Paris"})),
            ToolCall("toolu_2", "get_weather", '{"city": "Rome"'),
        ),
        reasoning="Two cities.",
        reasoning_signature="sig==",
    ),
    Message("tool", "18C", tool_call_id="toolu_1", name="get_weather"),
    Message("tool", "Error: bad arguments", tool_call_id="toolu_2", is_error=True),
)


async def test_request_body_and_headers_for_a_multi_turn_history() -> None:
    request = make_request(
        (
            *HISTORY,
            Message("user", "Also Oslo?"),
            Message("assistant", "", tool_calls=(ToolCall("toolu_3", "get_weather", frozen({})),)),
            Message("tool", frozen([{"type": "text", "text": "-2C"}]), tool_call_id="toolu_3"),
            Message("assistant", "Oslo is -2C.", reasoning="unsigned, not replayed"),
            Message("user", frozen([{"type": "text", "text": "Thanks!"}])),
        ),
        system="Be brief.",
        tools=(WEATHER,),
        extra={"thinking": {"type": "enabled", "budget_tokens": 1024}},
    )
    body = loopback.named_sse(message_start(), *message_end())
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            adapter = AnthropicAdapter(server.url, api_key=KEY, headers={"anthropic-beta": "b1"})
            await collect(adapter, request)
    [sent] = server.requests
    assert (sent.method, sent.path) == ("POST", "/v1/messages")
    assert sent.headers["x-api-key"] == KEY
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.headers["anthropic-beta"] == "b1"
    assert sent.headers["accept"] == "text/event-stream"
    assert "authorization" not in sent.headers
    got = sent.json()
    assert list(got) == ["model", "max_tokens", "system", "messages", "tools", "stream", "thinking"]
    assert (got["model"], got["max_tokens"], got["system"]) == ("claude-test", 4096, "Be brief.")
    assert got["stream"] is True
    assert got["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert got["tools"] == [
        {
            "name": "get_weather",
            "description": "Weather for a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    assert got["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two cities.", "signature": "sig=="},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "18C",
                    "is_error": False,
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": "Error: bad arguments",
                    "is_error": True,
                },
                {"type": "text", "text": "Also Oslo?"},
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_3", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_3",
                    "content": [{"type": "text", "text": "-2C"}],
                    "is_error": False,
                },
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Oslo is -2C."}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
    ]
    roles = [m["role"] for m in got["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]


async def test_max_tokens_from_config_and_defaults() -> None:
    body = loopback.named_sse(message_start(), *message_end())
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            await collect(AnthropicAdapter(server.url), make_request(max_tokens=10))
            small = AdapterDefaults(max_tokens=64)
            await collect_prepared(
                AnthropicAdapter(server.url, defaults=small), make_request(max_tokens=None)
            )
            await collect_prepared(AnthropicAdapter(server.url), make_request(max_tokens=None))
    explicit, defaulted, fallback = (r.json() for r in server.requests)
    assert explicit == {
        "model": "claude-test",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    assert defaulted["max_tokens"] == 64
    assert fallback["max_tokens"] == 4096
    assert "x-api-key" not in server.requests[0].headers


def test_defaults_keep_the_max_tokens_fallback() -> None:
    adapter = AnthropicAdapter("https://api.anthropic.com/v1", defaults=AdapterDefaults())
    assert adapter.defaults == AdapterDefaults(max_tokens=4096)
    adapter = AnthropicAdapter("https://api.anthropic.com", defaults=AdapterDefaults(max_tokens=9))
    assert adapter.defaults == AdapterDefaults(max_tokens=9)


async def test_consecutive_steps_share_a_byte_identical_prefix() -> None:
    step_2 = (*HISTORY, Message("assistant", "Paris 18C; Rome unknown."), Message("user", "Ok"))
    body = loopback.named_sse(message_start(), *message_end())
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            adapter = AnthropicAdapter(server.url, api_key=KEY)
            for history in (HISTORY, HISTORY, step_2):
                await collect(adapter, make_request(history, system="S", tools=(WEATHER,)))
    first, again, second = (r.body for r in server.requests)
    assert first == again
    messages_1 = dumps(json.loads(first)["messages"])
    messages_2 = dumps(json.loads(second)["messages"])
    assert messages_2.startswith(messages_1[:-1])
    assert second.startswith(first[: first.index(b',"tools":') - 1])


# --- configuration and secrets --------------------------------------------------------------


async def test_missing_model_or_max_tokens_is_rejected_before_any_request() -> None:
    adapter = AnthropicAdapter("http://127.0.0.1:9/v1", api_key=KEY)
    for config in (CallConfig(max_tokens=5), CallConfig(model="m")):
        with pytest.raises(ProviderError) as info:
            adapter.validate(config)
        assert info.value.code == "invalid_config"
    adapter.validate(CallConfig(model="m", max_tokens=5))
    # Nothing listens on port 9: reaching it would fail with connection_error instead.
    with pytest.raises(ProviderError) as info:
        await collect_prepared(adapter, make_request(model=None))
    assert info.value.code == "invalid_config"


def test_repr_and_defaults() -> None:
    adapter = AnthropicAdapter("https://api.anthropic.com/v1", api_key=KEY)
    assert repr(adapter) == "AnthropicAdapter(base_url='https://api.anthropic.com/v1')"
    assert adapter.defaults == AdapterDefaults(max_tokens=4096)


# --- reasoning blocks, base URLs, prompt caching ----------------------------------------------

SIG_ONE = "c2lnLW9uZS1hZ2VudGxvb3AtZml4dHVyZQ=="
SIG_TWO = "c2lnLXR3by1hZ2VudGxvb3AtZml4dHVyZQ=="
REDACTED = "RURBQ1RFRC1hZ2VudGxvb3AtZml4dHVyZS1ub3QtcmVhbA=="


@pytest.mark.parametrize("chunk_size", [None, 13])
async def test_redacted_and_several_thinking_blocks_fixture(chunk_size: int | None) -> None:
    parts = await run(
        loopback.replay_fixture("anthropic-messages-redacted-thinking.sse", chunk_size=chunk_size)
    )
    reasoning = [p for p in parts if isinstance(p, ReasoningDelta)]
    assert [p.block for p in reasoning] == [0, 0, 0, 0, 1, 2, 2, 2]
    assert reasoning[4] == ReasoningDelta(
        "", block=1, format="anthropic", fields={"type": "redacted_thinking", "data": REDACTED}
    )
    assert [p.signature for p in reasoning if p.signature] == [SIG_ONE, SIG_TWO]
    finish = finish_of(parts)
    assert finish.reason == "tool_calls"
    assert finish.usage is not None
    assert (finish.usage["cache_read_tokens"], finish.usage["cache_write_tokens"]) == (4096, 2048)


async def test_every_thinking_block_is_replayed_in_order_with_its_signature() -> None:
    with trio.fail_after(10):
        async with serve(
            loopback.replay_fixture("anthropic-messages-redacted-thinking.sse")
        ) as server:
            message = await loopback.fold_reply(
                AnthropicAdapter(server.url, api_key=KEY), make_request()
            )
        assert message.reasoning == "First, find the file. Then read it.The path is README.md."
        assert message.reasoning_signature == SIG_TWO  # the older field keeps the last one
        body = await loopback.sent_body(
            lambda url: AnthropicAdapter(url, api_key=KEY),
            (Message("user", "hi"), message, Message("tool", "# title", tool_call_id=(
                message.tool_calls[0].id))),
            max_tokens=100,
        )
    assert dumps(body["messages"][1]["content"]) == dumps([
        {"type": "thinking", "thinking": "First, find the file. Then read it.",
         "signature": SIG_ONE},
        {"type": "redacted_thinking", "data": REDACTED},
        {"type": "thinking", "thinking": "The path is README.md.", "signature": SIG_TWO},
        {"type": "text", "text": "Reading it now."},
        {"type": "tool_use", "id": "toolu_al_fixture_redacted", "name": "read_file",
         "input": {"path": "README.md"}},
    ])


async def test_foreign_or_unsigned_blocks_are_not_sent_as_thinking() -> None:
    history = (
        Message("user", "q"),
        Message("assistant", "a", reasoning="from elsewhere", reasoning_blocks=(
            frozen({"format": "openai-chat", "text": "from elsewhere",
                    "fields": {"field": "reasoning_content"}}),)),
        Message("user", "q2"),
        Message("assistant", "b", reasoning="cut", reasoning_blocks=(
            frozen({"format": "anthropic", "text": "cut", "fields": {"type": "thinking"}}),)),
        Message("user", "q3"),
    )
    body = await loopback.sent_body(lambda url: AnthropicAdapter(url, api_key=KEY), history,
                                    max_tokens=10)
    assert body["messages"][1]["content"] == [{"type": "text", "text": "a"}]
    assert body["messages"][3]["content"] == [{"type": "text", "text": "b"}]


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
async def test_base_url_with_or_without_the_version(suffix: str) -> None:
    body = loopback.named_sse(message_start(), *message_end())
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            root = server.url.removesuffix("/v1")
            await collect(AnthropicAdapter(root + suffix, api_key=KEY), make_request())
    assert [r.path for r in server.requests] == ["/v1/messages"]


async def test_prompt_caching_breakpoints() -> None:
    marker = {"type": "ephemeral", "ttl": "1h"}
    history = (
        Message("user", "first"),
        Message("assistant", "ok", reasoning="t", reasoning_signature="s"),
        Message("user", ({"type": "text", "text": "a"}, {"type": "text", "text": "b"})),
    )
    async with serve(loopback.json_error(400, {"error": {"message": "x"}})) as server:
        adapter = AnthropicAdapter(server.url, api_key=KEY, cache=("system", "tools", "history"),
                                   cache_ttl="1h")
        with pytest.raises(ProviderError):
            await collect(adapter, make_request(history, system="sys", tools=(WEATHER, WEATHER)))
    got = server.requests[-1].json()
    assert got["system"] == [{"type": "text", "text": "sys", "cache_control": marker}]
    assert "cache_control" not in got["tools"][0]
    assert got["tools"][1]["cache_control"] == marker
    assert got["messages"][0]["content"] == "first"
    assert got["messages"][2]["content"] == [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": marker}
    ]


async def test_no_cache_control_unless_asked() -> None:
    body = await loopback.sent_body(
        lambda url: AnthropicAdapter(url, api_key=KEY), (Message("user", "x"),), max_tokens=10
    )
    assert "cache_control" not in json.dumps(body)


def test_invalid_cache_options_are_config_errors() -> None:
    from agentloop import ConfigError

    with pytest.raises(ConfigError, match="breakpoints"):
        AnthropicAdapter("https://api.anthropic.com", cache=("everything",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cache_ttl"):
        AnthropicAdapter("https://api.anthropic.com", cache_ttl="1d")  # type: ignore[arg-type]
