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
    max_attempts = 5     # calls in total per request, the first included; 0 = no limit
    base_delay = 1.0     # seconds; the backoff ceiling doubles with every retry ...
    max_delay = 60.0     # ... up to this
    jitter = true        # wait uniform(0, ceiling) rather than the ceiling itself

A provider's ``Retry-After`` is honoured as a lower bound on the wait (see
:meth:`RetryPolicy.delay`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Final

import attrs
import trio

from agentloop import Context, Plugin, ProviderError, Retry
from agentloop.events import AgentRequestError, LlmRetry

from ._policy import RetryPolicy, is_retryable

__all__ = ["RetryPolicy", "is_retryable", "install", "plugin", "retry", "HANDLER_PRIORITY"]

HANDLER_PRIORITY: Final = -100
"""Priority of the ``agent/request-error`` handler: below the default, so that a handler of
your own that decides (returns a value) is asked first, and retrying is the fallback."""


def install(ctx: Context, policy: RetryPolicy) -> None:
    """Register the retrying ``agent/request-error`` handler on ``ctx`` (undone with its scope)."""

    async def on_request_error(event: AgentRequestError) -> Retry | None:
        error = event.error
        if not policy.allows(event.attempt) or not policy.retryable(error):
            return None
        # The failed call's number is also the number of the retry that follows it.
        delay = policy.delay(event.attempt, error.retry_after)
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
) -> Plugin:
    """A plugin retrying with ``policy`` (default :class:`RetryPolicy`), fields overridden by
    the keyword arguments given; for ``open_runtime(plugins=[...])``.

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
        install(ctx, chosen)
        task_status.started()

    retry.__doc__ = f"Retry failed model calls with {chosen!r}."
    return retry


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["retry"]``): reads the ``[retry]`` table.

    Raises:
        ConfigError: the table has an unknown key or an invalid value (named ``retry.<key>``),
            which fails ``open_runtime``.
    """
    await trio.lowlevel.checkpoint()
    policy = ctx.config.section("retry", RetryPolicy)
    install(ctx, policy)
    task_status.started()
