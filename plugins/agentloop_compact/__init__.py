"""Keep a long conversation inside the model's context: summarise older history.

Load it from the config (``plugins = ["compact"]``, with a ``[compact]`` table) or in code with
``open_runtime(plugins=[agentloop_compact.compact(max_context_tokens=2048)])``.

Before each step (``agent/pre-step``) the plugin estimates the size of the request the step
will send: the latest model call's reported usage (its input and output tokens) plus a
characters / 4 heuristic for the messages added since (everything, when no usage is known).
When the estimate exceeds the budget, everything older than the ``keep_recent_turns`` most
recent turns is summarised by a model call (the agent's own route, or ``provider``/``model``)
and replaced by that summary with ``session.replace_history`` (``history/replaced``, reason
``compaction``). The cut is always at a user message, so every tool call keeps its result.
The summary call runs inside the turn, so cancelling the turn cancels it; a failed summary
leaves the history untouched and logs an error (``agentloop.compact``).

Before it compacts, the plugin emits ``history/compacting`` (:class:`agentloop.events.
HistoryCompacting`, with the messages it would replace): a handler returns ``Reject(reason)``
to veto it, or ``Replace(messages)`` to supply the replacement instead of the summary call.
After, ``history/compacted`` (:class:`agentloop.events.HistoryCompacted`) reports the seqs
replaced, the summary and the estimated tokens before and after, for an audit trail.

The budget is ``max_context_tokens`` minus room for the reply (the agent's ``max_tokens``, else
a quarter of the context). Without ``max_context_tokens`` the plugin reads the
``context_tokens`` attribute of the adapter serving the agent's provider (the local model
plugin sets it to the server's real context size); with neither, nothing is compacted.

``[compact]`` settings (all optional)::

    [compact]
    max_context_tokens = 8192   # the model's context window, in tokens
    keep_recent_turns = 2       # turns kept verbatim (the current one included)
    provider = "openai"         # the route of the summary call (default: the agent's)
    model = "gpt-4o-mini"
    summary_max_tokens = 512    # the summary call's max_tokens
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import attrs
import trio

from agentloop import (
    Agent,
    CallConfig,
    ConfigError,
    Context,
    FrozenDict,
    InvalidContent,
    Message,
    Plugin,
    ProviderError,
)
from agentloop.events import AgentPreStep, HistoryCompacted, HistoryCompacting, Reject, Replace
from agentloop.llm import Finish, LLMRequest, TextDelta

__all__ = [
    "CompactPolicy", "install", "plugin", "compact", "compact_now", "estimate_tokens",
    "SUMMARY_PREFIX",
    "HANDLER_PRIORITY",
]

log = logging.getLogger("agentloop.compact")

HANDLER_PRIORITY: Final = -50
"""Below the default: a pre-step handler of your own that rejects the step runs first."""

SUMMARY_PREFIX: Final = "Summary of the earlier conversation:\n"

SUMMARY_SYSTEM: Final = (
    "You summarise a conversation between a user and an assistant so that it can go on "
    "without the full transcript. Keep every fact, decision, name, number, file and open "
    "task that later messages may need; drop small talk. Write a concise summary in plain "
    "text, nothing else."
)

# Characters of one message kept in the summary transcript, and the share of the
# context the transcript may use (chars/3 is a cautious tokens estimate for it).
_MESSAGE_CHARS: Final = 4000


def _count(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{attribute.name}: must be a positive integer, got {value!r}")


def _name(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{attribute.name}: must be a non-empty string, got {value!r}")


@attrs.frozen(slots=True, kw_only=True)
class CompactPolicy:
    """When and how to compact; also the ``[compact]`` table's shape.

    Attributes:
        max_context_tokens: the model's context window; ``None`` reads the adapter's
            ``context_tokens``.
        keep_recent_turns: the most recent turns kept verbatim, the current one included.
        provider: the summary call's provider (default: the agent's).
        model: the summary call's model (default: the agent's, or with ``provider``, required).
        summary_max_tokens: the summary call's ``max_tokens``.
    """

    max_context_tokens: int | None = attrs.field(default=None, validator=_count)
    keep_recent_turns: int = attrs.field(default=2, validator=_count)
    provider: str | None = attrs.field(default=None, validator=_name)
    model: str | None = attrs.field(default=None, validator=_name)
    summary_max_tokens: int = attrs.field(default=512, validator=_count)

    def __attrs_post_init__(self) -> None:
        if self.provider is not None and self.model is None:
            raise ConfigError("model: a summary provider needs a model")


def _chars(message: Message) -> int:
    size = len(message.text) + 4  # role and framing
    for call in message.tool_calls:
        arguments = call.arguments
        size += len(call.name) + (
            len(arguments) if isinstance(arguments, str) else len(json.dumps(arguments))
        )
    if message.reasoning:
        size += len(message.reasoning)
    return size


def estimate_tokens(agent: Agent, system: str = "") -> int:
    """The estimated size, in tokens, of the request ``agent``'s next step sends.

    The latest call's ``input_tokens + output_tokens`` covers the history it saw and its reply;
    what came after is counted at four characters a token. Without a usable last call the
    whole history (and ``system``) is counted that way.
    """
    session = agent.session
    messages = session.messages()
    last = session.last_usage
    if last is None:
        base, covered = len(system) // 4, 0
    else:
        usage, covered = last
        base = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
        covered = min(covered, len(messages))
    new = sum(_chars(messages[i]) for i in range(covered, len(messages)))
    return base + new // 4


def _route(agent: Agent) -> tuple[str | None, str | None]:
    """The route the agent's model calls take: its latest ``request/header`` (after any
    ``agent/request`` hook rerouted it), else its options. An agent resumed without options
    or routed by a hook has no provider in its options."""
    for event in reversed(agent.session.events):
        if event.type == "request/header":
            provider, model = event.data.get("provider"), event.data.get("model")
            if isinstance(provider, str) and provider and isinstance(model, str) and model:
                return provider, model
            break
    return agent.options.provider, agent.options.model


def _context_tokens(ctx: Context, policy: CompactPolicy, agent: Agent) -> int | None:
    if policy.max_context_tokens is not None:
        return policy.max_context_tokens
    provider = _route(agent)[0]
    adapter = ctx.llm.adapter(provider) if provider else None
    for candidate in (adapter, getattr(adapter, "wrapped", None)):
        value = getattr(candidate, "context_tokens", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _cut(agent: Agent, keep_turns: int) -> int:
    """The index of the first kept message: a user message opening a kept turn; 0 if
    nothing can be summarised."""
    session = agent.session
    starts = 0
    opened: int | None = None
    for event in reversed(session.events):
        if event.type == "turn/start":
            starts += 1
            opened = event.seq
            if starts == keep_turns:
                break
    if opened is None:
        return 0
    messages = session.messages()
    i = len(messages)
    while i > 0 and session.seq_of(i - 1) > opened:
        i -= 1
    # Only at a user message whose seq no earlier message shares is the cut clean.
    while i < len(messages) and (
        messages[i].role != "user" or (i > 0 and session.seq_of(i - 1) == session.seq_of(i))
    ):
        i += 1
    return i if i < len(messages) else 0


def _transcript(messages: Sequence[Message], limit: int) -> str:
    lines: list[str] = []
    for m in messages:
        text = m.text
        if len(text) > _MESSAGE_CHARS:
            text = text[: _MESSAGE_CHARS // 2] + " [...] " + text[-_MESSAGE_CHARS // 2:]
        if m.role == "tool":
            lines.append(f"tool result ({m.name or m.tool_call_id}): {text}")
            continue
        if text:
            lines.append(f"{m.role}: {text}")
        for call in m.tool_calls:
            arguments = call.arguments
            shown = arguments if isinstance(arguments, str) else json.dumps(arguments)
            lines.append(f"assistant called {call.name}({shown[:_MESSAGE_CHARS]})")
    transcript = "\n".join(lines)
    if len(transcript) > limit:
        # The start holds an earlier summary, the end the latest context: keep both.
        head = limit // 4
        transcript = transcript[:head] + "\n[...]\n" + transcript[-(limit - head):]
    return transcript


async def _summarise(
    ctx: Context, policy: CompactPolicy, agent: Agent, older: Sequence[Message], context: int
) -> tuple[str, FrozenDict | None]:
    route = _route(agent)
    provider = policy.provider or route[0]
    model = policy.model or route[1]
    adapter = ctx.llm.adapter(provider) if provider else None
    if adapter is None or model is None:
        raise ProviderError(f"no adapter serves the summary route {provider!r}/{model!r}",
                            code="NO_ADAPTER")
    # What the summary call may read: the context less its reply, at a cautious 3 chars a
    # token.
    limit = max(1000, (context - policy.summary_max_tokens - len(SUMMARY_SYSTEM) // 3) * 3)
    request = LLMRequest(
        system=SUMMARY_SYSTEM,
        messages=(Message("user", _transcript(older, limit)),),
        tools=(),
        config=CallConfig(provider=provider, model=model, max_tokens=policy.summary_max_tokens),
        session_id=agent.id,
    )
    adapter.validate(request.config)
    parts: list[str] = []
    usage: FrozenDict | None = None
    stream: AsyncIterator[Any] = adapter.stream(request)
    closing = (
        contextlib.aclosing(stream) if hasattr(stream, "aclose")  # type: ignore[type-var]
        else contextlib.nullcontext(stream)
    )
    finish: Finish | None = None
    async with closing:
        async for part in stream:
            if isinstance(part, TextDelta):
                parts.append(part.text)
            elif isinstance(part, Finish):
                finish = part
                if part.usage:
                    usage = FrozenDict(
                        {k: v for k, v in part.usage.items()
                         if isinstance(v, int) and not isinstance(v, bool)}
                    )
                break
    if finish is None:
        # A cut stream's text is a summary that stops mid-sentence: never replace history
        # with it.
        raise ProviderError("the summary stream ended without a finish",
                            code="incomplete_stream")
    if finish.reason not in ("stop", "max_tokens"):
        raise ProviderError(f"the summary call finished {finish.reason!r}, not with a text",
                            code="empty_summary")
    summary = "".join(parts).strip()
    if not summary:
        raise ProviderError("the summary call returned no text", code="empty_summary")
    return summary, usage


async def compact_now(ctx: Context, policy: CompactPolicy, agent: Agent) -> bool:
    """Summarise ``agent``'s history older than the kept turns now; True if it was replaced.

    A failure is logged and leaves the history as it was (False); so does finding nothing
    old enough to summarise. Cancellation propagates.
    """
    context = _context_tokens(ctx, policy, agent) or 0
    cut = _cut(agent, policy.keep_recent_turns)
    if cut == 0:
        log.info("agent %s: nothing old enough to compact", agent.id)
        return False
    session = agent.session
    older = list(session.messages()[:cut])
    last_seq = session.seq_of(cut) - 1
    before = estimate_tokens(agent)
    decision = await ctx.events.emit(
        HistoryCompacting(agent.id, 1, last_seq, tuple(older), before)
    )
    if isinstance(decision, Reject):
        log.info("agent %s: compaction vetoed by a history/compacting handler: %s",
                 agent.id, decision.reason)
        return False
    usage: FrozenDict | None = None
    if isinstance(decision, Replace):
        replacement = list(decision.messages)
        summary = "\n".join(m.text for m in replacement)
    else:
        try:
            summary, usage = await _summarise(ctx, policy, agent, older, context or 8192)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the history as it was
            log.error("agent %s: compacting %d messages failed; history left as it was: %r",
                      agent.id, len(older), exc)
            return False
        replacement = [Message("user", SUMMARY_PREFIX + summary)]
    try:
        session.replace_history(1, last_seq, replacement, reason="compaction", usage=usage)
    except InvalidContent as exc:
        log.error("agent %s: the compacted history was refused: %s", agent.id, exc)
        return False
    log.info("agent %s: compacted %d messages into a summary of %d characters",
             agent.id, len(older), len(summary))
    await ctx.events.emit(
        HistoryCompacted(agent.id, 1, last_seq, summary, before, estimate_tokens(agent))
    )
    return True


def install(ctx: Context, policy: CompactPolicy) -> None:
    """Register the compacting ``agent/pre-step`` handler on ``ctx`` (undone with its scope)."""

    # The turn in which compacting an agent last failed: not tried again before the next,
    # so a broken summary route costs one call per turn, not one per step.
    failed: dict[str, int] = {}

    async def on_pre_step(event: AgentPreStep) -> None:
        agent = ctx.agents.get(event.agent_id)
        if agent is None or failed.get(agent.id) == event.turn:
            return
        context = _context_tokens(ctx, policy, agent)
        if context is None:
            return
        reserve = agent.options.max_tokens or context // 4
        budget = max(1, context - reserve)
        if estimate_tokens(agent) > budget and not await compact_now(ctx, policy, agent):
            failed[agent.id] = event.turn

    ctx.events.on(AgentPreStep, on_pre_step, priority=HANDLER_PRIORITY)


def compact(
    policy: CompactPolicy | None = None,
    *,
    max_context_tokens: int | None = None,
    keep_recent_turns: int | None = None,
    provider: str | None = None,
    model: str | None = None,
    summary_max_tokens: int | None = None,
) -> Plugin:
    """A plugin compacting with ``policy``, fields overridden by the keyword arguments given.

    Raises:
        ConfigError: an invalid value, named by its field.
    """
    overrides: dict[str, Any] = {
        name: value
        for name, value in (
            ("max_context_tokens", max_context_tokens),
            ("keep_recent_turns", keep_recent_turns),
            ("provider", provider),
            ("model", model),
            ("summary_max_tokens", summary_max_tokens),
        )
        if value is not None
    }
    chosen = attrs.evolve(policy if policy is not None else CompactPolicy(), **overrides)

    # Named like the configured form: the runtime reports a plugin by its __name__.
    async def compact(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await trio.lowlevel.checkpoint()
        install(ctx, chosen)
        task_status.started()

    compact.__doc__ = f"Compact long histories with {chosen!r}."
    return compact


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["compact"]``): reads the ``[compact]`` table.

    Raises:
        ConfigError: an unknown key or an invalid value (named ``compact.<key>``).
    """
    await trio.lowlevel.checkpoint()
    install(ctx, ctx.config.section("compact", CompactPolicy))
    task_status.started()
