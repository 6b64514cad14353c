"""``reasoning_effort`` is validated by the adapter that owns it, with one rule everywhere.

A built adapter refuses a bad default at once, a call with a bad value fails through
``prepare_call`` (``invalid_config``), and a config file with one fails when it is loaded;
each message names the provider, the field and the allowed values.
"""

from __future__ import annotations

from typing import Any

import pytest

import agentloop
from agentloop import CallConfig, ConfigError, load_config
from agentloop.llm import (
    AdapterDefaults,
    AnthropicAdapter,
    OpenAIChatAdapter,
    OpenAIResponsesAdapter,
)

OPENAI = ("none", "minimal", "low", "medium", "high", "xhigh")
ALLOWED = "allowed: none, minimal, low, medium, high, xhigh"
OPENAI_KINDS = [OpenAIChatAdapter, OpenAIResponsesAdapter]


def call(effort: str | None, provider: str = "openai") -> CallConfig:
    return CallConfig(provider=provider, model="m", reasoning_effort=effort)


@pytest.mark.parametrize("kind", OPENAI_KINDS)
@pytest.mark.parametrize(
    "base_url", ["https://api.openai.com/v1", "https://team.openai.azure.com/openai/v1"]
)
def test_openai_hosts_accept_the_documented_values_only(kind: Any, base_url: str) -> None:
    adapter = kind(base_url, api_key="k")
    for effort in (None, *OPENAI):
        adapter.validate(call(effort))
    with pytest.raises(ConfigError) as info:
        adapter.validate(call("extreme", provider="main"))
    message = str(info.value)
    assert message.startswith("provider 'main' (")
    assert "reasoning_effort 'extreme' is not supported" in message
    assert message.endswith(ALLOWED)


def test_openrouter_also_takes_max() -> None:
    adapter = OpenAIChatAdapter("https://openrouter.ai/api/v1", api_key="k")
    adapter.validate(call("max"))
    with pytest.raises(ConfigError, match="allowed: none, minimal, low, medium, high, xhigh, max"):
        adapter.validate(call("maximal"))


@pytest.mark.parametrize("kind", OPENAI_KINDS)
def test_a_compatible_server_keeps_its_own_values(kind: Any) -> None:
    adapter = kind("http://127.0.0.1:8000/v1")
    adapter.validate(call("extreme"))  # vLLM, llama.cpp, a proxy: passed on as given
    restricted = kind("http://127.0.0.1:8000/v1", reasoning_efforts=("low", "high"))
    restricted.validate(call("low"))
    with pytest.raises(ConfigError, match="'medium' is not supported; allowed: low, high"):
        restricted.validate(call("medium"))
    # "any" lifts the known host's set, for a value newer than this package.
    kind("https://api.openai.com/v1", reasoning_efforts="any").validate(call("ultra"))


@pytest.mark.parametrize("kind", OPENAI_KINDS)
def test_a_bad_default_fails_when_the_adapter_is_built(kind: Any) -> None:
    with pytest.raises(ConfigError) as info:
        kind("https://api.openai.com/v1", defaults=AdapterDefaults(reasoning_effort="extreme"))
    assert "https://api.openai.com/v1: defaults: reasoning_effort 'extreme'" in str(info.value)
    assert ALLOWED in str(info.value)
    with pytest.raises(ConfigError, match="reasoning_efforts must be a collection"):
        kind("http://127.0.0.1:1/v1", reasoning_efforts="low")


def test_anthropic_refuses_every_value_and_names_thinking() -> None:
    adapter = AnthropicAdapter("https://api.anthropic.com", api_key="k")
    adapter.validate(CallConfig(provider="claude", model="m", max_tokens=10))
    with pytest.raises(ConfigError) as info:
        adapter.validate(
            CallConfig(provider="claude", model="m", max_tokens=10, reasoning_effort="high")
        )
    message = str(info.value)
    assert message.startswith("provider 'claude' (")
    assert "reasoning_effort 'high'" in message
    assert "'thinking'" in message
    with pytest.raises(ConfigError, match=r"defaults: reasoning_effort 'low'.*'thinking'"):
        AnthropicAdapter("https://api.anthropic.com", defaults=AdapterDefaults(
            reasoning_effort="low"))


# --- from the config file -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"kind": "openai", "base_url": "https://api.openai.com/v1", "reasoning_effort": "x"},
         "providers.p.reasoning_effort: reasoning_effort 'x' is not supported; " + ALLOWED),
        ({"kind": "openai-responses", "base_url": "https://api.openai.com/v1",
          "reasoning_effort": "max"}, "providers.p.reasoning_effort: reasoning_effort 'max'"),
        ({"kind": "anthropic", "base_url": "https://api.anthropic.com",
          "reasoning_effort": "high"}, "providers.p.reasoning_effort: the Anthropic Messages"),
    ],
)
def test_a_provider_entry_with_a_refused_value_fails_when_loaded(
    entry: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"providers": {"p": entry}})
    assert problem in str(info.value)


def test_an_agent_entry_is_checked_against_its_provider() -> None:
    providers = {
        "openai": {"kind": "openai", "base_url": "https://api.openai.com/v1"},
        "local": {"kind": "openai", "base_url": "http://127.0.0.1:8080/v1"},
    }
    with pytest.raises(ConfigError) as info:
        load_config({"providers": providers, "agents": [
            {"id": "a", "provider": "openai", "reasoning_effort": "huge"}]})
    assert "agents[0].reasoning_effort: provider 'openai': reasoning_effort 'huge'" in str(
        info.value
    )
    config = load_config({"providers": providers, "agents": [
        {"id": "a", "provider": "local", "reasoning_effort": "huge"},
        {"id": "b", "provider": "openai", "reasoning_effort": "minimal"},
        {"id": "c", "provider": "elsewhere", "reasoning_effort": "huge"},
    ]})
    assert [a.reasoning_effort for a in config.agents] == ["huge", "minimal", "huge"]


async def test_a_compatible_server_entry_is_served_with_its_value() -> None:
    config = {"providers": {"local": {
        "kind": "openai", "base_url": "http://127.0.0.1:9/v1", "reasoning_effort": "turbo"}}}
    async with agentloop.open_runtime(config) as rt:
        adapter = rt.llm.adapter("local")
        assert adapter is not None
        assert adapter.defaults.reasoning_effort == "turbo"
