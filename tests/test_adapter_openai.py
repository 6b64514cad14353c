"""OpenAIChatAdapter over real HTTP on loopback, plus the shared SSE decoder."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import attrs
import httpx
import loopback
import pytest
import trio
from loopback import Hang, serve

from agentloop._bus import EventBus
from agentloop._errors import ProviderError
from agentloop._json import FrozenDict, freeze
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
from agentloop.llm import OpenAIChatAdapter
from agentloop.llm._base import AdapterDefaults
from agentloop.llm._wire import SSEDecoder, SSEEvent, dumps

KEY = "sk-test-0123456789-SECRET"

# Closing a response before its end leaves httpx's and httpcore's nested body generators
# suspended (encode/httpx#3597, #3686); trio warns when it collects them.
httpx_early_close = pytest.mark.filterwarnings(
    "ignore:Async generator 'http(x|core)\\.:ResourceWarning"
)


frozen = freeze


def make_request(*args: Any, **config: Any) -> LLMRequest:
    config.setdefault("model", "gpt-test")
    return loopback.make_request(*args, **config)


collect = loopback.collect


async def collect_prepared(adapter: OpenAIChatAdapter, request: LLMRequest) -> list[StreamPart]:
    """One call as the runtime makes it: defaults filled and validated once, then streamed."""
    service = LLMService(EventBus())
    service.register("p", adapter)
    prepared = await service.prepare_call(attrs.evolve(request.config, provider="p"))
    stream, _ = await prepared.serve(attrs.evolve(request, config=prepared.config), agent_id="a")
    return [part async for part in stream]


async def run(handler: loopback.Handler, request: LLMRequest | None = None) -> list[StreamPart]:
    with trio.fail_after(10):
        async with serve(handler) as server:
            adapter = OpenAIChatAdapter(server.url, api_key=KEY)
            return await collect(adapter, request or make_request())


async def failure(handler: loopback.Handler, **kwargs: Any) -> ProviderError:
    with trio.fail_after(10):
        async with serve(handler) as server:
            adapter = OpenAIChatAdapter(server.url, api_key=KEY, **kwargs)
            with pytest.raises(ProviderError) as info:
                await collect(adapter, make_request())
    assert_no_key(info.value)
    return info.value


def assert_no_key(*things: object) -> None:
    for thing in things:
        assert KEY not in str(thing)
        assert KEY not in repr(thing)


def text_of(parts: list[StreamPart]) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextDelta))


def tool_calls(parts: list[StreamPart]) -> dict[int, dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for part in parts:
        if isinstance(part, ToolCallDelta):
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            for field in ("id", "name"):
                value = getattr(part, field)
                if value is not None:
                    assert call[field] is None, f"{field} of call {part.index} sent twice"
                    call[field] = value
            call["arguments"] += part.arguments
    return calls


def only_finish(parts: list[StreamPart]) -> Finish:
    finishes = [p for p in parts if isinstance(p, Finish)]
    assert len(finishes) == 1
    assert parts[-1] is finishes[0]
    return finishes[0]


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


# --- the project's own fixtures (tests/fixtures/streams) ------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
async def test_text_with_usage_fixture(chunk_size: int | None) -> None:
    parts = await run(
        loopback.replay_fixture("openai-chat-text-with-usage.sse", chunk_size=chunk_size)
    )
    assert parts[:-1] == [
        TextDelta("A loopback"),
        TextDelta(" server never"),
        TextDelta(" leaves the machine"),
        TextDelta(" \u2014 caf\u00e9"),
        TextDelta(" \u2615 included \U0001f680."),
    ]
    finish = only_finish(parts)
    assert finish.reason == "stop"
    assert finish.usage == {
        "input_tokens": 23,
        "output_tokens": 12,
        "total_tokens": 35,
        "cached_tokens": 0,
        "audio_tokens": 0,
        "reasoning_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
        "cache_read_tokens": 0,
    }


async def test_finish_length_fixture() -> None:
    parts = await run(loopback.replay_fixture("openai-chat-finish-length.sse"))
    assert text_of(parts) == "The first primes are 2, 3"
    finish = only_finish(parts)
    assert finish.reason == "max_tokens"
    assert finish.usage == {"input_tokens": 15, "output_tokens": 8, "total_tokens": 23}


@pytest.mark.parametrize("chunk_size", [None, 5])
async def test_tool_call_fixture(chunk_size: int | None) -> None:
    parts = await run(loopback.replay_fixture("openai-chat-tool-call.sse", chunk_size=chunk_size))
    assert parts[0] == ToolCallDelta(0, "call_alFixtureStation01", "find_station", "")
    rest = [p for p in parts[1:-1] if isinstance(p, ToolCallDelta)]
    assert len(rest) == 6 and all(p.id is None and p.name is None for p in rest)
    calls = tool_calls(parts)
    assert list(calls) == [0]
    assert json.loads(calls[0]["arguments"]) == {"name": "Gare du Nord", "limit": 3}
    finish = only_finish(parts)
    assert finish.reason == "tool_calls"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (61, 19)
    assert text_of(parts) == ""


async def test_parallel_tool_calls_fixture() -> None:
    parts = await run(loopback.replay_fixture("openai-chat-parallel-tool-calls.sse", chunk_size=64))
    calls = tool_calls(parts)
    assert calls == {
        0: {
            "id": "call_alFixtureClock01",
            "name": "local_time",
            "arguments": '{"zone": "Europe/Oslo"}',
        },
        1: {
            "id": "call_alFixtureUnits02",
            "name": "convert_units",
            "arguments": '{"value": 12.5, "from": "km", "to": "mi"}',
        },
    }
    finish = only_finish(parts)
    assert finish.reason == "tool_calls"
    assert finish.usage is not None and finish.usage["cached_tokens"] == 64


@pytest.mark.parametrize("chunk_size", [None, 3])
async def test_deepseek_reasoning_fixture(chunk_size: int | None) -> None:
    parts = await run(loopback.replay_fixture("deepseek-chat-reasoning.sse", chunk_size=chunk_size))
    assert parts[:-1] == [
        ReasoningDelta("Seventeen has no divisor", format="openai-chat",
                       fields={"field": "reasoning_content"}),
        ReasoningDelta(" between 2 and \u221a17."),
        TextDelta("Yes, 17"),
        TextDelta(" is prime."),
    ]
    finish = only_finish(parts)
    assert finish.reason == "stop"
    assert finish.usage is not None
    assert finish.usage["input_tokens"] == 12 and finish.usage["output_tokens"] == 31
    assert finish.usage["reasoning_tokens"] == 24
    assert finish.usage["prompt_cache_miss_tokens"] == 12


# --- third-party captures (../shared/streams, skipped when absent) ---------------------------


@loopback.needs_captures
@pytest.mark.parametrize("chunk_size", [None, 1, 13])
async def test_text_with_usage_capture(chunk_size: int | None) -> None:
    parts = await run(loopback.replay("openai-chat-text-with-usage.sse", chunk_size=chunk_size))
    assert text_of(parts) == (
        "I'm unable to provide real-time weather updates. To get the current weather in San"
        " Francisco, I recommend checking a reliable weather website or a weather app."
    )
    assert all(isinstance(p, (TextDelta, Finish)) for p in parts)
    finish = only_finish(parts)
    assert finish.reason == "stop"
    assert finish.usage is not None
    assert finish.usage["input_tokens"] == 14
    assert finish.usage["output_tokens"] == 30
    assert finish.usage["total_tokens"] == 44
    assert finish.usage["reasoning_tokens"] == 0


@loopback.needs_captures
async def test_finish_length_capture() -> None:
    parts = await run(loopback.replay("openai-chat-finish-length.sse"))
    assert parts[:-1] == [TextDelta('{"')]
    assert only_finish(parts).reason == "max_tokens"
    assert dict(only_finish(parts).usage or {})["output_tokens"] == 1


@loopback.needs_captures
async def test_tool_call_capture() -> None:
    parts = await run(loopback.replay("openai-chat-tool-call.sse"))
    assert parts[0] == ToolCallDelta(0, "call_4XzlGBLtUe9dy3GVNV4jhq7h", "get_weather", "")
    assert all(p.id is None and p.name is None for p in parts[1:-1] if isinstance(p, ToolCallDelta))
    calls = tool_calls(parts)
    assert list(calls) == [0]
    assert json.loads(calls[0]["arguments"]) == {"city": "New York City"}
    finish = only_finish(parts)
    assert finish.reason == "tool_calls"
    assert finish.usage is not None
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (44, 16)
    assert text_of(parts) == ""


@loopback.needs_captures
async def test_parallel_tool_calls_capture() -> None:
    parts = await run(loopback.replay("openai-chat-parallel-tool-calls.sse", chunk_size=64))
    calls = tool_calls(parts)
    assert list(calls) == [0, 1]
    assert calls[1]["id"] == "call_DNYTawLBoN8fj3KN6qU9N1Ou"
    assert calls[1]["name"] == "get_stock_price"
    assert json.loads(calls[1]["arguments"]) == {"ticker": "AAPL", "exchange": "NASDAQ"}
    assert calls[0]["id"] == "call_JMW1whyEaYG438VE1OIflxA2"
    assert calls[0]["name"] == "GetWeatherArgs"
    assert json.loads(calls[0]["arguments"]) == {"city": "Edinburgh", "country": "GB", "units": "c"}
    assert only_finish(parts).reason == "tool_calls"


# --- server variations ----------------------------------------------------------------------


async def test_repeated_id_and_name_are_sent_once() -> None:
    def fragment(index: int, args: str) -> dict[str, Any]:
        call = {"id": f"call_{index}", "type": "function"}
        call |= {"index": index, "function": {"name": f"tool_{index}", "arguments": args}}
        return chunk({"tool_calls": [call]})

    body = loopback.sse(
        fragment(0, ""),
        fragment(0, '{"a":'),
        fragment(1, '{"b":'),
        fragment(0, "1}"),
        fragment(1, "2}"),
        chunk(finish="tool_calls"),
        done=True,
    )
    parts = await run(loopback.sse_body(body))
    calls = tool_calls(parts)  # fails if an id or a name arrives twice
    assert calls == {
        0: {"id": "call_0", "name": "tool_0", "arguments": '{"a":1}'},
        1: {"id": "call_1", "name": "tool_1", "arguments": '{"b":2}'},
    }
    assert only_finish(parts).reason == "tool_calls"


async def test_reasoning_keepalives_and_usage_on_the_finish_chunk() -> None:
    body = (
        b": keep-alive\n\n"
        + loopback.sse(
            chunk({"role": "assistant", "content": None, "reasoning_content": "Think"}),
            chunk({"reasoning_content": "ing."}),
        )
        + b": keep-alive\n\n"
        + loopback.sse(
            chunk({"content": "Answer"}),
            chunk(
                {"content": ""},
                "stop",
                usage={"prompt_tokens": 5, "completion_tokens": 7, "prompt_cache_hit_tokens": 3},
            ),
            done=True,
        )
    )
    parts = await run(loopback.sse_body(body))
    assert parts == [
        ReasoningDelta("Think", format="openai-chat", fields={"field": "reasoning_content"}),
        ReasoningDelta("ing."),
        TextDelta("Answer"),
        Finish(
            "stop",
            {"input_tokens": 5, "output_tokens": 7, "prompt_cache_hit_tokens": 3,
             "cache_read_tokens": 3},
        ),
    ]


async def test_last_event_without_a_trailing_blank_line() -> None:
    body = loopback.sse(chunk({"content": "x"}), chunk(finish="stop")) + b"data: [DONE]"
    parts = await run(loopback.sse_body(body))
    assert parts == [TextDelta("x"), Finish("stop", None)]


async def test_finish_without_done_is_complete() -> None:
    parts = await run(
        loopback.sse_body(loopback.sse(chunk({"content": "x"}), chunk(finish="stop")))
    )
    assert parts == [TextDelta("x"), Finish("stop", None)]


async def test_content_filter_finish_reason() -> None:
    parts = await run(loopback.sse_body(loopback.sse(chunk(finish="content_filter"), done=True)))
    assert parts == [Finish("content_filter", None)]


async def test_refusal_text_and_reason() -> None:
    body = loopback.sse(chunk({"refusal": "I can't."}), chunk(finish="stop"), done=True)
    assert await run(loopback.sse_body(body)) == [TextDelta("I can't."), Finish("refusal", None)]


@pytest.mark.parametrize(
    ("raw", "mapped"),
    [
        ("function_call", "tool_calls"),
        ("error", "error"),
        ("insufficient_system_resource", "error"),
    ],
)
async def test_finish_reasons_outside_the_common_ones(raw: str, mapped: str) -> None:
    parts = await run(loopback.sse_body(loopback.sse(chunk(finish=raw), done=True)))
    assert parts == [Finish(mapped)]


async def test_error_object_inside_a_200_stream() -> None:
    error = {"error": {"message": "The server had an error", "type": "server_error", "code": None}}
    exc = await failure(loopback.sse_body(loopback.sse(chunk({"content": "par"}), error)))
    assert exc.message == "The server had an error"
    assert exc.code == "server_error"


async def test_malformed_json_line() -> None:
    exc = await failure(loopback.sse_body(loopback.sse(chunk({"content": "a"}), '{"choices": [')))
    assert exc.code == "malformed_stream"


async def test_empty_200_body_is_an_error() -> None:
    exc = await failure(loopback.sse_body(b""))
    assert exc.code == "incomplete_stream"


async def test_stream_ending_without_finish_is_an_error() -> None:
    exc = await failure(loopback.sse_body(loopback.sse(chunk({"content": "half an ans"}))))
    assert exc.code == "incomplete_stream"


async def test_json_document_with_error_instead_of_a_stream() -> None:
    exc = await failure(loopback.json_document({"error": {"message": "bad", "code": "oops"}}))
    assert (exc.message, exc.code) == ("bad", "oops")


# --- HTTP and transport failures ------------------------------------------------------------


async def test_429_with_retry_after_and_error_body() -> None:
    payload = {
        "error": {
            "message": "Rate limit reached for requests",
            "type": "requests",
            "code": "rate_limit_exceeded",
        }
    }
    exc = await failure(loopback.json_error(429, payload, headers=[("Retry-After", "7")]))
    assert exc.status == 429
    assert exc.code == "rate_limit_exceeded"
    assert exc.message == "Rate limit reached for requests"
    assert exc.retry_after == 7.0


async def test_500_with_a_plain_body() -> None:
    exc = await failure(loopback.plain_error(500, "upstream exploded"))
    assert exc.status == 500
    assert exc.code is None
    assert "upstream exploded" in exc.message
    assert exc.retry_after is None


async def test_provider_echoing_the_key_is_scrubbed() -> None:
    payload = {
        "error": {
            "message": f"Incorrect API key provided: {KEY}.",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }
    }
    exc = await failure(loopback.json_error(401, payload))
    assert (exc.status, exc.code) == (401, "invalid_api_key")
    assert exc.message == "Incorrect API key provided: ***."


async def test_connection_dropped_mid_stream() -> None:
    body = loopback.fixture("openai-chat-tool-call.sse")
    exc = await failure(loopback.drop_mid_stream(body, after=len(body) // 2))
    assert exc.code == "connection_error"
    assert exc.status is None


async def test_connection_refused() -> None:
    with trio.fail_after(10):
        port = await loopback.unused_port()
        adapter = OpenAIChatAdapter(f"http://127.0.0.1:{port}/v1", api_key=KEY)
        with pytest.raises(ProviderError) as info:
            await collect(adapter, make_request())
    assert info.value.code == "connection_error"
    assert_no_key(info.value, adapter)


async def test_read_timeout_with_an_explicit_client() -> None:
    hang = Hang(loopback.sse(chunk({"content": "slow"})))
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.2)) as client:
        exc = await failure(hang, client=client)
    assert exc.code == "timeout"


# --- cancellation ---------------------------------------------------------------------------


async def test_cancellation_mid_stream_closes_the_connection() -> None:
    hang = Hang(loopback.sse(chunk({"content": "first"})))
    received: list[StreamPart] = []
    with trio.fail_after(10):
        async with serve(hang) as server:
            adapter = OpenAIChatAdapter(server.url, api_key=KEY)
            with trio.move_on_after(0.3) as scope:
                async with contextlib.aclosing(adapter.stream(make_request())) as parts:
                    async for part in parts:
                        received.append(part)
            assert scope.cancelled_caught
            with trio.fail_after(2):
                await hang.disconnected.wait()
    assert received == [TextDelta("first")]


@httpx_early_close
async def test_leaving_early_closes_the_connection() -> None:
    hang = Hang(loopback.sse(chunk({"content": "first"})))
    with trio.fail_after(10):
        async with serve(hang) as server:
            adapter = OpenAIChatAdapter(server.url, api_key=KEY)
            stream = adapter.stream(make_request())
            assert await anext(stream) == TextDelta("first")
            await stream.aclose()
            with trio.fail_after(2):
                await hang.disconnected.wait()


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
            ToolCall("call_1", "get_weather", frozen({"city": "Paris"})),
            ToolCall("call_2", "get_weather", '{"city": "Rome"'),
        ),
        reasoning="Two cities.",
    ),
    Message("tool", "18C", tool_call_id="call_1", name="get_weather"),
    Message(
        "tool", "Error: bad arguments", tool_call_id="call_2", name="get_weather", is_error=True
    ),
)


async def test_request_body_and_headers_for_a_multi_turn_history() -> None:
    followup = Message("user", frozen([{"type": "text", "text": "Thanks!"}]))
    request = make_request(
        (*HISTORY, Message("assistant", "Paris is 18C."), followup),
        system="Be brief.",
        tools=(WEATHER,),
        max_tokens=256,
        reasoning_effort="low",
        extra={"temperature": 0, "stream_options": {"include_usage": False}},
    )
    body = loopback.sse(chunk(finish="stop"), done=True)
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            adapter = OpenAIChatAdapter(server.url, api_key=KEY, headers={"X-Trace": "t1"})
            await collect(adapter, request)
    [sent] = server.requests
    assert (sent.method, sent.path) == ("POST", "/v1/chat/completions")
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["accept"] == "text/event-stream"
    assert sent.headers["x-trace"] == "t1"
    got = sent.json()
    assert list(got) == [
        "model",
        "messages",
        "tools",
        "stream",
        "stream_options",
        "max_tokens",
        "reasoning_effort",
        "temperature",
    ]
    assert got["model"] == "gpt-test"
    assert got["stream"] is True
    assert got["stream_options"] == {"include_usage": False}  # extra wins
    assert got["max_tokens"] == 256
    assert got["reasoning_effort"] == "low"
    assert got["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    assert got["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"'},
                },
            ],
            "reasoning_content": "Two cities.",
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Error: bad arguments"},
        {"role": "assistant", "content": "Paris is 18C."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
    ]


async def test_minimal_body_and_defaults() -> None:
    body = loopback.sse(chunk(finish="stop"), done=True)
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            await collect(OpenAIChatAdapter(server.url), make_request())
            defaults = AdapterDefaults(max_tokens=99, reasoning_effort="high")
            adapter = OpenAIChatAdapter(server.url, defaults=defaults)
            await collect(adapter, make_request())
            await collect_prepared(adapter, make_request())
    plain, direct, prepared = (r.json() for r in server.requests)
    assert "authorization" not in server.requests[0].headers
    assert plain == {
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # Defaults are filled by prepare_call only; the adapter sends the config it is given.
    assert direct == plain
    assert (prepared["max_tokens"], prepared["reasoning_effort"]) == (99, "high")


async def test_consecutive_steps_share_a_byte_identical_prefix() -> None:
    step_2 = (*HISTORY, Message("assistant", "Paris 18C; Rome unknown."), Message("user", "Ok"))
    body = loopback.sse(chunk(finish="stop"), done=True)
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            adapter = OpenAIChatAdapter(server.url, api_key=KEY)
            for history in (HISTORY, HISTORY, step_2):
                await collect(adapter, make_request(history, system="S", tools=(WEATHER,)))
    first, again, second = (r.body for r in server.requests)
    assert first == again
    head = first[: first.index(b'"messages":')]
    assert second.startswith(head)
    messages_1 = dumps(json.loads(first)["messages"])
    messages_2 = dumps(json.loads(second)["messages"])
    assert messages_2.startswith(messages_1[:-1])
    # Raw bytes: everything up to the last message of step 1 is repeated verbatim.
    assert second.startswith(first[: first.index(b',"tools":') - 1])


# --- configuration and secrets --------------------------------------------------------------


async def test_missing_model_is_rejected_before_any_request() -> None:
    adapter = OpenAIChatAdapter("http://127.0.0.1:9/v1", api_key=KEY)
    with pytest.raises(ProviderError) as info:
        adapter.validate(CallConfig())
    assert info.value.code == "invalid_config"
    # Nothing listens on port 9: reaching it would fail with connection_error instead.
    with pytest.raises(ProviderError) as info:
        await collect_prepared(adapter, make_request(model=None))
    assert info.value.code == "invalid_config"
    adapter.validate(CallConfig(model="m"))


def test_repr_hides_the_key() -> None:
    adapter = OpenAIChatAdapter("http://127.0.0.1:8080/v1/", api_key=KEY)
    assert repr(adapter) == "OpenAIChatAdapter(base_url='http://127.0.0.1:8080/v1')"
    assert_no_key(adapter)
    assert adapter.defaults == AdapterDefaults()


# --- lone surrogates -----------------------------------------------------------------------


async def test_a_lone_surrogate_in_the_stream_is_delivered_as_sent() -> None:
    # A pair split over two deltas is only whole once the reply is folded, so nothing is
    # repaired here.
    body = loopback.sse(
        chunk({"content": "a\ud83d"}),
        chunk({"content": "\ude00b"}),
        chunk(finish="stop"),
        done=True,
    )
    assert b'"a\\ud83d"' in body
    parts = await run(loopback.sse_body(body))
    assert parts == [TextDelta("a\ud83d"), TextDelta("\ude00b"), Finish("stop", None)]


async def test_a_lone_surrogate_in_the_history_is_sent_as_a_replacement_character() -> None:
    history = (
        Message("user", "half \ud83d an emoji"),
        Message(
            "assistant",
            "x\ude00",
            tool_calls=(ToolCall("call_1", "t", '{"q": "\udbff"}'),),
            reasoning="r\ud83d",
        ),
        Message("tool", "y\ud800", tool_call_id="call_1"),
    )
    body = loopback.sse(chunk({"content": "ok"}), chunk(finish="stop"), done=True)
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            adapter = OpenAIChatAdapter(server.url, api_key=KEY)
            parts = await collect(adapter, make_request(history, system="s\udc00"))
    assert text_of(parts) == "ok"
    [sent] = server.requests
    got = json.loads(sent.body.decode("utf-8"))
    assert [m.get("content") for m in got["messages"]] == [
        "s\ufffd",
        "half \ufffd an emoji",
        "x\ufffd",
        "y\ufffd",
    ]
    assert got["messages"][2]["reasoning_content"] == "r\ufffd"
    assert got["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"q": "\ufffd"}'


async def test_an_error_message_with_a_lone_surrogate_is_made_encodable() -> None:
    exc = await failure(loopback.json_error(500, {"error": {"message": "bad \ud83d", "code": "c"}}))
    assert exc.message == "bad \ufffd"
    json.dumps(exc.to_json(), ensure_ascii=False).encode()


# --- the SSE decoder ------------------------------------------------------------------------


SAMPLE = (
    ": comment\r\n"
    "event: first\r\n"
    'data: {"a": "\u00e9\u2028"}\r\n'
    "\r\n"
    "data: line one\rdata:line two\r\r"
    "id: 7\nretry: 10\nunknown: x\ndata\n\n"
    "event: last\n"
    "data: tail"
)
EXPECTED = [
    SSEEvent("first", '{"a": "\u00e9\u2028"}'),
    SSEEvent("message", "line one\nline two"),
    SSEEvent("message", ""),
    SSEEvent("last", "tail"),
]


def test_sse_decoder_whole() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(SAMPLE) + decoder.close() == EXPECTED


def test_sse_decoder_at_every_split_point() -> None:
    for cut in range(len(SAMPLE) + 1):
        decoder = SSEDecoder()
        events = decoder.feed(SAMPLE[:cut]) + decoder.feed(SAMPLE[cut:]) + decoder.close()
        assert events == EXPECTED, cut


def test_sse_decoder_character_by_character() -> None:
    decoder = SSEDecoder()
    events = [event for char in SAMPLE for event in decoder.feed(char)]
    assert events + decoder.close() == EXPECTED


def test_sse_decoder_close_is_idempotent_and_drops_nameless_empties() -> None:
    decoder = SSEDecoder()
    assert decoder.feed("event: x\n\n: only a comment\n\n") == []
    assert decoder.close() == []
    assert decoder.close() == []


# --- reasoning fields, replay, DeepSeek tool-call turns, cached tokens ----------------------


async def test_vllm_reasoning_field_becomes_a_block_replayed_under_that_field() -> None:
    body = loopback.sse(
        chunk({"role": "assistant", "reasoning": "Think"}),
        chunk({"reasoning": "ing."}),
        chunk({"content": "Done."}, "stop"),
        done=True,
    )
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            message = await loopback.fold_reply(OpenAIChatAdapter(server.url, api_key=KEY))
        assert message.reasoning == "Thinking."
        sent = await loopback.sent_body(
            lambda url: OpenAIChatAdapter(url, api_key=KEY), (Message("user", "hi"), message)
        )
    assert sent["messages"][1] == {
        "role": "assistant", "content": "Done.", "reasoning": "Thinking."
    }


async def test_a_server_sending_both_fields_is_read_once() -> None:
    parts = await run(loopback.sse_body(loopback.sse(
        chunk({"reasoning_content": "A", "reasoning": "A"}),
        chunk({"reasoning_content": "B", "reasoning": "B"}),
        chunk({}, "stop"),
    )))
    assert "".join(p.text for p in parts if isinstance(p, ReasoningDelta)) == "AB"


async def test_foreign_reasoning_is_sent_as_reasoning_content() -> None:
    message = Message("assistant", "x", reasoning="signed elsewhere", reasoning_blocks=(
        frozen({"format": "anthropic", "text": "signed elsewhere", "signature": "s"}),))
    sent = await loopback.sent_body(
        lambda url: OpenAIChatAdapter(url, api_key=KEY), (Message("user", "q"), message)
    )
    assert sent["messages"][1]["reasoning_content"] == "signed elsewhere"
    assert "reasoning" not in sent["messages"][1]


@pytest.mark.parametrize("pad", [True, False])
async def test_tool_call_turns_carry_reasoning_content_when_asked(pad: bool) -> None:
    history = (
        Message("user", "q"),
        Message("assistant", "", tool_calls=(ToolCall("c1", "f", frozen({})),)),
        Message("tool", "r", tool_call_id="c1", name="f"),
        Message("assistant", "plain answer"),
    )
    sent = await loopback.sent_body(
        lambda url: OpenAIChatAdapter(url, api_key=KEY, tool_call_reasoning=pad), history
    )
    assert ("reasoning_content" in sent["messages"][1]) is pad
    if pad:
        assert sent["messages"][1]["reasoning_content"] == ""
    assert "reasoning_content" not in sent["messages"][3]


def test_tool_call_reasoning_defaults_on_for_deepseek_only() -> None:
    assert OpenAIChatAdapter("https://api.deepseek.com").tool_call_reasoning
    assert OpenAIChatAdapter("https://api.deepseek.com/v1").tool_call_reasoning
    assert not OpenAIChatAdapter("https://api.openai.com/v1").tool_call_reasoning
    assert not OpenAIChatAdapter("https://notdeepseek.com/v1").tool_call_reasoning


async def test_cached_prompt_tokens_are_reported_as_cache_reads() -> None:
    parts = await run(loopback.replay_fixture("openai-chat-parallel-tool-calls.sse"))
    usage = only_finish(parts).usage
    assert usage is not None and usage["cache_read_tokens"] == usage["cached_tokens"] == 64


async def test_the_base_url_is_used_as_given() -> None:
    body = loopback.sse(chunk({}, "stop"))
    with trio.fail_after(10):
        async with serve(loopback.sse_body(body)) as server:
            root = server.url.removesuffix("/v1")
            await collect(OpenAIChatAdapter(root, api_key=KEY), make_request())
    assert [r.path for r in server.requests] == ["/chat/completions"]


# --- failures that are not the provider's ---------------------------------------------------


class _Boom(Exception):
    pass


class _FailsMidStream:
    """A foreign adapter (no ModelAdapter subclass) whose stream breaks after one part."""

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: LLMRequest) -> Any:
        self.calls += 1
        yield TextDelta("partial ")
        if self.calls == 1:
            raise _Boom("adapter bug")
        yield TextDelta("fine")
        yield Finish("stop")


class _FailsAtCall:
    def stream(self, request: LLMRequest) -> Any:
        raise _Boom("cannot even start")


class _BrokenDecoder(OpenAIChatAdapter):
    def _decoder(self) -> Any:
        decoder = super()._decoder()
        original = decoder.feed

        def feed(event: SSEEvent) -> list[StreamPart]:
            parts = original(event)
            if parts:
                raise KeyError(f"unforeseen payload, key {KEY}")
            return parts

        decoder.feed = feed  # type: ignore[method-assign]
        return decoder


async def _errors_seen(adapter: Any, *, retry: bool) -> tuple[list[ProviderError], list[str]]:
    import agentloop
    from agentloop.events import AgentRequestError, Retry

    seen: list[ProviderError] = []

    def decide(event: AgentRequestError) -> object:
        seen.append(event.error)
        return Retry() if retry and len(seen) == 1 else None

    async with agentloop.open_runtime() as rt:
        rt.llm.register("p", adapter)
        rt.events.on(AgentRequestError, decide)
        handle = await rt.agents.create(
            session_id="s1", agent_options=agentloop.AgentOptions(provider="p", model="m")
        )
        async with handle:
            with trio.fail_after(10):
                handle.agent.followup("hi")
                await handle.agent.wait_idle()
            ends = [e.data["reason"] for e in handle.agent.session.events if e.type == "turn/end"]
    return seen, ends


async def test_an_exception_inside_a_foreign_stream_reaches_request_error_and_retries() -> None:
    seen, ends = await _errors_seen(_FailsMidStream(), retry=True)
    assert [e.code for e in seen] == ["adapter_error"]
    assert isinstance(seen[0].__cause__, _Boom)
    assert "adapter bug" in seen[0].message
    assert ends == ["completed"]


async def test_an_exception_when_a_stream_is_opened_is_a_provider_failure() -> None:
    seen, ends = await _errors_seen(_FailsAtCall(), retry=False)
    assert [e.code for e in seen] == ["adapter_error"]
    assert isinstance(seen[0].__cause__, _Boom)
    assert ends == ["error"]


async def test_a_decoder_bug_in_an_http_adapter_is_a_masked_provider_failure() -> None:
    body = loopback.sse(chunk({"content": "x"}), chunk({}, "stop"), done=True)
    async with serve(loopback.sse_body(body)) as server:
        seen, ends = await _errors_seen(_BrokenDecoder(server.url, api_key=KEY), retry=False)
    assert [e.code for e in seen] == ["adapter_error"]
    assert isinstance(seen[0].__cause__, KeyError)
    assert_no_key(seen[0], seen[0].__cause__)
    assert ends == ["error"]


async def test_a_failing_llm_stream_handler_is_a_provider_failure() -> None:
    service = LLMService(EventBus())

    async def parts() -> Any:
        yield TextDelta("x")
        raise _Boom("served badly")

    from agentloop._reply import fold_stream
    from agentloop._session import Session
    from agentloop.events import LlmStream

    service._bus.on(LlmStream, lambda event: parts())
    prepared = await service.prepare_call(CallConfig(provider="none", model="m"))
    stream, failure = await prepared.serve(make_request(), agent_id="a")
    session = Session("s", FrozenDict(), service._bus)
    with pytest.raises(ProviderError) as info:
        await fold_stream(session, 1, 1, stream, failure=failure)  # as the driver reads it
    assert info.value.code == "adapter_error"
    assert isinstance(info.value.__cause__, _Boom)


# --- Gemini's OpenAI-compatible endpoint ----------------------------------------------------


def _gemini_call(call_id: str, name: str, arguments: str, signature: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments},
            "extra_content": {"google": {"thought_signature": signature}}}


GEMINI_STREAM = loopback.sse(
    chunk({"role": "assistant", "tool_calls": [_gemini_call("c-1", "read", '{"p":1}', "sigA")]}),
    chunk({"tool_calls": [_gemini_call("c-2", "read", '{"p":2}', "sigB")]}),
    chunk({}, "stop"),
    done=True,
)


async def test_unindexed_calls_with_thought_signatures_and_a_stop_finish() -> None:
    parts = await run(loopback.sse_body(GEMINI_STREAM))
    calls = tool_calls(parts)
    assert calls == {
        0: {"id": "c-1", "name": "read", "arguments": '{"p":1}'},
        1: {"id": "c-2", "name": "read", "arguments": '{"p":2}'},
    }
    assert only_finish(parts).reason == "tool_calls"


async def test_thought_signatures_go_back_on_their_calls() -> None:
    with trio.fail_after(10):
        async with serve(loopback.sse_body(GEMINI_STREAM)) as server:
            message = await loopback.fold_reply(OpenAIChatAdapter(server.url, api_key=KEY))
        sent = await loopback.sent_body(
            lambda url: OpenAIChatAdapter(url, api_key=KEY), (Message("user", "hi"), message)
        )
    assert dumps(sent["messages"][1]["tool_calls"]) == dumps([
        _gemini_call("c-1", "read", '{"p":1}', "sigA"),
        _gemini_call("c-2", "read", '{"p":2}', "sigB"),
    ])
    assert "reasoning_content" not in sent["messages"][1]


async def test_a_forced_function_finishing_with_stop_is_a_tool_call_finish() -> None:
    parts = await run(loopback.sse_body(loopback.sse(
        chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({}, "stop"),
    )))
    assert only_finish(parts).reason == "tool_calls"


def test_only_the_shipped_http_streams_skip_the_runtime_guard() -> None:
    class OwnStream(OpenAIChatAdapter):
        def stream(self, request: LLMRequest) -> Any:
            return super().stream(request)

    assert OpenAIChatAdapter._raises_provider_errors
    assert _BrokenDecoder._raises_provider_errors  # same stream, decoder failures converted
    assert not OwnStream._raises_provider_errors
