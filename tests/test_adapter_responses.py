"""OpenAIResponsesAdapter over real HTTP on loopback, with the project's constructed streams."""

from __future__ import annotations

import json
from typing import Any

import loopback
import pytest
import trio
from loopback import serve

from agentloop import Message, ProviderError, ToolCall, ToolSpec
from agentloop._json import freeze, thaw
from agentloop._model import Finish, ReasoningDelta, StreamPart, TextDelta, ToolCallDelta
from agentloop.llm import OpenAIResponsesAdapter
from agentloop.llm._wire import dumps

KEY = "sk-test-responses-SECRET"
ENCRYPTED = "Z0FBQUFBQm9fYWdlbnRsb29wX2ZpeHR1cmVfbm90X3JlYWxfY2lwaGVydGV4dA=="


def adapter_at(url: str, **kwargs: Any) -> OpenAIResponsesAdapter:
    return OpenAIResponsesAdapter(url, api_key=KEY, **kwargs)


async def run(handler: loopback.Handler, **config: Any) -> list[StreamPart]:
    with trio.fail_after(10):
        async with serve(handler) as server:
            return await loopback.collect(adapter_at(server.url), loopback.make_request(**config))


async def failure(handler: loopback.Handler) -> ProviderError:
    with trio.fail_after(10):
        async with serve(handler) as server:
            with pytest.raises(ProviderError) as info:
                await loopback.collect(adapter_at(server.url), loopback.make_request())
    assert KEY not in str(info.value) and KEY not in repr(info.value)
    return info.value


def finish_of(parts: list[StreamPart]) -> Finish:
    assert isinstance(parts[-1], Finish)
    assert sum(isinstance(p, Finish) for p in parts) == 1
    return parts[-1]


@pytest.mark.parametrize("chunk_size", [None, 1, 23])
async def test_text_fixture(chunk_size: int | None) -> None:
    parts = await run(loopback.replay_fixture("openai-responses-text.sse", chunk_size=chunk_size))
    assert parts[:-1] == [
        TextDelta("Loopback"),
        TextDelta(" servers stay"),
        TextDelta(" on the machine \u2014 caf\u00e9 \u2615."),
    ]
    finish = finish_of(parts)
    assert finish.reason == "stop"
    assert finish.usage == {
        "input_tokens": 37, "output_tokens": 14, "total_tokens": 51, "cached_tokens": 0,
        "reasoning_tokens": 0, "cache_read_tokens": 0,
    }


@pytest.mark.parametrize("chunk_size", [None, 7])
async def test_reasoning_and_function_call_fixture(chunk_size: int | None) -> None:
    parts = await run(
        loopback.replay_fixture("openai-responses-reasoning-tool-call.sse", chunk_size=chunk_size)
    )
    reasoning = [p for p in parts if isinstance(p, ReasoningDelta)]
    assert {p.block for p in reasoning} == {0}
    assert "".join(p.text for p in reasoning) == (
        "The user wants the weather in Oslo.\n\nA tool call answers that."
    )
    done = reasoning[-1]
    assert done.format == "openai-responses" and done.fields is not None
    assert done.fields["item"]["encrypted_content"] == ENCRYPTED
    calls = [p for p in parts if isinstance(p, ToolCallDelta)]
    assert calls[0] == ToolCallDelta(0, "call_al_fixture_01", "get_weather", "")
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Oslo", "unit": "c"}
    finish = finish_of(parts)
    assert finish.reason == "tool_calls"
    assert finish.usage is not None
    assert finish.usage["cache_read_tokens"] == 1024
    assert finish.usage["reasoning_tokens"] == 64
    assert (finish.usage["input_tokens"], finish.usage["output_tokens"]) == (1322, 96)


async def test_incomplete_fixture_finishes_with_max_tokens() -> None:
    parts = await run(loopback.replay_fixture("openai-responses-incomplete.sse"))
    assert parts[:-1] == [TextDelta("The answer is cut")]
    assert finish_of(parts).reason == "max_tokens"


async def test_failed_fixture_raises_the_provider_code() -> None:
    error = await failure(loopback.replay_fixture("openai-responses-failed.sse"))
    assert error.code == "server_error"
    assert "server had an error" in error.message


async def test_error_event_fixture() -> None:
    error = await failure(loopback.replay_fixture("openai-responses-error.sse"))
    assert error.code == "rate_limit_exceeded"


async def test_truncated_fixture_is_incomplete() -> None:
    error = await failure(loopback.replay_fixture("openai-responses-truncated.sse"))
    assert error.code == "incomplete_stream"


async def test_connection_dropped_mid_stream() -> None:
    body = loopback.fixture("openai-responses-text.sse")
    error = await failure(loopback.drop_mid_stream(body, after=len(body) // 2))
    assert error.code in ("connection_error", "incomplete_stream")


async def test_http_error_status() -> None:
    error = await failure(
        loopback.json_error(
            429, {"error": {"message": "slow down", "type": "requests", "code": "rate_limit"}},
            headers=[("Retry-After", "2")],
        )
    )
    assert (error.status, error.code, error.retry_after) == (429, "rate_limit", 2.0)


async def test_arguments_only_on_the_done_item() -> None:
    item = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": ""}
    body = loopback.named_sse(
        ("response.output_item.added", {"type": "response.output_item.added",
                                        "output_index": 0, "item": item}),
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0,
                                       "item": {**item, "arguments": '{"a":1}'}}),
        ("response.completed", {"type": "response.completed", "response": {"usage": None}}),
    )
    parts = await run(loopback.sse_body(body))
    assert parts == [
        ToolCallDelta(0, "c1", "f", ""), ToolCallDelta(0, arguments='{"a":1}'),
        Finish("tool_calls"),
    ]


async def test_request_body_and_history() -> None:
    item = freeze({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "E"})
    history = (
        Message("user", "weather?"),
        Message(
            "assistant", "Checking.",
            tool_calls=(ToolCall("c1", "get_weather", freeze({"city": "Oslo"})),),
            reasoning="r",
            reasoning_blocks=(freeze({"format": "openai-responses", "text": "r",
                                      "fields": {"item": item}}),),
        ),
        Message("tool", "-2C", tool_call_id="c1", name="get_weather"),
        Message("assistant", "Cold.", reasoning="foreign",
                reasoning_blocks=(freeze({"format": "anthropic", "text": "foreign",
                                          "signature": "s"}),)),
        Message("user", ({"type": "text", "text": "thanks"},)),
    )
    spec = ToolSpec("get_weather", "Weather.", freeze({"type": "object"}))
    async with serve(loopback.json_error(400, {"error": {"message": "seen"}})) as server:
        with pytest.raises(ProviderError):
            await loopback.collect(
                adapter_at(server.url),
                loopback.make_request(history, system="Be brief.", tools=(spec,),
                                      reasoning_effort="low", max_tokens=50),
            )
    sent = server.requests[-1]
    assert (sent.method, sent.path) == ("POST", "/v1/responses")
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert sent.headers["accept"] == "text/event-stream"
    body = sent.json()
    assert body["instructions"] == "Be brief."
    assert body["store"] is False and body["stream"] is True
    assert body["include"] == ["reasoning.encrypted_content"]
    assert body["reasoning"] == {"effort": "low"} and body["max_output_tokens"] == 50
    assert body["tools"] == [
        {"type": "function", "name": "get_weather", "description": "Weather.",
         "parameters": {"type": "object"}}
    ]
    assert body["input"] == [
        {"role": "user", "content": "weather?"},
        thaw(item),
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": dumps({"city": "Oslo"})},
        {"type": "function_call_output", "call_id": "c1", "output": "-2C"},
        {"role": "assistant", "content": "Cold."},  # another format's reasoning is not sent
        {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
    ]


async def test_no_encrypted_reasoning_without_effort() -> None:
    body = await loopback.sent_body(adapter_at, (Message("user", "hi"),))
    assert "include" not in body and "reasoning" not in body


async def test_reasoning_item_replayed_verbatim_after_the_fold() -> None:
    with trio.fail_after(10):
        async with serve(
            loopback.replay_fixture("openai-responses-reasoning-tool-call.sse")
        ) as server:
            message = await loopback.fold_reply(adapter_at(server.url))
        body = await loopback.sent_body(adapter_at, (Message("user", "hi"), message))
    fixture = loopback.fixture("openai-responses-reasoning-tool-call.sse").decode()
    done_items = [
        json.loads(line[6:])["item"] for line in fixture.splitlines()
        if line.startswith("data: ") and '"response.output_item.done"' in line
    ]
    assert body["input"][1] == done_items[0]  # the reasoning item, encrypted content and all
    assert body["input"][2] == {
        "type": "function_call", "call_id": "call_al_fixture_01", "name": "get_weather",
        "arguments": '{"city":"Oslo","unit":"c"}',
    }


def test_repr_hides_the_key() -> None:
    adapter = adapter_at("https://api.openai.com/v1/")
    assert repr(adapter) == "OpenAIResponsesAdapter(base_url='https://api.openai.com/v1')"
