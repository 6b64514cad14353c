"""The OpenAI Responses API adapter (``POST /responses``, streamed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

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
    error_fields,
    int_counters,
    parse_event_json,
)

__all__ = ["OpenAIResponsesAdapter"]

FORMAT = "openai-responses"

_INCOMPLETE_REASONS: dict[str, FinishReason] = {
    "max_output_tokens": "max_tokens",
    "content_filter": "content_filter",
}


class OpenAIResponsesAdapter(HTTPStreamAdapter):
    """Streams ``POST {base_url}/responses`` of the OpenAI Responses API.

    Args:
        base_url: the API root as the OpenAI SDK takes it, version included
            (``"https://api.openai.com/v1"``); used as given.
        api_key: sent as ``Authorization: Bearer``; never shown in reprs or errors.
        headers: extra request headers (they win over the adapter's own).
        client: the ``httpx.AsyncClient`` to use; by default the runtime's pooled client.
        defaults: values the runtime fills in when a call leaves them unset.
        encrypted_reasoning: ask for ``reasoning.encrypted_content`` so that reasoning items
            can be sent back without server-side storage. By default asked for when the call
            sets ``reasoning_effort`` (models without reasoning refuse the request).
        reasoning_efforts: the ``reasoning_effort`` values to accept, or ``"any"``; by
            default OpenAI's documented set (``none``, ``minimal``, ``low``, ``medium``,
            ``high``, ``xhigh``) for ``api.openai.com`` and Azure OpenAI, any value for a
            compatible server. A value outside the set raises
            :class:`agentloop.ConfigError` naming the provider, the field and the allowed
            values.
        retry: the provider's retry policy, captured when the adapter is registered.

    Requests are stateless (``store: false``): the whole history is sent each time. Every
    reasoning item is one reasoning block (format ``"openai-responses"``) whose fields keep
    the item exactly as ``response.output_item.done`` gave it (``id``, ``summary``,
    ``encrypted_content``), and is sent back unchanged before the text and function calls
    of its message. Its summary text streams as reasoning parts. ``config.extra`` is merged
    into the body last. ``response.incomplete`` finishes with ``"max_tokens"`` or
    ``"content_filter"``; ``response.failed`` and ``error`` events raise
    :class:`agentloop.ProviderError` with the provider's code. Cached input tokens are
    reported as ``cache_read_tokens``.
    """

    _path: ClassVar[str] = "/responses"
    _history_key: ClassVar[str] = "input"
    _kind: ClassVar[str] = "openai-responses"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        defaults: AdapterDefaults | None = None,
        encrypted_reasoning: bool | None = None,
        reasoning_efforts: AllowedEfforts = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(
            base_url, api_key=api_key, headers=headers, client=client, defaults=defaults,
            retry=retry, reasoning_efforts=reasoning_efforts,
        )
        self.encrypted_reasoning = encrypted_reasoning
        # A message's items depend on the message alone: encoded once per history.
        self._encoder = MessageEncoder(_message_items)

    def _auth_headers(self, api_key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"}

    def _items(self, request: LLMRequest) -> list[Any]:
        return _items(request.messages)

    def _fragments(self, request: LLMRequest) -> list[bytes]:
        return self._encoder.fragments(request.messages)  # b"" for a message of no item

    def _envelope(self, request: LLMRequest, items: list[Any]) -> dict[str, Any]:
        """The body around the input ``items``."""
        config = request.config
        body: dict[str, Any] = {"model": config.model}
        if request.system:
            body["instructions"] = request.system
        body["input"] = items
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        body["stream"] = True
        body["store"] = False
        if config.max_tokens is not None:
            body["max_output_tokens"] = config.max_tokens
        if config.reasoning_effort is not None:
            body["reasoning"] = {"effort": config.reasoning_effort}
        encrypted = self.encrypted_reasoning
        if encrypted is None:
            encrypted = config.reasoning_effort is not None
        if encrypted:
            body["include"] = ["reasoning.encrypted_content"]
        body.update(config.extra)
        return body

    def _decoder(self) -> _ResponsesDecoder:
        return _ResponsesDecoder()


def _user_part(part: object) -> object:
    # History content uses the chat-completions part shapes; the Responses API has its own.
    if not isinstance(part, Mapping):
        return part
    kind = part.get("type")
    if kind == "text":
        return {"type": "input_text", "text": part.get("text", "")}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        return {"type": "input_image", "image_url": url}
    return part


def _items(history: Sequence[Message]) -> list[Any]:
    return [item for message in history for item in _message_items(message)]


def _message_items(message: Message) -> list[Any]:
    if message.role == "user":
        content = message.content
        return [{
            "role": "user",
            "content": content if isinstance(content, str)
            else [_user_part(part) for part in content],
        }]
    if message.role == "tool":
        return [{
            "type": "function_call_output",
            "call_id": message.tool_call_id,
            "output": content_text(message.content),
        }]
    return _assistant_items(message)


def _assistant_items(message: Message) -> list[Any]:
    items: list[Any] = []
    late: list[tuple[int, Any]] = []
    for block in message.reasoning_blocks:
        if block.get("format") == FORMAT:
            fields = block.get("fields") or {}
            item = fields.get("item")
            if isinstance(item, Mapping):
                after = fields.get("after_tool_calls", 0)
                if isinstance(after, int) and after > 0:
                    late.append((after, item))
                else:
                    items.append(item)
    text = message.text
    if text:
        items.append({"role": "assistant", "content": text})
    for position, call in enumerate(message.tool_calls):
        items.extend(item for after, item in late if after == position)
        items.append(_call(call))
    count = len(message.tool_calls)
    items.extend(item for after, item in late if after >= count)
    return items


def _call(call: ToolCall) -> dict[str, Any]:
    arguments = call.arguments if isinstance(call.arguments, str) else dumps(call.arguments)
    return {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": arguments}


def _tool(spec: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "name": spec.name,
        "description": spec.description,
        "parameters": spec.parameters,
    }


def _usage(raw: object) -> dict[str, int] | None:
    usage = int_counters(raw)
    if not usage:
        return None
    cached = usage.get("cached_tokens")
    if cached is not None:
        usage["cache_read_tokens"] = cached
    return usage


class _ResponsesDecoder:
    def __init__(self) -> None:
        self.done = False
        self._reason: FinishReason | None = None
        self._usage: dict[str, int] | None = None
        self._refused = False
        # output_index -> reasoning block number, with the last summary part seen
        self._reasoning: dict[int, list[int]] = {}
        # output_index -> [tool-call index, whether argument deltas came]
        self._calls: dict[int, list[int]] = {}
        self._late: set[int] = set()  # reasoning blocks that came after a call
        # Every event carries a sequence number: the same event again under it is a
        # duplicate. (Only the same event: a server that numbers carelessly, every event 0,
        # must not lose the rest of its stream.)
        self._seen: dict[int, int] = {}
        # output_index -> the call's id and the arguments streamed so far
        self._call_ids: dict[int, str | None] = {}
        self._streamed: dict[int, list[str]] = {}
        # output_index -> argument fragments that came before their item was added
        self._early: dict[int, list[str]] = {}
        self._finished: set[int] = set()  # output indexes whose done item came

    def feed(self, event: SSEEvent) -> list[StreamPart]:
        if not event.data.strip():
            return []
        data = parse_event_json(event.data)
        kind = data.get("type")
        if not isinstance(kind, str):
            kind = event.event
        number = data.get("sequence_number")
        if isinstance(number, int) and not isinstance(number, bool):
            fingerprint = hash(event.data)
            if self._seen.get(number) == fingerprint:
                return []  # a duplicated event: it was taken once already
            self._seen[number] = fingerprint
        if kind == "response.output_text.delta":
            delta = data.get("delta")
            return [TextDelta(delta)] if isinstance(delta, str) and delta else []
        if kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return self._reasoning_delta(data, kind == "response.reasoning_summary_text.delta")
        if kind == "response.function_call_arguments.delta":
            return self._arguments(data)
        if kind == "response.output_item.added":
            return self._item(data, done=False)
        if kind == "response.output_item.done":
            return self._item(data, done=True)
        if kind == "response.refusal.delta":
            delta = data.get("delta")
            if isinstance(delta, str) and delta:
                self._refused = True
                return [TextDelta(delta)]
            return []
        if kind in ("response.completed", "response.incomplete"):
            self._end(data.get("response"), kind == "response.completed")
        elif kind == "response.failed":
            response = data.get("response")
            message, code = error_fields(response)
            raise ProviderError(message or "the response failed", code=code or "response_failed")
        elif kind == "error":
            message, code = error_fields(data)
            raise ProviderError(message or "the provider reported an error", code=code)
        return []

    def _index(self, data: Mapping[str, Any]) -> int:
        index = data.get("output_index")
        return index if isinstance(index, int) and not isinstance(index, bool) else -1

    def _reasoning_delta(self, data: Mapping[str, Any], summary: bool) -> list[StreamPart]:
        delta = data.get("delta")
        if not isinstance(delta, str) or not delta:
            return []
        index = self._index(data)
        state = self._reasoning.get(index)
        if state is None:
            # Text for an item that was never announced still gets a block of its own.
            state = self._reasoning[index] = [len(self._reasoning), -1]
            opened = ReasoningDelta("", block=state[0], format=FORMAT)
            return [opened, *self._reasoning_delta(data, summary)]
        part = data.get("summary_index" if summary else "content_index")
        part = part if isinstance(part, int) else 0
        if part != state[1]:
            # Summary parts are paragraphs of their own, as the API shows them.
            separate = state[1] >= 0
            state[1] = part
            if separate:
                return [ReasoningDelta("\n\n" + delta, block=state[0])]
        return [ReasoningDelta(delta, block=state[0])]

    def _arguments(self, data: Mapping[str, Any]) -> list[StreamPart]:
        delta = data.get("delta")
        if not isinstance(delta, str) or not delta:
            return []
        index = self._index(data)
        state = self._calls.get(index)
        if state is None:
            self._early.setdefault(index, []).append(delta)
            return []
        if index in self._finished:
            raise ProviderError(
                f"function call {self._call_ids.get(index)!r} got arguments after its "
                "finished item (events out of order)", code="invalid_stream",
            )
        state[1] = 1
        self._streamed[index].append(delta)
        return [ToolCallDelta(state[0], arguments=delta)]

    def _item(self, data: Mapping[str, Any], *, done: bool) -> list[StreamPart]:
        item = data.get("item")
        if not isinstance(item, Mapping):
            return []
        index = self._index(data)
        kind = item.get("type")
        if kind == "reasoning":
            state = self._reasoning.get(index)
            if state is None:
                state = self._reasoning[index] = [len(self._reasoning), -1]
            # The done item replaces the added one: it has the summary and encrypted content.
            fields: dict[str, Any] = {"item": item}
            if self._calls and state[0] not in self._late:
                self._late.add(state[0])
                # It goes back after the calls that preceded it, where the model put it.
                fields["after_tool_calls"] = len(self._calls)
            return [ReasoningDelta("", block=state[0], format=FORMAT, fields=fields)]
        if kind == "function_call":
            arguments = item.get("arguments")
            arguments = arguments if isinstance(arguments, str) else ""
            call_id = _str(item.get("call_id"))
            state = self._calls.get(index)
            if state is None:
                twin = next((i for i, c in self._call_ids.items()
                             if call_id is not None and c == call_id), None)
                if twin is not None:
                    raise ProviderError(
                        f"function call {call_id!r} was added at output {twin} and again at "
                        f"{index}", code="invalid_stream",
                    )
                state = self._calls[index] = [len(self._calls), 0]
                self._call_ids[index] = call_id
                if done:
                    self._finished.add(index)
                early = "".join(self._early.pop(index, ()))
                if early and not done:
                    # Deltas that overtook the added item: they lead its arguments.
                    arguments = early
                streamed = self._streamed[index] = [arguments] if arguments else []
                state[1] = 1 if streamed else 0
                return [ToolCallDelta(state[0], call_id, _str(item.get("name")), arguments)]
            if call_id is not None and self._call_ids.get(index) not in (None, call_id):
                raise ProviderError(
                    f"output {index} holds function call {self._call_ids[index]!r} and then "
                    f"{call_id!r}", code="invalid_stream",
                )
            if done:
                self._finished.add(index)
            if done and not state[1] and arguments:
                # A server that sends the arguments only with the finished item.
                state[1] = 1
                self._streamed[index].append(arguments)
                return [ToolCallDelta(state[0], arguments=arguments)]
            if done and arguments and "".join(self._streamed[index]) != arguments:
                raise ProviderError(
                    f"the arguments streamed for function call {call_id!r} differ from the "
                    "finished item's (events lost, repeated or out of order)",
                    code="invalid_stream",
                )
        return []

    def _end(self, response: object, completed: bool) -> None:
        self.done = True
        if not isinstance(response, Mapping):
            response = {}
        self._usage = _usage(response.get("usage"))
        if completed:
            self._reason = "tool_calls" if self._calls else "stop"
            return
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, Mapping) else None
        self._reason = _INCOMPLETE_REASONS.get(reason, "error") if isinstance(reason, str) \
            else "error"

    def finish(self) -> Finish:
        if not self.done or self._reason is None:
            raise ProviderError(
                "the stream ended before response.completed", code="incomplete_stream"
            )
        if self._early:
            outputs = ", ".join(str(i) for i in sorted(self._early))
            raise ProviderError(
                f"function call arguments came for output {outputs}, which was never added "
                "(no response.output_item.added)", code="invalid_stream",
            )
        reason = self._reason
        if reason == "stop" and self._refused:
            reason = "refusal"
        return Finish(reason, self._usage)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
