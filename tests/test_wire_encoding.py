"""The chat adapter's request body, with the history's messages encoded once per history.

``OpenAIChatAdapter._content`` must send exactly the bytes of ``encode_body(_body(request))``
(the whole body encoded afresh), whatever the history, the snapshot, the flags and the
config's extra; the property below drives histories that grow, are replaced, are read at an
older length, are rewritten into plain tuples, and are sent to adapters whose flags change.
"""

from __future__ import annotations

import string
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop._json import FrozenDict, freeze
from agentloop._model import CallConfig, LLMRequest, Message, ToolCall, ToolSpec
from agentloop._session import HistoryView
from agentloop.llm import OpenAIChatAdapter
from agentloop.llm._wire import ENCODED_HISTORIES, MessageEncoder, encode_body

# Lone surrogates included: a provider's "\ud83d" escape can put one in a history, and the
# body sends it as U+FFFD.
TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=8)
NAME = st.text(string.ascii_lowercase + "_", min_size=1, max_size=6)
SCALAR = st.none() | st.booleans() | st.integers(-1000, 1000) | TEXT
ARGUMENTS = st.dictionaries(NAME, SCALAR, max_size=3).map(freeze) | TEXT


def _frozen(value: Any) -> FrozenDict:
    frozen = freeze(value)
    assert isinstance(frozen, FrozenDict)
    return frozen


BLOCK = st.one_of(
    st.builds(lambda text: _frozen({"format": "openai-chat", "text": text}), TEXT),
    st.builds(
        lambda text, field: _frozen(
            {"format": "openai-chat", "text": text, "fields": {"field": field}}
        ),
        TEXT, st.sampled_from(["reasoning", "reasoning_content", "thinking"]),
    ),
    st.builds(
        lambda text, signature: _frozen({
            "format": "openrouter", "text": text,
            "fields": {"detail": {"type": "reasoning.text", "text": "", "signature": signature},
                       "text_key": "text"},
        }),
        TEXT, TEXT,
    ),
    st.builds(lambda text: _frozen({"format": "anthropic", "text": text}), TEXT),
)

CALL = st.builds(ToolCall, NAME.map(lambda n: f"call_{n}"), NAME, ARGUMENTS)

MESSAGE = st.one_of(
    st.builds(Message, st.just("user"), TEXT),
    st.builds(
        lambda texts: Message("user", tuple(_frozen({"type": "text", "text": t}) for t in texts)),
        st.lists(TEXT, min_size=1, max_size=2),
    ),
    st.builds(
        lambda text, calls, reasoning, blocks: Message(
            "assistant", text, tool_calls=tuple(calls), reasoning=reasoning,
            reasoning_blocks=tuple(blocks),
        ),
        TEXT, st.lists(CALL, max_size=2), st.none() | TEXT, st.lists(BLOCK, max_size=2),
    ),
    st.builds(
        lambda call_id, text: Message("tool", text, tool_call_id=call_id, name="t"),
        NAME, TEXT,
    ),
)

EXTRA = st.dictionaries(
    st.sampled_from(["temperature", "model", "messages", "stream", "top_p", "tools"]),
    SCALAR, max_size=2,
)

# What happens to the history between two requests.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(MESSAGE, min_size=1, max_size=3)),
        st.tuples(st.just("replace"), st.lists(MESSAGE, max_size=3)),
        st.tuples(st.just("older"), st.integers(0, 20)),
        st.tuples(st.just("rewritten"), st.none()),
        st.tuples(st.just("flags"), st.tuples(st.booleans(), st.booleans())),
        st.tuples(st.just("config"), st.tuples(st.none() | TEXT, EXTRA, st.booleans())),
    ),
    min_size=1, max_size=12,
)


def request(messages: Any, system: str | None, extra: dict[str, Any], tools: bool) -> LLMRequest:
    spec = ToolSpec("noop", "Do nothing.", _frozen({"type": "object", "properties": {}}))
    return LLMRequest(
        system=system or "",
        messages=messages,
        tools=(spec,) if tools else (),
        config=CallConfig(provider="p", model="m", max_tokens=64, extra=_frozen(extra)),
    )


def check(adapter: OpenAIChatAdapter, req: LLMRequest) -> None:
    assert adapter._content(req) == encode_body(adapter._body(req))


@settings(max_examples=150, deadline=None)
@given(st.lists(MESSAGE, max_size=4), OPS, st.booleans(), st.booleans())
def test_the_spliced_body_is_the_whole_body_encoded(
    first: list[Message], ops: list[tuple[str, Any]], pad: bool, details: bool
) -> None:
    adapter = OpenAIChatAdapter("http://127.0.0.1:9/v1", api_key="k",
                                tool_call_reasoning=pad, reasoning_details=details)
    items = list(first)
    system: str | None = None
    extra: dict[str, Any] = {}
    tools = False
    check(adapter, request(HistoryView(items, len(items)), system, extra, tools))
    for op, value in ops:
        view: Any = HistoryView(items, len(items))
        if op == "append":
            items.extend(value)
            view = HistoryView(items, len(items))
        elif op == "replace":
            items = [*items[: len(items) // 2], *value]  # a new list: a new source
            view = HistoryView(items, len(items))
        elif op == "older":
            view = HistoryView(items, min(value, len(items)))  # a snapshot taken earlier
        elif op == "rewritten":
            view = tuple(reversed(items))
        elif op == "flags":
            adapter.tool_call_reasoning, adapter.reasoning_details = value
        else:
            system, extra, tools = value
        check(adapter, request(view, system, extra, tools))


def test_only_the_new_messages_are_encoded() -> None:
    wired: list[Message] = []

    def wire(message: Message) -> object:
        wired.append(message)
        return {"content": message.content}

    encoder = MessageEncoder(wire)
    items = [Message("user", "a"), Message("assistant", "b")]
    assert encoder.fragments(HistoryView(items, 2)) == [b'{"content":"a"}', b'{"content":"b"}']
    items.append(Message("user", "c"))
    wired.clear()
    assert len(encoder.fragments(HistoryView(items, 3))) == 3
    assert wired == [items[2]]
    wired.clear()
    assert encoder.fragments(HistoryView(items, 1)) == [b'{"content":"a"}']
    assert wired == []
    # A plain sequence has no source to keep: encoded whole, every time.
    encoder.fragments(tuple(items))
    assert wired == items


def test_at_most_the_most_recent_histories_are_kept() -> None:
    encoder = MessageEncoder(lambda m: {"content": m.content})
    histories = [[Message("user", str(i))] for i in range(ENCODED_HISTORIES + 5)]
    for items in histories:
        encoder.fragments(HistoryView(items, 1))
    kept = encoder._histories
    assert len(kept) == ENCODED_HISTORIES
    assert [entry.source for entry in kept.values()] == histories[5:]
    # Sending an old one again makes it the most recent, encoded afresh and correct.
    assert encoder.fragments(HistoryView(histories[0], 1)) == [b'{"content":"0"}']
    assert next(reversed(kept.values())).source is histories[0]
