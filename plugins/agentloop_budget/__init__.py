"""Bound a runaway turn, or a whole tree of sub-agents: model calls, tool calls, tokens,
money and wall-clock seconds.

Load it from the config (``plugins = ["budget"]``, with a ``[budget]`` table) or in code with
``open_runtime(plugins=[agentloop_budget.budget(max_steps_per_turn=20)])``.

At every ``agent/turn-stopping`` point (before each step, and after a step's tools) the
plugin compares the turn so far with its limits. The first limit reached ends the turn
``aborted`` with ``cause == "budget"``; ``turn/end`` records the limit as ``detail`` and a
warning is logged (``agentloop.budget``) naming it. A limit is checked at those points only:
a single model call or tool is not interrupted.

With ``scope = "tree"`` the limits hold for a turn and every turn of its descendants
together (sub-agents, their sub-agents, background jobs), from one shared account: model
and tool calls are reserved before they are made, so the tree never makes more than its
limits allow; tokens and cost are booked when each reply arrives, so the tree can go over
``max_tokens_per_turn`` or ``max_cost_per_turn`` by the replies already in flight when the
account ran out (at most one per agent of the tree). A tool call refused for the tree's
budget, and the call of a parent whose sub-agent the budget stopped, answer the model with
``error_code == "BUDGET"``/``"DENIED"`` naming the limit.

``[budget]`` settings (all optional; a missing limit is no limit)::

    [budget]
    scope = "turn"                 # or "tree": a turn and its descendants' turns share the limits
    max_steps_per_turn = 50        # model calls in one turn
    max_tool_calls_per_turn = 200  # tool calls in one turn
    max_tokens_per_turn = 500000   # input + output tokens the turn's calls reported
    max_cost_per_turn = 2.5        # the turn's cost (needs a [prices] table)
    max_turn_seconds = 600         # seconds since the turn opened
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import attrs
import trio

from agentloop import ConfigError, Context, Plugin, Stop
from agentloop.events import AgentTurnStopping

from ._tree import CAUSE, ERROR_CODE, TreeBudget

__all__ = ["BudgetPolicy", "install", "plugin", "budget", "CAUSE", "ERROR_CODE", "TreeBudget"]

log = logging.getLogger("agentloop.budget")


def _count(_: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is None:
        return
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{attribute.name}: must be a positive integer, got {value!r}")


def _seconds(_: object, attribute: attrs.Attribute[float | None], value: object) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ConfigError(
            f"{attribute.name}: must be a positive, finite number of seconds, got {value!r}"
        )


def _money(_: object, attribute: attrs.Attribute[float | None], value: object) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ConfigError(f"{attribute.name}: must be a positive, finite amount, got {value!r}")


def _scope(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in ("turn", "tree"):
        raise ConfigError(f'{attribute.name}: must be "turn" or "tree", got {value!r}')


@attrs.frozen(slots=True, kw_only=True)
class BudgetPolicy:
    """The limits of one turn; also the ``[budget]`` table's shape. ``None`` is no limit.

    Attributes:
        max_steps_per_turn: model calls; checked before a step, so the turn makes at most
            this many.
        max_tool_calls_per_turn: tool calls; checked before a step and after tools, so the
            turn stops once its calls reach it (the step's calls already made still run).
        max_tokens_per_turn: ``input_tokens + output_tokens`` summed over the turn's calls.
        max_turn_seconds: seconds since the turn opened.
        max_cost_per_turn: the ``cost`` of the turn's calls, in the currency of the
            ``[prices]`` table; calls on a route without a price cost nothing here (their
            usage counts them as ``unpriced_calls``).
        scope: ``"turn"`` (each turn of each agent has the limits) or ``"tree"`` (a turn and
            every turn of its descendants share them; ``max_turn_seconds`` then counts from
            the top turn's start).
    """

    max_steps_per_turn: int | None = attrs.field(default=None, validator=_count)
    max_tool_calls_per_turn: int | None = attrs.field(default=None, validator=_count)
    max_tokens_per_turn: int | None = attrs.field(default=None, validator=_count)
    max_turn_seconds: float | None = attrs.field(default=None, validator=_seconds)
    max_cost_per_turn: float | None = attrs.field(default=None, validator=_money)
    scope: Literal["turn", "tree"] = attrs.field(default="turn", validator=_scope)

    def exceeded(self, event: AgentTurnStopping) -> str | None:
        """The limit ``event``'s turn reached (``"max_steps_per_turn (20)"``), or ``None``."""
        steps = self.max_steps_per_turn
        if steps is not None and event.point == "pre-step" and event.steps >= steps:
            return f"max_steps_per_turn ({steps})"
        limit = self.max_tool_calls_per_turn
        if limit is not None and event.tool_calls >= limit:
            return f"max_tool_calls_per_turn ({limit})"
        tokens = self.max_tokens_per_turn
        if tokens is not None:
            used = int(event.usage.get("input_tokens", 0)) + int(
                event.usage.get("output_tokens", 0)
            )
            if used >= tokens:
                return f"max_tokens_per_turn ({tokens}; the turn used {used})"
        money = self.max_cost_per_turn
        cost = event.usage.get("cost")
        if money is not None and isinstance(cost, (int, float)) and cost >= money:
            return f"max_cost_per_turn ({money:g}; the turn spent {cost:g})"
        seconds = self.max_turn_seconds
        if seconds is not None and event.elapsed >= seconds:
            return f"max_turn_seconds ({seconds:g})"
        return None


def install(ctx: Context, policy: BudgetPolicy) -> None:
    """Register the plugin's handlers on ``ctx`` (undone with its scope)."""
    if policy.max_cost_per_turn is not None and not ctx.config.section("prices"):
        log.warning(
            "budget: max_cost_per_turn is set but the config has no [prices] table, so no "
            "call has a cost and the limit never applies"
        )
    if policy.scope == "tree":
        TreeBudget(ctx, policy).install()
        return

    def on_stopping(event: AgentTurnStopping) -> Stop | None:
        limit = policy.exceeded(event)
        if limit is None:
            return None
        log.warning(
            "agent %s: turn %d reached its budget limit %s after %d steps and %d tool calls",
            event.agent_id, event.turn, limit, event.steps, event.tool_calls,
        )
        return Stop(CAUSE, f"budget limit {limit} reached")

    ctx.events.on(AgentTurnStopping, on_stopping)


def budget(
    policy: BudgetPolicy | None = None,
    *,
    max_steps_per_turn: int | None = None,
    max_tool_calls_per_turn: int | None = None,
    max_tokens_per_turn: int | None = None,
    max_turn_seconds: float | None = None,
    max_cost_per_turn: float | None = None,
    scope: Literal["turn", "tree"] | None = None,
) -> Plugin:
    """A plugin enforcing ``policy``, fields overridden by the keyword arguments given.

    Raises:
        ConfigError: an invalid value, named by its field.
    """
    overrides: dict[str, Any] = {
        name: value
        for name, value in (
            ("max_steps_per_turn", max_steps_per_turn),
            ("max_tool_calls_per_turn", max_tool_calls_per_turn),
            ("max_tokens_per_turn", max_tokens_per_turn),
            ("max_turn_seconds", max_turn_seconds),
            ("max_cost_per_turn", max_cost_per_turn),
            ("scope", scope),
        )
        if value is not None
    }
    chosen = attrs.evolve(policy if policy is not None else BudgetPolicy(), **overrides)

    # Named like the configured form: the runtime reports a plugin by its __name__.
    async def budget(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await trio.lowlevel.checkpoint()
        install(ctx, chosen)
        task_status.started()

    budget.__doc__ = f"Bound every turn by {chosen!r}."
    return budget


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["budget"]``): reads the ``[budget]`` table.

    Raises:
        ConfigError: an unknown key or an invalid value (named ``budget.<key>``).
    """
    await trio.lowlevel.checkpoint()
    install(ctx, ctx.config.section("budget", BudgetPolicy))
    task_status.started()
