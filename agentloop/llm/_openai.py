"""The OpenAI Chat Completions adapter (OpenAI, DeepSeek, llama.cpp, vLLM and friends)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx

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
from ._base import AdapterDefaults
from ._efforts import AllowedEfforts
from ._retry import RetryPolicy
from ._wire import (
    HTTPStreamAdapter,
    MessageEncoder,
    SSEEvent,
    dumps,
    encode_body,
    error_fields,
    int_counters,
    parse_event_json,
)

__all__ = ["OpenAIChatAdapter"]

FORMAT = "openai-chat"
# OpenRouter's reasoning_details: replayed only to OpenRouter, so a format of their own.
OPENROUTER = "openrouter"
# The detail types whose text streams as reasoning (the rest, encrypted data, stays opaque).
_DETAIL_TEXT = {"reasoning.text": "text", "reasoning.summary": "summary"}
_OPAQUE_TEXT = ("text", "summary", "data")
# Detail blocks come after the reasoning text's (0) and the tool calls' signatures (1 + i).
_DETAIL_BLOCK = 1_000_000
# Where compatible servers put reasoning: DeepSeek and llama.cpp, then vLLM >= 0.10 and
# OpenRouter. A server that sends both repeats the same text, so the first one wins.
_REASONING_FIELDS = ("reasoning_content", "reasoning")

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
        base_url: the API root as the OpenAI SDK takes it (``OPENAI_BASE_URL``), version
            included: ``"https://api.openai.com/v1"``, ``"http://127.0.0.1:8080/v1"``,
            ``"https://api.deepseek.com"``. It is used as given.
        api_key: sent as ``Authorization: Bearer``; never shown in reprs or errors.
        headers: extra request headers (they win over the adapter's own).
        client: the ``httpx.AsyncClient`` to use; by default the runtime's pooled client.
        defaults: values the runtime fills in when a call leaves ``max_tokens`` or
            ``reasoning_effort`` unset.
        tool_call_reasoning: send ``reasoning_content`` (empty when there was none) on every
            assistant message with tool calls, which DeepSeek's thinking mode requires. By
            default on for ``api.deepseek.com``, off elsewhere.
        reasoning_efforts: the ``reasoning_effort`` values to accept, or ``"any"``. By
            default the documented set of a service known by its host (OpenAI and Azure
            OpenAI: ``none``, ``minimal``, ``low``, ``medium``, ``high``, ``xhigh``;
            OpenRouter: those and ``max``), and any value for every other server, whose
            own values (vLLM's, a proxy's) must keep working. A value outside the set
            raises :class:`agentloop.ConfigError` naming the provider, the field and the
            allowed values.
        reasoning_details: send OpenRouter's ``reasoning_details`` back verbatim. By default
            on for ``openrouter.ai``; elsewhere such blocks go back as reasoning text.
        retry: the provider's retry policy, captured when the adapter is registered and
            carried by ``agent/request-error`` (see the retry plugin).

    ``reasoning_content`` deltas (DeepSeek, llama.cpp) and ``reasoning`` deltas (vLLM,
    OpenRouter) become one reasoning block (format ``"openai-chat"``, the field's name in its
    fields), sent back under the same field unchanged; reasoning from another provider is sent
    as ``reasoning_content``. OpenRouter's ``reasoning_details`` (``reasoning.text``,
    ``reasoning.summary``, ``reasoning.encrypted`` objects, streamed in fragments that share an
    ``index``) become one block per detail (format ``"openrouter"``): the text or summary
    streams as reasoning, the fragments are merged (``text``, ``summary`` and ``data``
    concatenated, any other key the latest non-null value, keys in the order first seen), and
    the merged objects go back as ``reasoning_details``, in order, to OpenRouter (see
    ``reasoning_details``); once a reply has them, its plain ``reasoning`` deltas, which repeat
    the same text, are not read. Cached prompt tokens are reported as ``cache_read_tokens``
    beside the server's own counters. Tool-call deltas without an ``index`` (Gemini) are
    told apart by their ids, a tool call's ``extra_content`` (Gemini's thought signature) is
    kept and sent back on that call, and ``finish_reason: "stop"`` after tool calls (a
    forced function, Gemini) finishes with ``"tool_calls"``. ``config.extra`` is merged
    into the request body last. A ``finish_reason`` outside the OpenAI vocabulary (a
    compatible server's own, such as DeepSeek's ``insufficient_system_resource``) finishes the
    call with ``"error"``.
    """

    _path: ClassVar[str] = "/chat/completions"
    _history_key: ClassVar[str] = "messages"
    supports_json_schema: ClassVar[bool] = True
    _kind: ClassVar[str] = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        defaults: AdapterDefaults | None = None,
        tool_call_reasoning: bool | None = None,
        reasoning_efforts: AllowedEfforts = None,
        reasoning_details: bool | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(
            base_url, api_key=api_key, headers=headers, client=client, defaults=defaults,
            retry=retry, reasoning_efforts=reasoning_efforts,
        )
        host = (urlsplit(self.base_url).hostname or "").lower()
        if tool_call_reasoning is None:
            tool_call_reasoning = host == "deepseek.com" or host.endswith(".deepseek.com")
        self.tool_call_reasoning = tool_call_reasoning
        if reasoning_details is None:
            reasoning_details = host == "openrouter.ai" or host.endswith(".openrouter.ai")
        self.reasoning_details = reasoning_details
        self._encoder = self._new_encoder()

    def _auth_headers(self, api_key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"}

    def _items(self, request: LLMRequest) -> list[Any]:
        messages: list[Any] = []
        if request.system:
            messages.append({"role": "system", "content": request.system})
        pad, details = self.tool_call_reasoning, self.reasoning_details
        messages.extend(_message(message, pad, details) for message in request.messages)
        return messages

    def _new_encoder(self) -> tuple[tuple[bool, bool], MessageEncoder]:
        pad, details = self.tool_call_reasoning, self.reasoning_details
        return (pad, details), MessageEncoder(
            lambda message: [_message(message, pad, details)]
        )

    def _fragments(self, request: LLMRequest) -> list[bytes]:
        flags, encoder = self._encoder
        if flags != (self.tool_call_reasoning, self.reasoning_details):
            flags, encoder = self._encoder = self._new_encoder()  # the flags were changed
        fragments = encoder.fragments(request.messages)
        if request.system:
            return [encode_body({"role": "system", "content": request.system}), *fragments]
        return fragments

    def _envelope(self, request: LLMRequest, messages: list[Any]) -> dict[str, Any]:
        """The body around ``messages``."""
        config = request.config
        body: dict[str, Any] = {"model": config.model, "messages": messages}
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        if request.output_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": request.output_name,
                    "schema": request.output_schema,
                    # Strict mode refuses schemas with optional properties; the runtime
                    # validates the reply itself and sends back what is wrong.
                    "strict": False,
                },
            }
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


def _message(message: Message, pad: bool = False, details: bool = False) -> dict[str, Any]:
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
        extras = _call_extras(message)
        out["tool_calls"] = [_tool_call(call, extras.get(call.id)) for call in message.tool_calls]
    own = False
    replayed = _details(message) if details else []
    if replayed:
        out["reasoning_details"] = replayed
        own = True
    for block in message.reasoning_blocks:
        if block.get("format") == FORMAT and not replayed:
            fields = block.get("fields") or {}
            if "extra_content" in fields:
                continue  # a tool call's, sent with it
            field = fields.get("field")
            field = field if field in _REASONING_FIELDS else "reasoning_content"
            out[field] = out.get(field, "") + block.get("text", "")
            own = True
    if not own and message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    if pad and message.tool_calls and "reasoning_content" not in out:
        out["reasoning_content"] = ""
    return out


def _details(message: Message) -> list[Any]:
    """OpenRouter's ``reasoning_details`` of ``message``, exactly as they streamed in."""
    out: list[Any] = []
    for block in message.reasoning_blocks:
        if block.get("format") != OPENROUTER:
            continue
        fields = block.get("fields") or {}
        detail = fields.get("detail")
        if isinstance(detail, Mapping):
            key, text = fields.get("text_key"), block.get("text", "")
            out.append({k: text if k == key else v for k, v in detail.items()})
    return out


def _call_extras(message: Message) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    for block in message.reasoning_blocks:
        if block.get("format") == FORMAT:
            fields = block.get("fields") or {}
            owner = fields.get("tool_call_id")
            if isinstance(owner, str) and "extra_content" in fields:
                extras[owner] = fields["extra_content"]
    return extras


def _tool_call(call: ToolCall, extra: Any = None) -> dict[str, Any]:
    arguments = call.arguments if isinstance(call.arguments, str) else dumps(call.arguments)
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }
    if extra is not None:
        out["extra_content"] = extra
    return out


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
    # prompt_tokens_details.cached_tokens (OpenAI, flattened), prompt_cache_hit_tokens (DeepSeek)
    read = counters.get("cached_tokens", counters.get("prompt_cache_hit_tokens"))
    if read is not None:
        usage["cache_read_tokens"] = read
    return usage


class _ChatDecoder:
    def __init__(self) -> None:
        self.done = False
        self._reason: FinishReason | None = None
        self._usage: dict[str, int] | None = None
        self._refused = False
        # index -> (id sent, name sent): servers that repeat both in every delta exist.
        self._tools: dict[int, tuple[bool, bool]] = {}
        self._reasoning_field: str | None = None
        self._ids: dict[str, int] = {}  # call id -> index
        self._names: dict[int, str] = {}  # index -> the name its call started with
        self._last_index: int | None = None
        # OpenRouter detail index -> the detail merged so far (its streamed text key empty)
        self._details: dict[int, dict[str, Any]] = {}

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
        details = delta.get("reasoning_details")
        if isinstance(details, list) and details:
            for detail in details:
                if isinstance(detail, Mapping):
                    self._detail(detail, parts)
        field = self._reasoning_field
        if self._details:
            pass  # the details carry the reasoning; the plain field repeats it
        elif field is not None:
            reasoning = delta.get(field)
            if isinstance(reasoning, str) and reasoning:
                parts.append(ReasoningDelta(reasoning))
        else:
            for field in _REASONING_FIELDS:
                reasoning = delta.get(field)
                if isinstance(reasoning, str) and reasoning:
                    # The first fragment opens the block and says where it goes back to.
                    self._reasoning_field = field
                    parts.append(
                        ReasoningDelta(reasoning, format=FORMAT, fields={"field": field})
                    )
                    break
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
                    self._tool_delta(position, call, parts)
        return parts

    def _detail(self, detail: Mapping[str, Any], parts: list[StreamPart]) -> None:
        index = detail.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            index = max(self._details, default=-1) + 1  # a whole detail of its own
        kind = detail.get("type")
        text_key = _DETAIL_TEXT.get(kind) if isinstance(kind, str) else None
        state = self._details.get(index)
        changed = state is None
        if state is None:
            state = self._details[index] = {}
        fragment = ""
        for key, value in detail.items():
            if key == text_key and isinstance(value, str):
                fragment += value
                if key not in state:
                    state[key] = ""  # its place in the object; the text is the block's
            elif key in _OPAQUE_TEXT and isinstance(value, str) and isinstance(
                state.get(key), str
            ):
                if value:
                    state[key] += value
                    changed = True
            elif key not in state or (value is not None and state[key] != value):
                state[key] = value
                changed = True
        block = _DETAIL_BLOCK + index
        if changed:
            parts.append(ReasoningDelta(
                fragment, block=block, format=OPENROUTER,
                fields={"detail": dict(state), "text_key": text_key},
            ))
        elif fragment:
            parts.append(ReasoningDelta(fragment, block=block))

    def _tool_delta(self, position: int, call: Mapping[str, Any], parts: list[StreamPart]) -> None:
        index = call.get("index")
        raw_id = call.get("id")
        raw_id = raw_id if isinstance(raw_id, str) and raw_id else None
        if not isinstance(index, int) or isinstance(index, bool):
            index = self._unindexed(position, raw_id)
        self._last_index = index
        if raw_id is not None:
            self._ids.setdefault(raw_id, index)
        extra = call.get("extra_content")
        if isinstance(extra, Mapping) and extra:
            # Gemini's thought signature rides on the call and must go back with it: kept as a
            # reasoning block of its own (numbered after the reasoning text's block 0).
            owner = raw_id or next((i for i, n in self._ids.items() if n == index), None)
            parts.append(ReasoningDelta(
                "", block=1 + index, format=FORMAT,
                fields={"tool_call_id": owner, "extra_content": extra},
            ))
        function = call.get("function")
        if not isinstance(function, Mapping):
            function = {}
        id_sent, name_sent = self._tools.get(index, (False, False))
        self._same_call(index, raw_id, function.get("name"))
        call_id = call.get("id")
        call_id = call_id if isinstance(call_id, str) and call_id and not id_sent else None
        name = function.get("name")
        name = name if isinstance(name, str) and name and not name_sent else None
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else ""
        self._tools[index] = (id_sent or call_id is not None, name_sent or name is not None)
        if call_id is None and name is None and not arguments:
            return
        parts.append(ToolCallDelta(index, call_id, name, arguments))

    def _same_call(self, index: int, call_id: str | None, name: object) -> None:
        """A second name, or a second id that comes with a name (a call's opening), at one
        index is another call in its place: merging the two would run one call with the
        other's arguments. A fresh id on a bare fragment is a server's habit, not a call."""
        if call_id is not None and isinstance(name, str) and name:
            first = next((i for i, n in self._ids.items() if n == index), call_id)
            if first != call_id:
                raise ProviderError(
                    f"tool call {index} changed its id from {first!r} to {call_id!r}",
                    code="invalid_stream",
                )
            taken = self._ids.get(call_id, index)
            if taken != index:
                raise ProviderError(
                    f"tool call id {call_id!r} streamed at index {taken} and {index}",
                    code="invalid_stream",
                )
        if isinstance(name, str) and name:
            known = self._names.setdefault(index, name)
            if known != name:
                raise ProviderError(
                    f"tool call {index} changed its name from {known!r} to {name!r}",
                    code="invalid_stream",
                )

    def _unindexed(self, position: int, call_id: str | None) -> int:
        # Gemini's compatible endpoint leaves ``index`` out: a new id starts a new call, and a
        # fragment without one continues the call before it.
        if call_id is not None:
            known = self._ids.get(call_id)
            if known is not None:
                return known
            return max(self._tools, default=-1) + 1
        return self._last_index if self._last_index is not None else position

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
        elif reason == "stop" and self._tools:
            # A forced function (tool_choice) on OpenAI, and Gemini always, say "stop" even
            # though the reply is tool calls the loop has to run.
            reason = "tool_calls"
        return Finish(reason, self._usage)
