"""Model doubles, usable without any network (re-exported by :mod:`agentloop.testing`).

``ScriptedModel`` plays back canned replies; ``FunctionModel`` streams whatever a function
yields. Both are adapters (register them with ``ctx.llm.register(name, model)``) and record
every request they receive in ``.requests``, with the runtime's defaults already filled in.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import trio

from .._errors import ProviderError
from .._model import (
    Finish,
    FinishReason,
    LLMRequest,
    Message,
    ReasoningDelta,
    StreamPart,
    TextDelta,
    ToolCallDelta,
)
from ..llm._base import AdapterDefaults, ModelAdapter

__all__ = [
    "ScriptedModel",
    "FunctionModel",
    "TestModel",
    "example_arguments",
    "Reply",
    "reply",
    "TextDelta",
    "ReasoningDelta",
    "ToolCallDelta",
    "Finish",
    "ProviderError",
]

_WORDS = re.compile(r"\S+\s*|\s+")


@attrs.frozen(slots=True)
class Reply:
    """One scripted model reply (build it with :func:`reply`)."""

    text: str | None
    reasoning: str | None
    tool_calls: tuple[tuple[str, Mapping[str, Any] | str, str | None], ...]
    finish: FinishReason
    usage: Mapping[str, Any] | None
    chunk_size: int | None
    error: ProviderError | None = None


def reply(
    text: str | None = None,
    *,
    reasoning: str | None = None,
    tool_calls: Iterable[Sequence[Any]] = (),
    finish: str | None = None,
    usage: Mapping[str, Any] | None = None,
    chunk_size: int | None = None,
) -> Reply:
    """A scripted reply.

    Args:
        text: the visible text, streamed one word per chunk (or ``chunk_size`` characters).
        reasoning: reasoning text, streamed before the text.
        tool_calls: ``(name, arguments)`` or ``(name, arguments, call_id)``; arguments is a
            dict, or a raw string to simulate malformed model output.
        finish: a :class:`Finish` reason (``"stop"``, ``"tool_calls"``, ``"max_tokens"``,
            ...); defaults to ``"tool_calls"`` when there are tool calls, else ``"stop"``.
            An unknown reason raises ``ValueError`` here.
        usage: token counters reported with the finish.
        chunk_size: characters per text chunk.
    """
    calls = []
    for call in tool_calls:
        if len(call) == 2:
            name, arguments = call
            call_id = None
        elif len(call) == 3:
            name, arguments, call_id = call
        else:
            raise ValueError(f"a tool call is (name, arguments[, call_id]), got {call!r}")
        calls.append((name, arguments, call_id))
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
    # Normalised now, so that a bad reason fails where the script is written, not mid-turn.
    reason = Finish(finish).reason if finish else ("tool_calls" if calls else "stop")
    return Reply(text, reasoning, tuple(calls), reason, usage, chunk_size)


def fail(error: ProviderError) -> Reply:
    """A scripted reply that fails the call with ``error`` before any part is streamed."""
    return Reply(None, None, (), "error", None, None, error)


def _chunks(text: str, size: int | None) -> list[str]:
    if size is None:
        return _WORDS.findall(text)
    return [text[i : i + size] for i in range(0, len(text), size)]


def _render_arguments(arguments: Mapping[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


class ScriptedModel(ModelAdapter):
    """An adapter that answers each call with the next scripted :class:`Reply`.

    Replies may also be plain strings (text replies) or ``ProviderError`` instances (a failed
    call). Running out of replies fails the call with a ``ProviderError`` that says so.
    """

    def __init__(
        self,
        replies: Iterable[Reply | str | ProviderError] = (),
        *,
        defaults: AdapterDefaults | None = None,
    ) -> None:
        self._replies: list[Reply | str | ProviderError] = list(replies)
        self.requests: list[LLMRequest] = []
        if defaults is not None:
            self.defaults = defaults

    def add(self, *replies: Reply | str | ProviderError) -> None:
        """Append more replies to the script."""
        self._replies.extend(replies)

    @property
    def remaining(self) -> int:
        return len(self._replies)

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        self.requests.append(request)
        if not self._replies:
            return _raise(ProviderError(
                f"ScriptedModel has no reply left for call {len(self.requests)}",
                code="script_exhausted",
            ))
        item = self._replies.pop(0)
        if isinstance(item, ProviderError):
            return _raise(item)
        if isinstance(item, str):
            item = reply(item)
        if item.error is not None:
            return _raise(item.error)
        return _play(item)


class _Failing:
    """A stream that fails on its first step, the way a refused HTTP call does."""

    def __init__(self, error: ProviderError) -> None:
        self._error = error

    def __aiter__(self) -> _Failing:
        return self

    async def __anext__(self) -> StreamPart:
        await trio.lowlevel.checkpoint()
        raise self._error


def _raise(error: ProviderError) -> AsyncIterator[StreamPart]:
    return _Failing(error)


async def _play(r: Reply) -> AsyncIterator[StreamPart]:
    if r.reasoning:
        for piece in _chunks(r.reasoning, r.chunk_size):
            await trio.lowlevel.checkpoint()
            yield ReasoningDelta(piece)
    if r.text:
        for piece in _chunks(r.text, r.chunk_size):
            await trio.lowlevel.checkpoint()
            yield TextDelta(piece)
    for index, (name, arguments, call_id) in enumerate(r.tool_calls):
        await trio.lowlevel.checkpoint()
        yield ToolCallDelta(
            index, id=call_id or f"call_{index + 1}", name=name,
            arguments=_render_arguments(arguments),
        )
    await trio.lowlevel.checkpoint()
    yield Finish(r.finish, r.usage)


class FunctionModel(ModelAdapter):
    """An adapter backed by ``fn(request) -> AsyncIterator[part]``.

    ``fn`` may be an async generator function; raising ``ProviderError`` inside it is a
    provider failure. Its :class:`Finish` reasons are checked when it builds them (see
    :class:`Finish`).
    """

    def __init__(
        self,
        fn: Callable[[LLMRequest], AsyncIterator[StreamPart]],
        *,
        defaults: AdapterDefaults | None = None,
    ) -> None:
        self._fn = fn
        self.requests: list[LLMRequest] = []
        if defaults is not None:
            self.defaults = defaults

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        self.requests.append(request)
        return self._fn(request)


def example_arguments(schema: Mapping[str, Any]) -> Any:
    """A value that fits the JSON schema ``schema``, chosen plainly and deterministically.

    Covers what tool schemas use: ``type`` (one or a list), ``enum``, ``const``, ``anyOf`` /
    ``oneOf``, ``properties`` with ``required``, ``items`` and ``prefixItems``,
    ``minItems``, ``minimum``/``maximum`` (also exclusive) and ``minLength``/``maxLength``.
    """
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if branches:
            # A null branch is the Optional[...] spelling: the other one exercises more.
            typed = [b for b in branches if b.get("type") != "null"] or list(branches)
            return example_arguments(typed[0])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties", {})
        return {name: example_arguments(sub) for name, sub in properties.items()}
    if kind == "array":
        prefix = [example_arguments(s) for s in schema.get("prefixItems", ())]
        items = schema.get("items")
        count = max(int(schema.get("minItems", 0)), len(prefix), 1 if items else 0)
        if schema.get("maxItems") is not None:
            count = min(count, int(schema["maxItems"]))
        extra = [example_arguments(items) for _ in range(count - len(prefix))] if items else []
        return [*prefix, *extra][: max(count, len(prefix))]
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        value: int | float = 0 if low is None else low
        if "exclusiveMinimum" in schema and "minimum" not in schema:
            value = low + 1 if kind == "integer" else low + 0.5
        if high is not None and value > high:
            value = high
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            value = schema["exclusiveMaximum"] - (1 if kind == "integer" else 0.5)
        if kind == "integer":
            return int(value) if float(value).is_integer() else math.ceil(value)
        return value
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    if kind == "string":
        length = max(int(schema.get("minLength", 1)), 0)
        if schema.get("maxLength") is not None:
            length = min(length, int(schema["maxLength"]))
        return "a" * length
    return None


class TestModel(ModelAdapter):
    """An adapter that calls every visible tool once, then answers with text.

    On the first call of a turn (the history ends with a user message) it calls each tool in
    ``request.tools`` (or only those named in ``call_tools``) with arguments generated from
    the tool's JSON schema, all in one reply; once the results are back it answers ``text``,
    or by default a JSON object of each tool's result text by name. It records every request
    in ``.requests``.
    """

    __test__ = False  # a class named Test* is not a pytest test class

    def __init__(
        self,
        *,
        text: str | None = None,
        call_tools: Iterable[str] | None = None,
        defaults: AdapterDefaults | None = None,
    ) -> None:
        self._text = text
        self._only = None if call_tools is None else frozenset(call_tools)
        self.requests: list[LLMRequest] = []
        if defaults is not None:
            self.defaults = defaults

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        self.requests.append(request)
        messages = list(request.messages)
        if messages and messages[-1].role == "tool":
            return _play(reply(self._answer(messages)))
        calls = [
            (spec.name, example_arguments(spec.parameters),
             f"test_{len(self.requests)}_{i}")
            for i, spec in enumerate(
                s for s in request.tools if self._only is None or s.name in self._only
            )
        ]
        if not calls:
            return _play(reply(self._text or "success (no tool calls)"))
        return _play(reply(None, tool_calls=calls))

    def _answer(self, messages: list[Message]) -> str:
        if self._text is not None:
            return self._text
        results: dict[str, str] = {}
        for m in reversed(messages):
            if m.role != "tool":
                break
            results[m.name or m.tool_call_id or "?"] = m.text
        return json.dumps(dict(reversed(results.items())))
