"""The retry policy: which provider failures are transient, and how long to wait before a retry.

It lives beside the adapters because a provider registration captures one (the registered
adapter's ``retry``) and ``agent/request-error`` carries it; the retry plugin
(``agentloop_retry``) is what acts on it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import attrs

from .._errors import ConfigError, ProviderError

__all__ = ["RetryPolicy", "is_retryable"]

# Transient by nature, when the failure carries no HTTP status (an error event inside an
# already-open stream, or a transport failure before any response).
_TRANSIENT_CODES = frozenset(
    {
        "overloaded_error",
        "rate_limit_error",
        "rate_limit_exceeded",
        "api_error",
        "server_error",
        "connection_error",
        "timeout",
        "incomplete_stream",
    }
)

# Permanent whatever the status says: the same call fails the same way every time.
_PERMANENT_CODES = frozenset(
    {
        "NO_ADAPTER",
        "INVALID_CONFIG",
        "invalid_config",
        "invalid_stream",
        "malformed_stream",
        "script_exhausted",
        "insufficient_quota",
    }
)

_RETRYABLE_4XX = frozenset({408, 409, 429})

# llama.cpp's server reports a reply it could not parse (tool calls a model without a tool
# template wrote as plain text) as a generic ``server_error``; the same prompt fails the same
# way on every attempt.
_UNPARSEABLE_OUTPUT = "does not match the expected"


def is_retryable(error: ProviderError) -> bool:
    """Whether ``error`` is a transient failure worth making the same call again for.

    Retryable: HTTP 408, 409, 429 and every 5xx (529 "overloaded" included); without a status,
    the codes of an overloaded or rate-limited provider (``overloaded_error``,
    ``rate_limit_error``, ...), of a transport failure (``connection_error``, ``timeout``) and
    ``incomplete_stream`` (the stream ended early: the connection dropped mid-answer, which a
    new call usually survives).

    Not retryable: every other 4xx, a missing adapter or invalid call configuration
    (``NO_ADAPTER``, ``INVALID_CONFIG``), output that does not parse (``malformed_stream``,
    ``invalid_stream``), an exhausted quota (``insufficient_quota``, sent with a 429) and
    llama.cpp's "output that does not match the expected format" (sent as ``server_error``).
    """
    if error.code in _PERMANENT_CODES or _UNPARSEABLE_OUTPUT in error.message:
        return False
    status = error.status
    if status is not None:
        return status in _RETRYABLE_4XX or 500 <= status <= 599
    return error.code in _TRANSIENT_CODES


def _count(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(
            f"{attribute.name}: must be an integer >= 0 (0 retries without limit), got {value!r}"
        )


def _seconds(_: object, attribute: attrs.Attribute[float], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ConfigError(
            f"{attribute.name}: must be a positive, finite number of seconds, got {value!r}"
        )


def _ceiling(policy: RetryPolicy, attribute: attrs.Attribute[float], value: float) -> None:
    _seconds(policy, attribute, value)
    if value < policy.base_delay:
        raise ConfigError(
            f"{attribute.name}: must be >= base_delay ({policy.base_delay!r}), got {value!r}"
        )


def _flag(_: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}: must be true or false, got {value!r}")


# Set in code only: a ``[retry]`` table cannot name a function or a random source.
_CODE_ONLY = {"config": False}


@attrs.frozen(slots=True)
class RetryPolicy:
    """How the retry plugin reacts to a failed model call; also the ``[retry]`` table's shape.

    Attributes:
        max_attempts: calls made for one request on one route (the first one included; a
            fallback to another route counts from 1 there); ``0`` retries without limit,
            until the call succeeds or the turn is cancelled.
        base_delay: the backoff ceiling before the first retry, in seconds; it doubles with
            every further retry.
        max_delay: the backoff ceiling never grows past this.
        jitter: wait a uniformly random time between 0 and the ceiling ("full jitter"), so that
            clients that failed together do not retry together; ``False`` waits the ceiling.
        retryable: decides which failures are retried (default :func:`is_retryable`).
        rng: the random source of the jitter (inject a seeded one for reproducible delays).

    An invalid value raises :class:`agentloop.ConfigError` naming the field and the value
    (``max_attempts: ...``; read from the config, ``retry.max_attempts: ...``).
    """

    max_attempts: int = attrs.field(default=5, validator=_count)
    base_delay: float = attrs.field(default=1.0, validator=_seconds)
    max_delay: float = attrs.field(default=60.0, validator=_ceiling)
    jitter: bool = attrs.field(default=True, validator=_flag)
    retryable: Callable[[ProviderError], bool] = attrs.field(
        default=is_retryable, repr=False, metadata=_CODE_ONLY
    )
    rng: random.Random = attrs.field(
        factory=random.Random, eq=False, repr=False, metadata=_CODE_ONLY
    )

    def allows(self, attempt: int) -> bool:
        """Whether another call may follow the failed call number ``attempt`` (1-based)."""
        return self.max_attempts == 0 or attempt < self.max_attempts

    def ceiling(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (1-based): base * 2**(retry-1), capped."""
        try:
            grown = math.ldexp(self.base_delay, retry - 1)
        except OverflowError:
            # Unbounded mode reaches exponents no float holds; the cap applies long before.
            grown = math.inf
        return min(self.max_delay, grown)

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """The wait before retry number ``retry``: the jittered backoff, at least ``retry_after``.

        A provider's ``Retry-After`` is a floor, not the exact wait: calling earlier only earns
        another refusal, and the jitter on top keeps the clients it told the same time from
        coming back in lockstep. It is honoured even beyond ``max_delay`` (cancel the turn to
        stop waiting); a negative or non-finite value is ignored.
        """
        ceiling = self.ceiling(retry)
        wait = self.rng.uniform(0.0, ceiling) if self.jitter else ceiling
        if retry_after is not None and math.isfinite(retry_after) and retry_after > wait:
            wait = retry_after
        return wait
