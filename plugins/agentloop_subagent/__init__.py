"""Delegation tools for models: sub-agents on demand and in the background.

Load it from the config (``plugins = ["subagent"]``) or in code with
``open_runtime(plugins=[agentloop_subagent.subagents(profiles=[...])])``. Models get four tools:

- ``subagent(task, agent?)``: run ``task`` in a fresh child agent and return its answer. Several
  calls in one reply run in parallel, each in its own child.
- ``subagent_start(task, agent?)``: start it in the background and return a job id;
  ``subagent_status(job_id)`` and ``subagent_result(job_id, wait?)`` follow it up.

Children are child actors of the calling agent (``ctx.subagents`` / ``ctx.jobs``): they die
with it, cancelling its turn cancels theirs, and the limits ``subagents.max_depth`` and
``subagents.max_children`` apply. A limit, a failed child or an unknown job id is an error
result the model can read, never a failed turn.

``[subagent]`` settings (all optional)::

    [subagent]
    deliver = false          # also inject each finished background job's answer into the
                             # parent's inbox
    [[subagent.profiles]]    # named agents a model may pick with the ``agent`` argument
    name = "researcher"
    provider = "openai"      # unset fields are the calling agent's
    model = "gpt-4o-mini"
    system_prompt = "You research facts and answer briefly."
    tools = ["search"]       # the only tools its requests offer and it may call (omit
                             # for all the parent's); its own sub-agents inherit the
                             # limit and can only narrow it
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import trio

import agentloop
from agentloop import AgentOptions, ConfigError, Context, Deny, Plugin, Tool, ToolCall
from agentloop.events import AgentRequest
from agentloop.llm import LLMRequest

__all__ = ["Profile", "SubagentConfig", "install", "plugin", "subagents"]


def _check_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{attribute.name}: must be a non-empty string, got {value!r}")


@attrs.frozen(slots=True)
class Profile:
    """A named kind of sub-agent; unset fields are the calling agent's."""

    name: str = attrs.field(validator=_check_name)
    provider: str | None = None
    model: str | None = None
    system_prompt: str | None = None
    tools: tuple[str, ...] | None = None
    """The tool names its requests offer and it may call; ``None`` for every tool the parent
    sees."""


def _unique(_: object, attribute: attrs.Attribute[Any], value: tuple[Profile, ...]) -> None:
    names = [p.name for p in value]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{attribute.name}: profile names must be unique, repeated: {twice}")


@attrs.frozen(slots=True)
class SubagentConfig:
    """The ``[subagent]`` table."""

    profiles: tuple[Profile, ...] = attrs.field(default=(), validator=_unique)
    deliver: bool = False


_TASK = {
    "type": "string",
    "description": "The complete, self-contained task. The sub-agent sees none of this "
    "conversation, so include every fact, constraint and expected answer format it needs.",
}
_JOB_ID = {"type": "string", "description": "The job id subagent_start returned."}


def _object(properties: Mapping[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {
        "type": "object", "properties": dict(properties), "required": list(required),
        "additionalProperties": False,
    }


def _task_schema(profiles: Sequence[Profile]) -> dict[str, Any]:
    properties: dict[str, Any] = {"task": _TASK}
    if profiles:
        properties["agent"] = {
            "type": "string",
            "enum": [p.name for p in profiles],
            "description": "Which kind of sub-agent to use (default: one like you). "
            + "; ".join(f"{p.name}: {p.system_prompt or 'no special instructions'}"
                        for p in profiles),
        }
    return _object(properties, ["task"])


def _allow_only(names: Iterable[str]) -> tuple[Any, Any]:
    """The child's request filter (the model never sees other tools) and its guard (a call
    of one anyway, a name it guessed or remembered from a seed, is denied)."""
    allowed = frozenset(names)

    def hide(event: AgentRequest) -> LLMRequest | None:
        tools = event.tools
        kept = tuple(t for t in tools if t.name in allowed)
        if len(kept) == len(tools):
            return None
        return attrs.evolve(event.request, tools=kept)

    def policy(call: ToolCall, tool: Tool) -> Deny | None:
        if tool.name in allowed:
            return None
        return Deny(f"this agent may only call: {', '.join(sorted(allowed)) or 'no tools'}")

    return hide, policy


def install(ctx: Context, config: SubagentConfig) -> None:
    """Register the four tools on ``ctx`` (undone with its scope)."""
    by_name = {p.name: p for p in config.profiles}
    # The allow-list in force for each live restricted agent, by id. A child's own
    # delegations inherit it (intersected with their profile's), so a sandbox holds down
    # the whole tree and can only narrow: a restricted child cannot escape through a
    # grandchild with no profile, or with a wider one.
    allowed_of: dict[str, frozenset[str]] = {}

    def options_for(agent: str | None) -> tuple[AgentOptions | None, Any]:
        parent = ctx.agents.current()
        inherited = allowed_of.get(parent.id) if parent is not None else None
        options: AgentOptions | None = None
        allowed = inherited
        if agent:
            profile = by_name.get(agent)
            if profile is None:
                known = ", ".join(sorted(by_name)) or "none are configured"
                raise ValueError(f"unknown agent profile {agent!r} (known: {known})")
            base = parent.options if parent is not None else AgentOptions()
            fields = {
                name: value for name in ("provider", "model", "system_prompt")
                if (value := getattr(profile, name)) is not None
            }
            options = attrs.evolve(base, **fields)
            if profile.tools is not None:
                own = frozenset(profile.tools)
                allowed = own if inherited is None else own & inherited
        if allowed is None:
            return options, None
        hide, policy = _allow_only(allowed)
        fenced = allowed

        async def setup(child: Context) -> None:
            await trio.lowlevel.checkpoint()
            child.events.on(AgentRequest, hide)
            child.tools.guard(policy)
            child_id = child.agent_id
            if child_id is not None:
                allowed_of[child_id] = fenced

                def forget() -> None:
                    if allowed_of.get(child_id) is fenced:
                        del allowed_of[child_id]

                child.track(agentloop.Disposer(forget))

        return options, setup

    def job(job_id: str) -> agentloop.Job:
        found = ctx.jobs.get(job_id)
        if found is None:
            known = ", ".join(j.id for j in ctx.jobs.list()) or "none"
            raise ValueError(f"unknown job id {job_id!r} (this agent's jobs: {known})")
        return found

    async def run_subagent(task: str, agent: str | None = None) -> str:
        options, setup = options_for(agent)
        result = await ctx.subagents.run(task, agent_options=options, setup=setup)
        if result.reason not in ("completed", "max-tokens"):
            raise RuntimeError(f"the sub-agent's turn ended {result.reason}: {result.text!r}")
        return result.text

    async def start(task: str, agent: str | None = None) -> dict[str, str]:
        options, setup = options_for(agent)
        started = await ctx.jobs.start(
            task, agent_options=options, setup=setup, deliver=config.deliver
        )
        return {"job_id": started.id, "status": started.status}

    async def status(job_id: str) -> dict[str, str]:
        await trio.lowlevel.checkpoint()
        return {"job_id": job_id, "status": job(job_id).status}

    async def result(job_id: str, wait: bool = True) -> Any:
        found = job(job_id)
        if not wait and found.status == "running":
            await trio.lowlevel.checkpoint()
            return {"job_id": job_id, "status": "running"}
        return (await found.result()).text

    task_schema = _task_schema(config.profiles)
    ctx.tools.register(Tool(
        "subagent",
        "Delegate a self-contained task to a fresh sub-agent and return its final answer. "
        "Call it several times in one reply to work on independent tasks in parallel.",
        task_schema, run_subagent, concurrency="parallel",
    ))
    ctx.tools.register(Tool(
        "subagent_start",
        "Start a self-contained task in a background sub-agent and return its job id at once; "
        "check on it later with subagent_status and collect it with subagent_result.",
        task_schema, start, concurrency="parallel",
    ))
    ctx.tools.register(Tool(
        "subagent_status",
        "The status of a background job: running, done, failed or cancelled.",
        _object({"job_id": _JOB_ID}, ["job_id"]), status, concurrency="parallel",
    ))
    ctx.tools.register(Tool(
        "subagent_result",
        "The answer of a background job. With wait (the default) it waits for the job to "
        "finish; with wait false it returns the status at once while the job still runs.",
        _object({"job_id": _JOB_ID, "wait": {
            "type": "boolean", "description": "Wait for the job to finish (default true).",
        }}, ["job_id"]),
        result, concurrency="parallel",
    ))


def subagents(
    profiles: Sequence[Profile] = (), *, deliver: bool = False
) -> Plugin:
    """The plugin with these profiles, for ``open_runtime(plugins=[...])``.

    Raises:
        ConfigError: an invalid profile list (e.g. a repeated name).
    """
    try:
        config = SubagentConfig(tuple(profiles), deliver)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"subagent.{exc}") from None

    # Named like the configured form: the runtime reports a plugin by its __name__.
    async def subagent(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await trio.lowlevel.checkpoint()
        install(ctx, config)
        task_status.started()

    return subagent


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["subagent"]``): reads the ``[subagent]`` table.

    Raises:
        ConfigError: the table has an unknown key or an invalid value, which fails
            ``open_runtime``.
    """
    await trio.lowlevel.checkpoint()
    install(ctx, ctx.config.section("subagent", SubagentConfig))
    task_status.started()
