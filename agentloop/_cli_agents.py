"""The agents that ``mcp-serve`` and ``acp`` offer: the config's ``[[agents]]``, or one agent
on the command line's route when the config names none.

As with ``run`` and ``chat``, the command line owns the sessions: a configured agent lends its
provider, model and options, and its ``session_id`` (resumed when stored).
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Mapping

import attrs

from agentloop import AgentOptions, Config, load_config

from ._cli import EXIT_USAGE, CliError, Plan, choose_route

__all__ = ["Offered", "offered_agents"]


@attrs.frozen
class Offered:
    """One agent a protocol server offers: its id, options, and session id (None: fresh)."""

    id: str
    options: AgentOptions
    session_id: str | None = None

    def fresh_session_id(self) -> str:
        return f"{self.id}-{uuid.uuid4().hex[:8]}"


def offered_agents(
    args: argparse.Namespace, plan: Plan, environ: Mapping[str, str] = os.environ
) -> list[Offered]:
    """The agents to serve, in config order; ``--agent ID`` keeps only that one."""
    config = load_config(args.config) if args.config else Config()
    agents: list[Offered] = []
    for agent in config.agents:
        options = plan.options
        if agent.provider and not args.provider:
            route = choose_route(agent.provider, agent.model, config, environ)
            options = AgentOptions(
                provider=route.provider,
                model=route.model,
                max_tokens=args.max_tokens or agent.max_tokens or route.max_tokens,
                reasoning_effort=agent.reasoning_effort or route.reasoning_effort,
            )
        session = agent.resume_session_id or agent.session_id
        agents.append(Offered(agent.id, options, session))
    if not agents:
        agents.append(Offered("agent", plan.options))
    wanted = getattr(args, "agent", None)
    if wanted is not None:
        agents = [a for a in agents if a.id == wanted]
        if not agents:
            known = ", ".join(a.id for a in config.agents) or "none"
            raise CliError(f"no agent {wanted!r} in the config (agents: {known})", EXIT_USAGE)
    if len(agents) == 1 and (plan.session or plan.resume):
        agents[0] = attrs.evolve(agents[0], session_id=plan.resume or plan.session)
    return agents
