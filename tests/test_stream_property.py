"""A property over adversarial provider streams, for the three wire formats.

Streams of one to three tool calls are drawn, their events interleaved, then damaged:
events duplicated, an argument fragment moved ahead of its call's start, fragments swapped,
the stream cut short. Each goes through the real adapter over loopback HTTP and the real
fold into the session's history. Whatever the damage, the reply is either refused as a
stream error or every call the history records is one that was streamed, whole, once, with
its own arguments: never a phantom call, a call run with defaults, or one call's arguments
under another's name.

What each format lets a client check differs, and the damage drawn follows it: Responses
events carry a sequence number and the finished item repeats the arguments, so any event
may be repeated and fragments may be swapped. Chat chunks and Anthropic deltas carry
neither, so a repeated or swapped argument fragment cannot be told from a real one there;
those formats get every other kind of damage (repeated starts, stops and finishes,
fragments ahead of their start, interleaving, truncation).
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Literal

import attrs
import loopback
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from agentloop import Message, ProviderError
from agentloop.llm import AnthropicAdapter, OpenAIChatAdapter, OpenAIResponsesAdapter

# Slow: hypothesis searches over real loopback HTTP.
pytestmark = pytest.mark.slow

Wire = Literal["chat", "anthropic", "responses"]
STREAM_ERRORS = {"invalid_stream", "incomplete_stream", "malformed_stream"}


@attrs.frozen
class Call:
    id: str
    name: str
    arguments: dict[str, Any]
    pieces: tuple[str, ...]  # the arguments' JSON, cut into fragments


@attrs.frozen
class Ev:
    """One abstract stream event: a call's start, one of its fragments, or its stop."""

    kind: Literal["start", "frag", "stop"]
    call: int
    piece: int = 0


@st.composite
def calls(draw: st.DrawFn) -> list[Call]:
    out = []
    for i in range(draw(st.integers(1, 3))):
        arguments = draw(st.dictionaries(
            st.sampled_from(["a", "b", "path", "n"]),
            st.one_of(st.integers(-5, 500), st.text("xyz/é ", max_size=6)),
            max_size=3,
        ))
        text = json.dumps(arguments)
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=4)))
        bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
        pieces = tuple(text[a:b] for a, b in itertools.pairwise(bounds) if b > a)
        out.append(Call(f"call_{i}", draw(st.sampled_from(["add", "read", "find"])),
                        arguments, pieces))
    return out


@st.composite
def interleaved(draw: st.DrawFn, plan: list[Call]) -> list[Ev]:
    """Each call's own events in order; the calls' events merged in a drawn order."""
    queues = [[Ev("start", i), *(Ev("frag", i, j) for j in range(len(c.pieces))),
               Ev("stop", i)] for i, c in enumerate(plan)]
    if not draw(st.booleans()):
        return [e for q in queues for e in q]  # one call after the other, as providers do
    merged: list[Ev] = []
    while any(queues):
        live = [q for q in queues if q]
        merged.append(draw(st.sampled_from(live)).pop(0))
    return merged


@st.composite
def damaged(draw: st.DrawFn, wire: Wire) -> tuple[list[Call], list[Ev], list[Any]]:
    plan = draw(calls())
    events = draw(interleaved(plan))
    damage: list[Any] = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["dup", "early", "swap"] if wire == "responses"
                                    else ["dup", "early"]))
        if kind == "dup":
            candidates = [i for i, e in enumerate(events)
                          if wire == "responses" or e.kind != "frag"]
            at = draw(st.sampled_from(candidates))
            events.insert(draw(st.integers(at + 1, len(events))), events[at])
            damage.append(("dup", events[at]))
        elif kind == "early":
            # A start arrives after some of its call's fragments.
            i = draw(st.integers(0, len(plan) - 1))
            start = events.index(Ev("start", i))
            last_frag = max((k for k, e in enumerate(events) if e == Ev("frag", i,
                            len(plan[i].pieces) - 1)), default=start)
            events.insert(draw(st.integers(start, max(start, last_frag))), events.pop(start))
            damage.append(("early", i))
        else:
            frags = [k for k, e in enumerate(events) if e.kind == "frag"]
            if len(frags) >= 2:
                a, b = draw(st.lists(st.sampled_from(frags), min_size=2, max_size=2,
                                     unique=True))
                events[a], events[b] = events[b], events[a]
                damage.append(("swap", a, b))
    return plan, events, damage


# --- rendering each format --------------------------------------------------------------------


def chat_body(plan: list[Call], events: list[Ev]) -> bytes:
    chunks: list[object] = []

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks.append(chunk({"role": "assistant", "content": None}))
    for e in events:
        c = plan[e.call]
        if e.kind == "start":
            call = {"index": e.call, "id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": ""}}
        elif e.kind == "frag":
            call = {"index": e.call, "function": {"arguments": c.pieces[e.piece]}}
        else:
            continue  # chat has no stop event
        chunks.append(chunk({"tool_calls": [call]}))
    chunks.append(chunk({}, "tool_calls"))
    return loopback.sse(*chunks, done=True)


def chat_tail(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


def anthropic_events(plan: list[Call], events: list[Ev]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("message_start", {
        "type": "message_start", "message": {"id": "msg", "type": "message", "role": "assistant",
                                             "content": [], "usage": {"input_tokens": 3}}})]
    for e in events:
        c = plan[e.call]
        if e.kind == "start":
            out.append(("content_block_start", {
                "type": "content_block_start", "index": e.call,
                "content_block": {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}}))
        elif e.kind == "frag":
            out.append(("content_block_delta", {
                "type": "content_block_delta", "index": e.call,
                "delta": {"type": "input_json_delta", "partial_json": c.pieces[e.piece]}}))
        else:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": e.call}))
    out.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                                  "usage": {"output_tokens": 5}}))
    out.append(("message_stop", {"type": "message_stop"}))
    return out


def responses_events(plan: list[Call], events: list[Ev]) -> list[tuple[str, dict[str, Any]]]:
    """Sequence numbers are given in the order the events were first made, so a repeat
    carries its original's number, as a duplicated delivery would."""
    numbers: dict[Ev, int] = {}
    out: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"type": "response.created", "sequence_number": 0,
                              "response": {"id": "r", "status": "in_progress", "output": []}}),
    ]
    for e in events:
        number = numbers.setdefault(e, len(numbers) + 1)
        c = plan[e.call]
        item = {"id": f"fc_{e.call}", "type": "function_call", "call_id": c.id,
                "name": c.name, "arguments": ""}
        if e.kind == "start":
            kind, data = "response.output_item.added", {"item": item}
        elif e.kind == "frag":
            kind, data = "response.function_call_arguments.delta", {
                "item_id": item["id"], "delta": c.pieces[e.piece]}
        else:
            kind, data = "response.output_item.done", {
                "item": {**item, "arguments": "".join(c.pieces), "status": "completed"}}
        out.append((kind, {"type": kind, "sequence_number": number, "output_index": e.call,
                           **data}))
    out.append(("response.completed", {
        "type": "response.completed", "sequence_number": len(numbers) + 1,
        "response": {"id": "r", "status": "completed",
                     "usage": {"input_tokens": 1, "output_tokens": 1}}}))
    return out


def wire_events(wire: Wire, plan: list[Call], events: list[Ev]) -> list[bytes]:
    if wire == "chat":
        return chat_tail(chat_body(plan, events))
    named = (anthropic_events(plan, events) if wire == "anthropic"
             else responses_events(plan, events))
    return [loopback.named_sse(e) for e in named]


ADAPTERS = {
    "chat": lambda url: OpenAIChatAdapter(url, api_key="k"),
    "anthropic": lambda url: AnthropicAdapter(url, api_key="k"),
    "responses": lambda url: OpenAIResponsesAdapter(url, api_key="k"),
}


def fold(wire: Wire, body: bytes) -> Message | ProviderError:
    async def main() -> Message | ProviderError:
        async with loopback.serve(loopback.sse_body(body)) as server:
            try:
                return await loopback.fold_reply(ADAPTERS[wire](server.url))
            except ProviderError as exc:
                return exc

    return trio.run(main)


def check(wire: Wire, plan: list[Call], body: bytes, *, whole: bool) -> None:
    outcome = fold(wire, body)
    if isinstance(outcome, ProviderError):
        assert outcome.code in STREAM_ERRORS, outcome
        return
    streamed = {c.id: c for c in plan}
    recorded = [(t.id, t.name, t.arguments) for t in outcome.tool_calls]
    # Every recorded call was streamed, once, under its own name, with its own arguments.
    assert len({r[0] for r in recorded}) == len(recorded), recorded
    for call_id, name, arguments in recorded:
        assert call_id in streamed, (call_id, recorded)
        assert name == streamed[call_id].name, recorded
        assert arguments == streamed[call_id].arguments, (recorded, plan)
    if whole:
        # A stream that reached its end delivered every call.
        assert sorted(r[0] for r in recorded) == sorted(streamed), (recorded, plan)


@given(st.sampled_from(["chat", "anthropic", "responses"]).flatmap(
    lambda wire: st.tuples(st.just(wire), damaged(wire), st.data())))
def test_every_recorded_call_was_streamed_whole_once_with_its_own_arguments(
    case: tuple[Wire, tuple[list[Call], list[Ev], list[Any]], st.DataObject],
) -> None:
    wire, (plan, events, _damage), data = case
    parts = wire_events(wire, plan, events)
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(parts) - 1)), label="cut")
    body = b"".join(parts if cut is None else parts[:cut])
    check(wire, plan, body, whole=cut is None)


# --- the named cases, as regressions --------------------------------------------------------


def _one_call(pieces: tuple[str, ...] = ('{"a": ', "1, ", '"b": 2}')) -> list[Call]:
    return [Call("call_0", "add", {"a": 1, "b": 2}, pieces)]


def test_a_repeated_anthropic_tool_start_is_one_call_with_its_arguments() -> None:
    plan = _one_call()
    events = [Ev("start", 0), Ev("frag", 0, 0), Ev("start", 0), Ev("frag", 0, 1),
              Ev("frag", 0, 2), Ev("stop", 0)]
    outcome = fold("anthropic", b"".join(wire_events("anthropic", plan, events)))
    assert isinstance(outcome, Message)
    assert [(t.id, t.name, dict(t.arguments)) for t in outcome.tool_calls] == [
        ("call_0", "add", {"a": 1, "b": 2})]


def test_anthropic_arguments_ahead_of_their_start_are_kept() -> None:
    plan = _one_call()
    events = [Ev("frag", 0, 0), Ev("start", 0), Ev("frag", 0, 1), Ev("frag", 0, 2),
              Ev("stop", 0)]
    outcome = fold("anthropic", b"".join(wire_events("anthropic", plan, events)))
    assert isinstance(outcome, Message)
    assert [dict(t.arguments) for t in outcome.tool_calls] == [{"a": 1, "b": 2}]


def test_anthropic_arguments_for_a_block_that_never_starts_are_a_stream_error() -> None:
    plan = _one_call()
    events = [Ev("frag", 0, 0), Ev("frag", 0, 1), Ev("frag", 0, 2)]
    outcome = fold("anthropic", b"".join(wire_events("anthropic", plan, events)))
    assert isinstance(outcome, ProviderError) and outcome.code == "invalid_stream"
    assert "content block 0, which never started" in outcome.message


def test_responses_arguments_ahead_of_their_item_and_repeats_are_merged() -> None:
    plan = _one_call()
    events = [Ev("frag", 0, 0), Ev("start", 0), Ev("frag", 0, 1), Ev("frag", 0, 1),
              Ev("frag", 0, 2), Ev("stop", 0)]
    outcome = fold("responses", b"".join(wire_events("responses", plan, events)))
    assert isinstance(outcome, Message)
    assert [dict(t.arguments) for t in outcome.tool_calls] == [{"a": 1, "b": 2}]


def test_responses_fragments_out_of_order_are_a_stream_error() -> None:
    plan = _one_call()
    events = [Ev("start", 0), Ev("frag", 0, 1), Ev("frag", 0, 0), Ev("frag", 0, 2),
              Ev("stop", 0)]
    outcome = fold("responses", b"".join(wire_events("responses", plan, events)))
    assert isinstance(outcome, ProviderError) and outcome.code == "invalid_stream"
    assert "differ from the finished item's" in outcome.message


def test_a_chat_call_index_reused_by_another_id_is_a_stream_error() -> None:
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]} for call in (
        {"index": 0, "id": "call_a", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"index": 0, "id": "call_b", "function": {"name": "read", "arguments": ""}},
    )]
    body = loopback.sse(*chunks, {"choices": [{"index": 0, "delta": {},
                                                "finish_reason": "tool_calls"}]}, done=True)
    outcome = fold("chat", body)
    assert isinstance(outcome, ProviderError) and outcome.code == "invalid_stream"
    assert "'call_a' to 'call_b'" in outcome.message


def test_responses_events_all_numbered_alike_are_not_taken_for_repeats() -> None:
    plan = _one_call()
    events = [Ev("start", 0), Ev("frag", 0, 0), Ev("frag", 0, 1), Ev("frag", 0, 2),
              Ev("stop", 0)]
    named = responses_events(plan, events)
    for _, data in named:
        data["sequence_number"] = 0  # a careless server
    outcome = fold("responses", loopback.named_sse(*named))
    assert isinstance(outcome, Message)
    assert [dict(t.arguments) for t in outcome.tool_calls] == [{"a": 1, "b": 2}]


def test_a_chat_server_stamping_a_fresh_id_on_each_fragment_makes_one_call() -> None:
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]} for call in (
        {"index": 0, "id": "call_a", "function": {"name": "add", "arguments": '{"a": '}},
        {"index": 0, "id": "call_x1", "function": {"arguments": "1}"}},
    )]
    body = loopback.sse(*chunks, {"choices": [{"index": 0, "delta": {},
                                                "finish_reason": "tool_calls"}]}, done=True)
    outcome = fold("chat", body)
    assert isinstance(outcome, Message)
    assert [(t.id, t.name, dict(t.arguments)) for t in outcome.tool_calls] == [
        ("call_a", "add", {"a": 1})]
