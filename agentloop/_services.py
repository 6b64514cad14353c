"""The runtime's services record: what every layer above is handed, built by ``open_runtime``.

It sits below the agents, the supervisor and the scopes, so each of them is given the services
it uses instead of reaching up for a runtime object: the bus, settings, model and tool
registries, the system prompt, the persistence slot and the leases this runtime holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import trio

from ._bus import Disposer, EventBus
from ._config import CallLimitsConfig, Config, ProviderConfig
from ._errors import PersistenceError, RuntimeClosed
from ._events import Event, SessionEventAppended, SessionFlush, SessionPersistenceFailed
from ._limits import CallLimits, Limit
from ._llm import LLMService, SystemPrompt
from ._prices import load_prices
from ._settings import Settings, flatten_settings
from ._tools import ToolRegistry
from ._util import Latch

if TYPE_CHECKING:
    from ._persistence import SessionPersistence
    from ._session import Session

__all__ = ["LeaseClaim", "Services"]

log = logging.getLogger("agentloop")


class LeaseClaim(Latch):
    """One contender's claim on a session's persistence lease within this runtime.

    The claim is its own latch, ``settled``: a claim outlives its agent's creation (a
    hibernated agent keeps its lease), and agents are many, so it is one small object that
    makes an event only for a contender that waits.
    """

    __slots__ = ("published",)

    def __init__(self) -> None:
        super().__init__()
        self.published = False

    @property
    def settled(self) -> Latch:
        """Set once the creation holding the claim published or rolled back."""
        return self


def _setting_tables(config: Config) -> dict[str, Any]:
    """``[settings]``, plus a top-level ``[agent-loop]`` table: the same keys, spelled as
    ``[agent-loop] crashed_turn = "continue"``."""
    tables = dict(config.settings)
    loop = config.sections.get("agent-loop")
    if isinstance(loop, Mapping):
        inner = tables.get("agent-loop")
        tables["agent-loop"] = {**(inner if isinstance(inner, Mapping) else {}), **loop}
    return tables


def _limits_of(providers: Mapping[str, ProviderConfig]) -> dict[tuple[str, str | None], Limit]:
    """The limits ``[providers.NAME]`` tables set, by (provider, model or ``None``)."""
    found: dict[tuple[str, str | None], Limit] = {}
    for name, provider in providers.items():
        found[(name, None)] = Limit(provider.max_concurrent_calls, provider.max_calls_per_minute)
        for model, route in provider.models.items():
            assert isinstance(route, CallLimitsConfig)
            found[(name, model)] = Limit(route.max_concurrent_calls, route.max_calls_per_minute)
    return found


class Services:
    """The services of one runtime, shared by every scope, agent and plugin in it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.bus = EventBus()
        self.settings = Settings(self.bus, flatten_settings(_setting_tables(config)))
        self.llm = LLMService(self.bus)
        # Shared by every agent of this runtime: limits are per runtime, not per fleet.
        self.limits = CallLimits(_limits_of(config.providers))
        self.tools = ToolRegistry()
        self.prompt = SystemPrompt(config.system_prompt)
        # [prices]: read by the core, not a plugin, since every call's usage carries its cost.
        self.prices = load_prices(config.section("prices"))
        self.persistence: SessionPersistence | None = None
        # Runtime-wide services plugins provide by name (``ctx.invariants``), each owned by
        # the providing scope.
        self.named: dict[str, object] = {}
        # Session ids whose persistence lease this runtime holds or is acquiring, with the
        # token of the holder: one live driver per session, arbitrated before the store.
        self.leases: dict[str, LeaseClaim] = {}
        self.owner_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.system_nursery: trio.Nursery
        self._closing = False
        self._inflight = 0
        self._inflight_done = trio.Event()
        self._inflight_done.set()

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

    async def close_admission(self) -> None:
        """Refuse new agents from now on, and wait for the creations under way to settle."""
        self._closing = True
        await self._inflight_done.wait()

    # --- persistence ---------------------------------------------------------------------

    def flush(self, session_id: str, seq: int) -> Awaitable[None] | None:
        """The commit of ``session_id``'s log up to ``seq`` to await (its agent's flush
        barrier: a tool step, a turn's end and a disposal ask for one), or None when nothing
        stores sessions, as in most runtimes."""
        if self.bus.has_handlers(SessionFlush):
            return self._flush(session_id, seq)
        return None

    async def _flush(self, session_id: str, seq: int) -> None:
        try:
            await self.bus.emit(SessionFlush(session_id, seq))
        except Exception as exc:
            # The store keeps what it can and says so; the session's owner hears it here.
            log.exception("agent %s: flushing up to seq %d failed", session_id, seq)
            self.emit(SessionPersistenceFailed(session_id, seq, str(exc)))

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

    async def attach_persistence(self, session: Session, *, acquire: bool) -> None:
        """Store a synchronously created session (``agent_loop.create``, which cannot await),
        taking its lease first when ``acquire``."""
        backend = self.persistence
        if backend is None:
            return
        if acquire:
            await backend.acquire(session.id, self.owner_id)
        await backend.create(session.id, session.meta)
        for event in session.events:
            backend.append(session.id, event)

    async def release_persistence(self, session_id: str, lease: LeaseClaim | None) -> None:
        backend = self.persistence
        if lease is None or self.leases.get(session_id) is not lease:
            return  # never held it: a loser must not release the winner's lease
        try:
            if backend is not None:
                await backend.release(session_id, self.owner_id)
        except Exception:
            log.exception("agent %s: releasing the session lease failed", session_id)
        finally:
            del self.leases[session_id]
