"""Which ``reasoning_effort`` values an adapter accepts: one rule, for the config file and calls.

The OpenAI-compatible adapters know the documented set of the services they can name by
host, and accept any non-empty value elsewhere: a compatible server (vLLM, llama.cpp,
Ollama, a proxy) may take values of its own, and refusing them would make it unusable. The
Anthropic adapter refuses every value: the Messages API controls reasoning with
``thinking``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal
from urllib.parse import urlsplit

__all__ = [
    "OPENAI_EFFORTS", "OPENROUTER_EFFORTS", "AllowedEfforts", "known_efforts", "effort_problem",
    "allowed_efforts", "ANTHROPIC_EFFORT",
]

OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's documented ``reasoning_effort`` values (chat completions and Responses alike);
which of them a model takes varies (``none`` from gpt-5.1, ``xhigh`` after
gpt-5.1-codex-max), and the API itself refuses what a model lacks."""

OPENROUTER_EFFORTS = (*OPENAI_EFFORTS, "max")
"""OpenRouter's documented values (its ``reasoning_effort`` shorthand for
``reasoning.effort``)."""

ANTHROPIC_EFFORT = (
    "the Anthropic Messages API has no reasoning_effort; enable extended thinking with "
    "'thinking' in the call's extra instead (extra={'thinking': {'type': 'enabled', "
    "'budget_tokens': 2048}})"
)

AllowedEfforts = Collection[str] | Literal["any"] | None
"""An adapter's ``reasoning_efforts`` option: the values to accept, ``"any"`` for every
non-empty value, or ``None`` to decide by host (:func:`known_efforts`)."""


def known_efforts(base_url: str) -> tuple[str, ...] | None:
    """The documented values of the service at ``base_url``, or ``None`` when it is not
    one this package knows (then any value is passed on)."""
    host = (urlsplit(base_url).hostname or "").lower()
    if host == "api.openai.com" or host.endswith(".openai.azure.com"):
        return OPENAI_EFFORTS
    if host == "openrouter.ai" or host.endswith(".openrouter.ai"):
        return OPENROUTER_EFFORTS
    return None


def allowed_efforts(option: AllowedEfforts, base_url: str) -> tuple[str, ...] | None:
    """The values an adapter built with ``reasoning_efforts=option`` accepts (``None``: all).

    Raises:
        ValueError: ``option`` is not a collection of non-empty strings, ``"any"`` or None.
    """
    if option is None:
        return known_efforts(base_url)
    if option == "any":
        return None
    if isinstance(option, str) or not all(isinstance(v, str) and v.strip() for v in option):
        raise ValueError(
            f"reasoning_efforts must be a collection of non-empty strings, 'any' or None, "
            f"got {option!r}"
        )
    return tuple(option)


def effort_problem(value: str | None, allowed: tuple[str, ...] | None) -> str | None:
    """What is wrong with ``value`` for an adapter accepting ``allowed``, or ``None``."""
    if value is None or allowed is None or value in allowed:
        return None
    return f"reasoning_effort {value!r} is not supported; allowed: {', '.join(allowed)}"
