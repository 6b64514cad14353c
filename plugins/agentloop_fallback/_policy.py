"""The fallback policy: the routes a failed call may move to, in order; the ``[fallback]`` table."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from agentloop import CallConfig, ConfigError, FrozenDict, ProviderError

__all__ = ["FallbackPolicy", "Route", "always"]


def always(error: ProviderError) -> bool:
    """Every terminal failure moves the call (the default of ``FallbackPolicy.when``)."""
    return True


@attrs.frozen(slots=True)
class Route:
    """A ``provider`` and, unless the call's own model is kept, a ``model``."""

    provider: str
    model: str | None = None

    @classmethod
    def parse(cls, text: object) -> Route:
        """``"provider:model"`` or ``"provider"``; the model may itself contain ``:``.

        Raises:
            ValueError: naming what is wrong with ``text``.
        """
        if not isinstance(text, str):
            raise ValueError(f"must be a string 'provider' or 'provider:model', got {text!r}")
        provider, colon, model = text.partition(":")
        if not provider.strip() or (colon and not model.strip()) or provider != provider.strip():
            raise ValueError(f"must be 'provider' or 'provider:model', got {text!r}")
        return cls(provider, model or None)


def _problem(entries: object) -> tuple[int, str] | None:
    if not isinstance(entries, tuple):
        return -1, f"must be an array of routes, got {entries!r}"
    for i, entry in enumerate(entries):
        try:
            Route.parse(entry)
        except ValueError as exc:
            return i, str(exc)
    return None


def _routes(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
    problem = _problem(value)
    if problem is not None:
        i, why = problem
        where = attribute.name if i < 0 else f"{attribute.name}[{i}]"
        raise ConfigError(f"{where}: {why}")


def _chains(
    _: object, attribute: attrs.Attribute[Mapping[str, tuple[str, ...]]], value: object
) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{attribute.name}: must be a table of route arrays, got {value!r}")
    for name, entries in value.items():
        try:
            Route.parse(name)
        except ValueError as exc:
            raise ConfigError(f"{attribute.name}: key {exc}") from None
        problem = _problem(entries)
        if problem is not None:
            i, why = problem
            where = f"{attribute.name}.{name}" + ("" if i < 0 else f"[{i}]")
            raise ConfigError(f"{where}: {why}")


def _frozen_chains(value: object) -> object:
    if isinstance(value, Mapping):
        return FrozenDict(
            {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in value.items()}
        )
    return value


def _key(provider: str | None, model: str | None) -> str:
    # The spelling of AgentRequestError.routes.
    return f"{provider}:{model}"


@attrs.frozen(slots=True)
class FallbackPolicy:
    """Where a failed call may go next; also the ``[fallback]`` table's shape.

    Attributes:
        routes: the default chain, in order.
        chains: chains for calls on one route, keyed ``"provider:model"`` or ``"provider"``.
        when: which terminal failures move the call (set in code only; default: all).

    A malformed route raises :class:`agentloop.ConfigError` naming it (``routes[1]: ...``;
    read from the config, ``fallback.routes[1]: ...``).
    """

    routes: tuple[str, ...] = attrs.field(default=(), validator=_routes)
    chains: Mapping[str, tuple[str, ...]] = attrs.field(
        factory=FrozenDict, converter=_frozen_chains, validator=_chains
    )
    when: Callable[[ProviderError], bool] = attrs.field(
        default=always, repr=False, metadata={"config": False}
    )

    def chain(self, config: CallConfig) -> tuple[str, ...]:
        """The chain of a call made with ``config``."""
        chain = self.chains.get(_key(config.provider, config.model))
        if chain is None and config.provider is not None:
            chain = self.chains.get(config.provider)
        return self.routes if chain is None else chain

    def next_route(self, config: CallConfig, tried: Sequence[str]) -> Route | None:
        """The first route after ``config``'s in its chain (wrapping round) not in ``tried``.

        ``tried`` holds the routes already called (``"provider:model"``); ``config``'s own
        counts as tried. ``None`` when every route of the chain was.
        """
        chain = self.chain(config)
        seen = {*tried, _key(config.provider, config.model)}
        resolved = [Route.parse(entry) for entry in chain]
        keys = [_key(r.provider, r.model or config.model) for r in resolved]
        here = _key(config.provider, config.model)
        start = keys.index(here) + 1 if here in keys else 0
        for i in [*range(start, len(keys)), *range(start)]:
            if keys[i] not in seen:
                route = resolved[i]
                return Route(route.provider, route.model or config.model)
        return None
