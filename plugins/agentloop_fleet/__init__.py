"""A serving fleet on PostgreSQL: runtimes that drive whichever sessions receive input.

Enable it with config ``[fleet] serve = true`` beside ``[persistence] backend = "postgres"``
(the runtime then loads this plugin), or run ``agentloop serve --config FILE``. Every serving
runtime of one database shares the work: input routed to a session nobody drives
(``ctx.sessions.send``) wakes one of them, which resumes the session (crash recovery first),
drives it, and lets it go once it has been idle for ``idle_seconds``. PostgreSQL does the
coordination: ``LISTEN/NOTIFY`` wakes the runtimes, ``FOR UPDATE SKIP LOCKED`` hands each
session to one of them, and the store's fenced leases keep one driver per session; a serving
runtime that dies leaves its leases to expire, and another takes its sessions over.
"""

from __future__ import annotations

import math

import attrs
import trio

from agentloop import ConfigError, Context

from ._server import FleetServer, RetireIdle, release_idle

__all__ = ["FleetConfig", "FleetServer", "RetireIdle", "release_idle", "plugin"]


def _problem(name: str, value: object, *, integer: bool = False) -> str | None:
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return f"{name}: must be a positive integer, got {value!r}"
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value > 0 and math.isfinite(value)
    )
    return None if ok else f"{name}: must be a positive number of seconds, got {value!r}"


@attrs.frozen(kw_only=True)
class FleetConfig:
    """The ``[fleet]`` table: whether this runtime serves, and how.

    ``serve``: claim and drive sessions that receive routed input while nobody drives them.
    ``idle_seconds``: a driven session idle this long is let go (its lease released).
    ``max_sessions``: sessions this runtime drives at once; beyond, it leaves work to others.
    ``recheck_seconds``: the bounded fallback, a look for unclaimed work this often even
    without a notification (one missed while the listening connection was down, a lease that
    expired). ``provider`` and ``model``: what claimed sessions are driven with (default: the
    session's last request's).
    """

    serve: bool = False
    idle_seconds: float = 60.0
    max_sessions: int = 1000
    recheck_seconds: float = 5.0
    provider: str | None = None
    model: str | None = None

    def __attrs_post_init__(self) -> None:
        problems = [
            _problem("idle_seconds", self.idle_seconds),
            _problem("max_sessions", self.max_sessions, integer=True),
            _problem("recheck_seconds", self.recheck_seconds),
        ]
        for name in ("provider", "model"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                problems.append(f"{name}: must be a non-empty string, got {value!r}")
        # The first problem, named by its field (placed under [fleet] by the loader).
        found = next((p for p in problems if p is not None), None)
        if found is not None:
            raise ConfigError(found)


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form: serves when ``[fleet] serve = true``, on the PostgreSQL store."""
    cfg = ctx.config.section("fleet", FleetConfig)
    if not cfg.serve:
        task_status.started()
        return
    # Imported only to serve: a runtime that does not serve needs no psycopg.
    from agentloop_postgres import PostgresSessionStore

    store = ctx.session_persistence
    if not isinstance(store, PostgresSessionStore):
        raise ConfigError(
            'fleet.serve: a serving fleet needs [persistence] backend = "postgres"'
            f" (the store here is {type(store).__name__ if store is not None else 'none'})"
        )
    await FleetServer(ctx, store, cfg).run(task_status=task_status)
