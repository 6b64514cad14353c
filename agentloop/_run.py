"""Run handles: reading one turn of an agent back, losslessly, from its durable log."""

from __future__ import annotations

__all__ = ["RunControls"]


class RunControls:
    """The run-handle methods of :class:`agentloop.Agent` (``run``, ``ask``)."""

    __slots__ = ()
