"""The configuration model: frozen attrs classes, one explicit cattrs converter, TOML loading.

Every problem found while loading is reported in a single :class:`ConfigError` whose message
lists each one as ``path: what is wrong, got VALUE`` (``agents[0].max_tokens: ...``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

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

__all__ = [
    "AgentConfig",
    "ProviderConfig",
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
    """An agent started with the runtime (TOML ``[[agents]]``)."""

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
            ("id", _non_empty(self.id)),
            ("reasoning_effort", _non_empty(self.reasoning_effort, optional=True)),
            ("max_tokens", _positive(self.max_tokens)),
            ("", "session_id and resume_session_id are mutually exclusive" if both else None),
        )


@attrs.frozen(kw_only=True)
class ProviderConfig:
    """A model provider route (TOML ``[providers.NAME]``); ``repr`` never shows the API key."""

    kind: Literal["openai", "anthropic"]
    base_url: str
    api_key: str | None = attrs.field(default=None, repr=False)
    api_key_env: str | None = None
    headers: FrozenDict = attrs.field(factory=FrozenDict, converter=_frozen)
    model: str | None = None
    max_tokens: int | None = None
    reasoning_effort: str | None = None

    def __attrs_post_init__(self) -> None:
        _check(
            ("base_url", _non_empty(self.base_url)),
            ("api_key_env", _non_empty(self.api_key_env, optional=True)),
            ("reasoning_effort", _non_empty(self.reasoning_effort, optional=True)),
            ("max_tokens", _positive(self.max_tokens)),
        )

    def resolve_api_key(self, environ: Mapping[str, str]) -> str | None:
        """The explicit ``api_key``, else the value of the ``api_key_env`` variable, else None."""
        if self.api_key is not None:
            return self.api_key
        if self.api_key_env is not None:
            return environ.get(self.api_key_env) or None
        return None


@attrs.frozen(kw_only=True)
class PersistenceConfig:
    """The session-persistence backend (TOML ``[persistence]``)."""

    backend: Literal["sqlite"]
    path: str

    def __attrs_post_init__(self) -> None:
        _check(("path", _non_empty(self.path)))


@attrs.frozen(kw_only=True)
class Config:
    """A whole deployment: plugins, agents, providers, persistence, settings, plugin sections.

    ``settings`` and ``sections`` are deep-frozen JSON; ``sections`` holds every top-level
    table this model does not know (``[retry]``, ``[mcp]``, ...) for plugins to read.
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
        problems: list[tuple[str, str | None]] = []
        for i, agent in enumerate(self.agents):
            if agent.id in first:
                why = f"duplicates agents[{first[agent.id]}].id, got {agent.id!r}"
                problems.append((f"agents[{i}].id", why))
            first.setdefault(agent.id, i)
        _check(*problems)

    def section(self, name: str) -> FrozenDict:
        """The frozen top-level table ``name`` (empty when absent)."""
        found: FrozenDict = self.sections.get(name, FrozenDict())
        return found


_FIELDS = frozenset(a.name for a in attrs.fields(Config)) - {"sections"}

converter = cattrs.Converter(forbid_extra_keys=True, omit_if_default=True)
"""The one converter between plain mappings (TOML's shape) and the config classes."""


def _exact(tp: type, noun: str) -> Callable[[object, object], Any]:
    def hook(value: object, _: object) -> Any:
        if type(value) is not tp:  # no bool for int, no coercion of 3 to "3"
            raise ValueError(f"expected {noun}, got {value!r}")
        return value

    return hook


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


def _register(cl: type, **overrides: Any) -> None:
    inner: Callable[[Mapping[str, Any], Any], Any] = make_dict_structure_fn(
        cl, converter, **overrides
    )

    def hook(value: object, _: object) -> Any:
        return inner(_table(value), cl)

    converter.register_structure_hook(cl, hook)


converter.register_structure_hook(str, _exact(str, "a string"))
converter.register_structure_hook(int, _exact(int, "an integer"))
converter.register_structure_hook_func(_is_literal, _structure_literal)
converter.register_structure_hook_factory(_is_homogenous_tuple, _tuple_hook)
_register(AgentConfig)
_register(PersistenceConfig)
_register(ProviderConfig, headers=override(struct_hook=_mapping_of(str)))
_structure_fields = make_dict_structure_fn(
    Config,
    converter,
    providers=override(struct_hook=_mapping_of(ProviderConfig)),
    settings=override(struct_hook=lambda value, _: _frozen(value)),
    sections=override(struct_hook=lambda value, _: value),
)


def _structure_config(value: object, _: object) -> Config:
    known: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    errors: list[Exception] = []
    for key, item in _table(value).items():
        if key in _FIELDS:
            known[key] = item
        elif isinstance(item, Mapping):
            try:
                sections[key] = _frozen(item, key)
            except ConfigError as exc:
                errors.append(exc)
        else:
            why = f"unknown top-level key (only tables may be added), got {item!r}"
            errors.append(_ProblemsError([(key, why)]))
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


def _problems(exc: BaseException, path: str) -> Iterator[str]:
    if isinstance(exc, _ProblemsError):
        for sub, msg in exc.problems:
            yield f"{_join(path, sub) or 'config'}: {msg}"
    elif isinstance(exc, ForbiddenExtraKeysError):
        for key in sorted(exc.extra_fields):
            yield f"{path or 'config'}: unknown key {key!r}"
    elif isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for inner, note in with_notes:
            step = note.name if isinstance(note, AttributeValidationNote) else note.index
            yield from _problems(inner, _join(path, step))
        for inner in without:
            yield from _problems(inner, path)
    elif isinstance(exc, KeyError):
        yield f"{path}: is required"
    else:
        yield f"{path or 'config'}: {exc}"


def _read_toml(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid TOML in {path}: {exc}") from None


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
        raise ConfigError(f"invalid config{where}: " + "; ".join(_problems(exc, ""))) from None


def to_mapping(config: Config) -> dict[str, Any]:
    """The config as plain data in TOML's shape, for display; API keys are left out."""
    data: dict[str, Any] = converter.unstructure(config)
    data.update(data.pop("sections", {}))
    return thaw(data)  # type: ignore[no-any-return]
