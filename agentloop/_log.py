"""The durable log's schema: one builder per event type that agentloop writes, and the typed
payload its readers get.

Every writer builds ``data`` here, so the keys of a type are written in one place; readers use
the ``TypedDict`` of the type (``cast(AssistantMessageData, event.data)``). The builders return
the same :class:`FrozenDict` a literal would, from values that are already frozen JSON, so the
per-chunk builder costs one dict construction.
"""

from __future__ import annotations

from typing import Final, Literal, TypedDict

from ._json import JSON, FrozenDict, freeze
from ._model import Content, Message, ToolCall

__all__ = [
    "TURN_START", "TURN_END", "USER_MESSAGE", "STEERING_MESSAGE", "REQUEST_HEADER",
    "ASSISTANT_CHUNK", "ASSISTANT_MESSAGE", "TOOL_CALL", "TOOL_RESULT",
    "turn_start", "turn_end", "claimed_message", "request_header", "text_chunk",
    "tool_call_chunk", "assistant_message", "tool_call", "tool_result",
    "ClaimedMessageData", "AssistantMessageData", "ToolCallData", "ToolResultData",
    "TurnEndData", "ChunkData", "RequestHeaderData",
    "TOOL_APPROVAL_REQUESTED", "TOOL_APPROVAL_ANSWERED", "approval_requested",
    "approval_answered", "ApprovalRequestedData", "ApprovalAnsweredData",
    "HISTORY_REPLACED", "history_replaced", "HistoryReplacedData", "message_json",
    "USAGE_KEYS", "TurnStartData", "SCHEMA", "failed_call",
    "TURN_RESUMED", "turn_resumed", "TurnResumedData",
]

TURN_START: Final = "turn/start"
TURN_END: Final = "turn/end"
TURN_RESUMED: Final = "turn/resumed"
USER_MESSAGE: Final = "user/message"
STEERING_MESSAGE: Final = "steering/message"
REQUEST_HEADER: Final = "request/header"
ASSISTANT_CHUNK: Final = "assistant/chunk"
ASSISTANT_MESSAGE: Final = "assistant/message"
TOOL_CALL: Final = "tool/call"
TOOL_RESULT: Final = "tool/result"
TOOL_APPROVAL_REQUESTED: Final = "tool/approval-requested"
TOOL_APPROVAL_ANSWERED: Final = "tool/approval-answered"
HISTORY_REPLACED: Final = "history/replaced"

USAGE_KEYS: Final = (
    "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
    "reasoning_tokens",
)
"""The normalised token counters summed into ``turn/end`` and ``session.usage``."""


# --- payloads, for readers ---------------------------------------------------------------------


class TurnStartData(TypedDict):
    turn: int


class TurnResumedData(TypedDict):
    turn: int
    after_seq: int  # the last stored event before the crash
    step: int | None  # the step the crash cut (its model call or its tools), if any
    rerun: list[str]  # idempotent calls run again
    interrupted: list[str]  # calls answered INTERRUPTED_BY_CRASH


class ClaimedMessageData(TypedDict):
    message_id: str
    content: Content
    source: JSON


class RequestHeaderData(TypedDict, total=False):
    step: int
    provider: str | None
    model: str | None
    config: FrozenDict
    adapter_defaults: tuple[str, ...]
    messages: int
    """How many messages the request sends."""
    cache_prefix: int
    """The index of the first message that differs from the previous request on the same
    route (provider and model): what a prompt cache may reuse."""
    rewritten: bool
    """An ``agent/request`` handler replaced the messages (for this call only)."""
    after_error: FrozenDict
    """This call retries a failed one of the same step: that call's ``provider``, ``model``,
    ``attempt`` (its number on that route) and ``error`` (``message``, ``status``, ``code``,
    ...). A different provider or model than this header's is a fallback to another route."""
    queued_seconds: float
    """How long the call waited for a slot of its provider's or route's shared limits
    (``max_concurrent_calls``, ``max_calls_per_minute``); absent when it did not wait."""


class HistoryReplacedData(TypedDict, total=False):
    """The derived history shows ``messages`` in place of what seqs ``first_seq`` to
    ``last_seq`` produced (a replacement's own messages count as produced by its
    ``last_seq``)."""

    first_seq: int
    last_seq: int
    messages: tuple[FrozenDict, ...]
    reason: str
    usage: FrozenDict


class ChunkData(TypedDict, total=False):
    step: int
    kind: Literal["text", "reasoning", "tool_call"]
    delta: str | FrozenDict
    repaired: bool


class AssistantMessageData(TypedDict, total=False):
    step: int | None
    content: str
    reasoning: str | None
    reasoning_signature: str | None
    reasoning_blocks: tuple[FrozenDict, ...]
    tool_calls: tuple[FrozenDict, ...]
    source_event_seqs: tuple[int, ...]
    finish_reason: str | None
    usage: FrozenDict | None
    interrupted: bool
    renamed_tool_call_ids: tuple[FrozenDict, ...]
    output: JSON


class ToolCallData(TypedDict):
    call_id: str
    name: str
    arguments: FrozenDict | str


class ToolResultData(TypedDict, total=False):
    call_id: str
    name: str
    content: JSON
    is_error: bool
    error_code: str | None
    repaired: bool


class ApprovalRequestedData(TypedDict):
    """A call parked until a person answers: everything it needs to run comes from here."""

    call_id: str
    name: str
    arguments: FrozenDict
    prompt: str


class ApprovalAnsweredData(TypedDict, total=False):
    """The answer to a parked call, logged before the call runs (or is refused), so a crash
    after an approval never asks, or runs, the call a second time."""

    call_id: str
    approved: bool
    reason: str


class TurnEndData(TypedDict, total=False):
    turn: int
    reason: str
    cause: str
    error: FrozenDict
    usage: FrozenDict
    detail: str
    # A suspended turn that asked for structured output: the turn its approvals open asks
    # for the same, even in another process.
    output_schema: FrozenDict
    output_name: str


# --- builders, for writers ---------------------------------------------------------------------


def turn_start(turn: int) -> FrozenDict:
    return FrozenDict(turn=turn)


def turn_resumed(
    turn: int, after_seq: int, step: int | None, rerun: tuple[str, ...],
    interrupted: tuple[str, ...],
) -> FrozenDict:
    return FrozenDict(
        turn=turn, after_seq=after_seq, step=step, rerun=rerun, interrupted=interrupted
    )


def turn_end(
    turn: int, reason: str, cause: str | None = None, error: FrozenDict | None = None,
    usage: FrozenDict | None = None, detail: str | None = None,
    output: tuple[FrozenDict, str] | None = None,
) -> FrozenDict:
    fields: dict[str, JSON] = {"turn": turn, "reason": reason}
    if cause is not None:
        fields["cause"] = cause
    if error is not None:
        fields["error"] = error
    if usage is not None:
        fields["usage"] = usage
    if detail:
        fields["detail"] = detail
    if output is not None:
        fields["output_schema"], fields["output_name"] = output
    return FrozenDict(fields)


def claimed_message(message_id: str, content: Content, source: JSON) -> FrozenDict:
    """The payload of ``user/message`` and ``steering/message``."""
    return FrozenDict(message_id=message_id, content=content, source=source)


def request_header(
    step: int, config: FrozenDict, adapter_defaults: tuple[str, ...],
    messages: int | None = None, cache_prefix: int | None = None, rewritten: bool = False,
    after_error: FrozenDict | None = None, queued_seconds: float | None = None,
) -> FrozenDict:
    fields: dict[str, JSON] = {
        "step": step,
        "provider": config["provider"],
        "model": config["model"],
        "config": config,
        "adapter_defaults": adapter_defaults,
    }
    if messages is not None:
        fields["messages"] = messages
    if cache_prefix is not None:
        fields["cache_prefix"] = cache_prefix
    if rewritten:
        fields["rewritten"] = True
    if after_error is not None:
        fields["after_error"] = after_error
    if queued_seconds is not None:
        fields["queued_seconds"] = queued_seconds
    return FrozenDict(fields)


def failed_call(
    provider: str | None, model: str | None, attempt: int, error: FrozenDict
) -> FrozenDict:
    """The ``after_error`` of the ``request/header`` that retries a failed call."""
    return FrozenDict(provider=provider, model=model, attempt=attempt, error=error)


def text_chunk(step: int, kind: str, delta: str, *, repaired: bool = False) -> FrozenDict:
    """An ``assistant/chunk`` of text or reasoning."""
    if repaired:
        return FrozenDict(step=step, kind=kind, delta=delta, repaired=True)
    return FrozenDict(step=step, kind=kind, delta=delta)


def tool_call_chunk(
    step: int, index: int, call_id: str | None, name: str | None, arguments: str,
    *, repaired: bool = False,
) -> FrozenDict:
    delta = FrozenDict(index=index, id=call_id, name=name, arguments=arguments)
    if repaired:
        delta = FrozenDict(delta, repaired=True)
    return FrozenDict(step=step, kind="tool_call", delta=delta)


def assistant_message(
    step: int | None,
    content: str,
    reasoning: str | None,
    reasoning_signature: str | None,
    tool_calls: tuple[ToolCall, ...],
    source_event_seqs: tuple[int, ...],
    finish_reason: str | None,
    usage: FrozenDict | None,
    interrupted: bool,
    renamed: tuple[FrozenDict, ...] = (),
    reasoning_blocks: tuple[FrozenDict, ...] = (),
    output: JSON = None,
) -> FrozenDict:
    """The completion anchor: final, interrupted (cancel) and crash-recovered alike.

    ``reasoning_blocks`` (the provider's blocks, kept for a verbatim replay) is written only
    when there are some; ``reasoning`` and ``reasoning_signature`` stay for older readers.
    """
    fields = FrozenDict(
        step=step,
        content=content,
        reasoning=reasoning,
        reasoning_signature=reasoning_signature,
        tool_calls=(
            (tool_calls[0].to_json(),) if len(tool_calls) == 1
            else tuple(c.to_json() for c in tool_calls)
        ),
        source_event_seqs=source_event_seqs,
        finish_reason=finish_reason,
        usage=usage,
        interrupted=interrupted,
    )
    if reasoning_blocks:
        fields = FrozenDict(fields, reasoning_blocks=reasoning_blocks)
    if output is not None:
        # The run's validated structured output, kept here so that a resume rebuilds it.
        fields = FrozenDict(fields, output=output)
    if renamed:
        return FrozenDict(fields, renamed_tool_call_ids=renamed)
    return fields


def tool_call(call: ToolCall) -> FrozenDict:
    return FrozenDict(call_id=call.id, name=call.name, arguments=call.arguments)


def tool_result(
    call: ToolCall, content: JSON, is_error: bool, error_code: str | None,
    repaired: bool = False,
) -> FrozenDict:
    fields = result_of(call.id, call.name, content, is_error, error_code)
    return FrozenDict(fields, repaired=True) if repaired else fields


def result_of(
    call_id: str, name: str, content: JSON, is_error: bool, error_code: str | None
) -> FrozenDict:
    """A ``tool/result`` payload from its parts (no repair noted)."""
    return FrozenDict(
        call_id=call_id, name=name, content=content, is_error=is_error, error_code=error_code
    )


def approval_requested(call: ToolCall, arguments: FrozenDict, prompt: str) -> FrozenDict:
    return FrozenDict(call_id=call.id, name=call.name, arguments=arguments, prompt=prompt)


def approval_answered(call_id: str, *, approved: bool, reason: str | None = None) -> FrozenDict:
    if reason is None:
        return FrozenDict(call_id=call_id, approved=approved)
    return FrozenDict(call_id=call_id, approved=approved, reason=reason)


def message_json(message: Message) -> FrozenDict:
    """A history message as frozen JSON (fields at their defaults are left out).

    Raises:
        InvalidContent: the content is not JSON.
    """
    fields: dict[str, JSON] = {"role": message.role, "content": freeze(message.content)}
    if message.tool_calls:
        fields["tool_calls"] = freeze(tuple(c.to_json() for c in message.tool_calls))
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        fields["name"] = message.name
    if message.is_error:
        fields["is_error"] = True
    if message.interrupted:
        fields["interrupted"] = True
    if message.reasoning is not None:
        fields["reasoning"] = message.reasoning
    if message.reasoning_signature is not None:
        fields["reasoning_signature"] = message.reasoning_signature
    if message.reasoning_blocks:
        fields["reasoning_blocks"] = freeze(message.reasoning_blocks)
    return FrozenDict(fields)


def history_replaced(
    first_seq: int, last_seq: int, messages: tuple[FrozenDict, ...], reason: str,
    usage: FrozenDict | None = None,
) -> FrozenDict:
    fields = FrozenDict(
        first_seq=first_seq, last_seq=last_seq, messages=messages, reason=reason
    )
    return FrozenDict(fields, usage=usage) if usage else fields


SCHEMA: Final[tuple[tuple[str, type, str], ...]] = (
    (TURN_START, TurnStartData, "a turn opens"),
    (TURN_RESUMED, TurnResumedData,
     "a turn a crash left open goes on in a new process (crashed_turn = \"continue\")"),
    (USER_MESSAGE, ClaimedMessageData, "a next-turn message is claimed"),
    (STEERING_MESSAGE, ClaimedMessageData, "a next-step message (steer or inject) is claimed"),
    (REQUEST_HEADER, RequestHeaderData, "before each model call: what is sent"),
    (ASSISTANT_CHUNK, ChunkData, "each streamed delta"),
    (ASSISTANT_MESSAGE, AssistantMessageData, "the completion anchor (final or interrupted)"),
    (TOOL_CALL, ToolCallData, "a tool call enters the pipeline"),
    (TOOL_APPROVAL_REQUESTED, ApprovalRequestedData, "a call is parked for approval"),
    (TOOL_APPROVAL_ANSWERED, ApprovalAnsweredData, "a parked call is approved or denied"),
    (TOOL_RESULT, ToolResultData, "a call's result is final"),
    (HISTORY_REPLACED, HistoryReplacedData, "history is compacted or replaced"),
    (TURN_END, TurnEndData, "a turn closes"),
)
"""Every durable log type agentloop writes, its payload and when it is written (the event
catalog is generated from this)."""
