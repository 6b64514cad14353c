"""``scope = "tree"``: one account for a turn and every turn of its descendants.

A turn of an agent without a parent (or whose parent has run no turn) opens an account; a
sub-agent's turn is charged to the account of its parent's latest turn, so a whole tree
(sub-agents of sub-agents, background jobs) spends from one account.

All the bookkeeping runs in synchronous hook handlers: between two checkpoints nothing else
runs (trio), so a check and the reservation that follows it are one step, and concurrent
children cannot both take the last unit. What is known before it is spent is reserved
before: a model call at ``agent/turn-stopping`` (pre-step), a tool call at
``tools/pre-execute``. What is only known after (tokens, cost) is booked when the reply is
anchored (``agent/step-result``); that is where the account can go over, by the replies in
flight when it ran out (one per agent at most).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

import attrs
import trio

from agentloop import Context, Deny, Stop, ToolResult
from agentloop.events import (
    AgentDisposed,
    AgentStepResult,
    AgentTurnEnd,
    AgentTurnStopping,
    ToolPostExecute,
    ToolPreExecute,
)

if TYPE_CHECKING:
    from . import BudgetPolicy

__all__ = ["Account", "CAUSE", "ERROR_CODE", "TreeBudget"]

CAUSE: Final = "budget"
"""The ``turn/end`` cause of a turn this plugin ended."""

ERROR_CODE: Final = "BUDGET"
"""The ``error_code`` of a tool result refused, or replaced, because the tree's budget ran out."""

log = logging.getLogger("agentloop.budget")


@attrs.define(slots=True, eq=False)
class Account:
    """What one tree spent: model calls and tool calls reserved, tokens and cost booked."""

    started: float
    model_calls: int = 0
    tool_calls: int = 0
    tokens: int = 0
    cost: float = 0.0


@attrs.define(slots=True, eq=False)
class _Member:
    """One agent's current turn in a tree, and what of its usage is booked already."""

    turn: int
    account: Account
    parent: str | None
    parent_call: str | None
    tokens: int = 0
    cost: float = 0.0


def _tokens(usage: object) -> tuple[int, float]:
    if not isinstance(usage, dict):
        return 0, 0.0
    tokens = 0
    for key in ("input_tokens", "output_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            tokens += value
    cost = usage.get("cost")
    return tokens, float(cost) if isinstance(cost, (int, float)) else 0.0


class TreeBudget:
    """The accounts of one runtime's trees, kept by the budget plugin's hooks."""

    def __init__(self, ctx: Context, policy: BudgetPolicy) -> None:
        self._ctx = ctx
        self._policy = policy
        self._members: dict[str, _Member] = {}
        # Parent calls whose sub-agent the budget stopped: (parent id, call id) -> why.
        self._stopped: dict[tuple[str, str], str] = {}

    def install(self) -> None:
        on = self._ctx.events.on
        on(AgentTurnStopping, self.stopping)
        on(AgentStepResult, self.step_result)
        on(ToolPreExecute, self.pre_execute)
        on(ToolPostExecute, self.post_execute)
        on(AgentTurnEnd, self.turn_end)
        on(AgentDisposed, self.disposed)

    def account(self, agent_id: str) -> Account | None:
        """The account ``agent_id``'s latest turn is charged to."""
        member = self._members.get(agent_id)
        return member.account if member is not None else None

    # --- membership ------------------------------------------------------------------------

    def _member(self, agent_id: str, turn: int, elapsed: float) -> _Member:
        member = self._members.get(agent_id)
        if member is not None and member.turn == turn:
            return member
        session = self._ctx.sessions.get(agent_id)
        meta = session.meta if session is not None else {}
        parent, call = meta.get("parent_session_id"), meta.get("parent_call_id")
        parent = parent if isinstance(parent, str) else None
        above = self._members.get(parent) if parent is not None else None
        account = (
            above.account if above is not None
            else Account(started=trio.current_time() - elapsed)
        )
        member = _Member(turn, account, parent, call if isinstance(call, str) else None)
        self._members[agent_id] = member
        return member

    def _book(self, agent_id: str, member: _Member) -> None:
        """Add what the turn's calls spent since the last booking to its account."""
        session = self._ctx.sessions.get(agent_id)
        if session is None:
            return
        tokens, cost = _tokens(session.turn_usage)
        account = member.account
        account.tokens += tokens - member.tokens
        account.cost += cost - member.cost
        member.tokens, member.cost = tokens, cost

    # --- limits ----------------------------------------------------------------------------

    def _spent(self, account: Account, *, pre_step: bool) -> str | None:
        p = self._policy
        if pre_step and p.max_steps_per_turn is not None and (
            account.model_calls >= p.max_steps_per_turn
        ):
            return f"max_steps_per_turn ({p.max_steps_per_turn})"
        if p.max_tool_calls_per_turn is not None and (
            account.tool_calls >= p.max_tool_calls_per_turn
        ):
            return f"max_tool_calls_per_turn ({p.max_tool_calls_per_turn})"
        if p.max_tokens_per_turn is not None and account.tokens >= p.max_tokens_per_turn:
            return f"max_tokens_per_turn ({p.max_tokens_per_turn}; the tree used {account.tokens})"
        if p.max_cost_per_turn is not None and account.cost >= p.max_cost_per_turn:
            return f"max_cost_per_turn ({p.max_cost_per_turn:g}; the tree spent {account.cost:g})"
        seconds = p.max_turn_seconds
        if seconds is not None and trio.current_time() - account.started >= seconds:
            return f"max_turn_seconds ({seconds:g})"
        return None

    def stopping(self, event: AgentTurnStopping) -> Stop | None:
        member = self._member(event.agent_id, event.turn, event.elapsed)
        self._book(event.agent_id, member)
        account = member.account
        limit = self._spent(account, pre_step=event.point == "pre-step")
        if limit is None:
            if event.point == "pre-step":
                account.model_calls += 1  # reserved: the step's call is counted before it runs
            return None
        why = f"tree budget limit {limit} reached"
        log.warning(
            "agent %s: turn %d reached its tree's budget limit %s (%d model calls, %d tool "
            "calls in the tree)", event.agent_id, event.turn, limit, account.model_calls,
            account.tool_calls,
        )
        if member.parent is not None and member.parent_call is not None:
            self._stopped[(member.parent, member.parent_call)] = why
        return Stop(CAUSE, why)

    def step_result(self, event: AgentStepResult) -> None:
        member = self._members.get(event.agent_id)
        if member is not None and member.turn == event.turn:
            self._book(event.agent_id, member)

    def pre_execute(self, event: ToolPreExecute) -> Deny | None:
        member = self._members.get(event.agent_id)
        if member is None:
            return None
        account, limit = member.account, self._policy.max_tool_calls_per_turn
        if limit is not None and account.tool_calls >= limit:
            return Deny(
                f"the budget's limit max_tool_calls_per_turn ({limit}) is reached for this "
                "agent and its sub-agents"
            )
        account.tool_calls += 1  # reserved before the call runs
        return None

    def post_execute(self, event: ToolPostExecute) -> ToolResult | None:
        why = self._stopped.pop((event.agent_id, event.call.id), None)
        if why is None:
            return None
        return ToolResult.error(ERROR_CODE, f"the sub-agent was stopped: {why}")

    def turn_end(self, event: AgentTurnEnd) -> None:
        member = self._members.get(event.agent_id)
        if member is not None and member.turn == event.turn:
            self._book(event.agent_id, member)
        # A stopped child's news that no result carried (its call was cancelled) is stale.
        for key in [k for k in self._stopped if k[0] == event.agent_id]:
            del self._stopped[key]

    def disposed(self, event: AgentDisposed) -> None:
        self._members.pop(event.agent_id, None)
