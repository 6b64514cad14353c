"""The shape of a plugin, for ``open_runtime(plugins=[...])`` and ``plugins = [...]`` alike."""

from __future__ import annotations

from typing import Protocol

import trio

from ._context import Context

__all__ = ["Plugin"]


class Plugin(Protocol):
    """An async callable the runtime runs in a scope of its own until the runtime closes.

    It registers what it offers on ``ctx`` (tools, providers, handlers; each is undone when
    its scope closes), calls ``task_status.started()`` once that is done (the runtime waits for
    it before starting configured agents), then returns or keeps running. A
    :class:`~agentloop.ConfigError` raised before ``started()`` fails ``open_runtime``; any
    other failure unloads just this plugin and is reported as ``plugin/failed``.

    A module ``agentloop_NAME`` offers one as ``plugin``, loaded for ``plugins = ["NAME"]``;
    it reads its ``[NAME]`` table with :meth:`agentloop.Config.section`.
    """

    async def __call__(
        self, ctx: Context, /, *, task_status: trio.TaskStatus[None] = ...
    ) -> None: ...
