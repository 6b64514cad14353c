"""The Anthropic Messages adapter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .._errors import ProviderError
from .._model import (
    CallConfig,
    Finish,
    FinishReason,
    LLMRequest,
    Message,
    ReasoningDelta,
    StreamPart,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from ._base import AdapterDefaults
from ._wire import HTTPStreamAdapter, SSEEvent, dumps, error_fields, int_counters, parse_event_json

__all__ = ["AnthropicAdapter"]

ANTHROPIC_VERSION = "2023-06-01"
_FALLBACK_MAX_TOKENS = 4096

_STOP_REASONS: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "max_tokens",
    "model_context_window_exceeded": "max_tokens",
    "refusal": "refusal",
}


class AnthropicAdapter(HTTPStreamAdapter):
    """Streams ``POST {base_url}/messages`` of the Anthropic Messages API.

    Args:
        base_url: the API root, e.g. ``"https://api.anthropic.com/v1"``.
        api_key: sent as ``x-api-key``; never shown in reprs or errors.
        headers: extra request headers such as ``anthropic-beta`` (they win over the
            adapter's own).
        client: the ``httpx.AsyncClient`` to use; by default the runtime's pooled client.
        defaults: values the runtime fills in when a call leaves them unset; ``max_tokens``
            is 4096 unless given, because the API requires it.

    Thinking blocks stream as reasoning parts (their signature as a reasoning part with empty
    text) and are replayed when an assistant message keeps both reasoning and signature.
    ``reasoning_effort`` has no direct equivalent here; pass ``thinking`` through
    ``config.extra``, which is merged into the request body last. A ``stop_reason`` this
    adapter does not know (``pause_turn`` of server tools, ...) finishes the call with
    ``"error"``.
    """

    _path: ClassVar[str] = "/messages"
    _kind: ClassVar[str] = "anthropic"
    _default_defaults: ClassVar[AdapterDefaults] = AdapterDefaults(max_tokens=_FALLBACK_MAX_TOKENS)

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

    def _body(self, request: LLMRequest) -> dict[str, Any]:
        config = request.config
        body: dict[str, Any] = {"model": config.model}
        if config.max_tokens is not None:
            body["max_tokens"] = config.max_tokens
        if request.system:
            body["system"] = request.system
        body["messages"] = _messages(request.messages)
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        body["stream"] = True
        body.update(config.extra)
        return body

    def _decoder(self) -> _MessagesDecoder:
        return _MessagesDecoder()


def _blocks(content: str | tuple[Any, ...]) -> list[Any]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _messages(history: Sequence[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    # The content list of the user turn that collects tool results, while it is still open:
    # the API wants all results of one assistant turn (and any user text after them) together.
    results: list[Any] | None = None
    for message in history:
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
    return out


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning is not None and message.reasoning_signature:
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
    for call in message.tool_calls:
        arguments = call.arguments
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": {} if isinstance(arguments, str) else arguments,
            }
        )
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
            tool_index = len(self._tool_blocks)
            self._tool_blocks[index] = tool_index
            initial = block.get("input")
            arguments = dumps(initial) if isinstance(initial, Mapping) and initial else ""
            return [
                ToolCallDelta(tool_index, _str(block.get("id")), _str(block.get("name")), arguments)
            ]
        if kind == "text":
            text = block.get("text")
            return [TextDelta(text)] if isinstance(text, str) and text else []
        if kind == "thinking":
            parts: list[StreamPart] = []
            thinking = block.get("thinking")
            if isinstance(thinking, str) and thinking:
                parts.append(ReasoningDelta(thinking))
            signature = block.get("signature")
            if isinstance(signature, str) and signature:
                parts.append(ReasoningDelta("", signature=signature))
            return parts
        return []

    def _block_delta(self, index: object, delta: object) -> list[StreamPart]:
        if not isinstance(delta, Mapping):
            return []
        kind = delta.get("type")
        if kind == "text_delta":
            text = delta.get("text")
            return [TextDelta(text)] if isinstance(text, str) and text else []
        if kind == "input_json_delta":
            fragment = delta.get("partial_json")
            tool_index = self._tool_blocks.get(index) if isinstance(index, int) else None
            if tool_index is None or not isinstance(fragment, str) or not fragment:
                return []
            return [ToolCallDelta(tool_index, arguments=fragment)]
        if kind == "thinking_delta":
            thinking = delta.get("thinking")
            return [ReasoningDelta(thinking)] if isinstance(thinking, str) and thinking else []
        if kind == "signature_delta":
            signature = delta.get("signature")
            if isinstance(signature, str) and signature:
                return [ReasoningDelta("", signature=signature)]
        return []

    def finish(self) -> Finish:
        if not self.done:
            raise ProviderError("the stream ended before message_stop", code="incomplete_stream")
        return Finish(self._reason or "stop", dict(self._usage) or None)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
