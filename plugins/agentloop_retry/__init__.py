"""Retry failed model calls with exponential backoff and full jitter.

Load it from the config (``plugins = ["retry"]``, tuned by a ``[retry]`` table) or in code with
``open_runtime(plugins=[agentloop_retry.retry(max_attempts=3)])``.

On ``agent/request-error`` the plugin retries transient failures (see :func:`is_retryable`):
it publishes ``llm/retry`` (:class:`agentloop.events.LlmRetry`) with the retry number, the
delay and the error, sleeps that delay, then answers :class:`agentloop.Retry`. The sleep runs
inside the agent's turn, so ``agent.cancel()`` interrupts it and the turn ends ``aborted``
without another call. Anything else, or a failure once ``max_attempts`` calls were made,
is left alone and the turn ends with reason ``error``.

``[retry]`` settings (all optional)::

    [retry]
    max_attempts = 5     # calls per request on one route, the first included; 0 = no limit
    base_delay = 1.0     # seconds; the backoff ceiling doubles with every retry ...
    max_delay = 60.0     # ... up to this
    jitter = true        # wait uniform(0, ceiling) rather than the ceiling itself

A provider's ``Retry-After`` is honoured as a lower bound on the wait (see
:meth:`RetryPolicy.delay`).

Which policy applies to a failed call, first match wins:

1. the policy the provider's registration captured, which ``agent/request-error`` carries
   (``AgentRequestError.retry_policy``): the ``retry`` of the adapter registered for the
   route (``OpenAIChatAdapter(url, retry=RetryPolicy(max_attempts=3))``, or a ``retry``
   attribute of your own adapter), read when it is registered;
2. the plugin's policy for the call's provider route: a ``[retry.routes.NAME]`` table (its
   unset keys are the ``[retry]`` table's), or ``retry(routes={"NAME": RetryPolicy(...)})``;
3. the plugin's default, the ``[retry]`` table (or ``retry(...)``'s policy)::

    [retry]
    max_attempts = 5

    [retry.routes.anthropic]   # overloaded often: wait longer, try more
    max_attempts = 8
    base_delay = 2.0

``max_attempts`` counts the calls on one route: when a fallback (the ``fallback`` plugin)
moves the call to another route, that route's policy counts from 1 again. The retry
handler runs before the fallback's, so a transient failure is retried on its own route
first and only a failure the policy gives up on moves the call.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import trio

from agentloop import Context, Plugin, ProviderError, Retry
from agentloop.events import AgentRequestError, LlmRetry

from ._policy import RetryPolicy, is_retryable
from ._settings import RetrySettings, RouteRetry

__all__ = [
    "RetryPolicy", "RetrySettings", "RouteRetry", "is_retryable", "install", "plugin", "retry",
    "HANDLER_PRIORITY",
]

HANDLER_PRIORITY: Final = -100
"""Priority of the ``agent/request-error`` handler: below the default, so that a handler of
your own that decides (returns a value) is asked first, and retrying is the fallback."""


def install(
    ctx: Context, policy: RetryPolicy, routes: Mapping[str, RetryPolicy] | None = None
) -> None:
    """Register the retrying ``agent/request-error`` handler on ``ctx`` (undone with its scope).

    ``routes`` maps a provider name to its policy; ``policy`` serves every other route. A
    policy the failed call's registration captured wins over both.
    """
    by_route = dict(routes or {})
    for name, chosen in by_route.items():
        if not isinstance(chosen, RetryPolicy):
            raise TypeError(f"routes[{name!r}] must be a RetryPolicy, got {chosen!r}")

    async def on_request_error(event: AgentRequestError) -> Retry | None:
        error = event.error
        chosen = event.retry_policy
        if chosen is None:
            chosen = by_route.get(event.config.provider or "", policy)
        if not chosen.allows(event.attempt) or not chosen.retryable(error):
            return None
        # The failed call's number is also the number of the retry that follows it.
        delay = chosen.delay(event.attempt, error.retry_after)
        ctx.events.emit_nowait(LlmRetry(event.agent_id, event.attempt, delay, error))
        await trio.sleep(delay)
        return Retry()

    ctx.events.on(AgentRequestError, on_request_error, priority=HANDLER_PRIORITY)


def retry(
    policy: RetryPolicy | None = None,
    *,
    max_attempts: int | None = None,
    base_delay: float | None = None,
    max_delay: float | None = None,
    jitter: bool | None = None,
    retryable: Callable[[ProviderError], bool] | None = None,
    rng: random.Random | None = None,
    routes: Mapping[str, RetryPolicy] | None = None,
) -> Plugin:
    """A plugin retrying with ``policy`` (default :class:`RetryPolicy`), fields overridden by
    the keyword arguments given; for ``open_runtime(plugins=[...])``. ``routes`` gives
    provider routes policies of their own (used as given, not overridden).

    Raises:
        ConfigError: an invalid value, named by its field, raised here rather than at load.
    """
    overrides: dict[str, Any] = {
        name: value
        for name, value in (
            ("max_attempts", max_attempts),
            ("base_delay", base_delay),
            ("max_delay", max_delay),
            ("jitter", jitter),
            ("retryable", retryable),
            ("rng", rng),
        )
        if value is not None
    }
    chosen = attrs.evolve(policy if policy is not None else RetryPolicy(), **overrides)

    # Named like the configured form: the runtime reports a plugin by its __name__.
    async def retry(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await trio.lowlevel.checkpoint()
        install(ctx, chosen, by_route)
        task_status.started()

    by_route = dict(routes or {})
    for name, route_policy in by_route.items():
        if not isinstance(route_policy, RetryPolicy):
            raise TypeError(f"routes[{name!r}] must be a RetryPolicy, got {route_policy!r}")
    retry.__doc__ = f"Retry failed model calls with {chosen!r}." + (
        f" Routes: {by_route!r}." if by_route else ""
    )
    return retry


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["retry"]``): reads the ``[retry]`` table and its
    ``[retry.routes.NAME]`` tables.

    Raises:
        ConfigError: a table has an unknown key or an invalid value (named ``retry.<key>``
            or ``retry.routes.NAME.<key>``), which fails ``open_runtime``.
    """
    await trio.lowlevel.checkpoint()
    settings = ctx.config.section("retry", RetrySettings)
    install(ctx, settings.policy(), settings.route_policies())
    task_status.started()
