"""Runtime settings: validated at the write, observable, applied without restart."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ._bus import EventBus
from ._errors import SettingsError
from ._events import SettingChanged

__all__ = [
    "Settings", "MAX_PARALLEL_TOOL_CALLS", "APPROVAL_TIMEOUT", "CRASHED_TURN", "MAX_STEPS_PER_TURN",
    "HIBERNATE_AFTER",
]

MAX_PARALLEL_TOOL_CALLS = "agent-loop.max_parallel_tool_calls"
APPROVAL_TIMEOUT = "agent-loop.approval_timeout"
CRASHED_TURN = "agent-loop.crashed_turn"
MAX_STEPS_PER_TURN = "agent-loop.max_steps_per_turn"
HIBERNATE_AFTER = "agent-loop.hibernate_after_seconds"


def _positive_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SettingsError(f"{key}: must be a positive integer, got {value!r}")
    return value


def _count_or_zero(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingsError(f"{key}: must be a non-negative integer (0: no limit), got {value!r}")
    return value


def _positive_seconds_or_none(key: str, value: object) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or not math.isfinite(value) or value <= 0
    ):
        raise SettingsError(f"{key}: must be a positive number of seconds (or None), got {value!r}")
    return value


def _crashed_turn(key: str, value: object) -> str:
    if value not in ("close", "continue"):
        raise SettingsError(f"{key}: must be 'close' or 'continue', got {value!r}")
    return str(value)


_SCHEMA: dict[str, tuple[Callable[[str, object], Any], Any]] = {
    MAX_PARALLEL_TOOL_CALLS: (_positive_int, 10),
    APPROVAL_TIMEOUT: (_positive_seconds_or_none, None),
    CRASHED_TURN: (_crashed_turn, "close"),
    # A model that keeps calling tools would otherwise run until killed.
    MAX_STEPS_PER_TURN: (_count_or_zero, 50),
    # None: an idle agent keeps its actor and log in memory until it is disposed.
    HIBERNATE_AFTER: (_positive_seconds_or_none, None),
    "subagents.max_depth": (_positive_int, 3),
    "subagents.max_children": (_positive_int, 8),
}


class Settings:
    """``ctx.settings``: typed keys with defaults; a bad write raises and changes nothing.

    Known keys:

    - ``agent-loop.max_parallel_tool_calls`` (positive int, default 10), read by each agent
      at the start of every tool group, so a write applies to the next group;
    - ``agent-loop.approval_timeout`` (positive seconds or ``None``, the default: no limit),
      after which a call parked for approval is answered ``DENIED``, read whenever a parked
      call is checked, so a write applies to the calls already waiting;
    - ``agent-loop.max_steps_per_turn`` (non-negative int, default 50; ``0``: no limit), the
      model calls one turn may make: a turn that has made that many ends ``aborted`` with
      cause ``step_limit`` before its next call; read before every step;
    - ``agent-loop.crashed_turn`` (``"close"``, the default, or ``"continue"``): what resuming
      a session does with the turn a crash left open, unless ``resume`` says;
    - ``subagents.max_depth`` and ``subagents.max_children`` (positive ints, defaults 3 and
      8): how deep a tree of sub-agents may grow, and how many live children one agent may
      own.
    """

    def __init__(self, bus: EventBus, initial: Mapping[str, Any] | None = None) -> None:
        self._bus = bus
        self._values: dict[str, Any] = {key: default for key, (_, default) in _SCHEMA.items()}
        for key, value in (initial or {}).items():
            self.set(key, value)

    def get(self, key: str) -> Any:
        """The current value of ``key``; unknown keys raise ``SettingsError``."""
        try:
            return self._values[key]
        except KeyError:
            raise SettingsError(f"unknown setting {key!r}") from None

    def set(self, key: str, value: object) -> None:
        """Validate and store ``value``; emits ``settings/changed``."""
        try:
            check, _ = _SCHEMA[key]
        except KeyError:
            known = ", ".join(sorted(_SCHEMA))
            raise SettingsError(f"unknown setting {key!r} (known: {known})") from None
        self._values[key] = check(key, value)
        if self._bus.has_listeners(SettingChanged):
            self._bus.emit_nowait(SettingChanged(key, self._values[key]))


def flatten_settings(tables: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"agent-loop": {"max_parallel_tool_calls": 4}}`` -> ``{"agent-loop.max_...": 4}``."""
    out: dict[str, Any] = {}
    for key, value in tables.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(flatten_settings(value, path))
        else:
            out[path] = value
    return out
