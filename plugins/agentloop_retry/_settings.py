"""The ``[retry]`` table: the default policy and the per-route ``[retry.routes.NAME]`` tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from agentloop import ConfigError, FrozenDict

from ._policy import RetryPolicy

__all__ = ["RetrySettings", "RouteRetry"]

_DEFAULT = RetryPolicy()


@attrs.frozen(slots=True)
class RouteRetry:
    """One ``[retry.routes.NAME]`` table: the keys it sets override the ``[retry]`` table's.

    Each key is a :class:`RetryPolicy` field; unset keys (``None``) keep the default's.
    """

    max_attempts: int | None = None
    base_delay: float | None = None
    max_delay: float | None = None
    jitter: bool | None = None

    def over(self, default: RetryPolicy) -> RetryPolicy:
        """``default`` with the keys this table sets; validated like any policy."""
        changes: dict[str, Any] = {
            name: value for name, value in attrs.asdict(self).items() if value is not None
        }
        return attrs.evolve(default, **changes) if changes else default


@attrs.frozen(slots=True)
class RetrySettings:
    """The ``[retry]`` table's shape: a :class:`RetryPolicy`'s settable fields plus ``routes``.

    Every policy is built (and so validated) when the table is read: an invalid value fails
    ``open_runtime`` with a :class:`agentloop.ConfigError` naming it (``retry.max_attempts``,
    ``retry.routes.NAME.base_delay``).
    """

    max_attempts: int = _DEFAULT.max_attempts
    base_delay: float = _DEFAULT.base_delay
    max_delay: float = _DEFAULT.max_delay
    jitter: bool = _DEFAULT.jitter
    routes: Mapping[str, RouteRetry] = attrs.field(factory=FrozenDict)

    def __attrs_post_init__(self) -> None:
        self.route_policies()  # raises on the first invalid value, named by its path

    def policy(self) -> RetryPolicy:
        """The default policy (for every route without a table of its own)."""
        return RetryPolicy(
            max_attempts=self.max_attempts,
            base_delay=self.base_delay,
            max_delay=self.max_delay,
            jitter=self.jitter,
        )

    def route_policies(self) -> dict[str, RetryPolicy]:
        """Each route's policy: the default with that route's keys."""
        default = self.policy()
        policies: dict[str, RetryPolicy] = {}
        for name, route in self.routes.items():
            try:
                policies[name] = route.over(default)
            except ConfigError as exc:
                # "max_delay: must be ..." placed under its table: routes.NAME.max_delay
                raise ConfigError(f"routes.{name}.{exc}") from None
        return policies
