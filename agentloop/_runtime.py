"""``open_runtime``: the supervisor, its services, plugins and configured agents."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from ._agents import Supervisor, dispose
from ._bus import Disposer, EventBus
from ._config import Config, load_config
from ._context import Context
from ._errors import ConfigError, PersistenceError, RuntimeClosed
from ._events import (
    Event,
    PluginFailed,
    SessionEventAppended,
    SessionFlush,
)
from ._http import open_shared_client
from ._json import FrozenDict
from ._llm import LLMService, SystemPrompt
from ._model import AgentOptions
from ._settings import Settings, flatten_settings
from ._tools import ToolRegistry

if TYPE_CHECKING:
    from ._agent import Agent
    from ._agents import LeaseClaim
    from ._persistence import SessionPersistence
    from ._session import Session

__all__ = ["open_runtime", "Runtime", "Plugin"]

log = logging.getLogger("agentloop")

Plugin = Callable[..., Any]
"""``async def plugin(ctx, task_status=trio.TASK_STATUS_IGNORED)``."""


class Runtime:
    """The supervisor: sole writer of the agent and session registries."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.bus = EventBus()
        self.settings = Settings(self.bus, flatten_settings(config.settings))
        self.llm = LLMService(self.bus)
        self.tools = ToolRegistry()
        self.prompt = SystemPrompt(config.system_prompt)
        self.agents: dict[str, Agent] = {}
        self.sessions: dict[str, Session] = {}
        self.persistence: SessionPersistence | None = None
        # Runtime-wide services plugins provide by name (``ctx.invariants``), each owned by
        # the providing scope.
        self.services: dict[str, object] = {}
        # Session ids whose persistence lease this runtime holds or is acquiring, with the
        # token of the holder: one live driver per session, arbitrated before the store.
        self.leases: dict[str, LeaseClaim] = {}
        self.owner_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._closing = False
        self._inflight = 0
        self._inflight_done = trio.Event()
        self._inflight_done.set()
        self.system_nursery: trio.Nursery
        self.supervisor = Supervisor(self)
        self.root: Context

    def emit(self, event: Event) -> None:
        if self.bus.has_listeners(type(event)):
            self.bus.emit_nowait(event)

    # --- admission of new agents ---------------------------------------------------------

    def check_open(self) -> None:
        if self._closing:
            raise RuntimeClosed("the runtime is shutting down; no new agents can be created")

    @contextlib.contextmanager
    def inflight(self) -> Iterator[None]:
        """Mark a create/resume in progress; shutdown waits for it to settle."""
        self._inflight += 1
        if self._inflight == 1:
            self._inflight_done = trio.Event()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._inflight_done.set()

    # --- persistence ---------------------------------------------------------------------

    def install_persistence(self, backend: SessionPersistence) -> Disposer:
        if self.persistence is not None:
            raise PersistenceError("a session-persistence backend is already installed")
        self.persistence = backend
        on_append = self.bus.on(
            SessionEventAppended, lambda e: backend.append(e.session_id, e.event)
        )

        async def on_flush(e: SessionFlush) -> None:
            await backend.flush(e.session_id, e.seq)

        on_flush_d = self.bus.on(SessionFlush, on_flush)

        def uninstall() -> None:
            on_append()
            on_flush_d()
            if self.persistence is backend:
                self.persistence = None

        return Disposer(uninstall)

    async def attach_persistence(self, agent: Agent) -> None:
        """Run by the driver of a synchronously created agent (``agent_loop.create``, which
        cannot await) before anything else: take the lease and store the new session."""
        backend = self.persistence
        if backend is None:
            return
        session = agent.session
        if agent._needs_lease:
            await backend.acquire(session.id, self.owner_id)
        await backend.create(session.id, session.meta)
        for event in session.events:
            backend.append(session.id, event)

    async def release_persistence(self, agent: Agent) -> None:
        backend = self.persistence
        if agent._lease is None or self.leases.get(agent.id) is not agent._lease:
            return  # never held it: a loser must not release the winner's lease
        try:
            if backend is not None:
                await backend.release(agent.id, self.owner_id)
        except Exception:
            log.exception("agent %s: releasing the session lease failed", agent.id)
        finally:
            del self.leases[agent.id]


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
            raise ConfigError(f"plugins: unknown plugin {spec!r} (no module {module_name!r})")\
                from None
        plugin = getattr(module, "plugin", None)
        if plugin is None:
            raise ConfigError(f"plugins: module {module_name!r} has no 'plugin' entry point")
        return spec, plugin
    if callable(spec):
        return getattr(spec, "__name__", repr(spec)), spec
    raise ConfigError(f"plugins: {spec!r} is neither a plugin name nor a callable")


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
    rt: Runtime, name: str, plugin: Plugin, ctx: Context, scope: trio.CancelScope,
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
        with trio.move_on_after(30, shield=True):
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
    resolved = [_resolve_plugin(s) for s in specs]
    rt = Runtime(cfg)
    try:
        async with _supervised(rt, resolved, cfg) as root:
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
    rt: Runtime, resolved: list[tuple[str, Plugin]], cfg: Config
) -> AsyncIterator[Context]:
    async with open_shared_client(), trio.open_nursery() as system:
        rt.system_nursery = system
        await system.start(rt.supervisor.run, name="agentloop.supervisor")
        root = rt.root = Context(rt, name="root")
        loaded: list[tuple[Context, trio.CancelScope]] = []
        try:
            _register_providers(root, cfg)
            for name, plugin in resolved:
                ctx = root.child(f"plugin:{name}")
                scope = trio.CancelScope()
                loaded.append((ctx, scope))
                await system.start(_run_plugin, rt, name, plugin, ctx, scope,
                                   name=f"agentloop.plugin:{name}")
            await _start_configured_agents(root, cfg)
            yield root
        finally:
            with trio.CancelScope(shield=True):
                await _shutdown(rt, root, loaded)
            system.cancel_scope.cancel()


async def _shutdown(
    rt: Runtime, root: Context, loaded: list[tuple[Context, trio.CancelScope]]
) -> None:
    rt._closing = True
    await rt._inflight_done.wait()
    async with trio.open_nursery() as nursery:
        for agent in list(rt.agents.values()):
            nursery.start_soon(dispose, agent)
    for ctx, scope in reversed(loaded):
        scope.cancel()
        await ctx.aclose()
    await root.aclose()
    rt.supervisor.close()


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


async def _start_configured_agents(root: Context, cfg: Config) -> None:
    from ._agents import fresh_session_id

    rt = root._runtime
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
            backend = rt.persistence
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
