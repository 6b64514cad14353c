"""Fall back to the next configured route when a model call fails for good.

Load it from the config (``plugins = ["retry", "fallback"]``, with a ``[fallback]`` table) or
in code with ``open_runtime(plugins=[agentloop_fallback.fallback(routes=[...])])``.

A route is ``"provider:model"`` (a provider registered with ``ctx.llm`` or declared under
``[providers]``), or ``"provider"`` alone to keep the call's model::

    [fallback]
    routes = ["openai:gpt-4o-mini", "anthropic:claude-3-5-haiku-latest"]

    [fallback.chains]          # optional: a chain of its own for calls on one route
    deepseek = ["openai:gpt-4o-mini"]
    "openai:gpt-4o" = ["openai:gpt-4o-mini", "anthropic:claude-3-5-haiku-latest"]

A failed call's chain is the ``chains`` entry for its ``provider:model``, else for its
provider, else ``routes``. When ``agent/request-error`` reaches this plugin's handler, the
call is made again on the first route of that chain after the failed one (wrapping round to
the start) that the call has not been made on yet (``AgentRequestError.routes``): each route
at most once per call, so a fallback never loops, and when every route has failed the turn
ends ``error`` with the last failure. The move serves that one call: the next step starts
from the agent's own route again. Moving to another provider leaves out ``reasoning_effort``
and ``extra``, which belong to the failed route's adapter (the new route's adapter fills
its own defaults); ``max_tokens`` is kept.

Why a plugin of its own rather than an option of the retry plugin: the two answer different
questions (is this failure worth the same call again, and where else can the call go), and
the handlers' priorities put them in that order. Its handler runs below the retry plugin's
(:data:`HANDLER_PRIORITY`), so the call only moves once the failure is terminal: not
retryable, or retries exhausted on its route (retry counts per route, so the new route gets
its own retries). Without the retry plugin every failure is terminal.

A cancelled turn never falls back: the handler checks for cancellation before it decides,
and ``agent.cancel()`` during a retry's wait ends the turn before this handler is asked.

Both calls are durable: the ``request/header`` of the new call records the failed one under
``after_error`` (its provider, model, attempt and error), and ``llm/retry``
(:class:`agentloop.events.LlmRetry`) is published with ``route`` set to the new route; a
warning is logged (``agentloop.fallback``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import attrs
import trio

from agentloop import CallConfig, ConfigError, Context, Plugin, ProviderError, Retry
from agentloop.events import AgentRequestError, LlmRetry

from ._policy import FallbackPolicy, Route, always

__all__ = ["FallbackPolicy", "Route", "install", "plugin", "fallback", "HANDLER_PRIORITY"]

HANDLER_PRIORITY: Final = -200
"""Priority of the ``agent/request-error`` handler: below the retry plugin's (-100), so a
failure is retried on its own route before the call moves to another."""

log = logging.getLogger("agentloop.fallback")


def moved(config: CallConfig, route: Route) -> CallConfig:
    """``config`` for ``route``: another provider's adapter-owned fields are left out."""
    if route.provider == config.provider:
        return attrs.evolve(config, model=route.model or config.model)
    return attrs.evolve(
        config, provider=route.provider, model=route.model or config.model,
        reasoning_effort=None, extra={},
    )


def install(ctx: Context, policy: FallbackPolicy) -> None:
    """Register the falling-back ``agent/request-error`` handler on ``ctx`` (undone with it)."""

    async def on_request_error(event: AgentRequestError) -> Retry | None:
        # A turn cancelled meanwhile ends here, aborted, instead of calling another route.
        await trio.lowlevel.checkpoint_if_cancelled()
        if not policy.when(event.error):
            return None
        route = policy.next_route(event.config, event.routes)
        if route is None:
            return None
        config = moved(event.config, route)
        target = f"{config.provider}:{config.model}"
        log.warning(
            "agent %s: the call on %s:%s failed (%s); falling back to %s",
            event.agent_id, event.config.provider, event.config.model, event.error, target,
        )
        ctx.events.emit_nowait(
            LlmRetry(event.agent_id, event.attempt, 0.0, event.error, route=target)
        )
        return Retry(config)

    ctx.events.on(AgentRequestError, on_request_error, priority=HANDLER_PRIORITY)


def _as_tuple(entries: Iterable[str], where: str) -> tuple[str, ...]:
    if isinstance(entries, str):
        raise ConfigError(f"{where}: must be an array of routes, got the string {entries!r} "
                          f"(for one route write [{entries!r}])")
    return tuple(entries)


def fallback(
    routes: Iterable[str] = (),
    *,
    chains: Mapping[str, Iterable[str]] | None = None,
    when: Callable[[ProviderError], bool] = always,
) -> Plugin:
    """A plugin falling back along ``routes`` (and ``chains``); for ``open_runtime(plugins=...)``.

    ``when`` decides which terminal failures move the call (default: every one).

    Raises:
        ConfigError: a route that is not ``"provider"`` or ``"provider:model"``, at once.
    """
    # A lone string is one route the caller forgot to put in a list, never its letters.
    policy = FallbackPolicy(
        routes=_as_tuple(routes, "routes"),
        chains={name: _as_tuple(chain, f"chains.{name}")
                for name, chain in (chains or {}).items()},
        when=when,
    )

    # Named like the configured form: the runtime reports a plugin by its __name__.
    async def fallback(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await trio.lowlevel.checkpoint()
        install(ctx, policy)
        task_status.started()

    fallback.__doc__ = f"Fall back along {policy!r}."
    return fallback


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["fallback"]``): reads the ``[fallback]`` table.

    Raises:
        ConfigError: an unknown key or a malformed route (named ``fallback.routes[1]``,
            ``fallback.chains.NAME[0]``), which fails ``open_runtime``.
    """
    await trio.lowlevel.checkpoint()
    install(ctx, ctx.config.section("fallback", FallbackPolicy))
    task_status.started()
