"""Checks on what callers hand the runtime, made before anything is accepted.

Each returns nothing or raises :class:`~agentloop.InvalidContent` naming the bad value, so
that a bad prompt, seed or ``meta`` is refused at the call that brought it, not later by a
provider (which would refuse every request after it: the session would be bricked).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._bus import EventBus
from ._errors import InvalidContent, PersistenceError
from ._json import FrozenDict
from ._model import Content, SessionEvent
from ._session import Session

__all__ = ["check_meta", "check_prompt", "check_seed"]


def check_prompt(content: Content, what: str = "content") -> None:
    """Refuse a prompt with nothing in it: ``""``, blank text, ``[]``, or a blank text part.

    Anthropic refuses an empty or blank text block, OpenAI an empty content list; either
    way the message would be resent with every later request.
    """
    if isinstance(content, str):
        if not content.strip():
            raise InvalidContent(f"{what}: the prompt is empty ({content!r}); send some text")
        return
    if not content:
        raise InvalidContent(f"{what}: the prompt is an empty list of parts; send some text")
    for i, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidContent(
                    f"{what}[{i}].text: a text part needs a string, got {text!r}"
                )
            if not text.strip():
                raise InvalidContent(
                    f"{what}[{i}].text: the text part is empty ({text!r}); providers refuse it"
                )


def check_meta(meta: FrozenDict) -> None:
    """``meta["depth"]``, when given, must be a non-negative integer: a negative one would
    lift ``subagents.max_depth`` for the whole tree below."""
    if "depth" not in meta:
        return
    depth = meta["depth"]
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise InvalidContent(
            f"meta['depth']: must be a non-negative integer (the agent's depth in its "
            f"tree, 0 for a top-level agent), got {depth!r}"
        )


def check_seed(events: Sequence[SessionEvent]) -> None:
    """A seed must be a well-formed log prefix that ends at a turn boundary.

    Each event is folded as a stored log would be (so an event lacking what its type
    requires is named here, as ``seed[i]``), turns must not nest, and the last turn must
    be closed: a prefix cut mid-turn would leave a request no provider accepts.
    """
    probe = Session("seed", FrozenDict(), EventBus())
    open_at: tuple[int, Any] | None = None
    for i, event in enumerate(events):
        if event.type == "turn/start":
            if open_at is not None:
                raise InvalidContent(
                    f"seed[{i}]: turn/start (turn {event.turn!r}) inside turn "
                    f"{open_at[1]!r}, opened at seed[{open_at[0]}] and never ended"
                )
            open_at = (i, event.turn)
        elif event.type == "turn/end":
            if open_at is None:
                raise InvalidContent(f"seed[{i}]: turn/end without a turn/start before it")
            open_at = None
        try:
            probe.load([event])
        except PersistenceError as exc:
            cause = str(exc).split(" is malformed: ", 1)[-1]
            raise InvalidContent(
                f"seed[{i}] ({event.type}): malformed event data: {cause}"
            ) from None
    if open_at is not None:
        raise InvalidContent(
            f"seed: ends inside turn {open_at[1]!r} (its turn/start is seed[{open_at[0]}] "
            f"and it has no turn/end); fork at a turn boundary, e.g. seed[:{open_at[0]}]"
        )
