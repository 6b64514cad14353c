"""The configuration model: frozen attrs classes, one explicit cattrs converter, TOML loading.

Every problem found while loading is reported in a single :class:`ConfigError` whose message
lists each one as ``path: what is wrong, got VALUE`` (``agents[0].max_tokens: ...``).

Secrets never reach a message: a value under a key whose name contains ``key``, ``token``,
``secret``, ``passw``, ``credential`` or ``auth`` (ignoring case; a count such as
``max_tokens`` is no secret) is shown as ``***``, wherever the message would echo it.
"""

from __future__ import annotations

import collections.abc
import difflib
import os
import re
import stat
import tomllib
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, overload

import attrs
import cattrs
from cattrs import BaseConverter
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    CattrsError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from ._errors import ConfigError, InvalidContent
from ._json import FrozenDict, freeze, thaw
from ._session import validate_session_id
from .llm._efforts import ANTHROPIC_EFFORT, effort_problem, known_efforts

T = TypeVar("T")

__all__ = [
    "AgentConfig",
    "ProviderConfig",
    "CallLimitsConfig",
    "PersistenceConfig",
    "Config",
    "load_config",
    "to_mapping",
    "converter",
]


class _ProblemsError(ConfigError):
    """Problems found by a class's own checks, each as (path relative to the object, message)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in problems))
        self.problems = problems


def _check(*problems: tuple[str, str | None]) -> None:
    found = [(path, msg) for path, msg in problems if msg is not None]
    if found:
        raise _ProblemsError(found)


def _non_empty(value: object, *, optional: bool = False) -> str | None:
    if (optional and value is None) or (isinstance(value, str) and value):
        return None
    return f"must be a non-empty string, got {value!r}"


def _positive(value: object) -> str | None:
    if value is None or (type(value) is int and value > 0):
        return None
    return f"must be a positive integer, got {value!r}"


def _id(value: object, what: str, *, optional: bool = False) -> str | None:
    if optional and value is None:
        return None
    try:
        validate_session_id(value, what)
    except InvalidContent as exc:
        return str(exc)
    return None


def _table(value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a table, got {value!r}")
    return value


def _frozen(value: object, path: str = "") -> FrozenDict:
    try:
        frozen = freeze(_table(value), path=path)
    except InvalidContent as exc:
        sub, _, why = str(exc).partition(": ")
        raise _ProblemsError([(sub, why)]) from None
    assert isinstance(frozen, FrozenDict)
    return frozen


@attrs.frozen(kw_only=True)
class AgentConfig:
    """An agent started with the runtime (TOML ``[[agents]]``).

    ``id``, ``session_id`` and ``resume_session_id`` follow the session-id rule (see
    :func:`agentloop.validate_session_id`).
    """

    id: str
    provider: str | None = None
    model: str | None = None
    cwd: str | None = None
    session_id: str | None = None
    resume_session_id: str | None = None
    reasoning_effort: str | None = None
    max_tokens: int | None = None

    def __attrs_post_init__(self) -> None:
        both = self.session_id is not None and self.resume_session_id is not None
        _check(
            ("id", _id(self.id, "agent id")),
            ("session_id", _id(self.session_id, "session id", optional=True)),
            ("resume_session_id", _id(self.resume_session_id, "session id", optional=True)),
            ("reasoning_effort", _non_empty(self.reasoning_effort, optional=True)),
            ("max_tokens", _positive(self.max_tokens)),
            ("", "session_id and resume_session_id are mutually exclusive" if both else None),
        )


@attrs.frozen(kw_only=True)
class CallLimitsConfig:
    """Shared limits on the model calls of one route (TOML ``[providers.NAME.models.MODEL]``):
    every agent of the runtime calling that provider and model counts against them."""

    max_concurrent_calls: int | None = None
    max_calls_per_minute: int | None = None

    def __attrs_post_init__(self) -> None:
        _check(
            ("max_concurrent_calls", _positive(self.max_concurrent_calls)),
            ("max_calls_per_minute", _positive(self.max_calls_per_minute)),
        )


@attrs.frozen(kw_only=True)
class ProviderConfig:
    """A model provider route (TOML ``[providers.NAME]``); ``repr`` never shows the API key.

    ``max_concurrent_calls`` and ``max_calls_per_minute`` are shared by every agent of the
    runtime calling this provider (per runtime: each runtime of a fleet counts its own
    calls); ``models`` holds the same limits for single models of it. A table with limits
    and no ``kind`` and ``base_url`` limits a provider whose adapter is registered in code.
    """

    kind: Literal["openai", "openai-responses", "anthropic"] | None = None
    base_url: str | None = None
    api_key: str | None = attrs.field(default=None, repr=False)
    api_key_env: str | None = None
    # Header values may be credentials (Azure's api-key): never in a repr.
    headers: FrozenDict = attrs.field(factory=FrozenDict, converter=_frozen, repr=False)
    model: str | None = None
    max_tokens: int | None = None
    reasoning_effort: str | None = None
    max_concurrent_calls: int | None = None
    max_calls_per_minute: int | None = None
    models: FrozenDict = attrs.field(factory=FrozenDict, converter=FrozenDict)

    def __attrs_post_init__(self) -> None:
        limits_only = self.kind is None and self.base_url is None and (
            self.max_concurrent_calls is not None or self.max_calls_per_minute is not None
            or bool(self.models)
        )
        _check(
            ("kind", None if self.kind is not None or limits_only else "is required"),
            ("base_url", None if limits_only else "is required" if self.base_url is None
             else _non_empty(self.base_url) or url_problem(self.base_url)),
            ("api_key_env", _non_empty(self.api_key_env, optional=True)),
            ("reasoning_effort", _non_empty(self.reasoning_effort, optional=True)
             or self.effort_problem(self.reasoning_effort)),
            ("max_tokens", _positive(self.max_tokens)),
            ("max_concurrent_calls", _positive(self.max_concurrent_calls)),
            ("max_calls_per_minute", _positive(self.max_calls_per_minute)),
        )

    @property
    def has_adapter(self) -> bool:
        """Whether this table configures an adapter (not only limits for one made in code)."""
        return self.kind is not None

    def effort_problem(self, effort: str | None) -> str | None:
        """Whether this provider's adapter would refuse ``effort``: the adapters' own rule,
        applied when the config is read rather than at the first call."""
        if effort is None:
            return None
        if self.kind == "anthropic":
            return ANTHROPIC_EFFORT
        return effort_problem(effort, known_efforts(self.base_url if isinstance(
            self.base_url, str) else ""))

    def resolve_api_key(self, environ: Mapping[str, str]) -> str | None:
        """The explicit ``api_key``, else the value of the ``api_key_env`` variable, else None."""
        if self.api_key is not None:
            return self.api_key
        if self.api_key_env is not None:
            return environ.get(self.api_key_env) or None
        return None


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a provider's base URL, or ``None``. Without a scheme, httpx
    would fail at the first call with a message that names neither the key nor the fix."""
    if re.match(r"https?://[^/\s]", url):
        return None
    return (
        f"must start with http:// or https:// (for example http://127.0.0.1:8080/v1), "
        f"got {url!r}"
    )


def _masked_dsn(dsn: object) -> str:
    # A DSN may carry a password: a repr names its presence, never the connection string.
    return "None" if dsn is None else "'***'"


_DSN_START = re.compile(r"(postgres|postgresql)://|\s*\w+\s*=", re.IGNORECASE)


@attrs.frozen(kw_only=True)
class PersistenceConfig:
    """The session-persistence backend (TOML ``[persistence]``).

    ``backend = "sqlite"`` needs ``path``; ``backend = "postgres"`` needs ``dsn`` (a libpq
    connection string, URI or ``key=value`` form), whose password is never shown. A live
    driver's lease on a session lasts ``lease_seconds`` unless its holder renews it.
    """

    backend: Literal["sqlite", "postgres"]
    path: str = ""
    dsn: str | None = attrs.field(default=None, repr=_masked_dsn)
    lease_seconds: float = 30.0

    def __attrs_post_init__(self) -> None:
        if self.backend == "postgres":
            dsn_problem = None
            if not isinstance(self.dsn, str) or not _DSN_START.match(self.dsn):
                # Never echoed: the connection string may hold a password.
                dsn_problem = (
                    "must be a PostgreSQL connection string (postgresql://... or key=value)"
                )
            _check(
                ("dsn", dsn_problem),
                ("path", "is for backend 'sqlite' only" if self.path else None),
                ("lease_seconds", _positive_number(self.lease_seconds)),
            )
        else:
            _check(
                ("path", _non_empty(self.path)),
                ("dsn", "is for backend 'postgres' only" if self.dsn is not None else None),
                ("lease_seconds", _positive_number(self.lease_seconds)),
            )


def _positive_number(value: object) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e9:
        return None
    return f"must be a positive number of seconds, got {value!r}"


@attrs.frozen(kw_only=True)
class Config:
    """A whole deployment: plugins, agents, providers, persistence, settings, plugin sections.

    ``settings`` and ``sections`` are deep-frozen JSON. A top-level key that is none of the
    fields below names a plugin's section (``[retry]``, ``[mcp]``, ...): it is kept, raw, in
    ``sections`` for the plugin to read with :meth:`section`, whichever plugins end up loaded
    (a plugin may be passed in code rather than named in ``plugins``). Two kinds of unknown
    key are refused instead, with the closest field name as a hint: one that is not a table
    (a plugin's section always is), and a table whose name is within a typo of a field
    (``difflib`` similarity of 0.8 or more: ``[persistance]``, ``[agent]``, ``[setings]``).
    """

    plugins: tuple[str, ...] = ()
    agents: tuple[AgentConfig, ...] = ()
    providers: FrozenDict = attrs.field(factory=FrozenDict, converter=FrozenDict)
    persistence: PersistenceConfig | None = None
    settings: FrozenDict = attrs.field(factory=FrozenDict, converter=_frozen)
    system_prompt: str | None = None
    sections: FrozenDict = attrs.field(factory=FrozenDict, converter=_frozen)

    def __attrs_post_init__(self) -> None:
        first: dict[str, int] = {}
        # Two agents driving one session would meet as a SessionIdInUse at startup.
        sessions: dict[str, tuple[int, str]] = {}
        problems: list[tuple[str, str | None]] = []
        for i, agent in enumerate(self.agents):
            if agent.id in first:
                why = f"duplicates agents[{first[agent.id]}].id, got {agent.id!r}"
                problems.append((f"agents[{i}].id", why))
            first.setdefault(agent.id, i)
            for key in ("session_id", "resume_session_id"):
                sid = getattr(agent, key)
                if sid is None:
                    continue
                if sid in sessions:
                    j, other = sessions[sid]
                    why = (f"session {sid!r} is already agents[{j}].{other}; two agents "
                           "cannot drive one session")
                    problems.append((f"agents[{i}].{key}", why))
                sessions.setdefault(sid, (i, key))
            provider = self.providers.get(agent.provider) if agent.provider else None
            if isinstance(provider, ProviderConfig):
                problem = provider.effort_problem(agent.reasoning_effort)
                if problem is not None:
                    problems.append(
                        (f"agents[{i}].reasoning_effort", f"provider {agent.provider!r}: {problem}")
                    )
        _check(*problems)

    @overload
    def section(self, name: str) -> FrozenDict: ...

    @overload
    def section(self, name: str, cls: type[T]) -> T: ...

    def section(self, name: str, cls: type[T] | None = None) -> T | FrozenDict:
        """The top-level table ``name``: raw (frozen JSON), or structured as ``cls``.

        ``cls`` is a frozen attrs class whose defaults make ``cls()`` valid: an absent table
        gives ``cls()``. The table is structured by the converter that structures the rest of
        the config: unknown keys are refused (with the closest field as a hint), each value
        must have its field's type (a field with an attrs ``converter`` gets the raw value,
        for the converter and the validators to judge), and a field marked
        ``metadata={"config": False}`` (a callable, a random source) is left to code: a table
        cannot set it. Validators name their field in the message (``"max_attempts: must be
        ..."``), which the error places under the table (``retry.max_attempts: ...``).

        Raises:
            ConfigError: listing the problems found, each named by its path.
        """
        raw: FrozenDict | None = self.sections.get(name)
        if cls is None:
            return raw if raw is not None else FrozenDict()
        if raw is None:
            return cls()
        try:
            return converter.structure(raw, cls)
        except (CattrsError, ValueError) as exc:
            raise ConfigError(_report(exc, name, {name: raw})) from None


_FIELDS = tuple(a.name for a in attrs.fields(Config) if a.name != "sections")
# Plugin sections live at the top level beside the fields, so only a near miss is refused.
_TYPO = 0.8

converter = cattrs.Converter(
    forbid_extra_keys=True, omit_if_default=True, prefer_attrib_converters=True
)
"""The one converter between plain mappings (TOML's shape) and the config classes."""


def _exact(tp: type, noun: str) -> Callable[[object, object], Any]:
    def hook(value: object, _: object) -> Any:
        if type(value) is not tp:  # no bool for int, no coercion of 3 to "3"
            raise ValueError(f"expected {noun}, got {value!r}")
        return value

    return hook


def _structure_float(value: object, _: object) -> float:
    # TOML writes 3 for 3.0, so an integer is a number too; a bool or "3" is a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _structure_literal(value: object, tp: object) -> object:
    choices = get_args(tp)
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"must be one of {allowed}, got {value!r}")
    return value


def _is_literal(tp: Any) -> bool:
    return get_origin(tp) is Literal


def _is_homogenous_tuple(tp: Any) -> bool:
    return get_origin(tp) is tuple and get_args(tp)[1:] == (...,)


def _is_table_of(tp: Any) -> bool:
    return get_origin(tp) is collections.abc.Mapping and get_args(tp)[:1] == (str,)


def _is_array_or_table(tp: Any) -> bool:
    """A union of one ``tuple[X, ...]`` and one ``Mapping[str, Y]``, told apart by shape."""
    if get_origin(tp) not in (Union, types.UnionType):
        return False
    members = get_args(tp)
    return (
        len(members) == 2
        and any(_is_homogenous_tuple(m) for m in members)
        and any(_is_table_of(m) for m in members)
    )


def _tuple_hook(tp: Any, conv: BaseConverter) -> Callable[[object, object], tuple[Any, ...]]:
    inner = homogenous_tuple_structure_factory(tp, conv)

    def hook(value: object, _: object) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected an array, got {value!r}")
        result: tuple[Any, ...] = inner(value, tp)
        return result

    return hook


def _mapping_of(tp: Any) -> Callable[[object, object], FrozenDict]:
    def hook(value: object, _: object) -> FrozenDict:
        return FrozenDict(converter.structure(_table(value), dict[str, tp]))

    return hook


def _table_hook(tp: Any) -> Callable[[object, object], FrozenDict]:
    return _mapping_of(get_args(tp)[1])


def _array_or_table_hook(tp: Any) -> Callable[[object, object], Any]:
    array, table = sorted(get_args(tp), key=_is_table_of)

    def hook(value: object, _: object) -> Any:
        if isinstance(value, Mapping):
            return converter.structure(value, table)
        if isinstance(value, (list, tuple)):
            return converter.structure(value, array)
        raise ValueError(f"expected an array or a table, got {value!r}")

    return hook


def _config_fields(cl: type) -> list[str]:
    return [a.name for a in attrs.fields(cl) if a.init and a.metadata.get("config", True)]


def _attrs_hook(cl: type, **overrides: Any) -> Callable[[object, object], Any]:
    settable = _config_fields(cl)
    for a in attrs.fields(cl):
        if a.name not in settable:
            overrides.setdefault(a.name, override(omit=True))
    inner: Callable[[Mapping[str, Any], Any], Any] = make_dict_structure_fn(
        cl, converter, **overrides
    )

    def hook(value: object, _: object) -> Any:
        return inner(_table(value), cl)

    return hook


converter.register_structure_hook(str, _exact(str, "a string"))
converter.register_structure_hook(int, _exact(int, "an integer"))
converter.register_structure_hook(bool, _exact(bool, "true or false"))
converter.register_structure_hook(float, _structure_float)
converter.register_structure_hook_func(_is_literal, _structure_literal)
converter.register_structure_hook_factory(_is_homogenous_tuple, _tuple_hook)
converter.register_structure_hook_factory(_is_table_of, _table_hook)
converter.register_structure_hook_factory(_is_array_or_table, _array_or_table_hook)
converter.register_structure_hook_factory(attrs.has, lambda cl: _attrs_hook(cl))
converter.register_structure_hook(
    ProviderConfig,
    _attrs_hook(
        ProviderConfig,
        headers=override(struct_hook=_mapping_of(str)),
        models=override(struct_hook=_mapping_of(CallLimitsConfig)),
    ),
)
_structure_fields = make_dict_structure_fn(
    Config,
    converter,
    providers=override(struct_hook=_mapping_of(ProviderConfig)),
    settings=override(struct_hook=lambda value, _: _frozen(value)),
    sections=override(struct_hook=lambda value, _: value),
)


def _closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def _unknown_key(name: str, known: Sequence[str]) -> str:
    close = _closest(name, known)
    if close is not None:
        return f"unknown key; did you mean {close!r}?"
    names = ", ".join(sorted(known))
    return f"unknown key (known: {names})" if names else "unknown key"


def _structure_config(value: object, _: object) -> Config:
    known: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    errors: list[Exception] = []
    for key, item in _table(value).items():
        close = _closest(key, _FIELDS)
        if key in _FIELDS:
            known[key] = item
        elif not isinstance(item, Mapping):
            hint = f"; did you mean {close!r}?" if close else " (a plugin's section is a table)"
            errors.append(_ProblemsError([(key, "unknown top-level key" + hint)]))
        elif _closest(key, _FIELDS, cutoff=_TYPO) is not None:
            errors.append(_ProblemsError([(key, f"unknown section; did you mean {close!r}?")]))
        else:
            try:
                sections[key] = _frozen(item, key)
            except ConfigError as exc:
                errors.append(exc)
    try:
        config = _structure_fields({**known, "sections": FrozenDict(sections)}, Config)
    except (CattrsError, ValueError) as exc:
        errors.append(exc)
    if errors:
        raise ClassValidationError("While structuring Config", errors, Config)
    return config


converter.register_structure_hook(Config, _structure_config)
converter.register_unstructure_hook(
    FrozenDict, lambda d: {k: converter.unstructure(v) for k, v in d.items()}
)
converter.register_unstructure_hook(
    ProviderConfig,
    make_dict_unstructure_fn(
        ProviderConfig, converter, _cattrs_omit_if_default=True, api_key=override(omit=True)
    ),
)


def _join(path: str, step: str | int) -> str:
    if isinstance(step, int):
        return f"{path}[{step}]"
    if step.startswith("["):
        return path + step
    return f"{path}.{step}" if path and step else path or step


def _problems(exc: BaseException, path: str) -> Iterator[tuple[str, str]]:
    """Each problem in ``exc`` as (path, what is wrong), the path relative to ``path``."""
    if isinstance(exc, _ProblemsError):
        for sub, msg in exc.problems:
            yield _join(path, sub), msg
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = _config_fields(exc.cl) if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields):
            yield _join(path, key), _unknown_key(key, known)
    elif isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for inner, note in with_notes:
            step = note.name if isinstance(note, AttributeValidationNote) else note.index
            yield from _problems(inner, _join(path, step))
        for inner in without:
            if isinstance(inner, ConfigError) and not isinstance(inner, _ProblemsError):
                # The class's constructor refused: its validators name the field first
                # ("max_attempts: must be ..."), relative to where the class sits.
                sub, _, why = str(inner).partition(": ")
                yield (_join(path, sub), why) if why else (path, sub)
            else:
                yield from _problems(inner, path)
    elif isinstance(exc, KeyError):
        yield path, "is required"
    else:
        yield path, str(exc)


_SECRET_NAME = re.compile(r"key|token|secret|passw|credential|auth", re.IGNORECASE)
_COUNT_NAME = re.compile(r"(max|min|num|n|total)_(\w+_)?tokens", re.IGNORECASE)
_STEP = re.compile(r"[.\[\]]")


def _is_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name)) and not _COUNT_NAME.fullmatch(name)


def _secret_values(value: object, secret: bool = False) -> Iterator[object]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _secret_values(item, secret or _is_secret(str(key)))
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _secret_values(item, secret)
    elif secret:
        yield value


def _report(exc: BaseException, path: str, source: Mapping[str, Any]) -> str:
    """The problems of ``exc`` as one message, with every secret of ``source`` masked."""
    shown: set[str] = set()
    for value in _secret_values(source):
        shown.add(repr(value))
        # Bare text is masked too, unless so short it would also match ordinary words.
        if isinstance(value, str) and len(value) >= 4:
            shown.add(value)
    lines = []
    for where, why in _problems(exc, path):
        if any(_is_secret(step) for step in _STEP.split(where)):
            why = re.sub(r", got .*", ", got ***", why, flags=re.DOTALL)
        for text in sorted(shown, key=len, reverse=True):
            why = why.replace(text, "***")
        lines.append(f"{where or 'config'}: {why}")
    return "; ".join(lines)


def _read_toml(path: Path) -> Any:
    try:
        # Opening a FIFO blocks until a writer comes, and /dev/zero never ends: only a
        # regular file is read.
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) \
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file"
            raise ConfigError(f"config file {path} is not a regular file (it is {kind})")
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid TOML in {path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"invalid TOML in {path}: arrays or tables nested too deeply") \
            from None


def load_config(source: Config | str | os.PathLike[str] | Mapping[str, Any] | None) -> Config:
    """Build a :class:`Config` from a Config (returned as is), a TOML file path, a mapping or None.

    A ``str`` is always a path. Raises :class:`ConfigError` listing every problem found.
    """
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    where = ""
    if isinstance(source, (str, os.PathLike)):
        where = f" in {os.fspath(source)}"
        source = _read_toml(Path(source))
    if not isinstance(source, Mapping):
        raise ConfigError(f"config must be a Config, a TOML file path or a mapping, got {source!r}")
    try:
        return converter.structure(source, Config)
    except (CattrsError, ValueError) as exc:
        raise ConfigError(f"invalid config{where}: {_report(exc, '', source)}") from None
    except RecursionError:
        raise ConfigError(f"invalid config{where}: values nested too deeply") from None


def to_mapping(config: Config) -> dict[str, Any]:
    """The config as plain data in TOML's shape, for display; API keys are left out."""
    data: dict[str, Any] = converter.unstructure(config)
    data.update(data.pop("sections", {}))
    return thaw(data)  # type: ignore[no-any-return]
