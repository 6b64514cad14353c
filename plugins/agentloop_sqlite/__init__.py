"""Embedded SQLite session persistence for agentloop.

Enable it with config ``[persistence] backend = "sqlite", path = "sessions.db"`` (the runtime
then loads this plugin), or programmatically with ``open_runtime(plugins=[sqlite(path)])``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine
from typing import Any

import trio

from agentloop import ConfigError, Context

from ._store import SqliteSessionStore, validate_session_id

__all__ = ["SqliteSessionStore", "validate_session_id", "plugin", "sqlite", "default_path"]


def default_path() -> str:
    """The command line's default store: ``$XDG_DATA_HOME/agentloop/sessions.db``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(base, "agentloop", "sessions.db")


def sqlite(
    path: str | os.PathLike[str],
) -> Callable[..., Coroutine[Any, Any, None]]:
    """A plugin that stores every session in the SQLite file at ``path``."""

    async def sqlite_persistence(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with SqliteSessionStore(path) as store:
            ctx.provide_persistence(store)
            task_status.started()
            # Alive until unload; agents are disposed (and flushed) before plugins unload.
            await trio.sleep_forever()

    return sqlite_persistence


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form: reads ``[persistence]`` from the runtime's config."""
    cfg = ctx.config.persistence
    if cfg is None:
        raise ConfigError("persistence: the sqlite plugin needs [persistence] path = \"...\"")
    await sqlite(cfg.path)(ctx, task_status=task_status)
