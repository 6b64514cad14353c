"""``open_runtime``: the supervisor, its services, plugins and configured agents."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import logging
import os
import pkgutil
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import trio

from ._agent import CLOSE_GRACE
from ._agents import Supervisor, fresh_session_id
from ._config import Config, load_config
from ._context import Context
from ._errors import ConfigError, PersistenceError
from ._events import PluginFailed
from ._http import open_shared_client
from ._json import FrozenDict
from ._model import AgentOptions
from ._services import Services

__all__ = ["open_runtime", "Plugin"]

log = logging.getLogger("agentloop")

Plugin = Callable[..., Any]
"""``async def plugin(ctx, task_status=trio.TASK_STATUS_IGNORED)``."""


def _resolve_plugin(spec: object) -> tuple[str, Plugin]:
    if isinstance(spec, str):
        module_name = spec if spec.startswith("agentloop_") else f"agentloop_{spec}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise ConfigError(
                    f"plugins: {spec!r} needs {exc.name!r}, which is not installed"
                ) from exc
            raise ConfigError(
                f"plugins: unknown plugin {spec!r} (no module {module_name!r})"
                + _did_you_mean(spec)
            ) from None
        plugin = getattr(module, "plugin", None)
        if plugin is None:
            raise ConfigError(f"plugins: module {module_name!r} has no 'plugin' entry point")
        return spec, plugin
    if callable(spec):
        return getattr(spec, "__name__", repr(spec)), spec
    raise ConfigError(f"plugins: {spec!r} is neither a plugin name nor a callable")


def _did_you_mean(spec: str) -> str:
    """``"; did you mean 'retry'?"`` from the installed ``agentloop_*`` modules, or ``""``."""
    installed = sorted(
        m.name.removeprefix("agentloop_") for m in pkgutil.iter_modules()
        if m.name.startswith("agentloop_")
    )
    close = difflib.get_close_matches(spec.removeprefix("agentloop_"), installed, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; installed: {', '.join(installed)}" if installed else ""


class _StartedOnce:
    """Wraps a task_status so a plugin that returns or fails without started() still unblocks."""

    def __init__(self, inner: trio.TaskStatus[Any]) -> None:
        self._inner = inner
        self.started_yet = False

    def started(self, value: object = None) -> None:
        if not self.started_yet:
            self.started_yet = True
            self._inner.started(value)


async def _run_plugin(
    rt: Services, name: str, plugin: Plugin, ctx: Context, scope: trio.CancelScope,
    *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    status = _StartedOnce(task_status)
    try:
        with scope:
            params = inspect.signature(plugin).parameters
            if "task_status" in params:
                await plugin(ctx, task_status=status)
            else:
                await plugin(ctx)
            status.started()
            if scope.cancel_called:
                return
            # A plugin that returned keeps its registrations until the runtime closes.
            await trio.sleep_forever()
    except Exception as exc:
        # A misconfigured plugin, or a store that cannot open, must not silently leave the
        # runtime running without it: before started() those fail open_runtime itself.
        fatal = isinstance(exc, (ConfigError, PersistenceError)) and not status.started_yet
        if not fatal:
            log.error("plugin %s failed and was unloaded: %r", name, exc, exc_info=exc)
            rt.emit(PluginFailed(name, exc))
        with trio.move_on_after(CLOSE_GRACE, shield=True):
            await ctx.aclose()
        if fatal:
            raise
        status.started()
    else:
        status.started()


@contextlib.asynccontextmanager
async def open_runtime(
    config: Config | str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    plugins: Sequence[Plugin | str] = (),
) -> AsyncIterator[Context]:
    """Run agentloop inside the calling trio program; yields the root :class:`Context`.

    Starts the supervisor, loads plugins (configured ones first, then ``plugins``), registers
    configured providers, then starts configured agents. Leaving the block disposes every agent
    (to quiescence), then unloads plugins in reverse order.
    """
    cfg = load_config(config)
    specs = [*cfg.plugins, *plugins]
    if os.environ.get("AGENTLOOP_INVARIANTS") and not any(
        s in ("invariants", "agentloop_invariants") for s in specs if isinstance(s, str)
    ):
        # Every runtime of the process checks its requests against the log (CI runs the
        # suite once this way).
        specs.append("invariants")
    if cfg.persistence is not None:
        backend = cfg.persistence.backend
        if not any(s in (backend, f"agentloop_{backend}") for s in specs if isinstance(s, str)):
            specs.insert(0, backend)
    if "fleet" in cfg.sections and not any(
        s in ("fleet", "agentloop_fleet") for s in specs if isinstance(s, str)
    ):
        # The [fleet] table is the fleet plugin's: it checks the table and serves if asked.
        specs.append("fleet")
    resolved = [_resolve_plugin(s) for s in specs]
    services = Services(cfg)
    try:
        async with _supervised(services, Supervisor(services), resolved, cfg) as root:
            yield root
    except BaseExceptionGroup as group:
        # The runtime's nurseries are an implementation detail: one failure is one exception.
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


@contextlib.asynccontextmanager
async def _supervised(
    services: Services, supervisor: Supervisor, resolved: list[tuple[str, Plugin]], cfg: Config
) -> AsyncIterator[Context]:
    async with open_shared_client(), trio.open_nursery() as system:
        services.system_nursery = system
        await system.start(supervisor.run, name="agentloop.supervisor")
        root = Context(services, supervisor, name="root")
        loaded: list[tuple[Context, trio.CancelScope]] = []
        try:
            _register_providers(root, cfg)
            for name, plugin in resolved:
                ctx = root.child(f"plugin:{name}")
                scope = trio.CancelScope()
                loaded.append((ctx, scope))
                await system.start(_run_plugin, services, name, plugin, ctx, scope,
                                   name=f"agentloop.plugin:{name}")
            await _start_configured_agents(services, root, cfg)
            yield root
        finally:
            with trio.CancelScope(shield=True):
                await _shutdown(services, supervisor, root, loaded)
            system.cancel_scope.cancel()


async def _shutdown(
    services: Services, supervisor: Supervisor, root: Context,
    loaded: list[tuple[Context, trio.CancelScope]],
) -> None:
    await services.close_admission()
    async with trio.open_nursery() as nursery:
        for agent in supervisor.all_agents():
            nursery.start_soon(supervisor.dispose, agent)
    for ctx, scope in reversed(loaded):
        scope.cancel()
        await ctx.aclose()
    await root.aclose()
    supervisor.close()


def _register_providers(root: Context, cfg: Config) -> None:
    if not cfg.providers:
        return
    from .llm import AnthropicAdapter, OpenAIChatAdapter, OpenAIResponsesAdapter
    from .llm._base import AdapterDefaults

    kinds: dict[str, type[OpenAIChatAdapter | OpenAIResponsesAdapter | AnthropicAdapter]] = {
        "openai": OpenAIChatAdapter,
        "openai-responses": OpenAIResponsesAdapter,
        "anthropic": AnthropicAdapter,
    }
    for name, provider in cfg.providers.items():
        if provider.kind is None or provider.base_url is None:
            continue  # limits only: the adapter is registered in code
        key = provider.resolve_api_key(os.environ)
        cls = kinds[provider.kind]
        try:
            # Unset values stay unset: the adapter keeps its own fallback for them.
            defaults = AdapterDefaults(
                reasoning_effort=provider.reasoning_effort, max_tokens=provider.max_tokens
            )
            adapter = cls(provider.base_url, api_key=key, headers=dict(provider.headers),
                          defaults=defaults)
        except ConfigError as exc:
            raise ConfigError(f"providers.{name}: {exc}") from None
        root.llm.register(name, adapter)


async def _start_configured_agents(services: Services, root: Context, cfg: Config) -> None:
    for agent_cfg in cfg.agents:
        provider_cfg = cfg.providers.get(agent_cfg.provider) if agent_cfg.provider else None
        options = AgentOptions(
            provider=agent_cfg.provider,
            model=agent_cfg.model or (provider_cfg.model if provider_cfg else None),
            reasoning_effort=agent_cfg.reasoning_effort,
            max_tokens=agent_cfg.max_tokens,
        )
        meta = FrozenDict(cwd=agent_cfg.cwd, label=agent_cfg.id) if agent_cfg.cwd else FrozenDict(
            label=agent_cfg.id
        )
        if agent_cfg.resume_session_id:
            await root.agents.resume(
                resume_session_id=agent_cfg.resume_session_id, agent_options=options
            )
        elif agent_cfg.session_id:
            backend = services.persistence
            if backend is not None and await backend.exists(agent_cfg.session_id):
                await root.agents.resume(
                    resume_session_id=agent_cfg.session_id, agent_options=options
                )
            else:
                await root.agents.create(
                    session_id=agent_cfg.session_id, meta=meta, agent_options=options
                )
        else:
            await root.agents.create(
                session_id=fresh_session_id(agent_cfg.id), meta=meta, agent_options=options
            )
