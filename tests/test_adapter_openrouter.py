"""OpenRouter's ``reasoning_details`` over loopback HTTP: kept verbatim, replayed to OpenRouter.

The stream follows OpenRouter's documented shape: each chunk's ``delta`` carries the plain
``reasoning`` text and ``reasoning_details`` fragments (``reasoning.text`` with a final
``signature``, ``reasoning.summary``, ``reasoning.encrypted``) that share an ``index``.
"""

from __future__ import annotations

import json
from typing import Any

import loopback
import trio

from agentloop import Message
from agentloop.llm import AnthropicAdapter, OpenAIChatAdapter

CLAUDE = "anthropic-claude-v1"


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "gen-1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def detail(**fields: Any) -> dict[str, Any]:
    return {"reasoning_details": [fields]}


BODY = loopback.sse(
    chunk({"role": "assistant", "content": "", "reasoning": "Let",
           **detail(type="reasoning.text", text="Let", format=CLAUDE, index=0)}),
    chunk({"reasoning": " me think.",
           **detail(type="reasoning.text", text=" me think.", format=CLAUDE, index=0)}),
    chunk(detail(type="reasoning.text", text="", signature="c2lnbmF0dXJl", format=CLAUDE,
                 index=0)),
    chunk(detail(type="reasoning.encrypted", data="ZW5j", id="rs_1", format=CLAUDE, index=1)),
    chunk(detail(type="reasoning.encrypted", data="cnlwdGVk", index=1)),
    chunk({"reasoning": "In short.",
           **detail(type="reasoning.summary", summary="In short.", format=CLAUDE, index=2)}),
    chunk({"content": "Hi", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                              "function": {"name": "look", "arguments": "{}"}}]}),
    chunk({}, "tool_calls"),
    done=True,
)

EXPECTED = [
    {"type": "reasoning.text", "text": "Let me think.", "format": CLAUDE, "index": 0,
     "signature": "c2lnbmF0dXJl"},
    {"type": "reasoning.encrypted", "data": "ZW5jcnlwdGVk", "id": "rs_1", "format": CLAUDE,
     "index": 1},
    {"type": "reasoning.summary", "summary": "In short.", "format": CLAUDE, "index": 2},
]


async def folded() -> Message:
    async with loopback.serve(loopback.sse_body(BODY, chunk_size=37)) as server:
        return await loopback.fold_reply(OpenAIChatAdapter(server.url, api_key="k"))


async def test_details_are_kept_and_replayed_to_openrouter_verbatim() -> None:
    with trio.fail_after(20):
        message = await folded()
        # The plain reasoning repeats the details' text: it is read once.
        assert message.reasoning == "Let me think.In short."
        assert message.tool_calls[0].id == "call_1"
        sent = await loopback.sent_body(
            lambda url: OpenAIChatAdapter(url, api_key="k", reasoning_details=True),
            (Message("user", "hi"), message),
        )
    replayed = sent["messages"][1]
    assert json.dumps(replayed["reasoning_details"]) == json.dumps(EXPECTED)
    assert "reasoning" not in replayed
    assert "reasoning_content" not in replayed
    assert replayed["tool_calls"][0]["id"] == "call_1"


async def test_other_providers_get_the_text_form() -> None:
    with trio.fail_after(20):
        message = await folded()
        chat = await loopback.sent_body(
            lambda url: OpenAIChatAdapter(url, api_key="k"), (Message("user", "hi"), message)
        )
        claude = await loopback.sent_body(
            lambda url: AnthropicAdapter(url, api_key="k"), (Message("user", "hi"), message)
        )
    replayed = chat["messages"][1]
    assert replayed["reasoning_content"] == "Let me think.In short."
    assert "reasoning_details" not in replayed
    for body in (chat, claude):
        text = json.dumps(body)
        assert "ZW5j" not in text  # encrypted data stays with its owner
        assert "c2lnbmF0dXJl" not in text


def test_openrouter_is_recognised_by_its_host() -> None:
    assert OpenAIChatAdapter("https://openrouter.ai/api/v1").reasoning_details is True
    assert OpenAIChatAdapter("https://api.openai.com/v1").reasoning_details is False
    assert OpenAIChatAdapter("http://127.0.0.1:1/v1", reasoning_details=True).reasoning_details


async def test_a_detail_without_index_is_one_of_its_own() -> None:
    body = loopback.sse(
        chunk(detail(type="reasoning.encrypted", data="AAA", format="google-gemini-v1")),
        chunk(detail(type="reasoning.text", text="Why.", format="google-gemini-v1")),
        chunk({"content": "Ok"}, "stop"),
        done=True,
    )
    with trio.fail_after(20):
        async with loopback.serve(loopback.sse_body(body)) as server:
            message = await loopback.fold_reply(OpenAIChatAdapter(server.url))
        sent = await loopback.sent_body(
            lambda url: OpenAIChatAdapter(url, reasoning_details=True),
            (Message("user", "hi"), message),
        )
    assert sent["messages"][1]["reasoning_details"] == [
        {"type": "reasoning.encrypted", "data": "AAA", "format": "google-gemini-v1"},
        {"type": "reasoning.text", "text": "Why.", "format": "google-gemini-v1"},
    ]
