"""The Anthropic Messages adapter."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import httpx

from .._errors import ConfigError, ProviderError
from .._json import FrozenDict
from .._model import (
    CallConfig,
    Finish,
    FinishReason,
    HistorySnapshot,
    LLMRequest,
    Message,
    ReasoningDelta,
    StreamPart,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from ._base import AdapterDefaults
from ._efforts import ANTHROPIC_EFFORT
from ._retry import RetryPolicy
from ._wire import (
    HTTPStreamAdapter,
    SSEEvent,
    dumps,
    encode_body,
    error_fields,
    int_counters,
    parse_event_json,
)

__all__ = ["AnthropicAdapter", "CacheBreakpoint"]

ANTHROPIC_VERSION = "2023-06-01"
_FALLBACK_MAX_TOKENS = 4096
FORMAT = "anthropic"

CacheBreakpoint = Literal["system", "tools", "history"]
_BREAKPOINTS: frozenset[str] = frozenset(("system", "tools", "history"))
_CACHE_TTLS = ("5m", "1h")

_STOP_REASONS: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "max_tokens",
    "model_context_window_exceeded": "max_tokens",
    "refusal": "refusal",
}


class AnthropicAdapter(HTTPStreamAdapter):
    """Streams ``POST {base_url}/v1/messages`` of the Anthropic Messages API.

    Args:
        base_url: the API root as the Anthropic SDK takes it (``ANTHROPIC_BASE_URL``), e.g.
            ``"https://api.anthropic.com"``; a URL that already ends in ``/v1`` works too.
        api_key: sent as ``x-api-key``; never shown in reprs or errors.
        headers: extra request headers such as ``anthropic-beta`` (they win over the
            adapter's own).
        client: the ``httpx.AsyncClient`` to use; by default the runtime's pooled client.
        defaults: values the runtime fills in when a call leaves them unset; ``max_tokens``
            is 4096 unless given, because the API requires it.
        cache: prompt-caching breakpoints to mark with ``cache_control``: ``"system"`` (the
            system prompt), ``"tools"`` (the last tool) and ``"history"`` (the last block of
            the last history message, which every later step of the session repeats).
        cache_ttl: ``"5m"`` or ``"1h"``; unset uses the API's default (5 minutes).
        retry: the provider's retry policy, captured when the adapter is registered.

    Every ``thinking`` and ``redacted_thinking`` block streams as its own reasoning block
    (format ``"anthropic"``; the signature as a reasoning part with empty text, a redacted
    block's ``data`` in its fields) and is replayed verbatim, in order. An assistant message
    without such blocks gets one thinking block when it keeps both reasoning and signature;
    reasoning without a signature is not sent (the API refuses it). Cache reads and writes
    are reported as ``cache_read_tokens`` and ``cache_write_tokens`` beside the API's own
    counters.
    ``reasoning_effort`` has no equivalent here and is refused (a
    :class:`agentloop.ConfigError` naming the provider and ``thinking``, for ``defaults``
    when the adapter is built and for a call in :meth:`validate`); pass ``thinking``
    through ``config.extra``, which is merged into the request body last. A ``stop_reason`` this
    adapter does not know (``pause_turn`` of server tools, ...) finishes the call with
    ``"error"``.
    """

    _path: ClassVar[str] = "/messages"
    _history_key: ClassVar[str] = "messages"
    _kind: ClassVar[str] = "anthropic"
    _default_defaults: ClassVar[AdapterDefaults] = AdapterDefaults(max_tokens=_FALLBACK_MAX_TOKENS)

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        defaults: AdapterDefaults | None = None,
        cache: Collection[CacheBreakpoint] = (),
        cache_ttl: Literal["5m", "1h"] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(
            base_url, api_key=api_key, headers=headers, client=client, defaults=defaults,
            retry=retry,
        )
        if isinstance(cache, str) or not set(cache) <= _BREAKPOINTS:
            raise ConfigError(
                f"anthropic: cache must list breakpoints among {sorted(_BREAKPOINTS)}, "
                f"got {cache!r}"
            )
        if cache_ttl is not None and cache_ttl not in _CACHE_TTLS:
            raise ConfigError(
                f"anthropic: cache_ttl must be one of {list(_CACHE_TTLS)}, got {cache_ttl!r}"
            )
        self.cache: frozenset[str] = frozenset(cache)
        marker: dict[str, str] = {"type": "ephemeral"}
        if cache_ttl is not None:
            marker["ttl"] = cache_ttl
        self._marker = FrozenDict(marker)
        # The SDK's convention: the root without the version; a root that has it is kept.
        version = "" if urlsplit(self.base_url).path.endswith("/v1") else "/v1"
        self._endpoint = f"{self.base_url}{version}{self._path}"

    def _url(self) -> str:
        return self._endpoint

    def _effort_problem(self, effort: str | None) -> str | None:
        return None if effort is None else f"reasoning_effort {effort!r}: {ANTHROPIC_EFFORT}"

    def validate(self, config: CallConfig) -> None:
        """Also refuse a call without ``max_tokens``, which the Messages API requires."""
        super().validate(config)
        if config.max_tokens is None:
            raise ProviderError(
                f"{type(self).__name__}: no max_tokens configured", code="invalid_config"
            )

    def _auth_headers(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key}

    def _static_headers(self) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION}

    def _items(self, request: LLMRequest) -> list[Any]:
        messages = _messages(request.messages)
        if "history" in self.cache:
            _mark_last_block(messages, self._marker)
        return messages

    def _fragments(self, request: LLMRequest) -> list[bytes] | None:
        # Converted per wire message as the history grows: see _Converted.
        history = request.messages
        if not isinstance(history, HistorySnapshot):
            return None  # rewritten
        converted = history.memo(self, _Converted)
        if len(history) < converted.count:
            return None  # an older snapshot: rare
        converted.add(history[i] for i in range(converted.count, len(history)))
        return converted.fragments(self._marker if "history" in self.cache else None)

    def _envelope(self, request: LLMRequest, messages: list[Any]) -> dict[str, Any]:
        """The body around the wire ``messages``."""
        config = request.config
        body: dict[str, Any] = {"model": config.model}
        if config.max_tokens is not None:
            body["max_tokens"] = config.max_tokens
        cache = self.cache
        if request.system:
            if "system" in cache:
                body["system"] = [
                    {"type": "text", "text": request.system, "cache_control": self._marker}
                ]
            else:
                body["system"] = request.system
        body["messages"] = messages
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
            if "tools" in cache:
                body["tools"][-1]["cache_control"] = self._marker
        body["stream"] = True
        body.update(config.extra)
        return body

    def _decoder(self) -> _MessagesDecoder:
        return _MessagesDecoder()


def _blocks(content: str | tuple[Any, ...]) -> list[Any]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _messages(history: Sequence[Message]) -> list[dict[str, Any]]:
    converted = _Converted()
    converted.add(history)
    return converted.out


class _Converted:
    """A history's wire messages, converted as the history grows.

    Consecutive tool results, and user text right after them, go into one user message,
    so the last wire message may still grow; every one before it is final, and is encoded
    once (``encoded``).
    """

    __slots__ = ("count", "encoded", "out", "results")

    def __init__(self) -> None:
        self.count = 0  # history messages converted
        self.out: list[dict[str, Any]] = []
        # The content list of the user turn that collects tool results, while it is still
        # open: the API wants all results of one assistant turn (and any user text after
        # them) together.
        self.results: list[Any] | None = None
        self.encoded: list[bytes] = []  # out[i], encoded, for every final i

    def add(self, messages: Iterable[Message]) -> None:
        out = self.out
        for message in messages:
            results, kept, growing = self.results, len(out), len(self.results or ())
            try:
                self._add(message)
            except BaseException:
                # As it was before this message, so that a message that cannot be sent is
                # refused at every call, not skipped at the next.
                del out[kept:]
                if results is not None:
                    del results[growing:]
                self.results = results
                raise
            self.count += 1

    def _add(self, message: Message) -> None:
        out, results = self.out, self.results
        if message.role == "tool":
            if results is None:
                results = []
                out.append({"role": "user", "content": results})
            content = message.content
            results.append(
                {
                    "type": "tool_result",
                    "tool_use_id": message.tool_call_id,
                    "content": content if isinstance(content, str) else list(content),
                    "is_error": message.is_error,
                }
            )
        elif message.role == "user":
            if results is not None:
                results.extend(_blocks(message.content))
                results = None
            else:
                content = message.content
                out.append(
                    {
                        "role": "user",
                        "content": content if isinstance(content, str) else list(content),
                    }
                )
        else:
            results = None
            blocks = _assistant_blocks(message)
            if blocks:
                out.append({"role": "assistant", "content": blocks})
        self.results = results

    def fragments(self, marker: FrozenDict | None) -> list[bytes]:
        """Every wire message encoded, the last one with ``marker`` on its last block."""
        out, encoded = self.out, self.encoded
        if not out:
            return []
        for i in range(len(encoded), len(out) - 1):
            encoded.append(encode_body(out[i]))
        last = out[-1]
        if marker is not None:
            # Marked on a copy: the last message may still grow, and is marked afresh.
            last = {**last}
            if isinstance(last["content"], list):
                last["content"] = list(last["content"])
            _mark_last_block([last], marker)
        return [*encoded, encode_body(last)]


def _mark_last_block(messages: list[dict[str, Any]], marker: FrozenDict) -> None:
    if not messages:
        return
    last = messages[-1]
    content = last["content"]
    if isinstance(content, str):
        if content:
            last["content"] = [{"type": "text", "text": content, "cache_control": marker}]
        return
    # Thinking blocks cannot carry a breakpoint; the block after them can.
    for position in range(len(content) - 1, -1, -1):
        block = content[position]
        if isinstance(block, Mapping) and block.get("type") not in (
            "thinking", "redacted_thinking"
        ):
            content[position] = {**block, "cache_control": marker}
            return


def _replayed(block: FrozenDict) -> dict[str, Any] | None:
    """The wire form of one kept ``anthropic`` block, or None when the API would refuse it."""
    fields = block.get("fields") or {}
    if fields.get("type") == "redacted_thinking":
        data = fields.get("data")
        return {"type": "redacted_thinking", "data": data} if isinstance(data, str) else None
    signature = block.get("signature")
    if not signature:
        return None  # cut short before its signature arrived: unusable
    return {"type": "thinking", "thinking": block.get("text", ""), "signature": signature}


def _after_calls(block: FrozenDict) -> int:
    after = (block.get("fields") or {}).get("after_tool_calls", 0)
    return after if isinstance(after, int) else 0


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    own = [b for b in message.reasoning_blocks if b.get("format") == FORMAT]
    late: list[tuple[int, dict[str, Any]]] = []  # interleaved: after some tool calls
    if own:
        for kept in own:
            replayed = _replayed(kept)
            if replayed is None:
                continue
            after = _after_calls(kept)
            if after:
                late.append((after, replayed))
            else:
                blocks.append(replayed)
    elif message.reasoning is not None and message.reasoning_signature:
        blocks.append(
            {
                "type": "thinking",
                "thinking": message.reasoning,
                "signature": message.reasoning_signature,
            }
        )
    text = message.text
    if text:
        blocks.append({"type": "text", "text": text})
    pending = iter(late)
    following = next(pending, None)
    for position, call in enumerate(message.tool_calls):
        while following is not None and following[0] <= position:
            blocks.append(following[1])
            following = next(pending, None)
        arguments = call.arguments
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": {} if isinstance(arguments, str) else arguments,
            }
        )
    while following is not None:
        blocks.append(following[1])
        following = next(pending, None)
    return blocks


def _tool(spec: ToolSpec) -> dict[str, Any]:
    return {"name": spec.name, "description": spec.description, "input_schema": spec.parameters}


class _MessagesDecoder:
    def __init__(self) -> None:
        self.done = False
        self._reason: FinishReason | None = None
        self._usage: dict[str, int] = {}
        # content block index -> running tool-call index
        self._tool_blocks: dict[int, int] = {}
        # content block index -> (id, name) of its tool call, to tell a repeated start
        self._tool_ids: dict[int, tuple[str | None, str | None]] = {}
        # content block index -> argument fragments that came before the block's start
        self._early: dict[int, list[str]] = {}
        # content block index -> running reasoning block number
        self._thinking_blocks: dict[int, int] = {}

    def feed(self, event: SSEEvent) -> list[StreamPart]:
        if not event.data.strip():
            return []
        data = parse_event_json(event.data)
        kind = data.get("type")
        if not isinstance(kind, str):
            kind = event.event
        if kind == "content_block_delta":
            return self._block_delta(data.get("index"), data.get("delta"))
        if kind == "content_block_start":
            return self._block_start(data.get("index"), data.get("content_block"))
        if kind == "message_start":
            message = data.get("message")
            if isinstance(message, Mapping):
                self._usage.update(int_counters(message.get("usage")))
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, Mapping):
                reason = delta.get("stop_reason")
                if isinstance(reason, str) and reason:
                    self._reason = _STOP_REASONS.get(reason, "error")
            self._usage.update(int_counters(data.get("usage")))
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            message, code = error_fields(data)
            raise ProviderError(message or "the provider reported an error", code=code)
        return []

    def _block_start(self, index: object, block: object) -> list[StreamPart]:
        if not isinstance(block, Mapping):
            return []
        kind = block.get("type")
        if kind == "tool_use" and isinstance(index, int):
            identity = (_str(block.get("id")), _str(block.get("name")))
            known = self._tool_ids.get(index)
            if known is not None:
                if known == identity:
                    return []  # the same start again: one call, not a second one
                raise ProviderError(
                    f"content block {index} started twice with different tool calls "
                    f"({known[1]!r} id {known[0]!r}, then {identity[1]!r} id {identity[0]!r})",
                    code="invalid_stream",
                )
            twin = next((i for i, seen in self._tool_ids.items()
                         if identity[0] is not None and seen[0] == identity[0]), None)
            if twin is not None:
                raise ProviderError(
                    f"tool call id {identity[0]!r} started in content blocks {twin} and "
                    f"{index}", code="invalid_stream",
                )
            tool_index = len(self._tool_blocks)
            self._tool_blocks[index] = tool_index
            self._tool_ids[index] = identity
            initial = block.get("input")
            arguments = dumps(initial) if isinstance(initial, Mapping) and initial else ""
            # Fragments that overtook their start belong to this call, in the order they came.
            arguments += "".join(self._early.pop(index, ()))
            return [ToolCallDelta(tool_index, identity[0], identity[1], arguments)]
        if kind == "text":
            text = block.get("text")
            return [TextDelta(text)] if isinstance(text, str) and text else []
        if kind == "thinking":
            number = self._thinking_block(index)
            thinking = block.get("thinking")
            signature = block.get("signature")
            return [
                ReasoningDelta(
                    thinking if isinstance(thinking, str) else "",
                    signature if isinstance(signature, str) and signature else None,
                    block=number, format=FORMAT, fields=self._fields("thinking"),
                )
            ]
        if kind == "redacted_thinking":
            data = block.get("data")
            fields = self._fields("redacted_thinking", data if isinstance(data, str) else "")
            return [
                ReasoningDelta("", block=self._thinking_block(index), format=FORMAT, fields=fields)
            ]
        return []

    def _fields(self, kind: str, data: str | None = None) -> dict[str, Any]:
        fields: dict[str, Any] = {"type": kind}
        if data is not None:
            fields["data"] = data
        if self._tool_blocks:
            # Interleaved thinking: the block goes back after the calls that preceded it.
            fields["after_tool_calls"] = len(self._tool_blocks)
        return fields

    def _thinking_block(self, index: object) -> int:
        number = len(self._thinking_blocks)
        # An index the stream never gave still gets a block of its own.
        self._thinking_blocks[index if isinstance(index, int) else -1 - number] = number
        return number

    def _block_delta(self, index: object, delta: object) -> list[StreamPart]:
        if not isinstance(delta, Mapping):
            return []
        kind = delta.get("type")
        if kind == "text_delta":
            text = delta.get("text")
            return [TextDelta(text)] if isinstance(text, str) and text else []
        if kind == "input_json_delta":
            fragment = delta.get("partial_json")
            if not isinstance(fragment, str) or not fragment:
                return []
            if not isinstance(index, int) or isinstance(index, bool):
                raise ProviderError(
                    f"an input_json_delta names no content block (index {index!r})",
                    code="invalid_stream",
                )
            tool_index = self._tool_blocks.get(index)
            if tool_index is None:
                self._early.setdefault(index, []).append(fragment)
                return []
            return [ToolCallDelta(tool_index, arguments=fragment)]
        if kind == "thinking_delta":
            thinking = delta.get("thinking")
            if not isinstance(thinking, str) or not thinking:
                return []
            number = self._thinking_blocks.get(index) if isinstance(index, int) else None
            if number is None:
                number = self._thinking_block(index)
                return [ReasoningDelta(thinking, block=number, format=FORMAT,
                                       fields=self._fields("thinking"))]
            return [ReasoningDelta(thinking, block=number)]
        if kind == "signature_delta":
            signature = delta.get("signature")
            if isinstance(signature, str) and signature:
                number = self._thinking_blocks.get(index) if isinstance(index, int) else None
                if number is None:
                    number = self._thinking_block(index)
                    return [ReasoningDelta("", signature, block=number, format=FORMAT,
                                           fields=self._fields("thinking"))]
                return [ReasoningDelta("", signature=signature, block=number)]
        return []

    def finish(self) -> Finish:
        if not self.done:
            raise ProviderError("the stream ended before message_stop", code="incomplete_stream")
        if self._early:
            blocks = ", ".join(str(i) for i in sorted(self._early))
            raise ProviderError(
                f"tool arguments came for content block {blocks}, which never started "
                "(no content_block_start)", code="invalid_stream",
            )
        return Finish(self._reason or "stop", _usage(self._usage))


def _usage(counters: dict[str, int]) -> dict[str, int] | None:
    if not counters:
        return None
    usage = dict(counters)
    read = counters.get("cache_read_input_tokens")
    if read is not None:
        usage["cache_read_tokens"] = read
    written = counters.get("cache_creation_input_tokens")
    if written is not None:
        usage["cache_write_tokens"] = written
    return usage


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
