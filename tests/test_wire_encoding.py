"""Request bodies with the history's messages encoded once per history, not once per call.

Each HTTP adapter's ``_content`` must send exactly the bytes of ``encode_body(_body(request))``
(the whole body encoded afresh), whatever the history, the snapshot, the flags and the
config's extra; the property below drives histories that grow, are replaced, are read at an
older length and are rewritten into plain tuples, through the chat adapter (whose flags also
change), the Responses adapter, and the Anthropic adapter with its cache breakpoints.
"""

from __future__ import annotations

import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agentloop
from agentloop._bus import EventBus
from agentloop._json import FrozenDict, freeze
from agentloop._model import CallConfig, LLMRequest, Message, ToolCall, ToolSpec
from agentloop._session import HistoryView, Session
from agentloop.llm import AnthropicAdapter, OpenAIChatAdapter, OpenAIResponsesAdapter
from agentloop.llm._wire import MessageEncoder, encode_body, splice_body

# Lone surrogates included: a provider's "\ud83d" escape can put one in a history, and the
# body sends it as U+FFFD. Frozen JSON (blocks, parts, arguments) refuses them, so it is
# drawn from PLAIN.
TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=8)
PLAIN = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
NAME = st.text(string.ascii_lowercase + "_", min_size=1, max_size=6)
SCALAR = st.none() | st.booleans() | st.integers(-1000, 1000) | PLAIN
ARGUMENTS = st.dictionaries(NAME, SCALAR, max_size=3).map(freeze) | TEXT


def _frozen(value: Any) -> FrozenDict:
    frozen = freeze(value)
    assert isinstance(frozen, FrozenDict)
    return frozen


BLOCK = st.one_of(
    st.builds(lambda text: _frozen({"format": "openai-chat", "text": text}), PLAIN),
    st.builds(
        lambda text, field: _frozen(
            {"format": "openai-chat", "text": text, "fields": {"field": field}}
        ),
        PLAIN, st.sampled_from(["reasoning", "reasoning_content", "thinking"]),
    ),
    st.builds(
        lambda text, signature: _frozen({
            "format": "openrouter", "text": text,
            "fields": {"detail": {"type": "reasoning.text", "text": "", "signature": signature},
                       "text_key": "text"},
        }),
        PLAIN, PLAIN,
    ),
    st.builds(
        lambda text, signature: _frozen(
            {"format": "anthropic", "text": text, "signature": signature}
        ),
        PLAIN, st.none() | PLAIN,
    ),
    st.builds(
        lambda data, after: _frozen({
            "format": "anthropic", "text": "",
            "fields": {"type": "redacted_thinking", "data": data, "after_tool_calls": after},
        }),
        PLAIN, st.integers(0, 2),
    ),
    st.builds(
        lambda summary, after: _frozen({
            "format": "openai-responses", "text": summary,
            "fields": {"item": {"type": "reasoning", "summary": [summary]},
                       "after_tool_calls": after},
        }),
        PLAIN, st.integers(0, 2),
    ),
)

CALL = st.builds(ToolCall, NAME.map(lambda n: f"call_{n}"), NAME, ARGUMENTS)

TOOL_RESULT = st.builds(
    lambda call_id, text: Message("tool", text, tool_call_id=call_id, name="t"), NAME, TEXT,
)

MESSAGE = st.one_of(
    st.builds(Message, st.just("user"), TEXT),
    st.builds(
        lambda texts: Message("user", tuple(_frozen({"type": "text", "text": t}) for t in texts)),
        st.lists(PLAIN, min_size=1, max_size=2),
    ),
    st.builds(
        lambda text, calls, reasoning, blocks: Message(
            "assistant", text, tool_calls=tuple(calls), reasoning=reasoning,
            reasoning_blocks=tuple(blocks),
        ),
        TEXT, st.lists(CALL, max_size=2), st.none() | TEXT, st.lists(BLOCK, max_size=2),
    ),
    TOOL_RESULT,
)

EXTRA = st.dictionaries(
    st.sampled_from(["temperature", "model", "messages", "stream", "top_p", "tools"]),
    SCALAR, max_size=2,
)

# What happens to the history between two requests.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(MESSAGE, min_size=1, max_size=3)),
        # Results, and text after them, join the last wire message for Anthropic.
        st.tuples(st.just("append"), st.lists(TOOL_RESULT | MESSAGE, min_size=1, max_size=2)),
        st.tuples(st.just("replace"), st.lists(MESSAGE, max_size=3)),
        st.tuples(st.just("older"), st.integers(0, 20)),
        st.tuples(st.just("rewritten"), st.none()),
        st.tuples(st.just("flags"), st.tuples(st.booleans(), st.booleans())),
        st.tuples(st.just("config"), st.tuples(st.none() | TEXT, EXTRA, st.booleans())),
    ),
    min_size=1, max_size=12,
)


class Views:
    """Snapshots of lists as sessions make them: each list the history of its own session."""

    def __init__(self) -> None:
        self._sessions: dict[int, Session] = {}

    def __call__(self, items: list[Message], n: int | None = None) -> HistoryView:
        session = self._sessions.get(id(items))
        if session is None:
            session = self._sessions[id(items)] = Session("s", agentloop.FrozenDict(), EventBus())
            session._history = items  # the list its views are of (kept alive here)
        return HistoryView(items, len(items) if n is None else n, 0, session)


def request(messages: Any, system: str | None, extra: dict[str, Any], tools: bool) -> LLMRequest:
    spec = ToolSpec("noop", "Do nothing.", _frozen({"type": "object", "properties": {}}))
    return LLMRequest(
        system=system or "",
        messages=messages,
        tools=(spec,) if tools else (),
        config=CallConfig(provider="p", model="m", max_tokens=64, extra=_frozen(extra)),
    )


def check(adapter: Any, req: LLMRequest) -> None:
    assert adapter._content(req) == encode_body(adapter._body(req))


URL = "http://127.0.0.1:9/v1"
ADAPTERS = st.one_of(
    st.builds(
        lambda pad, details: OpenAIChatAdapter(
            URL, api_key="k", tool_call_reasoning=pad, reasoning_details=details
        ),
        st.booleans(), st.booleans(),
    ),
    st.builds(lambda: OpenAIResponsesAdapter(URL, api_key="k")),
    st.builds(
        lambda cache: AnthropicAdapter(URL, api_key="k", cache=cache),
        st.sets(st.sampled_from(["system", "history", "tools"])),
    ),
)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(MESSAGE, max_size=4), OPS, ADAPTERS)
def test_the_spliced_body_is_the_whole_body_encoded(
    first: list[Message], ops: list[tuple[str, Any]], adapter: Any
) -> None:
    views = Views()
    items = list(first)
    system: str | None = None
    extra: dict[str, Any] = {}
    tools = False
    check(adapter, request(views(items), system, extra, tools))
    for op, value in ops:
        view: Any = views(items)
        if op == "append":
            items.extend(value)
            view = views(items)
        elif op == "replace":
            items = [*items[: len(items) // 2], *value]  # a new list: a new source
            view = views(items)
        elif op == "older":
            view = views(items, min(value, len(items)))  # a snapshot taken earlier
        elif op == "rewritten":
            view = tuple(reversed(items))
        elif op == "flags":
            if isinstance(adapter, OpenAIChatAdapter):
                adapter.tool_call_reasoning, adapter.reasoning_details = value
        else:
            system, extra, tools = value
        check(adapter, request(view, system, extra, tools))


def test_anthropic_tool_results_and_text_after_them_join_the_last_message() -> None:
    adapter = AnthropicAdapter(URL, api_key="k")
    views = Views()
    calls = (ToolCall("c1", "t", freeze({})), ToolCall("c2", "t", freeze({})))
    items = [Message("user", "q"), Message("assistant", "", tool_calls=calls)]
    for more in (
        Message("tool", "r1", tool_call_id="c1"),
        Message("tool", "r2", tool_call_id="c2"),  # the same wire message as r1
        Message("user", "and then?"),  # still the same one
        Message("assistant", "done"),
    ):
        items.append(more)
        check(adapter, request(views(items), None, {}, tools=False))
    body = adapter._body(request(views(items), None, {}, tools=False))
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant"]


def test_only_the_new_messages_are_encoded() -> None:
    wired: list[Message] = []

    def wire(message: Message) -> list[Any]:
        wired.append(message)
        return [{"content": message.content}]

    encoder = MessageEncoder(wire)
    views = Views()
    items = [Message("user", "a"), Message("assistant", "b")]
    assert encoder.fragments(views(items, 2)) == [b'{"content":"a"}', b'{"content":"b"}']
    items.append(Message("user", "c"))
    wired.clear()
    assert len(encoder.fragments(views(items, 3))) == 3
    assert wired == [items[2]]
    wired.clear()
    assert encoder.fragments(views(items, 1)) == [b'{"content":"a"}']
    assert wired == []
    # A plain sequence has no source to keep: encoded whole, every time.
    encoder.fragments(tuple(items))
    assert wired == items


def test_the_encoded_messages_live_with_the_session_history() -> None:
    wired: list[str] = []
    encoder = MessageEncoder(lambda m: wired.append(m.text) or [{"content": m.content}])
    session = Session("s", agentloop.FrozenDict(), EventBus())
    session.append("user/message", freeze({"message_id": "m1", "content": "a"}), 1)
    encoder.fragments(session.messages())
    session.append("user/message", freeze({"message_id": "m2", "content": "b"}), 1)
    assert encoder.fragments(session.messages()) == [b'{"content":"a"}', b'{"content":"b"}']
    assert wired == ["a", "b"]  # each once, across snapshots of the same history
    # A replacement starts a new history, and with it new memos.
    session.replace_history(1, 2, [Message("user", "c")], reason="test")
    assert encoder.fragments(session.messages()) == [b'{"content":"c"}']
    assert wired == ["a", "b", "c"]
    # A snapshot that keeps nothing (no memos) is encoded whole every time.
    encoder.fragments(HistoryView([Message("user", "d")], 1))
    encoder.fragments(HistoryView([Message("user", "d")], 1))
    assert wired[-2:] == ["d", "d"]


def test_an_anthropic_message_that_cannot_be_converted_is_refused_at_every_call() -> None:
    adapter = AnthropicAdapter(URL, api_key="k")
    views = Views()
    bad = Message("assistant", "x", reasoning_blocks=(_frozen({"format": "anthropic",
                                                                "text": "t", "fields": "oops"}),))
    items = [Message("user", "q"), bad, Message("user", "again")]
    for _ in range(2):
        with pytest.raises(AttributeError):
            adapter._body(request(views(items), None, {}, tools=False))
        with pytest.raises(AttributeError):
            adapter._content(request(views(items), None, {}, tools=False))
    items[1] = Message("assistant", "fine")  # (a test may edit its own list; a session never)
    fresh = Views()
    check(adapter, request(fresh(items), None, {}, tools=False))


def test_a_subclass_that_changes_its_items_alone_is_encoded_whole() -> None:
    class Briefed(OpenAIChatAdapter):
        def _items(self, request: LLMRequest) -> list[Any]:
            return [{"role": "developer", "content": "be brief"}, *super()._items(request)]

    adapter = Briefed(URL, api_key="k")
    req = request(Views()([Message("user", "hi")]), None, {}, tools=False)
    check(adapter, req)
    assert b'"developer"' in adapter._content(req)


def test_a_message_sent_as_no_item_or_as_several() -> None:
    encoder = MessageEncoder(lambda m: [{"n": i} for i in range(len(m.text))])
    items = [Message("user", ""), Message("user", "ab"), Message("user", "")]
    fragments = encoder.fragments(HistoryView(items, 3))
    assert fragments == [b"", b'{"n":0},{"n":1}', b""]
    body = {"model": "m", "input": [], "stream": True}
    assert splice_body(body, "input", fragments) == (
        b'{"model":"m","input":[{"n":0},{"n":1}],"stream":true}'
    )
    assert body == {"model": "m", "input": [], "stream": True}
