"""The retry policy: which provider failures are transient, and how long to wait before a retry."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from agentloop import ConfigError, ProviderError

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

_KEYS = ("max_attempts", "base_delay", "max_delay", "jitter")


def is_retryable(error: ProviderError) -> bool:
    """Whether ``error`` is a transient failure worth making the same call again for.

    Retryable: HTTP 408, 409, 429 and every 5xx (529 "overloaded" included); without a status,
    the codes of an overloaded or rate-limited provider (``overloaded_error``,
    ``rate_limit_error``, ...), of a transport failure (``connection_error``, ``timeout``) and
    ``incomplete_stream`` (the stream ended early: the connection dropped mid-answer, which a
    new call usually survives).

    Not retryable: every other 4xx, a missing adapter or invalid call configuration
    (``NO_ADAPTER``, ``INVALID_CONFIG``), output that does not parse (``malformed_stream``,
    ``invalid_stream``) and an exhausted quota (``insufficient_quota``, sent with a 429).
    """
    if error.code in _PERMANENT_CODES:
        return False
    status = error.status
    if status is not None:
        return status in _RETRYABLE_4XX or 500 <= status <= 599
    return error.code in _TRANSIENT_CODES


def _problem_count(value: object) -> str | None:
    if type(value) is int and value >= 0:
        return None
    return f"must be an integer >= 0 (0 retries without limit), got {value!r}"


def _problem_seconds(value: object) -> str | None:
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        return None
    return f"must be a positive, finite number of seconds, got {value!r}"


def _problem_flag(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    return f"must be true or false, got {value!r}"


@attrs.frozen(slots=True)
class RetryPolicy:
    """How the retry plugin reacts to a failed model call.

    Attributes:
        max_attempts: calls made in total for one request (the first one included); ``0``
            retries without limit, until the call succeeds or the turn is cancelled.
        base_delay: the backoff ceiling before the first retry, in seconds; it doubles with
            every further retry.
        max_delay: the backoff ceiling never grows past this.
        jitter: wait a uniformly random time between 0 and the ceiling ("full jitter"), so that
            clients that failed together do not retry together; ``False`` waits the ceiling.
        retryable: decides which failures are retried (default :func:`is_retryable`).
        rng: the random source of the jitter (inject a seeded one for reproducible delays).

    Invalid values raise :class:`agentloop.ConfigError` naming ``retry.<field>`` and the value.
    """

    max_attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 60.0
    jitter: bool = True
    retryable: Callable[[ProviderError], bool] = attrs.field(default=is_retryable, repr=False)
    rng: random.Random = attrs.field(factory=random.Random, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        problems = [
            ("max_attempts", _problem_count(self.max_attempts)),
            ("base_delay", _problem_seconds(self.base_delay)),
            ("max_delay", _problem_seconds(self.max_delay)),
            ("jitter", _problem_flag(self.jitter)),
        ]
        found = [(key, why) for key, why in problems if why is not None]
        if not found and self.max_delay < self.base_delay:
            found.append(
                (
                    "max_delay",
                    f"must be >= retry.base_delay ({self.base_delay!r}), got {self.max_delay!r}",
                )
            )
        if found:
            raise ConfigError("; ".join(f"retry.{key}: {why}" for key, why in found))

    @classmethod
    def from_config(cls, section: Mapping[str, object]) -> RetryPolicy:
        """The policy a ``[retry]`` config table describes (absent keys keep their defaults).

        Raises:
            ConfigError: an unknown key or an invalid value, named ``retry.<key>``.
        """
        unknown = sorted(str(key) for key in section if key not in _KEYS)
        if unknown:
            allowed = ", ".join(_KEYS)
            raise ConfigError(
                "; ".join(f"retry.{key}: unknown setting (allowed: {allowed})" for key in unknown)
            )
        values: dict[str, Any] = dict(section)
        return cls(**values)

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
