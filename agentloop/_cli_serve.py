"""``agentloop serve --config FILE``: a serving runtime of a fleet on PostgreSQL.

It opens the runtime of the config with ``[fleet] serve = true`` and serves until SIGTERM or
SIGINT: input routed to any session nobody drives wakes one serving runtime, which drives it
(see ``docs/postgres.md``). Leaving disposes the agents it drives, which releases their leases
for the rest of the fleet at once rather than when they expire.
"""

from __future__ import annotations

import argparse
import signal
from typing import TextIO

import attrs
import trio

from agentloop import FrozenDict, load_config, open_runtime

from ._cli import EXIT_OK, EXIT_USAGE, CliError

__all__ = ["serve"]


async def serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if not args.config:
        raise CliError("serve needs --config FILE with [persistence] backend = \"postgres\"",
                       EXIT_USAGE)
    config = load_config(args.config)
    store = config.persistence
    if store is None or store.backend != "postgres":
        raise CliError(
            f"{args.config}: serve needs [persistence] backend = \"postgres\": the fleet's"
            " runtimes share their sessions through it", EXIT_USAGE,
        )
    fleet = dict(config.sections.get("fleet") or {})
    fleet["serve"] = True
    config = attrs.evolve(config, sections=FrozenDict({**config.sections, "fleet": fleet}))
    # Taken before the runtime opens: a signal during startup still stops it cleanly.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with open_runtime(config):
            # The one line of output: a supervisor knows from it that the runtime serves.
            out.write(f"serving the sessions of {_where(store.dsn)}\n")
            out.flush()
            async for _ in signals:
                break
    return EXIT_OK


def _where(dsn: str | None) -> str:
    from agentloop_postgres import masked_dsn

    return masked_dsn(dsn or "")
