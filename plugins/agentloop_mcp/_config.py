"""``ServerConfig`` and the shape of the ``[mcp]`` config table."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, cast

import attrs

from agentloop import ConfigError, FrozenDict

__all__ = ["ServerConfig", "Section", "DEFAULT_SEPARATOR"]

DEFAULT_SEPARATOR: Final = "."
_NAME = re.compile(r"[A-Za-z0-9_-]+")


# The converters pass a wrong type through unchanged, for the validators to name it.
def _to_tuple(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, list | tuple) else cast("tuple[str, ...]", value)


def _to_frozen(value: Mapping[str, str]) -> FrozenDict:
    return FrozenDict(value) if isinstance(value, Mapping) else cast("FrozenDict", value)


def _to_path(value: str | os.PathLike[str] | None) -> str | None:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _name_problem(value: object) -> str | None:
    if isinstance(value, str) and _NAME.fullmatch(value):
        return None
    return f"must be letters, digits, '_' or '-', got {value!r}"


def _name(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    problem = _name_problem(value)
    if problem:
        raise ConfigError(f"{attribute.name}: {problem}")


def _name_or_key(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value != "":
        _name(instance, attribute, value)


def _non_empty(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, str) and value):
        raise ConfigError(f"{attribute.name}: must be a non-empty string, got {value!r}")


def _strings(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, tuple) and all(isinstance(a, str) for a in value)):
        raise ConfigError(f"{attribute.name}: must be a list of strings, got {value!r}")


def _string_table(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, FrozenDict) and all(isinstance(v, str) for v in value.values())):
        raise ConfigError(f"{attribute.name}: must be a table of strings, got {value!r}")


def _positive_number(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
        raise ConfigError(f"{attribute.name}: must be a positive number, got {value!r}")


def _url(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, str) and value.startswith(("http://", "https://"))):
        raise ConfigError(f"{attribute.name}: must be an http:// or https:// URL, got {value!r}")


def _count(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ConfigError(f"{attribute.name}: must be a non-negative integer, got {value!r}")


def _flag(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}: must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    """One MCP server: a command run over stdio, or a URL spoken to over streamable HTTP
    (TOML ``[[mcp.servers]]``).

    Args:
        name: the server's name, the prefix of its tool names; letters, digits, ``_`` and ``-``.
        command: the executable to run (stdio). Exactly one of ``command`` and ``url``.
        args: its command-line arguments.
        env: extra environment variables. The server does not inherit the whole environment:
            it gets the MCP SDK's safe defaults (``HOME``, ``PATH``, ``SHELL``, ``TERM``,
            ``USER``, ``LOGNAME``) with ``env`` merged over them.
        cwd: its working directory (default: the current one).
        url: the endpoint of a streamable HTTP server (``https://host/mcp``).
        headers: HTTP headers sent with every request (``{Authorization = "Bearer ..."}``).
        headers_env: HTTP headers whose values come from the environment when the server is
            connected: ``{Authorization = "Bearer ${GITHUB_TOKEN}"}`` expands ``${VAR}``, and a
            value without ``$`` names the variable that holds the whole value. Header values
            are never logged, shown in a repr, or put in an event.
        resources: also offer the server's resources, as the tools
            ``{name}_list_resources`` and ``{name}_read_resource``.
        startup_timeout: seconds for the server to start and list its tools.
        tool_timeout: seconds before a call to one of its tools is abandoned (``TIMEOUT``).
        max_restarts: attempts in a row to restart a stdio server that exited, or to reconnect
            to an HTTP server that went away, before giving up (``0``: never try).
        restart_delay: seconds before the first attempt; each failed attempt doubles it, up
            to 30 s.

    An invalid value raises :class:`agentloop.ConfigError` naming the field and the value.
    """

    name: str = attrs.field(validator=_name)
    command: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_empty)
    )
    args: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_strings)
    env: FrozenDict = attrs.field(
        factory=FrozenDict, converter=_to_frozen, validator=_string_table, repr=False
    )
    cwd: str | None = attrs.field(
        default=None, converter=_to_path, validator=attrs.validators.optional(_non_empty)
    )
    url: str | None = attrs.field(default=None, validator=attrs.validators.optional(_url))
    headers: FrozenDict = attrs.field(
        factory=FrozenDict, converter=_to_frozen, validator=_string_table, repr=False
    )
    headers_env: FrozenDict = attrs.field(
        factory=FrozenDict, converter=_to_frozen, validator=_string_table
    )
    resources: bool = attrs.field(default=False, validator=_flag)
    startup_timeout: float = attrs.field(default=30.0, validator=_positive_number)
    tool_timeout: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive_number)
    )
    max_restarts: int = attrs.field(default=5, validator=_count)
    restart_delay: float = attrs.field(default=1.0, validator=_positive_number)

    def __attrs_post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            got = "both" if self.command is not None else "neither"
            raise ConfigError(
                f"command: give either command (a stdio server) or url (streamable HTTP), "
                f"got {got}"
            )
        if self.url is not None:
            for field in ("args", "env", "cwd"):
                if getattr(self, field):
                    raise ConfigError(f"{field}: only for a stdio server (command), not a url")
        elif self.headers or self.headers_env:
            field = "headers" if self.headers else "headers_env"
            raise ConfigError(f"{field}: only for an HTTP server (url), not a command")

    @property
    def transport(self) -> str:
        """``"stdio"`` or ``"http"``."""
        return "http" if self.url is not None else "stdio"


@attrs.frozen(kw_only=True)
class _KeyedServer(ServerConfig):
    """A ``[mcp.servers.NAME]`` table: its name, when it gives one, must be its key."""

    name: str = attrs.field(default="", validator=_name_or_key)

    def named(self, key: str) -> ServerConfig:
        fields = {a.name: getattr(self, a.name) for a in attrs.fields(ServerConfig)}
        return ServerConfig(**{**fields, "name": key})


def _servers(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    where = attribute.name
    if isinstance(value, Mapping):
        for key, server in value.items():
            problem = _name_problem(key)
            if problem:
                raise ConfigError(f"{where}.{key}: its key is its name, which {problem}")
            if server.name not in ("", key):
                raise ConfigError(
                    f"{where}.{key}.name: differs from the table's key {key!r}, "
                    f"got {server.name!r}"
                )
        return
    seen: set[str] = set()
    for i, server in enumerate(cast("tuple[object, ...]", value)):
        if not isinstance(server, ServerConfig):
            raise ConfigError(
                f"{where}[{i}]: must be an agentloop_mcp.ServerConfig, got {server!r}"
            )
        # Their tools would collide.
        if server.name in seen:
            raise ConfigError(f"{where}[{i}].name: duplicate server name {server.name!r}")
        seen.add(server.name)


@attrs.frozen(kw_only=True)
class Section:
    """The ``[mcp]`` table, also what :func:`agentloop_mcp.mcp` builds from its arguments.

    ``servers`` is an array of tables (``[[mcp.servers]]`` with ``name``) or a table of tables
    keyed by name (``[mcp.servers.NAME]``); ``separator`` joins server and tool names.
    """

    servers: tuple[ServerConfig, ...] | Mapping[str, _KeyedServer] = attrs.field(
        default=(), validator=_servers
    )
    separator: str = attrs.field(default=DEFAULT_SEPARATOR, validator=_non_empty)

    def server_configs(self) -> tuple[ServerConfig, ...]:
        """The servers, each with its name (a keyed table's comes from its key)."""
        if isinstance(self.servers, Mapping):
            return tuple(server.named(key) for key, server in self.servers.items())
        return self.servers
