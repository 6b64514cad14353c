"""Frozen value types shared by the runtime, the adapters and the test doubles."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, NewType, TypeAlias, TypeVar, get_args

import attrs

from ._errors import ConfigError
from ._json import JSON, FrozenDict, _iter_text, freeze_object, freeze_repaired
from ._util import quick_init

__all__ = [
    "MessageId",
    "new_message_id",
    "Content",
    "ToolCall",
    "Message",
    "SessionEvent",
    "InboxMessage",
    "AgentOptions",
    "CallConfig",
    "ToolSpec",
    "LLMRequest",
    "TextDelta",
    "ReasoningDelta",
    "ToolCallDelta",
    "Finish",
    "StreamPart",
    "FinishReason",
    "ToolResult",
    "PendingApproval",
    "HistorySnapshot",
    "content_text",
]

MessageId = NewType("MessageId", str)
"""Identifies one accepted inbox message; unique across both pending lists of an agent."""


def new_message_id() -> MessageId:
    """A fresh ``msg_`` id of 80 random bits (from the OS: an application's seeded
    ``random`` must not make two processes' ids meet in one durable log)."""
    return MessageId(f"msg_{os.urandom(10).hex()}")


Content: TypeAlias = "str | tuple[JSON, ...]"
"""Message content: a string, or a tuple of JSON-like parts (``{"type": "text", "text": ...}``)."""

FinishReason: TypeAlias = Literal[
    "stop", "tool_calls", "max_tokens", "content_filter", "refusal", "error"
]
"""Why a model call ended, in the runtime's vocabulary (adapters map their provider's)."""


def content_text(content: object) -> str:
    """The text of ``content``: the string itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(_iter_text(content))
    return ""


@quick_init
@attrs.frozen(slots=True, weakref_slot=False)
class ToolCall:
    """A tool call as the model made it.

    ``arguments`` is the parsed JSON object, or the raw text when the model's arguments did not
    parse as a JSON object (the call then gets an ``INVALID_ARGUMENTS`` result).
    """

    id: str
    name: str
    arguments: FrozenDict | str

    def to_json(self) -> FrozenDict:
        return FrozenDict(id=self.id, name=self.name, arguments=self.arguments)


@quick_init
@attrs.frozen(slots=True, weakref_slot=False)
class Message:
    """One entry of the derived history sent to the model.

    Attributes:
        role: ``"user"``, ``"assistant"`` or ``"tool"``.
        content: a string or a tuple of JSON parts.
        tool_calls: the assistant's tool calls, in the model's order.
        tool_call_id: for ``"tool"`` messages, the call answered.
        name: for ``"tool"`` messages, the tool's name.
        is_error: for ``"tool"`` messages, whether the result is an error.
        interrupted: True for an assistant prefix cut short by cancellation.
        reasoning: the assistant's reasoning text, replayed where a provider requires it.
        reasoning_signature: the provider's signature over that reasoning (Anthropic thinking).
        reasoning_blocks: the reply's reasoning blocks as the provider sent them, in order:
            each a ``{"format", "text"}`` object with the ``signature`` and the provider's
            opaque ``fields`` when there are any. An adapter of the same ``format`` replays
            them unchanged; any other sends ``reasoning`` as text (or nothing).
    """

    role: Literal["user", "assistant", "tool"]
    content: Content = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False
    interrupted: bool = False
    reasoning: str | None = None
    reasoning_signature: str | None = None
    reasoning_blocks: tuple[FrozenDict, ...] = ()

    @property
    def text(self) -> str:
        """The text content joined."""
        return content_text(self.content)


@quick_init
@attrs.frozen(slots=True, weakref_slot=False)
class SessionEvent:
    """One entry of a session's append-only durable log.

    ``seq`` increases strictly from 1; ``data`` is deep-frozen JSON (mutation raises
    ``TypeError``); ``turn`` is the turn the event belongs to, or ``None`` outside turns.
    """

    seq: int
    type: str
    turn: int | None
    data: FrozenDict


@quick_init
@attrs.frozen(slots=True)
class InboxMessage:
    """An accepted, pending inbox message. The same record is shared by every event about it."""

    id: MessageId
    content: Content
    source: JSON = None

    def to_json(self) -> FrozenDict:
        return FrozenDict(id=self.id, content=self.content, source=self.source)


def _non_empty_str_or_none(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{attribute.name}: must be a non-empty string, got {value!r}")


def _positive_int_or_none(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name}: must be a positive integer, got {value!r}")


def _non_negative_int(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name}: must be a non-negative integer, got {value!r}")


@attrs.frozen(slots=True, kw_only=True)
class AgentOptions:
    """Per-agent model options. Invalid values raise :class:`ConfigError` at construction."""

    provider: str | None = attrs.field(default=None, validator=_non_empty_str_or_none)
    model: str | None = attrs.field(default=None, validator=_non_empty_str_or_none)
    reasoning_effort: str | None = attrs.field(default=None, validator=_non_empty_str_or_none)
    max_tokens: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    system_prompt: str | None = None
    output_retries: int = attrs.field(default=2, validator=_non_negative_int)
    """Corrections a turn sends back for invalid structured output before it fails."""
    output_type: object = None
    """The structured output every ``run``/``ask`` of the agent asks for unless it names its
    own (an attrs class, a dataclass, a ``TypedDict`` or a JSON-schema dict)."""


_NO_EXTRA: Final = FrozenDict()


@attrs.frozen(slots=True, kw_only=True)
class CallConfig:
    """The effective configuration of one model call (what ``agent/request`` may rewrite)."""

    provider: str | None = None
    model: str | None = None
    reasoning_effort: str | None = attrs.field(default=None, validator=_non_empty_str_or_none)
    max_tokens: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    # One shared empty table (it is immutable): every agent holds a config, most without extras.
    extra: FrozenDict = attrs.field(default=_NO_EXTRA, converter=freeze_object)

    def to_json(self) -> FrozenDict:
        return FrozenDict(
            provider=self.provider,
            model=self.model,
            reasoning_effort=self.reasoning_effort,
            max_tokens=self.max_tokens,
            extra=self.extra,
        )


@attrs.frozen(slots=True)
class ToolSpec:
    """What the model sees of a tool: its name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: FrozenDict


_Memo = TypeVar("_Memo")


class HistorySnapshot(Sequence[Message]):
    """The first ``len(self)`` messages of an append-only list, ``source``.

    While ``source`` is the same object, its first n messages stay the same, so whatever was
    worked out from them (an adapter's encoded messages) holds for every later snapshot of
    it; a history that is replaced starts a new source. The session's history views are
    snapshots; a request whose messages were rewritten is a plain sequence.
    """

    __slots__ = ()

    @property
    def source(self) -> object:
        """The list this is a prefix of, as an identity (compared with ``is``, never read)."""
        raise NotImplementedError

    def memo(self, key: object, new: Callable[[], _Memo]) -> _Memo:
        """What ``key`` keeps about ``source`` (made by ``new`` the first time it asks): it
        lives as long as the source is the history, and goes with it (a replacement starts
        a new source, and with it new memos). A snapshot that keeps none makes a new one at
        every call."""
        return new()


@quick_init
@attrs.frozen(slots=True, kw_only=True, weakref_slot=False)
class LLMRequest:
    """One model call, as handed to an adapter.

    ``messages`` is an immutable snapshot of the derived history (O(1) to take: the history is
    append-only, so a snapshot is the list and a length).
    """

    system: str
    messages: Sequence[Message]
    tools: tuple[ToolSpec, ...]
    config: CallConfig
    session_id: str = ""
    turn: int = 0
    step: int = 0
    output_schema: FrozenDict | None = None
    """The JSON schema the reply text must satisfy, set only for adapters that declare
    ``supports_json_schema``; others get a ``final_result`` tool in ``tools`` instead."""
    output_name: str = "output"


@quick_init
@attrs.frozen(slots=True)
class TextDelta:
    """A fragment of the assistant's visible text."""

    text: str


def _reasoning_fields(value: object) -> FrozenDict | None:
    # Provider output that cannot be refused: a lone surrogate is repaired, not an error.
    if value is None or isinstance(value, FrozenDict):
        return value
    frozen = freeze_repaired(value)[0]
    if not isinstance(frozen, FrozenDict):
        raise TypeError(f"ReasoningDelta.fields must be a JSON object, got {value!r}")
    return frozen


@attrs.frozen(slots=True)
class ReasoningDelta:
    """A fragment of the assistant's reasoning (``reasoning_content``, Anthropic thinking).

    ``signature`` carries a provider signature over the reasoning block, when one arrives.

    ``block`` numbers the reasoning blocks of one reply in order: fragments with the same
    number are one block. ``format`` names the wire format that produced the block (the
    built-in adapters use ``"anthropic"``, ``"openai-chat"`` and ``"openai-responses"``);
    only an adapter of that format replays the block verbatim. ``fields`` are the block's
    opaque provider fields (a redacted block's ``data``, an encrypted reasoning item), merged
    into the block, later keys winning. A plain ``ReasoningDelta(text)`` is reasoning text
    that no provider needs back verbatim.
    """

    text: str
    signature: str | None = None
    block: int = attrs.field(default=0, kw_only=True)
    format: str | None = attrs.field(default=None, kw_only=True)
    fields: FrozenDict | None = attrs.field(
        default=None, kw_only=True, converter=_reasoning_fields
    )


@quick_init
@attrs.frozen(slots=True)
class ToolCallDelta:
    """A fragment of tool call ``index``: the first fragment carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "tool_calls": "tool_calls",
    "max_tokens": "max_tokens",
    "content_filter": "content_filter",
    "refusal": "refusal",
    "error": "error",
    # Provider spellings that hand-written adapters and test doubles have long yielded; the
    # shipped adapters map their whole vocabulary themselves and never rely on these.
    "end_turn": "stop",
    "stop_sequence": "stop",
    "length": "max_tokens",
    "tool_use": "tool_calls",
    "function_call": "tool_calls",
}


def _finish_reason(value: str) -> FinishReason:
    reason = _FINISH_REASONS.get(value) if isinstance(value, str) else None
    if reason is None:
        allowed = ", ".join(repr(name) for name in get_args(FinishReason))
        raise ValueError(
            f"unknown finish reason {value!r}: a Finish reason is one of {allowed} (an "
            f"adapter maps its provider's other reasons to one of these)"
        )
    return reason


@quick_init
@attrs.frozen(slots=True)
class Finish:
    """The provider finished the call. ``usage`` maps token counters to ints, when known.

    ``reason`` is always one of the :data:`FinishReason` values: the older provider spellings
    ``"end_turn"``, ``"stop_sequence"``, ``"length"``, ``"tool_use"`` and ``"function_call"``
    are normalised on construction, and anything else raises ``ValueError``.
    """

    reason: FinishReason = attrs.field(converter=_finish_reason)
    usage: Mapping[str, Any] | None = None


StreamPart: TypeAlias = "TextDelta | ReasoningDelta | ToolCallDelta | Finish"


@quick_init
@attrs.frozen(slots=True, weakref_slot=False)
class ToolResult:
    """The outcome of one tool call: what the model reads back."""

    content: Content
    is_error: bool = False
    error_code: str | None = None

    @classmethod
    def error(cls, code: str, message: str) -> ToolResult:
        return cls(content=f"Error: {message}", is_error=True, error_code=code)


@attrs.frozen(slots=True)
class PendingApproval:
    """A tool call parked until someone answers it (``agent.approve`` / ``agent.deny``).

    Attributes:
        call_id: the call's id, the key for ``approve`` and ``deny``.
        name: the tool's name.
        arguments: the validated arguments the call will run with.
        prompt: what the ``tools/pre-execute`` handler asked (``Ask(prompt)``).
    """

    call_id: str
    name: str
    arguments: FrozenDict
    prompt: str
