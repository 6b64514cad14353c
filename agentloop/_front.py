"""``open_agent``: a runtime with one agent, for the common case, in one ``async with``."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import attrs
import trio

from ._agent import Agent
from ._agents import fresh_session_id
from ._config import Config, load_config, url_problem
from ._context import Context
from ._errors import ConfigError
from ._events import PluginFailed
from ._model import AgentOptions
from ._output import output_spec
from ._runtime import Plugin, open_runtime
from ._tools import Tool, tool_from_function

__all__ = ["open_agent", "KNOWN_PROVIDERS", "KnownProvider"]

log = logging.getLogger("agentloop")

LOCAL_MODEL: Final = "gemma-3-270m"
"""The packaged local model's name, as the ``local`` plugin's server serves it."""

MODEL_OBJECT_PROVIDER: Final = "model"
"""The provider name a model object passed to ``open_agent`` is registered under."""


@attrs.frozen
class KnownProvider:
    """A provider ``open_agent`` can reach from environment variables alone.

    ``base_var`` overrides the endpoint (a proxy, or a compatible server); with it set, a
    missing key is no error: local servers (llama.cpp, Ollama, vLLM) take none.
    """

    name: str
    kind: str  # "openai" (chat completions) or "anthropic"
    base_url: str
    key_var: str | None

    @property
    def base_var(self) -> str:
        return f"{self.name.upper()}_BASE_URL"


KNOWN_PROVIDERS: Final = (
    KnownProvider("openai", "openai", "https://api.openai.com/v1", "OPENAI_API_KEY"),
    KnownProvider("anthropic", "anthropic", "https://api.anthropic.com", "ANTHROPIC_API_KEY"),
    KnownProvider("deepseek", "openai", "https://api.deepseek.com/v1", "DEEPSEEK_API_KEY"),
    KnownProvider("openrouter", "openai", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY"),
    KnownProvider("ollama", "openai", "http://127.0.0.1:11434/v1", None),
)


@attrs.frozen
class _Route:
    provider: str
    model: str
    register: Callable[[Context], object] | None = None
    plugin: str | None = None


def _split(model: str, config: Config) -> tuple[str, str | None]:
    provider, sep, name = model.partition(":")
    if sep and provider and name:
        return provider, name
    if not sep and model in config.providers:
        return model, None  # a configured provider, with its configured model
    raise ConfigError(
        f"open_agent: model must be 'provider:model' (for example 'openai:gpt-4o-mini'), "
        f"got {model!r}"
    )


def _route(model: object, config: Config, environ: Mapping[str, str]) -> _Route:
    """Where the agent's calls go, and what must be registered or loaded for that."""
    if not isinstance(model, str):
        if not callable(getattr(model, "stream", None)):
            raise ConfigError(
                f"open_agent: model must be 'provider:model' or a model object with a "
                f"'stream' method, got {model!r}"
            )
        # ``register`` adopts any object with a ``stream`` method, and says so if it cannot.
        adapter: Any = model
        return _Route(MODEL_OBJECT_PROVIDER, MODEL_OBJECT_PROVIDER,
                      lambda rt: rt.llm.register(MODEL_OBJECT_PROVIDER, adapter))
    if model in ("local", "local:"):
        return _local_route(None)
    provider, name = _split(model, config)
    if provider in config.providers:
        chosen = name or config.providers[provider].model
        if not chosen:
            raise ConfigError(f"open_agent: provider {provider!r} has no model in the config; "
                              f"name one as '{provider}:MODEL'")
        return _Route(provider, chosen)
    if provider == "local":
        return _local_route(name)
    assert name is not None
    for known in KNOWN_PROVIDERS:
        if known.name == provider:
            return _Route(provider, name, _registrar(known, environ))
    names = sorted({*config.providers, "local", *(k.name for k in KNOWN_PROVIDERS)})
    raise ConfigError(
        f"open_agent: unknown provider {provider!r} in {model!r} (known: {', '.join(names)})"
    )


def _local_route(name: str | None) -> _Route:
    # Looked up, not imported: the core never imports a plugin.
    if importlib.util.find_spec("agentloop_local") is None:
        raise ConfigError(
            "open_agent: the local model needs the 'local' extra (pip install 'agentloop[local]')"
        )
    return _Route("local", name or LOCAL_MODEL, plugin="local")


def _registrar(known: KnownProvider, environ: Mapping[str, str]) -> Callable[[Context], object]:
    key = environ.get(known.key_var) if known.key_var else None
    base = environ.get(known.base_var)
    if known.key_var and not key and not base:
        # Failing here names the variable; failing at the first call would name a 401.
        raise ConfigError(
            f"open_agent: provider {known.name!r} needs {known.key_var} in the environment "
            f"(or {known.base_var} for a server that takes no key)"
        )
    problem = url_problem(base) if base else None
    if problem is not None:
        raise ConfigError(f"open_agent: {known.base_var} {problem}")
    url = base or known.base_url

    def register(rt: Context) -> object:
        from .llm import AnthropicAdapter, OpenAIChatAdapter

        cls = AnthropicAdapter if known.kind == "anthropic" else OpenAIChatAdapter
        return rt.llm.register(known.name, cls(url, api_key=key or None))

    return register


def _as_tool(item: object) -> Tool:
    if isinstance(item, Tool):
        return item
    if callable(item):
        return tool_from_function(item)
    raise TypeError(f"open_agent: tools must be agentloop.Tool or functions, got {item!r}")


@contextlib.asynccontextmanager
async def open_agent(
    model: object,
    *,
    instructions: str | None = None,
    tools: Iterable[object] = (),
    output_type: object = None,
    session_id: str | None = None,
    config: Config | str | os.PathLike[str] | Mapping[str, Any] | None = None,
    plugins: Sequence[Plugin | str] = (),
) -> AsyncIterator[Agent]:
    """Open a runtime with one agent; leaving the block disposes both.

    Example::

        async with agentloop.open_agent("openai:gpt-4o-mini", instructions="Be brief.") as agent:
            print((await agent.ask("Why is the sky blue?")).text)

    Args:
        model: ``"provider:model"``: ``openai``, ``anthropic``, ``deepseek``, ``openrouter``
            and ``ollama`` take their key from ``<PROVIDER>_API_KEY`` and their endpoint from
            ``<PROVIDER>_BASE_URL`` (with only the URL set, the server is called without a
            key); ``local`` is the packaged local model (the ``local`` extra); a provider
            named in the config's ``[providers]`` is used as configured (``"name"`` alone
            takes its configured model). A model object (``agentloop.testing.ScriptedModel``,
            any adapter) is used as given.
        instructions: the agent's system prompt.
        tools: :class:`Tool` values (``@agentloop.tool``) or annotated, documented functions;
            they are this agent's (its sub-agents do not see them).
        output_type: the structured output every ``run``/``ask`` asks for unless it names
            its own (an attrs class, a dataclass, a ``TypedDict``, a pydantic ``BaseModel``
            or a JSON-schema dict).
        session_id: the session to create, or to resume when the configured store holds it;
            by default a fresh one.
        config: as for :func:`open_runtime` (a ``Config``, a TOML path or a mapping); its
            ``[[agents]]`` are not started: this agent is the one.
        plugins: more plugins, after the configured ones.

    Raises:
        ConfigError: an unknown provider, a missing key, a malformed ``model``; before any
            runtime starts.
        ToolDefinitionError: a tool function without annotations; ``output_type`` without a
            JSON schema.
    """
    cfg = attrs.evolve(load_config(config), agents=())
    route = _route(model, cfg, os.environ)
    built = [_as_tool(t) for t in tools]
    if output_type is not None:
        output_spec(output_type)  # refused here rather than at the first ask
    options = AgentOptions(provider=route.provider, model=route.model,
                           system_prompt=instructions, output_type=output_type)
    async with _one_agent(cfg, route, options, built, session_id, plugins) as agent:
        yield agent


@contextlib.asynccontextmanager
async def _one_agent(
    cfg: Config, route: _Route, options: AgentOptions, built: list[Tool],
    session_id: str | None, plugins: Sequence[Plugin | str],
) -> AsyncIterator[Agent]:
    failures: list[PluginFailed] = []

    async def watch(ctx: Context) -> None:
        ctx.events.on(PluginFailed, failures.append)
        await trio.lowlevel.checkpoint()

    loaded = [watch, *plugins]
    if route.plugin is not None and route.plugin not in cfg.plugins:
        loaded.append(route.plugin)

    async def setup(ctx: Context) -> None:
        # The agent's own tools: a sub-agent it starts does not inherit them, so a tool that
        # spawns a child cannot be called by that child (recursing to the depth limit).
        for item in built:
            ctx.tools.register(item)
        await trio.lowlevel.checkpoint()

    async with open_runtime(cfg, plugins=loaded) as rt:
        if route.register is not None:
            route.register(rt)
        if route.provider not in rt.llm.providers():
            # The plugin that was to serve it failed (the local model without its extra):
            # refused here, not at the first call as NO_ADAPTER.
            why = "; ".join(f"plugin {f.plugin} failed: {f.error}" for f in failures)
            detail = f" ({why})" if why else ""
            raise ConfigError(f"open_agent: nothing serves provider {route.provider!r}{detail}")
        store = rt.session_persistence
        if session_id is not None and store is not None and await store.exists(session_id):
            handle = await rt.agents.resume(
                resume_session_id=session_id, agent_options=options, setup=setup
            )
        else:
            handle = await rt.agents.create(
                session_id=session_id or fresh_session_id("agent"), agent_options=options,
                setup=setup,
            )
        async with handle:
            yield handle.agent
