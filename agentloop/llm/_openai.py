"""The OpenAI Chat Completions adapter (OpenAI, DeepSeek, llama.cpp, vLLM and friends)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from .._errors import ProviderError
from .._model import (
    Finish,
    FinishReason,
    LLMRequest,
    Message,
    ReasoningDelta,
    StreamPart,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    content_text,
)
from ._wire import HTTPStreamAdapter, SSEEvent, dumps, error_fields, int_counters, parse_event_json

__all__ = ["OpenAIChatAdapter"]

_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "max_tokens",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
    "error": "error",
}


class OpenAIChatAdapter(HTTPStreamAdapter):
    """Streams ``POST {base_url}/chat/completions`` of any OpenAI-compatible server.

    Args:
        base_url: the API root, e.g. ``"https://api.openai.com/v1"`` or
            ``"http://127.0.0.1:8080/v1"``.
        api_key: sent as ``Authorization: Bearer``; never shown in reprs or errors.
        headers: extra request headers (they win over the adapter's own).
        client: the ``httpx.AsyncClient`` to use; by default the runtime's pooled client.
        defaults: values the runtime fills in when a call leaves ``max_tokens`` or
            ``reasoning_effort`` unset.

    ``reasoning_content`` deltas (DeepSeek, llama.cpp) become reasoning parts, and an assistant
    message's ``reasoning`` is sent back as ``reasoning_content``. ``config.extra`` is merged
    into the request body last. A ``finish_reason`` outside the OpenAI vocabulary (a
    compatible server's own, such as DeepSeek's ``insufficient_system_resource``) finishes the
    call with ``"error"``.
    """

    _path: ClassVar[str] = "/chat/completions"
    _kind: ClassVar[str] = "openai"

    def _auth_headers(self, api_key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"}

    def _body(self, request: LLMRequest) -> dict[str, Any]:
        config = request.config
        messages: list[dict[str, Any]] = []
        if request.system:
            messages.append({"role": "system", "content": request.system})
        messages.extend(_message(message) for message in request.messages)
        body: dict[str, Any] = {"model": config.model, "messages": messages}
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if config.max_tokens is not None:
            body["max_tokens"] = config.max_tokens
        if config.reasoning_effort is not None:
            body["reasoning_effort"] = config.reasoning_effort
        body.update(config.extra)
        return body

    def _decoder(self) -> _ChatDecoder:
        return _ChatDecoder()


def _message(message: Message) -> dict[str, Any]:
    if message.role == "user":
        content = message.content
        return {"role": "user", "content": content if isinstance(content, str) else list(content)}
    if message.role == "tool":
        return {
            "role": "tool",
            "tool_call_id": message.tool_call_id,
            "content": content_text(message.content),
        }
    out: dict[str, Any] = {"role": "assistant", "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    return out


def _tool_call(call: ToolCall) -> dict[str, Any]:
    arguments = call.arguments if isinstance(call.arguments, str) else dumps(call.arguments)
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def _tool(spec: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": spec.name,
            "description": spec.description,
            "parameters": spec.parameters,
        },
    }


def _usage(raw: object) -> dict[str, int] | None:
    counters = int_counters(raw)
    if not counters:
        return None
    usage = {
        "input_tokens": counters.pop("prompt_tokens", 0),
        "output_tokens": counters.pop("completion_tokens", 0),
    }
    usage.update(counters)
    return usage


class _ChatDecoder:
    def __init__(self) -> None:
        self.done = False
        self._reason: FinishReason | None = None
        self._usage: dict[str, int] | None = None
        self._refused = False
        # index -> (id sent, name sent): servers that repeat both in every delta exist.
        self._tools: dict[int, tuple[bool, bool]] = {}

    def feed(self, event: SSEEvent) -> list[StreamPart]:
        data = event.data.strip()
        if not data:
            return []
        if data == "[DONE]":
            self.done = True
            return []
        chunk = parse_event_json(data)
        if chunk.get("error") is not None:
            message, code = error_fields(chunk)
            raise ProviderError(message or "the provider reported an error", code=code)
        usage = _usage(chunk.get("usage"))
        if usage is not None:
            self._usage = usage
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            return []
        choice = choices[0]
        parts = self._delta(choice.get("delta"))
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self._reason = _FINISH_REASONS.get(reason, "error")
        return parts

    def _delta(self, delta: object) -> list[StreamPart]:
        if not isinstance(delta, Mapping):
            return []
        parts: list[StreamPart] = []
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            parts.append(ReasoningDelta(reasoning))
        text = delta.get("content")
        if isinstance(text, str) and text:
            parts.append(TextDelta(text))
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self._refused = True
            parts.append(TextDelta(refusal))
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for position, call in enumerate(calls):
                if isinstance(call, Mapping):
                    part = self._tool_delta(position, call)
                    if part is not None:
                        parts.append(part)
        return parts

    def _tool_delta(self, position: int, call: Mapping[str, Any]) -> ToolCallDelta | None:
        index = call.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            index = position
        function = call.get("function")
        if not isinstance(function, Mapping):
            function = {}
        id_sent, name_sent = self._tools.get(index, (False, False))
        call_id = call.get("id")
        call_id = call_id if isinstance(call_id, str) and call_id and not id_sent else None
        name = function.get("name")
        name = name if isinstance(name, str) and name and not name_sent else None
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else ""
        self._tools[index] = (id_sent or call_id is not None, name_sent or name is not None)
        if call_id is None and name is None and not arguments:
            return None
        return ToolCallDelta(index, call_id, name, arguments)

    def finish(self) -> Finish:
        reason = self._reason
        if reason is None:
            if not self.done:
                raise ProviderError(
                    "the stream ended without a finish reason", code="incomplete_stream"
                )
            reason = "stop"
        if reason == "stop" and self._refused:
            reason = "refusal"
        return Finish(reason, self._usage)
