"""The exception hierarchy. Every public exception subclasses :class:`AgentLoopError`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AgentLoopError",
    "ConfigError",
    "SettingsError",
    "InvalidContent",
    "ProviderError",
    "SessionIdInUse",
    "SessionLeased",
    "ScopeClosed",
    "InvalidOptions",
    "SessionNotFound",
    "PersistenceUnavailable",
    "PersistenceError",
    "AgentDisposed",
    "AgentNotPublished",
    "RuntimeClosed",
    "ToolDefinitionError",
    "TurnFailed",
]


class AgentLoopError(Exception):
    """Base class of every error agentloop raises on purpose."""


class ConfigError(AgentLoopError, ValueError):
    """A configuration value is invalid; the message names its path and the bad value."""


class SettingsError(AgentLoopError, ValueError):
    """A settings write was refused; nothing changed."""


class InvalidContent(AgentLoopError, ValueError):  # noqa: N818 - the contract's name
    """Message content or metadata is not JSON-representable; nothing changed."""


_PROVIDER_FACTS = frozenset({"message", "status", "code", "retry_after"})


class ProviderError(AgentLoopError):
    """A model provider call failed.

    Attributes:
        status: the HTTP status when the failure came with one.
        code: a short machine-readable code (``"rate_limit_error"``, ``"NO_ADAPTER"``, ...).
        retry_after: seconds the provider asked us to wait, when it said so.
        message: the provider's own message.
    """

    def __init__(
        self,
        message: str = "",
        *,
        status: int | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        if not message:
            parts = [f"HTTP {status}" if status is not None else "", code or ""]
            message = " ".join(p for p in parts if p) or "provider error"
        super().__init__(message)
        # Facts about a call that happened: handlers (agent/request-error) read them, and
        # what the log records afterwards is what the provider said, not what a handler wrote.
        object.__setattr__(self, "message", message)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "retry_after", retry_after)

    message: str
    status: int | None
    code: str | None
    retry_after: float | None

    def __setattr__(self, name: str, value: object) -> None:
        if name in _PROVIDER_FACTS:
            raise AttributeError(f"ProviderError.{name} is read-only")
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        return (
            f"ProviderError({self.message!r}, status={self.status!r}, code={self.code!r}, "
            f"retry_after={self.retry_after!r})"
        )

    def to_json(self) -> dict[str, object]:
        """The error as plain JSON, as recorded in logs and events."""
        return {
            "message": self.message,
            "status": self.status,
            "code": self.code,
            "retry_after": self.retry_after,
        }


class SessionIdInUse(AgentLoopError):  # noqa: N818 - the contract's name
    """Another live agent already holds this session id."""


class PersistenceError(AgentLoopError):
    """The persistence backend failed (a corrupt or newer file, an undecodable row, ...)."""


class SessionLeased(SessionIdInUse, PersistenceError):  # noqa: N818 - as SessionIdInUse
    """Another runtime (another process or host) drives this session: its store's lease is
    held. A :class:`SessionIdInUse` for callers, a :class:`PersistenceError` for stores."""


class ScopeClosed(AgentLoopError, RuntimeError):  # noqa: N818 - reads as a state
    """The :class:`~agentloop.Context` is closed: it can own no new agents or registrations."""


class InvalidOptions(AgentLoopError, TypeError):  # noqa: N818 - reads as a state
    """An argument has the wrong type (``agent_options`` that is not an ``AgentOptions``)."""


class SessionNotFound(AgentLoopError, LookupError):  # noqa: N818 - the contract's name
    """No persisted session has this id."""


class PersistenceUnavailable(AgentLoopError):  # noqa: N818 - the contract's name
    """The operation needs a session-persistence backend and none is loaded."""


class AgentDisposed(AgentLoopError):  # noqa: N818 - reads as a state
    """The agent was disposed; it accepts no more input."""


class AgentNotPublished(AgentLoopError):  # noqa: N818 - reads as a state
    """The agent is still being set up and cannot be driven yet."""


class RuntimeClosed(AgentLoopError):  # noqa: N818 - reads as a state
    """The runtime is shutting down (or has shut down) and accepts no new agents."""


class ToolDefinitionError(AgentLoopError, TypeError):
    """A function cannot be turned into a tool (an annotation without a JSON schema, ...)."""


class TurnFailed(AgentLoopError):  # noqa: N818 - the contract's name
    """The turn that claimed a run's message ended with reason ``error``.

    Raised by ``Run.result()`` (and ``Agent.ask``). Only ``error`` is an exception: the other
    reasons a turn ends with are outcomes the caller chose or expects, reported on the result.

    Attributes:
        reason: always ``"error"``.
        error: the :class:`ProviderError` rebuilt from the ``turn/end`` error data when a model
            call failed, else that data itself (``{"type": ..., "message": ...}``), or ``None``.
        data: the ``turn/end`` error data as logged, or ``None``.
        turn: the number of the failed turn.
    """

    def __init__(
        self,
        turn: int,
        error: ProviderError | Mapping[str, Any] | None,
        data: Mapping[str, Any] | None = None,
        *,
        reason: str = "error",
    ) -> None:
        detail = str(error) if isinstance(error, ProviderError) else (
            (error or {}).get("message") or (error or {}).get("type") or "unknown error"
        )
        super().__init__(f"turn {turn} failed: {detail}")
        self.reason = reason
        self.error = error
        self.data = data
        self.turn = turn
