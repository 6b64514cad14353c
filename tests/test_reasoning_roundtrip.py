"""Reasoning and tool-call blocks survive the round trip, byte for byte, per provider.

Each example builds a stream in one provider's documented format (blocks in the order that
provider sends them, every fragment split anywhere), serves it over loopback HTTP, folds it
into a real session exactly as the runtime does, then sends the derived history back to the
same adapter: the reasoning and tool-call blocks of that request must be the ones streamed.
Every example runs in a fresh ``trio.run``.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Callable
from typing import Any

import loopback
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from agentloop import Message
from agentloop.llm import AnthropicAdapter, OpenAIChatAdapter, OpenAIResponsesAdapter
from agentloop.llm._wire import dumps

# Slow: hypothesis searches over real loopback HTTP.
pytestmark = pytest.mark.slow

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
OPAQUE = st.text(string.ascii_letters + string.digits + "+/=", min_size=1, max_size=40)
SCALAR = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=6).filter(
    lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)
)
ARGUMENTS = st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=5), SCALAR,
                            max_size=3)


@st.composite
def split(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut at arbitrary points (every piece non-empty)."""
    if len(text) <= 1:
        return [text]
    cuts = sorted(draw(st.sets(st.integers(1, len(text) - 1), max_size=4)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def tool_calls(draw: st.DrawFn, prefix: str) -> list[tuple[str, str, Any, list[str]]]:
    calls = []
    for i in range(draw(st.integers(0, 3))):
        arguments = draw(ARGUMENTS)
        calls.append((f"{prefix}{i}", f"tool_{i}", arguments, draw(split(dumps(arguments)))))
    return calls


def roundtrip(make: Callable[[str], Any], body: bytes) -> Any:
    """The request body that replays the folded reply of ``body`` (a fresh trio run)."""

    async def main() -> Any:
        with trio.fail_after(20):
            async with loopback.serve(loopback.sse_body(body)) as server:
                message = await loopback.fold_reply(make(server.url))
            return await loopback.sent_body(make, (Message("user", "hi"), message))

    return trio.run(main)


# --- Anthropic Messages ---------------------------------------------------------------------


@st.composite
def anthropic_thinking(draw: st.DrawFn, index: int) -> tuple[list[tuple[str, object]], Any]:
    """One ``thinking`` or ``redacted_thinking`` content block at ``index``."""
    events: list[tuple[str, object]] = []
    if draw(st.booleans()):
        chunks = draw(st.lists(TEXT, max_size=3))
        signature = draw(OPAQUE)
        events.append(("content_block_start", {
            "type": "content_block_start", "index": index,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
        events.extend(("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "thinking_delta", "thinking": c}}) for c in chunks)
        events.append(("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "signature_delta", "signature": signature}}))
        expected: Any = {"type": "thinking", "thinking": "".join(chunks), "signature": signature}
    else:
        data = draw(OPAQUE)
        events.append(("content_block_start", {
            "type": "content_block_start", "index": index,
            "content_block": {"type": "redacted_thinking", "data": data}}))
        expected = {"type": "redacted_thinking", "data": data}
    events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return events, expected


@st.composite
def anthropic_replies(draw: st.DrawFn) -> tuple[bytes, list[Any]]:
    """Thinking blocks, text, then tool calls with thinking between and after them."""
    events: list[tuple[str, object]] = [
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 1}}})
    ]
    expected: list[Any] = []
    index = 0

    def thinking(count: int) -> None:
        nonlocal index
        for _ in range(count):
            block_events, block = draw(anthropic_thinking(index))
            events.extend(block_events)
            expected.append(block)
            index += 1

    thinking(draw(st.integers(0, 3)))
    text = draw(st.lists(TEXT, max_size=3))
    if text:
        events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": {"type": "text", "text": ""}}))
        events.extend(("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "text_delta", "text": t}})
                      for t in text)
        index += 1
    calls = draw(tool_calls("toolu_"))
    for position, (call_id, name, arguments, pieces) in enumerate(calls):
        if position:
            thinking(draw(st.integers(0, 2)))
        events.append(("content_block_start", {
            "type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": call_id, "name": name, "input": {}}}))
        events.extend(("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": p}}) for p in pieces)
        expected.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
        index += 1
    if calls:
        thinking(draw(st.integers(0, 1)))
    reason = "tool_use" if calls else "end_turn"
    events.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason},
                                     "usage": {"output_tokens": 1}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return loopback.named_sse(*events), expected


@given(anthropic_replies())
def test_anthropic_thinking_and_tool_use_blocks_replay_byte_identical(
    reply: tuple[bytes, list[Any]],
) -> None:
    body, expected = reply
    if not expected and b"text_delta" not in body:
        return  # an empty reply is left out of the history: nothing to replay
    sent = roundtrip(lambda url: AnthropicAdapter(url, api_key="k"), body)
    content = sent["messages"][1]["content"]
    replayed = [b for b in content if b["type"] != "text"]
    assert dumps(replayed) == dumps(expected)


# --- OpenAI-compatible chat completions -----------------------------------------------------


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@st.composite
def chat_replies(draw: st.DrawFn) -> tuple[bytes, str, str, list[Any]]:
    field = draw(st.sampled_from(["reasoning_content", "reasoning"]))
    reasoning = draw(st.lists(TEXT, max_size=4))
    text = draw(st.lists(TEXT, max_size=3))
    calls = draw(tool_calls("call_"))
    chunks = [_chunk({"role": "assistant"})]
    chunks += [_chunk({field: r}) for r in reasoning]
    chunks += [_chunk({"content": t}) for t in text]
    expected = []
    for position, (call_id, name, arguments, pieces) in enumerate(calls):
        chunks.append(_chunk({"tool_calls": [{"index": position, "id": call_id, "type": "function",
                                              "function": {"name": name, "arguments": ""}}]}))
        chunks += [_chunk({"tool_calls": [{"index": position, "function": {"arguments": p}}]})
                   for p in pieces]
        expected.append({"id": call_id, "type": "function",
                         "function": {"name": name, "arguments": dumps(arguments)}})
    chunks.append(_chunk({}, "tool_calls" if calls else "stop"))
    return loopback.sse(*chunks, done=True), field, "".join(reasoning), expected


@given(chat_replies())
def test_chat_reasoning_and_tool_calls_replay_byte_identical(
    reply: tuple[bytes, str, str, list[Any]],
) -> None:
    body, field, reasoning, expected = reply
    if not reasoning and not expected and b'"content"' not in body:
        return
    sent = roundtrip(lambda url: OpenAIChatAdapter(url, api_key="k"), body)
    message = sent["messages"][1]
    assert message.get(field) == (reasoning or None)
    other = "reasoning" if field == "reasoning_content" else "reasoning_content"
    assert other not in message
    assert dumps(message.get("tool_calls", [])) == dumps(expected)


# --- OpenRouter reasoning_details ----------------------------------------------------------

DETAIL_FORMATS = st.sampled_from(
    ["anthropic-claude-v1", "openai-responses-v1", "google-gemini-v1", "unknown"]
)


@st.composite
def openrouter_detail(draw: st.DrawFn, index: int) -> tuple[list[dict[str, Any]], Any, str]:
    """One detail at ``index``: its fragments (as deltas), the merged object and its text."""
    kind = draw(st.sampled_from(["reasoning.text", "reasoning.summary", "reasoning.encrypted"]))
    head: dict[str, Any] = {"type": kind}
    if draw(st.booleans()):
        head["id"] = f"rd_{index}"
    head["format"] = draw(DETAIL_FORMATS)
    head["index"] = index
    if kind == "reasoning.encrypted":
        pieces = draw(split(draw(OPAQUE)))
        key, shown = "data", ""
    else:
        pieces = draw(split(draw(TEXT)))
        key = "text" if kind == "reasoning.text" else "summary"
        shown = "".join(pieces)
    # The first fragment carries every field; later ones only the type, text and index.
    fragments = [{**head, key: pieces[0]}]
    fragments += [{"type": kind, key: piece, "index": index} for piece in pieces[1:]]
    # Merged: keys in the order first seen, text joined, later non-null values winning.
    merged = {**head, key: "".join(pieces)}
    if kind == "reasoning.text" and draw(st.booleans()):
        signature = draw(OPAQUE)
        fragments.append({"type": kind, key: "", "signature": signature, "index": index})
        merged["signature"] = signature
    return fragments, merged, shown


@st.composite
def openrouter_replies(draw: st.DrawFn) -> tuple[bytes, list[Any], str, list[Any]]:
    chunks = [_chunk({"role": "assistant"})]
    details: list[Any] = []
    shown = []
    plain = draw(st.booleans())  # OpenRouter also sends the text as plain `reasoning`
    for index in range(draw(st.integers(0, 3))):
        fragments, merged, text = draw(openrouter_detail(index))
        for fragment in fragments:
            delta: dict[str, Any] = {"reasoning_details": [fragment]}
            piece = fragment.get("text", fragment.get("summary"))
            if plain and fragment["type"] != "reasoning.encrypted" and piece:
                delta["reasoning"] = piece
            chunks.append(_chunk(delta))
        details.append(merged)
        shown.append(text)
    text = draw(st.lists(TEXT, max_size=2))
    chunks += [_chunk({"content": t}) for t in text]
    calls = draw(tool_calls("call_"))
    expected_calls = []
    for position, (call_id, name, arguments, pieces) in enumerate(calls):
        chunks.append(_chunk({"tool_calls": [{"index": position, "id": call_id, "type": "function",
                                              "function": {"name": name, "arguments": ""}}]}))
        chunks += [_chunk({"tool_calls": [{"index": position, "function": {"arguments": p}}]})
                   for p in pieces]
        expected_calls.append({"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": dumps(arguments)}})
    chunks.append(_chunk({}, "tool_calls" if calls else "stop"))
    return loopback.sse(*chunks, done=True), details, "".join(shown), expected_calls


@given(openrouter_replies())
def test_openrouter_reasoning_details_replay_byte_identical(
    reply: tuple[bytes, list[Any], str, list[Any]],
) -> None:
    body, details, shown, calls = reply
    if not details and not calls and b'"content"' not in body:
        return
    sent = roundtrip(lambda url: OpenAIChatAdapter(url, api_key="k", reasoning_details=True),
                     body)
    message = sent["messages"][1]
    assert dumps(message.get("reasoning_details", [])) == dumps(details)
    assert "reasoning" not in message
    assert dumps(message.get("tool_calls", [])) == dumps(calls)
    # Any other chat provider gets the text form, and no opaque data.
    other = roundtrip(lambda url: OpenAIChatAdapter(url, api_key="k"), body)["messages"][1]
    assert "reasoning_details" not in other
    assert other.get("reasoning_content") == (shown or None)


# --- OpenAI Responses -----------------------------------------------------------------------


@st.composite
def responses_replies(draw: st.DrawFn) -> tuple[bytes, list[Any]]:
    events: list[tuple[str, object]] = []

    def event(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    event("response.created", response={"id": "resp_1", "status": "in_progress", "output": []})
    expected: list[Any] = []
    output = 0

    def reasoning(count: int) -> None:
        nonlocal output
        for _ in range(count):
            item_id = f"rs_{output}"
            event("response.output_item.added", output_index=output,
                  item={"id": item_id, "type": "reasoning", "summary": []})
            summary = []
            for part in range(draw(st.integers(0, 2))):
                pieces = draw(st.lists(TEXT, min_size=1, max_size=3))
                for piece in pieces:
                    event("response.reasoning_summary_text.delta", item_id=item_id,
                          output_index=output, summary_index=part, delta=piece)
                summary.append({"type": "summary_text", "text": "".join(pieces)})
            done: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": summary}
            if draw(st.booleans()):
                done["encrypted_content"] = draw(OPAQUE)
            event("response.output_item.done", output_index=output, item=done)
            expected.append(done)
            output += 1

    reasoning(draw(st.integers(0, 3)))
    text = draw(st.lists(TEXT, max_size=3))
    if text:
        event("response.output_item.added", output_index=output,
              item={"id": "msg_1", "type": "message", "role": "assistant", "content": []})
        for piece in text:
            event("response.output_text.delta", item_id="msg_1", output_index=output,
                  content_index=0, delta=piece)
        expected.append({"role": "assistant", "content": "".join(text)})
        output += 1
    calls = draw(tool_calls("call_"))
    for position, (call_id, name, arguments, pieces) in enumerate(calls):
        if position:
            reasoning(draw(st.integers(0, 1)))
        item = {"id": f"fc_{call_id}", "type": "function_call", "call_id": call_id,
                "name": name, "arguments": ""}
        event("response.output_item.added", output_index=output, item=item)
        for piece in pieces:
            event("response.function_call_arguments.delta", item_id=item["id"],
                  output_index=output, delta=piece)
        event("response.output_item.done", output_index=output,
              item={**item, "arguments": "".join(pieces), "status": "completed"})
        expected.append({"type": "function_call", "call_id": call_id, "name": name,
                         "arguments": dumps(arguments)})
        output += 1
    if calls:
        reasoning(draw(st.integers(0, 1)))
    event("response.completed", response={"id": "resp_1", "status": "completed",
                                          "usage": {"input_tokens": 1, "output_tokens": 1}})
    return loopback.named_sse(*events), expected


@given(responses_replies())
def test_responses_reasoning_items_and_calls_replay_byte_identical(
    reply: tuple[bytes, list[Any]],
) -> None:
    body, expected = reply
    if not expected:
        return
    sent = roundtrip(lambda url: OpenAIResponsesAdapter(url, api_key="k"), body)
    assert dumps(sent["input"][1:]) == dumps(expected)


# --- across providers: the text form ----------------------------------------------------------


def test_anthropic_blocks_reach_a_chat_provider_as_text() -> None:
    body = loopback.fixture("anthropic-messages-redacted-thinking.sse")

    async def main() -> Any:
        async with loopback.serve(loopback.sse_body(body)) as server:
            message = await loopback.fold_reply(AnthropicAdapter(server.url, api_key="k"))
        return await loopback.sent_body(
            lambda url: OpenAIChatAdapter(url, api_key="k"), (Message("user", "hi"), message)
        )

    sent = trio.run(main)
    message = sent["messages"][1]
    assert message["reasoning_content"] == (
        "First, find the file. Then read it.The path is README.md."
    )
    assert "RURBQ1RFRC" not in json.dumps(sent)  # the redacted block's data stays with its owner
    assert "signature" not in json.dumps(sent)
