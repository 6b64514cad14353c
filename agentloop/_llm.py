"""The ``llm`` service: adapter routes, call preparation and dispatch."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Final

import attrs
import trio

from ._bus import Disposer, EventBus
from ._errors import ConfigError, ProviderError
from ._events import LlmStream
from ._model import CallConfig, LLMRequest, StreamPart
from ._util import quick_init, stored_maker
from .llm._base import ModelAdapter, as_adapter, check_retry
from .llm._retry import RetryPolicy

__all__ = ["LLMService", "PreparedCall", "Registration", "CLOSE_SECONDS"]

# Closing a stream releases the adapter's connection; bounded, as all shielded cleanup is.
CLOSE_SECONDS: Final = 5.0


@attrs.frozen(eq=False, slots=True)
class Registration:
    """One adapter registered for one provider route (identity matters, not value).

    ``retry`` is the route's retry policy, fixed at registration: the one given to
    :meth:`LLMService.register`, else the adapter's own ``retry``.
    """

    provider: str
    adapter: ModelAdapter
    retry: RetryPolicy | None = None
    schemaless: set[str | None] = attrs.field(factory=set, repr=False)
    """The models of this route whose server refused a JSON-schema response format (filled
    as calls find out; a new registration starts empty)."""
    guard: Callable[[Exception], ProviderError] = attrs.field(init=False, repr=False)
    """What a failure of the adapter's stream is raised as (made once: a step asks for it)."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "guard", functools.partial(_adapter_failure, self.adapter))


@quick_init
@attrs.frozen(slots=True, weakref_slot=False)
class PreparedCall:
    """A call config with adapter defaults filled, pinned to the exact registration.

    Attributes:
        config: the effective config: the proposal with the adapter's defaults filled in,
            already validated by the adapter.
        registration: the registration that serves the call, or ``None`` when no adapter
            served the route at preparation (an ``llm/stream`` handler may still serve it).
        adapter_defaults: the names of the fields filled from the adapter's defaults.
    """

    config: CallConfig
    registration: Registration | None
    adapter_defaults: tuple[str, ...]
    _service: LLMService = attrs.field(repr=False, eq=False)

    @property
    def retry(self) -> RetryPolicy | None:
        """The retry policy captured by the pinned registration (``None`` without one)."""
        return None if self.registration is None else self.registration.retry

    @property
    def native_output(self) -> bool:
        """Whether structured output goes as a JSON-schema response format on this call: the
        adapter supports one, and the route's server has not refused it."""
        reg = self.registration
        return (
            reg is not None and reg.adapter.supports_json_schema
            and self.config.model not in reg.schemaless
        )

    def refused_json_schema(self) -> None:
        """Remember that this route's server refused the JSON-schema response format: later
        calls on it offer the ``final_result`` tool instead."""
        if self.registration is not None:
            self.registration.schemaless.add(self.config.model)

    def serve_now(
        self, request: LLMRequest
    ) -> tuple[AsyncIterator[StreamPart], Callable[[Exception], ProviderError] | None] | None:
        """What :meth:`serve` gives, at once, when no ``llm/stream`` handler could serve the
        call (the usual case); otherwise ``None``, and the caller awaits :meth:`serve`."""
        if self._service._bus.has_listeners(LlmStream):
            return None
        return self._adapter_stream(request)

    async def serve(
        self, request: LLMRequest, *, agent_id: str
    ) -> tuple[AsyncIterator[StreamPart], Callable[[Exception], ProviderError] | None]:
        """The stream of parts for ``request`` (an ``llm/stream`` handler's, else the
        adapter's), and what an exception of it other than a ``ProviderError`` must be raised
        as, or ``None`` when the adapter raises only provider errors.

        So the request-error hooks (the retry plugin, the user's) see every failed call. The
        reader applies the guard in its own loop (``fold_stream``): an async generator around
        the stream would stand between every part, and every checkpoint, and the driver.
        ``request.config`` should be :attr:`config`. The adapter is the one pinned at
        preparation, even if the route was re-registered or disposed since. ``agent_id`` is
        the agent the call is made for, as the ``llm/stream`` hook reports it.

        Raises:
            ProviderError: ``code="NO_ADAPTER"`` when neither an adapter nor a handler serves it.
        """
        bus = self._service._bus
        if bus.has_listeners(LlmStream):
            served = await bus.emit(LlmStream(agent_id, request, self.registration is not None))
            if served is not None:
                return _as_iterator(served), _failure_of("an llm/stream handler's stream")
        return self._adapter_stream(request)

    def _adapter_stream(
        self, request: LLMRequest
    ) -> tuple[AsyncIterator[StreamPart], Callable[[Exception], ProviderError] | None]:
        if self.registration is None:
            raise ProviderError(
                f"no adapter is registered for provider {request.config.provider!r} "
                f"(registered: {', '.join(self._service.providers()) or 'none'})",
                code="NO_ADAPTER",
            )
        adapter = self.registration.adapter
        try:
            stream = adapter.stream(request)
        except ProviderError:
            raise
        except Exception as exc:  # noqa: BLE001 - every adapter failure is a provider failure
            failure = _adapter_error(exc, _where(adapter))
        else:
            if adapter._raises_provider_errors:
                return stream, None
            return stream, self.registration.guard
        raise failure


_prepared = stored_maker(PreparedCall)  # one a step


class LLMService:
    """Routes provider names to adapters. The latest registration of a route wins."""

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._routes: dict[str, list[Registration]] = {}

    def register(
        self, provider: str, adapter: ModelAdapter, *, retry: RetryPolicy | None = None
    ) -> Disposer:
        """Serve calls whose config names ``provider`` with ``adapter``.

        An object that is not a :class:`ModelAdapter` but has a ``stream`` method is adopted
        (see :func:`agentloop.llm._base.as_adapter`); anything else raises ``TypeError``.
        ``retry`` (else the adapter's ``retry``) is captured as the route's retry policy:
        every failed call this registration served carries it to ``agent/request-error``.
        """
        if not isinstance(provider, str) or not provider:
            raise ValueError(f"provider must be a non-empty string, got {provider!r}")
        check_retry(provider, retry)
        served = as_adapter(adapter)
        reg = Registration(provider, served, retry if retry is not None else served.retry)
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

    def adapter(self, provider: str) -> ModelAdapter | None:
        """The adapter serving ``provider`` now (an adopted object's wrapper, for one)."""
        regs = self._routes.get(provider)
        return regs[-1].adapter if regs else None

    async def prepare_call(self, config: CallConfig) -> PreparedCall:
        """Fill the adapter's defaults into unset fields, then let the adapter validate.

        The only place either happens: adapters stream the config they are given. Runs under
        the caller's cancel scope. With no adapter for the route the proposed config is kept
        as is, so an ``llm/stream`` handler can still serve it.

        Raises:
            ProviderError: from the adapter's ``validate`` (``code="invalid_config"``, ...);
                a :class:`ConfigError` it raises (a value of a field it owns that it does not
                support) becomes ``code="invalid_config"`` with the same message, chained.
        """
        # A cancellation point without a reschedule: the step yields plenty elsewhere.
        await trio.lowlevel.checkpoint_if_cancelled()
        return self.prepare_now(config)

    def prepare_now(self, config: CallConfig) -> PreparedCall:
        """:meth:`prepare_call` without its cancellation point, for a caller that checks
        for a cancel itself (a step does, in a frame it already has)."""
        regs = self._routes.get(config.provider or "")
        if not regs:
            return PreparedCall(config, None, (), self)
        reg = regs[-1]
        defaults = reg.adapter.defaults
        effort, max_tokens = config.reasoning_effort, config.max_tokens
        filled: tuple[str, ...] = ()  # most adapters fill nothing
        if effort is None and defaults.reasoning_effort is not None:
            effort = defaults.reasoning_effort
            filled += ("reasoning_effort",)
        if max_tokens is None and defaults.max_tokens is not None:
            max_tokens = defaults.max_tokens
            filled += ("max_tokens",)
        if filled:
            config = attrs.evolve(config, reasoning_effort=effort, max_tokens=max_tokens)
        try:
            reg.adapter.validate(config)
        except ConfigError as exc:
            # A call's value, not the deployment's: the call fails, through request-error.
            failure = ProviderError(str(exc), code="invalid_config")
            failure.__cause__ = exc
        else:
            return _prepared(config, reg, filled, self)
        raise failure


def _adapter_error(exc: Exception, where: str) -> ProviderError:
    error = ProviderError(f"{where} failed: {type(exc).__name__}: {exc}", code="adapter_error")
    error.__cause__ = exc
    return error


def _adapter_failure(adapter: object, exc: Exception) -> ProviderError:
    # The adapter is named only when a failure needs it: the name is a string built per call.
    return _adapter_error(exc, _where(adapter))


def _where(adapter: object) -> str:
    # The class, not the repr: an error message should not carry an object address.
    return f"{type(getattr(adapter, 'wrapped', adapter)).__name__}.stream"


def _failure_of(where: str) -> Callable[[Exception], ProviderError]:
    return lambda exc: _adapter_error(exc, where)


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
