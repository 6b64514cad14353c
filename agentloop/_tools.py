"""Tool definitions and the registry behind ``ctx.tools``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeAlias

import attrs
import trio

from ._bus import Disposer
from ._errors import ToolDefinitionError
from ._json import FrozenDict, freeze_object
from ._model import Content, ToolCall, ToolSpec
from ._schema import Validator, compile_validator

__all__ = ["Tool", "ToolRegistry", "Concurrency", "Policy", "truncate_content", "tool"]

Concurrency: TypeAlias = Literal["exclusive", "parallel"]
Policy: TypeAlias = Callable[[ToolCall, "Tool"], Any]
"""A guard: ``policy(call, tool)`` returns ``Deny(reason)`` to refuse a call, else ``None``."""

_CONCURRENCY = ("exclusive", "parallel")


def _check_concurrency(_: object, __: object, value: object) -> None:
    if value not in _CONCURRENCY:
        raise ToolDefinitionError(f"concurrency must be 'exclusive' or 'parallel', got {value!r}")


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` returns an awaitable (an ``async def``, or an instance of a class
    whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the bound __call__ of an instance
    )


def in_worker_thread(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """``fn`` (a plain function) as an ``async`` callable that runs it in a worker thread.

    A cancelled call (abort, disposal, the tool's ``timeout``) abandons the thread: its
    result, if it ever comes, is dropped, and the call is reported at once. The thread
    cannot be stopped, so a body that must not outlive its call checks a deadline itself.
    """

    @functools.wraps(fn)
    async def run(**arguments: Any) -> Any:
        return await trio.to_thread.run_sync(
            functools.partial(fn, **arguments), abandon_on_cancel=True
        )

    run.__agentloop_thread__ = True  # type: ignore[attr-defined]
    return run


def _as_async(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    if not callable(fn):
        raise ToolDefinitionError(f"a tool's run must be callable, got {fn!r}")
    if is_async_callable(fn):
        return fn
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ToolDefinitionError(
            f"tool {getattr(fn, '__name__', fn)!r} is a generator; return the result instead"
        )
    return in_worker_thread(fn)


def _check_timeout(_: object, __: object, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ToolDefinitionError(f"timeout must be a positive number of seconds, got {value!r}")


def truncate_content(limit: int) -> Callable[[Content], Content]:
    """A ``finalize_content`` that cuts text results over ``limit`` characters, saying so."""

    def finalize(content: Content) -> Content:
        if isinstance(content, str) and len(content) > limit:
            dropped = len(content) - limit
            return f"{content[:limit]}\n[... truncated {dropped} characters]"
        return content

    return finalize


@attrs.frozen(slots=True, kw_only=False)
class Tool:
    """A tool the model can call.

    Attributes:
        name: what the model calls it.
        description: what it does, for the model.
        parameters: the JSON schema of its arguments (an object schema).
        run: ``async def run(**arguments)``, or a plain ``def`` that then runs in a worker
            thread; its return value becomes the result content (a string, or JSON that is
            rendered as text). Raising gives an error result.
        concurrency: ``"exclusive"`` (a barrier in its step) or ``"parallel"``.
        classify: ``classify(arguments) -> "exclusive" | "parallel"``, decided per call
            right before it starts; overrides ``concurrency``.
        timeout: seconds before the call is abandoned with a ``TIMEOUT`` error result (a
            thread tool's thread is abandoned too).
        finalize_content: maps the result content before it is logged (e.g. truncation).
        idempotent: running a call twice is safe: a call a crash left without a result is
            run again when its turn continues (``resume(..., crashed_turn="continue")``);
            otherwise it is answered ``INTERRUPTED_BY_CRASH``, and with persistence its
            ``tool/call`` is stored before its body starts.
        requires_approval: park every call for a person's answer, as a ``tools/pre-execute``
            handler returning ``Ask(f"run {name}?")`` would (``agent.pending_approvals``,
            ``agent.approve``/``deny``); a handler's own ``Ask`` or ``Deny`` still wins.
    """

    name: str
    description: str
    parameters: FrozenDict = attrs.field(converter=freeze_object)
    run: Callable[..., Awaitable[Any]] = attrs.field(converter=_as_async)
    concurrency: Concurrency = attrs.field(default="exclusive", validator=_check_concurrency)
    classify: Callable[[Mapping[str, Any]], Concurrency] | None = None
    timeout: float | None = attrs.field(default=None, validator=_check_timeout)
    finalize_content: Callable[[Content], Content] | None = None
    to_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]] | None = attrs.field(
        default=None, repr=False
    )
    idempotent: bool = False
    requires_approval: bool = attrs.field(default=False, kw_only=True)
    # ``parameters`` compiled once per definition: ``attrs.evolve`` to a new schema builds a
    # new Tool and so a new validator; the frozen schema cannot change under this one.
    validate_arguments: Validator = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ToolDefinitionError(f"tool name must be a non-empty string, got {self.name!r}")
        if self.parameters.get("type", "object") != "object":
            raise ToolDefinitionError(
                f"tool {self.name!r}: parameters must be an object schema, "
                f"got type {self.parameters.get('type')!r}"
            )
        object.__setattr__(self, "validate_arguments", compile_validator(self.parameters))

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)

    def mode_for(self, arguments: Mapping[str, Any]) -> Concurrency:
        if self.classify is None:
            return self.concurrency
        mode = self.classify(arguments)
        if mode not in _CONCURRENCY:
            raise ToolDefinitionError(
                f"tool {self.name!r}: classify returned {mode!r}, not 'exclusive' or 'parallel'"
            )
        return mode


def tool_from_function(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    concurrency: Concurrency = "exclusive",
    classify: Callable[[Mapping[str, Any]], Concurrency] | None = None,
    timeout: float | None = None,
    finalize_content: Callable[[Content], Content] | None = None,
    idempotent: bool = False,
    requires_approval: bool = False,
) -> Tool:
    from ._schema import describe_function

    described = describe_function(fn)
    return Tool(
        name or described.name,
        described.description,
        described.parameters,
        fn,
        concurrency=concurrency,
        classify=classify,
        timeout=timeout,
        finalize_content=finalize_content,
        to_kwargs=described.to_call_kwargs,
        idempotent=idempotent,
        requires_approval=requires_approval,
    )


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    concurrency: Concurrency = "exclusive",
    classify: Callable[[Mapping[str, Any]], Concurrency] | None = None,
    timeout: float | None = None,
    finalize_content: Callable[[Content], Content] | None = None,
    idempotent: bool = False,
    requires_approval: bool = False,
) -> Any:
    """Decorator: an annotated, documented function as a :class:`Tool`, registered nowhere.

    Pass the tool to ``open_agent(..., tools=[...])`` or ``ctx.tools.register``. Used bare
    (``@tool``) or with options (``@tool(requires_approval=True)``); the options are those of
    ``ctx.tools.tool``. A plain ``def`` runs in a worker thread.

    Raises:
        ToolDefinitionError: a parameter without an annotation, a generator, a bad option.
    """

    def decorate(f: Callable[..., Any]) -> Tool:
        return tool_from_function(
            f, name=name, concurrency=concurrency, classify=classify, timeout=timeout,
            finalize_content=finalize_content, idempotent=idempotent,
            requires_approval=requires_approval,
        )

    if fn is not None:
        return decorate(fn)
    return decorate


@attrs.define(eq=False, slots=True)
class _Entry:
    tool: Tool
    agent_id: str | None


class ToolRegistry:
    """Every registered tool, global or per agent; the latest registration of a name wins."""

    def __init__(self) -> None:
        self._entries: dict[str, list[_Entry]] = {}
        self._guards: list[tuple[str | None, Policy]] = []
        self.version = 0
        # Registrations for one agent; while there are none every agent sees the same tools,
        # and the specs of one version are built once for all of them.
        self._scoped = 0
        self._shared_specs: tuple[int, tuple[ToolSpec, ...]] = (-1, ())

    def register(self, tool: Tool, *, agent_id: str | None = None) -> Disposer:
        if not isinstance(tool, Tool):
            raise TypeError(f"expected an agentloop.Tool, got {tool!r}")
        entry = _Entry(tool, agent_id)
        self._entries.setdefault(tool.name, []).append(entry)
        self.version += 1
        if agent_id is not None:
            self._scoped += 1

        def dispose() -> None:
            entries = self._entries.get(tool.name)
            if entries and entry in entries:
                entries.remove(entry)
                if not entries:
                    del self._entries[tool.name]
                self.version += 1
                if agent_id is not None:
                    self._scoped -= 1

        return Disposer(dispose)

    def add_guard(self, policy: Policy, *, agent_id: str | None = None) -> Disposer:
        item = (agent_id, policy)
        self._guards.append(item)

        def dispose() -> None:
            if item in self._guards:
                self._guards.remove(item)

        return Disposer(dispose)

    def has_guards(self) -> bool:
        """Whether any guard is registered (for any agent)."""
        return bool(self._guards)

    def guards_for(self, agent_id: str) -> list[Policy]:
        if not self._guards:
            return []  # the usual registry: no guard at all
        return [p for owner, p in self._guards if owner is None or owner == agent_id]

    def lookup(self, name: str, agent_id: str) -> Tool | None:
        entries = self._entries.get(name)
        if not entries:
            return None
        if not self._scoped:
            return entries[-1].tool  # every registration is for all agents: the latest wins
        for entry in reversed(entries):
            if entry.agent_id == agent_id:
                return entry.tool
        for entry in reversed(entries):
            if entry.agent_id is None:
                return entry.tool
        return None

    def specs(self, agent_id: str) -> tuple[ToolSpec, ...]:
        """What the model of ``agent_id`` is shown of its :meth:`visible` tools."""
        if self._scoped:
            return tuple(t.spec for t in self.visible(agent_id))
        version, specs = self._shared_specs
        if version != self.version:
            specs = tuple(t.spec for t in self.visible(agent_id))
            self._shared_specs = (self.version, specs)
        return specs

    def visible(self, agent_id: str) -> tuple[Tool, ...]:
        """The tools an agent sees, sorted by name so requests serialize deterministically."""
        out = []
        for name in sorted(self._entries):
            found = self.lookup(name, agent_id)
            if found is not None:
                out.append(found)
        return tuple(out)


class ToolsFacade:
    """``ctx.tools``: registrations made here are undone when the scope closes."""

    def __init__(self, registry: ToolRegistry, track: Callable[[Disposer], Disposer],
                 agent_id: str | None) -> None:
        self._registry = registry
        self._track = track
        self._agent_id = agent_id

    def register(self, tool: Tool) -> Disposer:
        """Register ``tool`` (for this agent only, when called from an agent's setup)."""
        return self._track(self._registry.register(tool, agent_id=self._agent_id))

    def tool(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        concurrency: Concurrency = "exclusive",
        classify: Callable[[Mapping[str, Any]], Concurrency] | None = None,
        timeout: float | None = None,
        finalize_content: Callable[[Content], Content] | None = None,
        idempotent: bool = False,
        requires_approval: bool = False,
    ) -> Any:
        """Decorator: turn an annotated, documented function into a registered tool.

        An ``async def`` runs on the agent's trio task tree; a plain ``def`` runs in a worker
        thread (``trio.to_thread.run_sync``), so blocking code does not stall the runtime.
        ``requires_approval=True`` parks every call until ``agent.approve``/``deny``.
        """
        if concurrency not in _CONCURRENCY:
            raise ToolDefinitionError(
                f"concurrency must be 'exclusive' or 'parallel', got {concurrency!r}"
            )
        build = tool(
            name=name, concurrency=concurrency, classify=classify, timeout=timeout,
            finalize_content=finalize_content, idempotent=idempotent,
            requires_approval=requires_approval,
        )

        def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
            self.register(build(f))
            return f

        if fn is not None:
            return decorate(fn)
        return decorate

    def guard(self, policy: Policy) -> Disposer:
        """Add an owner policy. Guards only accumulate: a nested scope can tighten, never loosen."""
        return self._track(self._registry.add_guard(policy, agent_id=self._agent_id))

    def get(self, name: str) -> Tool | None:
        return self._registry.lookup(name, self._agent_id or "")

    def list(self) -> list[Tool]:
        return list(self._registry.visible(self._agent_id or ""))



