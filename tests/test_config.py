from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

import agentloop
from agentloop._config import (
    AgentConfig,
    Config,
    PersistenceConfig,
    ProviderConfig,
    load_config,
    to_mapping,
)
from agentloop._errors import ConfigError
from agentloop._json import FrozenDict

TOML = """
plugins = ["retry", "sqlite"]
system_prompt = "You are terse."

[[agents]]
id = "main"
provider = "oa"
model = "gpt-x"
max_tokens = 512
reasoning_effort = "low"

[[agents]]
id = "helper"
resume_session_id = "old"

[providers.oa]
kind = "openai"
base_url = "https://api.example/v1"
api_key_env = "OA_KEY"
headers = { "X-Team" = "core" }

[persistence]
backend = "sqlite"
path = "sessions.db"

[settings."agent-loop"]
max_parallel_tool_calls = 4

[retry]
max_attempts = 3
codes = [429, 503]

[mcp.servers.fs]
command = "mcp-fs"
"""


def _error(source: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return str(info.value)


def test_none_gives_defaults() -> None:
    config = load_config(None)
    assert config == Config()
    assert config.agents == ()
    assert config.persistence is None
    assert config.section("retry") == {}


def test_config_is_returned_as_is() -> None:
    config = Config(plugins=("retry",))
    assert load_config(config) is config


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "agentloop.toml"
    path.write_text(TOML)
    for source in (path, str(path)):
        config = load_config(source)
        assert config.plugins == ("retry", "sqlite")
        assert config.system_prompt == "You are terse."
        assert config.agents[0] == AgentConfig(
            id="main", provider="oa", model="gpt-x", max_tokens=512, reasoning_effort="low"
        )
        assert config.agents[1].resume_session_id == "old"
        provider = config.providers["oa"]
        assert isinstance(provider, ProviderConfig)
        assert provider.kind == "openai"
        assert provider.headers == {"X-Team": "core"}
        assert config.persistence == PersistenceConfig(backend="sqlite", path="sessions.db")
        assert config.settings["agent-loop"]["max_parallel_tool_calls"] == 4
        assert config.section("retry") == {"max_attempts": 3, "codes": (429, 503)}
        assert config.section("mcp")["servers"]["fs"]["command"] == "mcp-fs"


def test_mapping_matches_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    from_file = load_config(path)
    assert load_config(to_mapping(from_file)) == from_file


def test_sections_and_settings_are_frozen() -> None:
    config = load_config({"retry": {"codes": [429]}, "settings": {"a": {"b": 1}}})
    retry = config.section("retry")
    assert isinstance(retry, FrozenDict)
    assert retry["codes"] == (429,)
    with pytest.raises(TypeError):
        retry["codes"] = ()
    with pytest.raises(TypeError):
        config.settings["a"]["b"] = 2
    with pytest.raises(TypeError):
        config.providers["x"] = None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.plugins = ()  # type: ignore[misc]


def test_field_errors_are_all_reported_with_paths() -> None:
    message = _error(
        {
            "agents": [{"id": "a", "max_tokens": 0}, {"id": "b", "provider": 3}],
            "persistence": {"backend": "mysql", "path": "x"},
        }
    )
    assert "agents[0].max_tokens: must be a positive integer, got 0" in message
    assert "agents[1].provider: expected a string, got 3" in message
    assert "persistence.backend: must be one of 'sqlite', 'postgres', got 'mysql'" in message
    assert "$" not in message


def test_unknown_key_names_its_path_and_the_closest_field() -> None:
    message = _error({"agents": [{"id": "a", "modle": "m"}]})
    assert "agents[0].modle: unknown key; did you mean 'model'?" in message
    message = _error({"persistence": {"backend": "sqlite", "pth": "p", "path": "p"}})
    assert "persistence.pth: unknown key; did you mean 'path'?" in message
    message = _error({"providers": {"x": {"kind": "openai", "base_ulr": "u", "base_url": "https://u"}}})
    assert "providers.x.base_ulr: unknown key; did you mean 'base_url'?" in message


def test_unknown_key_without_a_close_field_lists_the_known_ones() -> None:
    message = _error({"persistence": {"backend": "sqlite", "path": "p", "extra": 1}})
    assert "persistence.extra: unknown key (known: backend, dsn, lease_seconds, path)" in message


def test_unknown_top_level_scalar_is_an_error() -> None:
    message = _error({"plugins": [], "verbose": True})
    assert "verbose: unknown top-level key (a plugin's section is a table)" in message


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"persistance": {"backend": "sqlite", "path": "p"}},
         "persistance: unknown section; did you mean 'persistence'?"),
        ({"plugin": ["retry"]}, "plugin: unknown top-level key; did you mean 'plugins'?"),
        ({"agent": {"id": "a"}}, "agent: unknown section; did you mean 'agents'?"),
        ({"agnets": [{"id": "a"}]}, "agnets: unknown top-level key; did you mean 'agents'?"),
        ({"setings": {"a": {"b": 1}}}, "setings: unknown section; did you mean 'settings'?"),
        ({"system_promt": "terse"},
         "system_promt: unknown top-level key; did you mean 'system_prompt'?"),
    ],
)
def test_top_level_typos_are_refused_with_the_closest_name(source: Any, expected: str) -> None:
    assert expected in _error(source)


def test_plugin_sections_are_kept_whatever_plugins_are_named() -> None:
    tables = {
        "retry": {"max_attempts": 3},
        "mcp": {"separator": "_"},
        "local": {"n_ctx": 512},
        "prompts": {"a": "b"},
        "persist": {"x": 1},
    }
    config = load_config({"plugins": ["retry"], **tables})
    assert config.sections == tables
    assert to_mapping(config) == {"plugins": ["retry"], **tables}


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        ({"id": ""}, "agents[0].id: invalid agent id ''"),
        ({}, "agents[0].id: is required"),
        ({"id": "a", "max_tokens": -1}, "agents[0].max_tokens: must be a positive integer, got -1"),
        ({"id": "a", "max_tokens": True}, "agents[0].max_tokens: expected an integer, got True"),
        ({"id": "a", "max_tokens": "3"}, "agents[0].max_tokens: expected an integer, got '3'"),
        (
            {"id": "a", "reasoning_effort": ""},
            "agents[0].reasoning_effort: must be a non-empty string, got ''",
        ),
        (
            {"id": "a", "session_id": "s", "resume_session_id": "r"},
            "agents[0]: session_id and resume_session_id are mutually exclusive",
        ),
        ("main", "agents[0]: expected a table, got 'main'"),
    ],
)
def test_agent_errors(agent: Any, expected: str) -> None:
    assert expected in _error({"agents": [agent]})


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_tokens: must be a positive integer, got 0"):
        AgentConfig(id="a", max_tokens=0)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        AgentConfig(id="a", session_id="s", resume_session_id="r")
    with pytest.raises(ConfigError, match="max_tokens"):
        ProviderConfig(kind="openai", base_url="https://u", max_tokens=False)


def test_duplicate_agent_ids_name_both_indices() -> None:
    message = _error({"agents": [{"id": "a"}, {"id": "b"}, {"id": "a"}]})
    assert "agents[2].id: duplicates agents[0].id, got 'a'" in message


def test_collection_shapes() -> None:
    message = _error({"plugins": "retry", "agents": {"id": "a"}, "settings": 3})
    assert "plugins: expected an array, got 'retry'" in message
    assert "agents: expected an array, got {'id': 'a'}" in message
    assert "settings: expected a table, got 3" in message


def test_provider_errors() -> None:
    message = _error(
        {"providers": {"oa": {"kind": "azure", "base_url": "https://u", "headers": {"X": 1}},
                       "x": 3}}
    )
    expected = "must be one of 'openai', 'openai-responses', 'anthropic', got 'azure'"
    assert f"providers.oa.kind: {expected}" in message
    assert "providers.oa.headers.X: expected a string, got 1" in message
    assert "providers.x: expected a table, got 3" in message
    assert "providers.y.base_url: is required" in _error({"providers": {"y": {"kind": "openai"}}})


def test_section_values_must_be_json() -> None:
    message = _error({"retry": {"when": datetime.date(2024, 1, 1), "ok": 1}})
    assert "retry.when: date is not JSON-representable" in message
    message = _error({"settings": {"agent-loop": {"x": float("nan")}}})
    assert "settings.agent-loop.x: nan is not a finite number" in message


def test_api_key_not_in_repr_or_mapping() -> None:
    config = load_config(
        {"providers": {"a": {"kind": "anthropic", "base_url": "https://u", "api_key": "sk-SECRET"}}}
    )
    provider = config.providers["a"]
    assert provider.api_key == "sk-SECRET"
    assert "sk-SECRET" not in repr(provider)
    assert "sk-SECRET" not in repr(config)
    assert "api_key" not in to_mapping(config)["providers"]["a"]
    assert to_mapping(config) == {"providers": {"a": {"kind": "anthropic", "base_url": "https://u"}}}


def test_resolve_api_key() -> None:
    explicit = ProviderConfig(kind="openai", base_url="https://u", api_key="k1", api_key_env="KEY")
    from_env = ProviderConfig(kind="openai", base_url="https://u", api_key_env="KEY")
    assert explicit.resolve_api_key({"KEY": "k2"}) == "k1"
    assert from_env.resolve_api_key({"KEY": "k2"}) == "k2"
    assert from_env.resolve_api_key({}) is None
    assert ProviderConfig(kind="openai", base_url="https://u").resolve_api_key({"KEY": "k"}) is None


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    assert str(missing) in _error(str(missing))
    # a str is always a path, never inline TOML
    assert "config file not found" in _error('plugins = ["retry"]')


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('plugins = []\n[[agents]]\nid = "a"\nmax_tokens = = 3\n')
    message = _error(path)
    assert str(path) in message
    assert "line 4" in message


def test_toml_validation_error_names_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[[agents]]\nid = "a"\nmax_tokens = 0\n')
    message = _error(path)
    assert str(path) in message
    assert "agents[0].max_tokens: must be a positive integer, got 0" in message


def test_other_sources_are_rejected() -> None:
    assert "got 42" in _error(42)


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        ({"id": "has space"}, "agents[0].id: invalid agent id 'has space'"),
        ({"id": ".hidden"}, "agents[0].id: invalid agent id '.hidden'"),
        ({"id": "a" * 129}, "agents[0].id: invalid agent id"),
        ({"id": "a", "session_id": "../x"}, "agents[0].session_id: invalid session id '../x'"),
        (
            {"id": "a", "resume_session_id": ""},
            "agents[0].resume_session_id: invalid session id ''",
        ),
    ],
)
def test_bad_agent_and_session_ids_are_config_errors(agent: Any, expected: str) -> None:
    message = _error({"agents": [agent]})
    assert expected in message
    assert "1 to 128 characters" in message


def test_good_ids_pass_and_direct_construction_checks_them() -> None:
    agent = AgentConfig(id="a.b:c-d_1", session_id="s-1")
    assert agent.session_id == "s-1"
    with pytest.raises(ConfigError, match="id: invalid agent id 'has space'"):
        AgentConfig(id="has space")


SECRET = "sk-SECRET-value-42"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"api_key": SECRET}, "api_key: unknown top-level key"),
        ({"providers": {"x": {"kind": "openai", "base_url": "https://u", "api_key": [SECRET]}}},
         "providers.x.api_key: expected a string, got ***"),
        ({"providers": {"x": {"kind": "openai", "base_url": "https://u", "api_key": 1234}}},
         "providers.x.api_key: expected a string, got ***"),
        ({"providers": {"api_key": SECRET}}, "providers.api_key: expected a table, got ***"),
        ({"persistence": {"backend": "sqlite", "path": "p", "api_key": SECRET}},
         "persistence.api_key: unknown key"),
        ({"agents": [{"id": "a", "token": SECRET}]}, "agents[0].token: unknown key"),
        ({"agents": {"id": "a", "password": SECRET}}, "agents: expected an array, got {"),
        ({"providers": {"x": {"kind": "openai", "base_url": "https://u",
                              "headers": {"Authorization": 7, "X-Api-Key": SECRET}}}},
         "providers.x.headers.Authorization: expected a string, got ***"),
        ({"settings": SECRET, "client_secret": SECRET},
         "client_secret: unknown top-level key"),
    ],
)
def test_config_errors_never_echo_a_secret(source: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    assert expected in str(info.value)
    for text in (str(info.value), repr(info.value)):
        assert SECRET not in text
        assert "1234" not in text
    assert info.value.__suppress_context__


def test_a_token_count_is_no_secret() -> None:
    assert "agents[0].max_tokens: must be a positive integer, got 0" in _error(
        {"agents": [{"id": "a", "max_tokens": 0}]}
    )


# --- plugin sections structured by the converter -------------------------------------------


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{attribute.name}: must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class _Server:
    cmd: str
    args: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class _Section:
    max_attempts: int = attrs.field(default=5, validator=_positive_int)
    delay: float = 1.0
    jitter: bool = True
    codes: tuple[int, ...] = ()
    token: str = ""
    servers: tuple[_Server, ...] | Mapping[str, _Server] = ()
    on_error: Callable[[], None] = attrs.field(default=print, metadata={"config": False})


def _section_error(table: Any) -> str:
    config = load_config({"demo": table})
    with pytest.raises(ConfigError) as info:
        config.section("demo", _Section)
    return str(info.value)


def test_section_absent_gives_the_defaults() -> None:
    assert Config().section("demo", _Section) == _Section()


def test_section_is_structured_by_the_converter() -> None:
    config = load_config(
        {"demo": {"max_attempts": 3, "delay": 2, "jitter": False, "codes": [429],
                  "servers": [{"cmd": "a", "args": ["-v"]}]}}
    )
    section = config.section("demo", _Section)
    assert section == _Section(max_attempts=3, delay=2.0, jitter=False, codes=(429,),
                               servers=(_Server(cmd="a", args=("-v",)),))
    assert type(section.delay) is float
    keyed = load_config({"demo": {"servers": {"b": {"cmd": "b"}}}}).section("demo", _Section)
    assert keyed.servers == {"b": _Server(cmd="b")}


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"max_attempts": 0}, "demo.max_attempts: must be a positive integer, got 0"),
        ({"max_attempts": 2.5}, "demo.max_attempts: expected an integer, got 2.5"),
        ({"max_attemps": 3}, "demo.max_attemps: unknown key; did you mean 'max_attempts'?"),
        ({"delay": "1"}, "demo.delay: expected a number, got '1'"),
        ({"delay": True}, "demo.delay: expected a number, got True"),
        ({"jitter": 1}, "demo.jitter: expected true or false, got 1"),
        ({"codes": [1, "2"]}, "demo.codes[1]: expected an integer, got '2'"),
        ({"on_error": "x"}, "demo.on_error: unknown key"),
        ({"servers": [{"cmd": "a"}, {"args": []}]}, "demo.servers[1].cmd: is required"),
        ({"servers": {"b": {"cmd": 3}}}, "demo.servers.b.cmd: expected a string, got 3"),
        ({"servers": ["x"]}, "demo.servers[0]: expected a table, got 'x'"),
        ({"servers": "x"}, "demo.servers: expected an array or a table, got 'x'"),
        ({"token": 12345}, "demo.token: expected a string, got ***"),
    ],
)
def test_section_errors_name_the_path(table: Any, expected: str) -> None:
    message = _section_error(table)
    assert expected in message
    assert "12345" not in message


def test_section_errors_list_every_problem() -> None:
    message = _section_error({"max_attempts": 2.5, "jitter": "no", "extra": 1})
    assert "demo.max_attempts: expected an integer" in message
    assert "demo.jitter: expected true or false" in message
    assert "demo.extra: unknown key" in message


async def test_a_responses_provider_is_registered_from_config() -> None:
    config = {"providers": {"r": {"kind": "openai-responses", "base_url": "http://127.0.0.1:9/v1",
                                  "api_key": "sk-x", "headers": {"api-key": "secret-header"}}}}
    async with agentloop.open_runtime(config) as rt:
        assert type(rt.llm.adapter("r")).__name__ == "OpenAIResponsesAdapter"
    assert "secret-header" not in repr(agentloop.load_config(config))
