"""The adapter boundary: one method that turns a request into a stream of parts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

import attrs

from .._model import CallConfig, LLMRequest, StreamPart

__all__ = ["ModelAdapter", "AdapterDefaults"]


@attrs.frozen(slots=True, kw_only=True)
class AdapterDefaults:
    """Values an adapter fills into a call config when the request leaves them unset."""

    reasoning_effort: str | None = None
    max_tokens: int | None = None


@runtime_checkable
class ModelAdapter(Protocol):
    """A model provider.

    ``stream`` returns an async iterator of :data:`StreamPart` values (text, reasoning and
    tool-call deltas, then exactly one :class:`Finish`). Provider failures raise
    :class:`agentloop.ProviderError`. The runtime closes the iterator (``aclose``) when it
    stops early, so an HTTP adapter must release its connection there.

    Optional members the runtime uses when present:

    - ``defaults: AdapterDefaults`` - values filled into unset config fields;
    - ``validate(config: CallConfig) -> None`` - raise ``ProviderError`` on unsupported
      adapter-owned fields (an unknown reasoning effort, ...).
    """

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]: ...


def validate_config(adapter: object, config: CallConfig) -> None:
    check = getattr(adapter, "validate", None)
    if check is not None:
        check(config)
