"""What a model call costs: the ``[prices]`` table and the ``cost`` it adds to usage.

A price is per route (``[prices."openai:gpt-4o-mini"]``; ``"provider:*"`` for every model of a
provider), in currency units per million tokens. The cost of a call is computed once, when its
reply is anchored, and recorded in that ``assistant/message``'s ``usage``: the log keeps what a
call cost at the prices of its day, and the session, turn and tree totals are sums of it.

Providers count tokens two ways, and the cost follows each:

- OpenAI-style usage (chat completions, Responses, DeepSeek, most compatible servers) counts
  cached prompt tokens inside ``input_tokens`` and reasoning tokens inside ``output_tokens``:
  those parts are taken out and priced at their own rates;
- Anthropic's usage (recognised by its own ``cache_read_input_tokens`` or
  ``cache_creation_input_tokens`` counters) reports cache reads and writes beside
  ``input_tokens``: they are added, not taken out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from ._errors import ConfigError
from ._json import FrozenDict

__all__ = ["PRICE_KEYS", "Price", "PriceTable", "add_cost", "add_usage", "load_prices"]

PRICE_KEYS: Final = (
    "input_per_mtok", "output_per_mtok", "cache_read_per_mtok", "cache_write_per_mtok",
    "reasoning_per_mtok",
)
_MTOK: Final = 1_000_000
# The counters that say input_tokens leaves cache reads and writes out (Anthropic's own).
_SEPARATE_CACHE: Final = ("cache_read_input_tokens", "cache_creation_input_tokens")


def _rate(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None and attribute.default is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ConfigError(
            f"{attribute.name}: must be a non-negative number (currency units per million "
            f"tokens), got {value!r}"
        )


def _count(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@attrs.frozen(slots=True, kw_only=True)
class Price:
    """One route's prices, in currency units per million tokens.

    Attributes:
        input_per_mtok: prompt tokens not read from or written to a cache.
        output_per_mtok: completion tokens other than reasoning.
        cache_read_per_mtok: prompt tokens read from the provider's cache (default: the
            input price).
        cache_write_per_mtok: prompt tokens written to the cache (default: the input price).
        reasoning_per_mtok: reasoning tokens (default: the output price).
    """

    input_per_mtok: float = attrs.field(validator=_rate)
    output_per_mtok: float = attrs.field(validator=_rate)
    cache_read_per_mtok: float | None = attrs.field(default=None, validator=_rate)
    cache_write_per_mtok: float | None = attrs.field(default=None, validator=_rate)
    reasoning_per_mtok: float | None = attrs.field(default=None, validator=_rate)

    def cost(self, usage: Mapping[str, Any]) -> float:
        """What a call with these token counters cost (see the module's note on counting)."""
        read, write = _count(usage, "cache_read_tokens"), _count(usage, "cache_write_tokens")
        reasoning = _count(usage, "reasoning_tokens")
        inp = _count(usage, "input_tokens")
        if not any(key in usage for key in _SEPARATE_CACHE):
            inp = max(inp - read - write, 0)
        out = max(_count(usage, "output_tokens") - reasoning, 0)
        inp_rate, out_rate = float(self.input_per_mtok), float(self.output_per_mtok)
        total = (
            inp * inp_rate + out * out_rate
            + read * _or(self.cache_read_per_mtok, inp_rate)
            + write * _or(self.cache_write_per_mtok, inp_rate)
            + reasoning * _or(self.reasoning_per_mtok, out_rate)
        )
        return total / _MTOK


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


@attrs.frozen(slots=True)
class PriceTable:
    """The runtime's ``[prices]``, by ``"provider:model"`` (or ``"provider:*"``)."""

    prices: Mapping[str, Price] = attrs.field(factory=dict)

    def of(self, provider: str | None, model: str | None) -> Price | None:
        """The price of a route: its own entry, else its provider's ``"provider:*"``."""
        prices = self.prices
        return prices.get(f"{provider}:{model}") or prices.get(f"{provider}:*")

    def priced(self, provider: str | None, model: str | None, usage: Mapping[str, Any]
               ) -> dict[str, Any]:
        """``usage`` with its ``cost`` on that route: ``None``, and ``unpriced_calls`` 1,
        when the route has no price. Only called when the table is not empty: without
        prices, usage carries no ``cost`` at all."""
        price = self.of(provider, model)
        if price is None:
            return {**usage, "cost": None, "unpriced_calls": 1}
        return {**usage, "cost": price.cost(usage)}


def load_prices(section: FrozenDict) -> PriceTable:
    """The ``[prices]`` table of a config, checked.

    Raises:
        ConfigError: a route that is not ``"provider:model"``, an entry that is not a table,
            an unknown key, a missing price or a bad number, named by its path
            (``prices."openai:gpt-4o".input_per_mtok: ...``).
    """
    prices: dict[str, Price] = {}
    for route, entry in section.items():
        where = f'prices."{route}"'
        provider, colon, model = route.partition(":")
        if not (colon and provider and model):
            raise ConfigError(f'{where}: a price is for a route "provider:model", got {route!r}')
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: must be a table of prices, got {entry!r}")
        unknown = sorted(set(entry) - set(PRICE_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}.{unknown[0]}: unknown key (known: {', '.join(PRICE_KEYS)})"
            )
        for key in ("input_per_mtok", "output_per_mtok"):
            if key not in entry:
                raise ConfigError(f"{where}.{key}: missing (a price needs it)")
        try:
            prices[route] = Price(**dict(entry))
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None
    return PriceTable(prices)


def add_cost(total: dict[str, Any], cost: object) -> None:
    """Add one ``cost`` to ``total``: summed over the priced, ``None`` (unknown) while no
    price is known, so an unpriced call never reads as free."""
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        previous = total.get("cost")
        total["cost"] = (previous if isinstance(previous, (int, float)) else 0.0) + cost
    else:
        total.setdefault("cost", None)


def add_usage(total: dict[str, Any], usage: Mapping[str, Any]) -> dict[str, Any]:
    """Sum one usage table into ``total``: counters add up, nested tables (per model) too,
    and ``cost`` as :func:`add_cost` says."""
    for key, value in usage.items():
        if key == "cost":
            add_cost(total, value)
        elif isinstance(value, int) and not isinstance(value, bool):
            previous = total.get(key, 0)
            total[key] = (previous if isinstance(previous, int) else 0) + value
        elif isinstance(value, Mapping):
            nested = total.get(key)
            total[key] = add_usage(nested if isinstance(nested, dict) else {}, value)
    return total
