"""The race's model and tools: behaviours a :class:`RaceModel` plays, and the kit's tools.

Both report where they are to the running race (:class:`Probe`): the moment a tool body
starts and the moment a model reply is half streamed are points an operation can be armed on
(``When("tool-start", Cancel(0))``), and a tool body that starts in a turn already cancelled
is recorded as a violation (no body may start after its turn's cancel).
"""

from __future__ import annotations

import contextvars
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from .._model import (
    AgentOptions,
    Finish,
    LLMRequest,
    ReasoningDelta,
    StreamPart,
    TextDelta,
    ToolCallDelta,
)
from .._tools import Tool
from ..llm._base import ModelAdapter
from ._doubles import ProviderError, example_arguments

if TYPE_CHECKING:
    from .._context import Context

__all__ = [
    "Probe", "RaceModel", "register_race_tools", "DEFAULT_TOOLS", "PROVIDER", "OPTIONS",
    "CHILD_OPTIONS", "MAX_TOOL_STEPS",
    "Say", "Think", "CallTools", "Fail", "Stall", "MaxTokens", "Behaviour",
]

PROVIDER = "race"
OPTIONS = AgentOptions(provider=PROVIDER, model="race-model")
# Sub-agents made by the ``delegate`` tool answer on a model of their own (a short stall, then
# text), so a tree stays two levels deep whatever the parent's script says.
CHILD_PROVIDER = "race-child"
CHILD_OPTIONS = AgentOptions(provider=CHILD_PROVIDER, model="race-child")
DEFAULT_TOOLS = ("fast", "slow", "excl", "guarded", "delegate")
# A turn that keeps calling tools is cut short after this many steps, so every example ends.
MAX_TOOL_STEPS = 3
# Longer than the runtime's disposal grace (30 s): a tool that ignores cancellation that long.
STUBBORN_SECONDS = 45.0


class Probe:
    """What the kit's model and tools tell the race: points reached, violations seen."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.armed: list[tuple[str, Callable[[], None]]] = []
        self.reached: dict[str, int] = {}
        self.holds: dict[str, float] = {}

    def arm(self, point: str, action: Callable[[], None]) -> None:
        """Run ``action`` (synchronously) the next time ``point`` is reached."""
        self.armed.append((point, action))

    def reach(self, point: str) -> None:
        self.reached[point] = self.reached.get(point, 0) + 1
        due = [a for p, a in self.armed if p == point]
        if due:
            self.armed = [(p, a) for p, a in self.armed if p != point]
            for action in due:
                action()

    def violation(self, text: str) -> None:
        self.violations.append(text)


_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar(
    "agentloop_race_probe", default=None
)


def current_probe() -> Probe | None:
    return _PROBE.get()


def set_probe(probe: Probe | None) -> contextvars.Token[Probe | None]:
    return _PROBE.set(probe)


def reset_probe(token: contextvars.Token[Probe | None]) -> None:
    _PROBE.reset(token)


def _body_starts(name: str) -> None:
    probe = current_probe()
    if probe is None:
        return
    if trio.current_effective_deadline() == -math.inf:
        probe.violation(f"the body of tool {name!r} started in a turn already cancelled; "
                        "expected no tool body to start after its turn's cancel")
    probe.reach("tool-start")


# --- model behaviours ------------------------------------------------------------------------


@attrs.frozen
class Say:
    text: str = "ok"


@attrs.frozen
class Think:
    reasoning: str = "hmm"
    text: str = "ok"


@attrs.frozen
class CallTools:
    """Call these tools (in one reply, so in parallel where they may); arguments come from
    each tool's schema."""

    names: tuple[str, ...]
    text: str = ""


@attrs.frozen
class Fail:
    """Fail the call with ``ProviderError(status)`` after streaming ``after`` text chunks."""

    status: int | None = 500
    after: int = 0


@attrs.frozen
class Stall:
    """Wait ``seconds`` (virtual) before streaming ``text``, a chunk every ``seconds``."""

    seconds: float
    text: str = "slow answer"


@attrs.frozen
class MaxTokens:
    text: str = "cut"


Behaviour = Say | Think | CallTools | Fail | Stall | MaxTokens


def _words(text: str) -> list[str]:
    return [w + " " for w in text.split()] or ([text] if text else [])


class RaceModel(ModelAdapter):
    """An adapter playing a script of behaviours, one per call, cycling through it.

    A turn that has called tools for ``MAX_TOOL_STEPS`` steps gets a plain answer instead,
    so every turn ends. Records every request in ``.requests``. Halfway through each reply it
    reaches the race's ``"stream"`` point.
    """

    def __init__(self, script: Sequence[Behaviour] = (Say(),)) -> None:
        self.script = tuple(script) or (Say(),)
        self.requests: list[LLMRequest] = []

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        behaviour = self.script[len(self.requests) % len(self.script)]
        self.requests.append(request)
        if isinstance(behaviour, CallTools) and request.step > MAX_TOOL_STEPS:
            behaviour = Say("enough tools")
        return self._play(behaviour, request)

    async def _play(self, b: Behaviour, request: LLMRequest) -> AsyncIterator[StreamPart]:
        await trio.lowlevel.checkpoint()
        if isinstance(b, Stall):
            for i, piece in enumerate(_words(b.text)):
                await trio.sleep(b.seconds)
                yield TextDelta(piece)
                if i == 0:
                    _reach("stream")
            yield Finish("stop")
        elif isinstance(b, Fail):
            for i in range(b.after):
                await trio.lowlevel.checkpoint()
                yield TextDelta(f"part{i} ")
            _reach("stream")
            raise ProviderError(status=b.status, code="race_failure")
        elif isinstance(b, CallTools):
            for piece in _words(b.text):
                yield TextDelta(piece)
            specs = {s.name: s for s in request.tools}
            for i, name in enumerate(b.names):
                await trio.lowlevel.checkpoint()
                spec = specs.get(name)
                arguments = example_arguments(spec.parameters) if spec is not None else {}
                yield ToolCallDelta(i, id=f"call_{request.turn}_{request.step}_{i}",
                                    name=name, arguments=json.dumps(arguments))
                if i == 0:
                    _reach("stream")
            yield Finish("tool_calls" if b.names else "stop")
        else:
            if isinstance(b, Think):
                for piece in _words(b.reasoning):
                    await trio.lowlevel.checkpoint()
                    yield ReasoningDelta(piece)
            for piece in _words(b.text):
                await trio.lowlevel.checkpoint()
                yield TextDelta(piece)
            _reach("stream")
            yield Finish("max_tokens" if isinstance(b, MaxTokens) else "stop")


def _reach(point: str) -> None:
    probe = current_probe()
    if probe is not None:
        probe.reach(point)


# --- the kit's tools -------------------------------------------------------------------------


def _sleeper(name: str, seconds: float) -> Callable[..., Awaitable[str]]:
    async def run() -> str:
        _body_starts(name)
        await trio.sleep(seconds)
        return name

    return run


async def _slow() -> str:
    _body_starts("slow")
    try:
        await trio.sleep(5)
    except trio.Cancelled:
        # Cleans up for longer than the disposal grace: a disposal must still end its turn.
        with trio.CancelScope(shield=True):
            await trio.sleep(STUBBORN_SECONDS)
        raise
    return "slow"


def _delegate(ctx: Context) -> Callable[..., Awaitable[str]]:
    async def run() -> str:
        _body_starts("delegate")
        result = await ctx.subagents.run("sub task", agent_options=CHILD_OPTIONS)
        return result.text or ""

    return run


def register_race_tools(ctx: Context) -> None:
    """The kit's tools: ``fast`` and ``slow`` (parallel, 1 s and 5 s; ``slow``, cancelled,
    cleans up for 45 s, past the disposal grace), ``excl`` (exclusive, 2 s), ``guarded``
    (1 s, ``requires_approval``: parked with the prompt ``"run guarded?"``) and ``delegate``
    (runs a sub-agent's turn on provider ``"race-child"``, which stalls 1 s). No hook is
    registered, so a step without ``guarded`` or ``excl`` takes the scheduler's plain pass,
    as it does in an application with no tool hooks."""
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    tools: list[tuple[str, str, Callable[..., Awaitable[str]], str]] = [
        ("fast", "Answers after 1 s.", _sleeper("fast", 1), "parallel"),
        ("slow", "Answers after 5 s; slow to cancel.", _slow, "parallel"),
        ("excl", "Answers after 2 s, alone.", _sleeper("excl", 2), "exclusive"),
        ("guarded", "Answers after 1 s, once approved.", _sleeper("guarded", 1), "parallel"),
        ("delegate", "Asks a sub-agent.", _delegate(ctx), "parallel"),
    ]
    for name, description, run, concurrency in tools:
        ctx.tools.register(Tool(
            name=name, description=description, parameters=no_arguments, run=run,
            concurrency=concurrency,  # type: ignore[arg-type]
            requires_approval=name == "guarded",
        ))
    if ctx.llm.adapter(CHILD_PROVIDER) is None:
        ctx.llm.register(CHILD_PROVIDER, RaceModel((Stall(1.0, "child answer"),)))
