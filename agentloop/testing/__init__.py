"""Testing agentloop programs: model doubles, checkers, race runs and persistence conformance.

- Model doubles, usable without any network: ``ScriptedModel`` plays back canned replies,
  ``FunctionModel`` streams whatever a function yields, ``TestModel`` calls every visible tool
  once with schema-valid arguments and then answers. Register one with
  ``ctx.llm.register(name, model)``; each records its requests in ``.requests``.
- ``block_network()``: inside it, any real provider request raises ``ProviderError``.
- Checkers that raise ``AssertionError`` with an explanation: ``check_log`` (a session's
  durable log), ``check_history`` (what OpenAI or Anthropic accept), ``check_inbox`` (every
  accepted message has exactly one fate; ``record_events`` records what it reads).
- ``run_race``: one example of a lifecycle race in a fresh trio run on a virtual clock; the
  hypothesis strategies that draw its operations live in :mod:`agentloop.testing.strategies`
  (the only part of this package that imports hypothesis).
- ``check_persistence_backend``: the conformance check of a ``SessionPersistence`` backend.
- ``record_stream`` / ``replay_stream``: capture a real provider exchange through a loopback
  proxy (credentials scrubbed) and serve it again byte for byte.

See ``docs/testing.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from .._http import blocking_requests
from ._checks import check_history, check_inbox, check_log, record_events
from ._conformance import check_persistence_backend
from ._doubles import (
    Finish,
    FunctionModel,
    ProviderError,
    ReasoningDelta,
    Reply,
    ScriptedModel,
    TestModel,
    TextDelta,
    ToolCallDelta,
    example_arguments,
    reply,
)
from ._race import Operation, Race, RaceModel, register_race_tools, run_race
from ._streams import Exchange, LoopbackServer, Recording, record_stream, replay_stream

__all__ = [
    "ScriptedModel",
    "FunctionModel",
    "TestModel",
    "Reply",
    "reply",
    "example_arguments",
    "TextDelta",
    "ReasoningDelta",
    "ToolCallDelta",
    "Finish",
    "ProviderError",
    "block_network",
    "check_log",
    "check_history",
    "check_inbox",
    "record_events",
    "run_race",
    "Race",
    "Operation",
    "RaceModel",
    "register_race_tools",
    "check_persistence_backend",
    "record_stream",
    "replay_stream",
    "Recording",
    "Exchange",
    "LoopbackServer",
]


@contextlib.contextmanager
def block_network(*, allow: Iterable[str] = ()) -> Iterator[None]:
    """Refuse every real provider request while the block runs.

    Any request an HTTP adapter makes inside (from any task of any trio run in the process,
    including agents started before the block) raises ``ProviderError`` with code
    ``"network_blocked"``, naming the URL it refused. ``allow`` names hosts that stay
    reachable, such as ``"127.0.0.1"`` for loopback servers; requests to them use a fresh
    connection rather than the adapter's own client. Blocks nest: an inner block can only
    narrow what is allowed. Usable inside or outside trio.
    """
    with blocking_requests(frozenset(allow)):
        yield

