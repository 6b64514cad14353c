"""The ``llm`` service: adapter routes, call preparation and dispatch."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio

from ._bus import Disposer, EventBus
from ._errors import ProviderError
from ._events import LlmStream
from ._model import CallConfig, LLMRequest, StreamPart
from .llm._base import AdapterDefaults, validate_config

__all__ = ["LLMService", "PreparedCall", "Registration"]


@attrs.define(eq=False, slots=True)
class Registration:
    """One adapter registered for one provider route (identity matters, not value)."""

    provider: str
    adapter: Any


@attrs.frozen(slots=True)
class PreparedCall:
    """A call config with adapter defaults filled, pinned to the exact registration."""

    config: CallConfig
    registration: Registration | None
    adapter_defaults: tuple[str, ...]


_DEFAULTABLE = ("reasoning_effort", "max_tokens")


class LLMService:
    """Routes provider names to adapters. The latest registration of a route wins."""

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._routes: dict[str, list[Registration]] = {}

    def register(self, provider: str, adapter: Any) -> Disposer:
        """Serve calls whose config names ``provider`` with ``adapter``."""
        if not isinstance(provider, str) or not provider:
            raise ValueError(f"provider must be a non-empty string, got {provider!r}")
        if not callable(getattr(adapter, "stream", None)):
            raise TypeError(f"{adapter!r} has no stream(request) method; it is not an adapter")
        reg = Registration(provider, adapter)
        self._routes.setdefault(provider, []).append(reg)

        def dispose() -> None:
            regs = self._routes.get(provider)
            if regs and reg in regs:
                regs.remove(reg)
                if not regs:
                    del self._routes[provider]

        return Disposer(dispose)

    def providers(self) -> list[str]:
        return sorted(self._routes)

    def adapter(self, provider: str) -> Any | None:
        regs = self._routes.get(provider)
        return regs[-1].adapter if regs else None

    async def prepare_call(self, config: CallConfig) -> PreparedCall:
        """Validate adapter-owned fields and fill the adapter's defaults.

        Runs under the caller's cancel scope. With no adapter for the route the proposed
        config is kept as is, so an ``llm/stream`` handler can still serve it.
        """
        # A cancellation point without a reschedule: the step yields plenty elsewhere.
        await trio.lowlevel.checkpoint_if_cancelled()
        regs = self._routes.get(config.provider or "")
        if not regs:
            return PreparedCall(config, None, ())
        reg = regs[-1]
        validate_config(reg.adapter, config)
        defaults: AdapterDefaults | None = getattr(reg.adapter, "defaults", None)
        filled: dict[str, object] = {}
        if defaults is not None:
            for name in _DEFAULTABLE:
                value = getattr(defaults, name)
                if value is not None and getattr(config, name) is None:
                    filled[name] = value
        if filled:
            config = attrs.evolve(config, **filled)  # type: ignore[arg-type]
        return PreparedCall(config, reg, tuple(filled))

    async def open_stream(
        self, prepared: PreparedCall, request: LLMRequest, agent_id: str
    ) -> AsyncIterator[StreamPart]:
        """The stream of parts for ``request``: an ``llm/stream`` handler's, else the adapter's."""
        if self._bus.has_listeners(LlmStream):
            served = await self._bus.emit(
                LlmStream(agent_id, request, prepared.registration is not None)
            )
            if served is not None:
                return _as_iterator(served)
        if prepared.registration is None:
            raise ProviderError(
                f"no adapter is registered for provider {request.config.provider!r} "
                f"(registered: {', '.join(self.providers()) or 'none'})",
                code="NO_ADAPTER",
            )
        stream: AsyncIterator[StreamPart] = prepared.registration.adapter.stream(request)
        return stream


def _as_iterator(served: object) -> AsyncIterator[StreamPart]:
    if hasattr(served, "__anext__"):
        return served  # type: ignore[return-value]
    if hasattr(served, "__aiter__"):
        return served.__aiter__()  # type: ignore[no-any-return]
    if isinstance(served, (list, tuple)):
        return _from_list(served)
    raise TypeError(f"an llm/stream handler returned {served!r}, not a stream of parts")


async def _from_list(parts: list[StreamPart] | tuple[StreamPart, ...]) -> AsyncIterator[StreamPart]:
    for part in parts:
        await trio.lowlevel.checkpoint()
        yield part


class SystemPrompt:
    """The deployment persona, per-agent overrides, and per-agent variable rendering.

    Templates may use ``{provider}``, ``{model}`` and ``{cwd}``; nothing else is added.
    """

    def __init__(self, persona: str | None = None) -> None:
        self.persona = persona or ""
        self._overrides: dict[str, list[str]] = {}
        self._cache: dict[tuple[str, str | None, str | None, str | None], str] = {}

    def override(self, agent_id: str, text: str) -> Callable[[], None]:
        stack = self._overrides.setdefault(agent_id, [])
        stack.append(text)

        def undo() -> None:
            if text in stack:
                stack.remove(text)
            if not stack:
                self._overrides.pop(agent_id, None)

        return undo

    def template_for(self, agent_id: str, fallback: str | None) -> str:
        stack = self._overrides.get(agent_id)
        if stack:
            return stack[-1]
        return fallback if fallback is not None else self.persona

    def render(self, template: str, *, provider: str | None, model: str | None,
               cwd: str | None) -> str:
        key = (template, provider, model, cwd)
        cached = self._cache.get(key)
        if cached is None:
            values = _Vars(provider=provider or "", model=model or "", cwd=cwd or "")
            cached = template.format_map(values) if "{" in template else template
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = cached
        return cached


class _Vars(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"
