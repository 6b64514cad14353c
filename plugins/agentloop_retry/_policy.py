"""The retry policy: defined in :mod:`agentloop.llm`, where a provider registration captures it."""

from __future__ import annotations

from agentloop.llm import RetryPolicy, is_retryable

__all__ = ["RetryPolicy", "is_retryable"]
