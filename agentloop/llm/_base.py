"""The adapter boundary: one method that turns a request into a stream of parts."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from typing import ClassVar

import attrs

from .._model import (
    CallConfig,
    LLMRequest,
    StreamPart,
    _non_empty_str_or_none,
    _positive_int_or_none,
)
from ._retry import RetryPolicy

__all__ = ["ModelAdapter", "AdapterDefaults", "as_adapter", "check_retry"]


@attrs.frozen(slots=True, kw_only=True)
class AdapterDefaults:
    """Values an adapter fills into a call config when the request leaves them unset.

    Invalid values raise :class:`agentloop.ConfigError` here, not in the middle of a call.
    """

    reasoning_effort: str | None = attrs.field(default=None, validator=_non_empty_str_or_none)
    max_tokens: int | None = attrs.field(default=None, validator=_positive_int_or_none)


_NO_DEFAULTS = AdapterDefaults()


class ModelAdapter(abc.ABC):
    """A model provider: subclass it and implement :meth:`stream`.

    ``stream`` returns an async iterator of :data:`StreamPart` values (text, reasoning and
    tool-call deltas, then exactly one :class:`Finish`, whose reason the adapter maps from its
    provider's). Provider failures raise :class:`agentloop.ProviderError`; any other exception
    from ``stream`` reaches the request-error hooks as ``ProviderError(code="adapter_error")``
    with the original as its ``__cause__``. The runtime closes
    the iterator (``aclose``) when it stops early, so an HTTP adapter must release its
    connection there.

    Before a call the runtime fills unset config fields from :attr:`defaults`, then passes
    the filled config to :meth:`validate`, once; ``stream`` receives that config as it is and
    does not check or fill it again.

    An object that is not a subclass but has a ``stream`` method is accepted too: it is
    adopted at registration (see :func:`as_adapter`).
    """

    defaults: AdapterDefaults = _NO_DEFAULTS
    """Values filled into unset config fields (``max_tokens``, ``reasoning_effort``)."""

    retry: RetryPolicy | None = None
    """The retry policy of this provider's calls, captured when the adapter is registered
    (unless the registration gives its own) and carried by ``agent/request-error``; the
    retry plugin prefers it to its own per-route and default policies."""

    supports_json_schema: ClassVar[bool] = False
    """Whether :meth:`stream` honours ``LLMRequest.output_schema`` (a native JSON-schema
    response format); when not, structured output goes through a ``final_result`` tool."""

    # True for adapters that already turn every failure into a ProviderError (the HTTP
    # ones): the runtime then passes their stream on without wrapping it.
    _raises_provider_errors: ClassVar[bool] = False

    @abc.abstractmethod
    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        """The parts of one call, ending with one :class:`Finish`."""

    def validate(self, config: CallConfig) -> None:  # noqa: B027 - optional, not abstract
        """Refuse a ``config`` this adapter cannot serve.

        ``config`` already has :attr:`defaults` filled in. Raise :class:`agentloop.ConfigError`
        for a value of a field the adapter owns that it does not support (naming the
        provider, the field and the allowed values), or ``ProviderError(code=
        "invalid_config")``; the runtime reports either as a failed call with code
        ``invalid_config``. Accepting everything is the default.
        """


class _Adopted(ModelAdapter):
    """An object with a ``stream`` method, seen as a :class:`ModelAdapter`.

    What it lacks is filled in here, once, so nothing on the call path has to look for it.
    """

    def __init__(
        self,
        wrapped: object,
        stream: Callable[[LLMRequest], AsyncIterator[StreamPart]],
        defaults: AdapterDefaults,
        validate: Callable[[CallConfig], object] | None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.wrapped = wrapped
        self.defaults = defaults
        self.retry = retry
        self._stream = stream
        self._validate = validate

    def __repr__(self) -> str:
        return repr(self.wrapped)

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        return self._stream(request)

    def validate(self, config: CallConfig) -> None:
        if self._validate is not None:
            self._validate(config)


def as_adapter(candidate: object) -> ModelAdapter:
    """``candidate`` as a :class:`ModelAdapter`, checked once, when it is registered.

    A subclass is returned as it is. Any other object with a callable ``stream`` is wrapped,
    keeping its own ``defaults``, ``validate`` and ``retry`` if it has them (read now, not
    per call); the wrapper's ``wrapped`` is the object. Anything else raises ``TypeError``.
    """
    if isinstance(candidate, ModelAdapter):
        if not isinstance(candidate.defaults, AdapterDefaults):
            raise TypeError(_bad_defaults(candidate, candidate.defaults))
        check_retry(candidate, candidate.retry)
        return candidate
    stream = getattr(candidate, "stream", None)
    if not callable(stream):
        raise TypeError(f"{candidate!r} has no stream(request) method; it is not an adapter")
    defaults = getattr(candidate, "defaults", None)
    if defaults is None:
        defaults = _NO_DEFAULTS
    elif not isinstance(defaults, AdapterDefaults):
        raise TypeError(_bad_defaults(candidate, defaults))
    validate = getattr(candidate, "validate", None)
    if validate is not None and not callable(validate):
        raise TypeError(f"{candidate!r}: validate must be a method, got {validate!r}")
    retry = getattr(candidate, "retry", None)
    check_retry(candidate, retry)
    return _Adopted(candidate, stream, defaults, validate, retry)


def check_retry(owner: object, retry: object) -> None:
    """Raise ``TypeError`` unless ``retry`` is a :class:`RetryPolicy` or ``None``."""
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"{owner!r}: retry must be a RetryPolicy or None, got {retry!r}")


def _bad_defaults(adapter: object, defaults: object) -> str:
    return f"{adapter!r}: defaults must be an AdapterDefaults, got {defaults!r}"
