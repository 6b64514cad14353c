"""PostgreSQL session persistence for agentloop, shared by many runtimes on many hosts.

Enable it with config ``[persistence] backend = "postgres", dsn = "postgresql://..."`` (the
runtime then loads this plugin), or programmatically with
``open_runtime(plugins=[postgres(dsn)])``. Install it with the ``postgres`` extra.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

import trio

from agentloop import ConfigError, Context

from ._router import delivered_ids, listen, route_inbox
from ._store import (
    DEFAULT_LEASE_SECONDS,
    INBOX_CHANNEL,
    SCHEMA_VERSION,
    PostgresSessionStore,
    Routed,
    StoreStats,
    masked_dsn,
)

__all__ = [
    "PostgresSessionStore",
    "StoreStats",
    "Routed",
    "INBOX_CHANNEL",
    "route_inbox",
    "delivered_ids",
    "listen",
    "SCHEMA_VERSION",
    "DEFAULT_LEASE_SECONDS",
    "masked_dsn",
    "plugin",
    "postgres",
]


def postgres(
    dsn: str, *, lease_seconds: float = DEFAULT_LEASE_SECONDS, route: bool = True
) -> Callable[..., Coroutine[Any, Any, None]]:
    """A plugin that stores every session in the PostgreSQL database at ``dsn``.

    With ``route``, input sent with :meth:`PostgresSessionStore.send` from any runtime is
    delivered to the agents this runtime drives (see :func:`route_inbox`).
    """

    async def postgres_persistence(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with (
            PostgresSessionStore(dsn, lease_seconds=lease_seconds) as store,
            trio.open_nursery() as nursery,
        ):
            ctx.provide_persistence(store)
            if route:
                await nursery.start(functools.partial(
                    route_inbox, ctx, store, sweep_every=max(1.0, lease_seconds / 3)
                ))
            task_status.started()
            # Alive until unload; agents are disposed (and flushed) before plugins unload.
            await trio.sleep_forever()

    postgres_persistence.__qualname__ = f"postgres({masked_dsn(dsn)!r})"
    return postgres_persistence


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form: reads ``[persistence]`` from the runtime's config."""
    cfg = ctx.config.persistence
    if cfg is None or not cfg.dsn:
        raise ConfigError('persistence: the postgres plugin needs [persistence] dsn = "..."')
    await postgres(cfg.dsn, lease_seconds=cfg.lease_seconds)(ctx, task_status=task_status)
