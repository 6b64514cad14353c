"""``ServerConfig`` and the parser of the ``[mcp]`` config table."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs

from agentloop import ConfigError, FrozenDict

__all__ = ["ServerConfig", "parse_section", "check_servers", "check_separator"]

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_FIELDS = ("name", "command", "args", "env", "cwd", "startup_timeout", "tool_timeout")
_SECTION_KEYS = ("servers", "separator")


class _ProblemsError(ConfigError):
    """Problems found by ``ServerConfig``'s own checks, as (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{field}: {message}" for field, message in problems))
        self.problems = problems


# The converters pass a wrong type through unchanged, for the checks to name it.
def _to_tuple(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, list | tuple) else cast("tuple[str, ...]", value)


def _to_frozen(value: Mapping[str, str]) -> FrozenDict:
    return FrozenDict(value) if isinstance(value, Mapping) else cast("FrozenDict", value)


def _to_path(value: str | os.PathLike[str] | None) -> str | None:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _is_number(value: object) -> bool:
    return type(value) in (int, float)


@attrs.frozen(kw_only=True)
class ServerConfig:
    """One MCP server started over stdio (TOML ``[[mcp.servers]]``).

    Args:
        name: the server's name, the prefix of its tool names; letters, digits, ``_`` and ``-``.
        command: the executable to run.
        args: its command-line arguments.
        env: extra environment variables. The server does not inherit the whole environment:
            it gets the MCP SDK's safe defaults (``HOME``, ``PATH``, ``SHELL``, ``TERM``,
            ``USER``, ``LOGNAME``) with ``env`` merged over them.
        cwd: its working directory (default: the current one).
        startup_timeout: seconds for the server to start and list its tools.
        tool_timeout: seconds before a call to one of its tools is abandoned (``TIMEOUT``).
    """

    name: str
    command: str
    args: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    env: FrozenDict = attrs.field(factory=FrozenDict, converter=_to_frozen)
    cwd: str | None = attrs.field(default=None, converter=_to_path)
    startup_timeout: float = 30.0
    tool_timeout: float | None = None

    def __attrs_post_init__(self) -> None:
        problems = [(field, message) for field, message in self._problems() if message]
        if problems:
            raise _ProblemsError(problems)

    def _problems(self) -> list[tuple[str, str | None]]:
        name, args, env = self.name, self.args, self.env
        return [
            ("name", None if isinstance(name, str) and _NAME.fullmatch(name) else
                f"must be letters, digits, '_' or '-', got {name!r}"),
            ("command", None if isinstance(self.command, str) and self.command else
                f"must be a non-empty string, got {self.command!r}"),
            ("args", None if isinstance(args, tuple) and all(isinstance(a, str) for a in args)
                else f"must be a list of strings, got {args!r}"),
            ("env", None if isinstance(env, FrozenDict) and all(
                isinstance(v, str) for v in env.values()) else
                f"must be a table of strings, got {env!r}"),
            ("cwd", None if self.cwd is None or (isinstance(self.cwd, str) and self.cwd) else
                f"must be a non-empty string, got {self.cwd!r}"),
            ("startup_timeout", None if _is_number(self.startup_timeout)
                and self.startup_timeout > 0 else
                f"must be a positive number, got {self.startup_timeout!r}"),
            ("tool_timeout", None if self.tool_timeout is None or (
                _is_number(self.tool_timeout) and self.tool_timeout > 0) else
                f"must be a positive number, got {self.tool_timeout!r}"),
        ]


def _build(raw: Mapping[str, Any], where: str) -> ServerConfig:
    unknown = [k for k in raw if k not in _FIELDS]
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}: unknown field (expected one of {', '.join(_FIELDS)}), "
            f"got {raw[unknown[0]]!r}"
        )
    for required in ("name", "command"):
        if required not in raw:
            raise ConfigError(f"{where}.{required}: required")
    try:
        return ServerConfig(**raw)
    except _ProblemsError as exc:
        raise ConfigError(
            "; ".join(f"{where}.{field}: {message}" for field, message in exc.problems)
        ) from None


def check_servers(servers: Sequence[ServerConfig], where: Sequence[str]) -> None:
    """Refuse two servers with one name (their tools would collide)."""
    seen: set[str] = set()
    for server, path in zip(servers, where, strict=True):
        if server.name in seen:
            raise ConfigError(f"{path}.name: duplicate server name {server.name!r}")
        seen.add(server.name)


def check_separator(separator: object, where: str) -> str:
    """The separator between server and tool names, checked."""
    if not isinstance(separator, str) or not separator:
        raise ConfigError(f"{where}: must be a non-empty string, got {separator!r}")
    return separator


def parse_section(section: Mapping[str, Any]) -> tuple[tuple[ServerConfig, ...], str]:
    """The servers and the name separator of an ``[mcp]`` table.

    Servers are an array of tables (``[[mcp.servers]]`` with ``name``) or a table of tables
    keyed by name (``[mcp.servers.NAME]``). Raises :class:`agentloop.ConfigError` naming the
    path of the first bad value (``mcp.servers[1].args``) and the value.
    """
    unknown = [k for k in section if k not in _SECTION_KEYS]
    if unknown:
        raise ConfigError(
            f"mcp.{unknown[0]}: unknown option (expected one of {', '.join(_SECTION_KEYS)}), "
            f"got {section[unknown[0]]!r}"
        )
    separator = check_separator(section.get("separator", "."), "mcp.separator")
    raw = section.get("servers", ())
    entries: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(raw, Mapping):
        for key, table in raw.items():
            where = f"mcp.servers.{key}"
            if not isinstance(table, Mapping):
                raise ConfigError(f"{where}: must be a table, got {table!r}")
            if "name" in table and table["name"] != key:
                raise ConfigError(
                    f"{where}.name: differs from the table's key {key!r}, got {table['name']!r}"
                )
            entries.append((where, {**table, "name": key}))
    elif isinstance(raw, list | tuple):
        for i, table in enumerate(raw):
            where = f"mcp.servers[{i}]"
            if not isinstance(table, Mapping):
                raise ConfigError(f"{where}: must be a table, got {table!r}")
            entries.append((where, table))
    else:
        raise ConfigError(
            f"mcp.servers: must be an array of tables ([[mcp.servers]]) or a table of tables, "
            f"got {raw!r}"
        )
    servers = tuple(_build(table, where) for where, table in entries)
    check_servers(servers, [where for where, _ in entries])
    return servers, separator
