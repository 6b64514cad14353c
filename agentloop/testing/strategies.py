"""Hypothesis strategies for lifecycle races (needs ``hypothesis``, a test dependency).

``operations()`` draws lists of :class:`~agentloop.testing.Operation` values and
``model_scripts()`` lists of model behaviours; hand both to :func:`run_race`::

    from hypothesis import given
    from agentloop.testing import run_race
    from agentloop.testing import strategies as als

    @given(ops=als.operations(), script=als.model_scripts())
    def test_my_plugin_survives_races(ops, script):
        run_race(ops, script=script, build=build_with_my_plugin)

Users' own operations join the mix through ``operations(extra=[my_strategy, ...])``: any
strategy of objects with ``async def apply(self, race)`` (see :class:`Operation`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hypothesis import strategies as st

from ._race import (
    DEFAULT_TOOLS,
    Advance,
    Behaviour,
    CallTools,
    Cancel,
    Close,
    CreateSameId,
    Edit,
    Exit,
    Fail,
    Followup,
    Inject,
    MaxTokens,
    Operation,
    Race,
    Remove,
    Say,
    Settle,
    Spawn,
    Stall,
    Steer,
    Think,
    WriteSetting,
    run_race,
)

__all__ = [
    "operations",
    "model_scripts",
    "OPERATION_KINDS",
    "run_race",
    "Race",
    "Operation",
    "Followup", "Steer", "Inject", "Edit", "Remove", "Cancel", "Close", "CreateSameId",
    "WriteSetting", "Advance", "Settle", "Spawn", "Exit",
    "Behaviour", "Say", "Think", "CallTools", "Fail", "Stall", "MaxTokens",
]

OPERATION_KINDS = (
    "followup", "steer", "inject", "edit", "remove", "cancel", "cancel_keep_inbox", "close",
    "create_same_id", "write_setting", "advance", "settle", "spawn", "exit",
)
"""Every built-in operation kind; ``spawn`` acts only where ``ctx.subagents`` exists, and
``exit`` leaves the runtime at once (turns in flight are disposed; later operations skipped)."""

_TEXT = st.sampled_from(["hi", "go on", "stop that", "why?", "and then"])


def _kind(name: str, agents: st.SearchStrategy[int]) -> st.SearchStrategy[Operation]:
    if name == "followup":
        return st.builds(Followup, agents, _TEXT)
    if name == "steer":
        return st.builds(Steer, agents, _TEXT)
    if name == "inject":
        return st.builds(Inject, agents, _TEXT)
    if name == "edit":
        return st.builds(Edit, agents, st.integers(0, 3), _TEXT)
    if name == "remove":
        return st.builds(Remove, agents, st.integers(0, 3))
    if name == "cancel":
        return st.builds(Cancel, agents, st.just(False))
    if name == "cancel_keep_inbox":
        return st.builds(Cancel, agents, st.just(True))
    if name == "close":
        return st.builds(Close, agents)
    if name == "create_same_id":
        return st.builds(CreateSameId, agents)
    if name == "write_setting":
        # Zero is invalid: the write is refused and must change nothing.
        return st.builds(WriteSetting, st.just("agent-loop.max_parallel_tool_calls"),
                         st.integers(0, 4))
    if name == "advance":
        return st.builds(Advance, st.integers(0, 6).map(float))
    if name == "settle":
        return st.just(Settle())
    if name == "spawn":
        return st.builds(Spawn, _TEXT)
    if name == "exit":
        return st.just(Exit())
    raise ValueError(f"unknown operation kind {name!r}; known: {', '.join(OPERATION_KINDS)}")


def operations(
    *,
    agents: int = 2,
    kinds: Iterable[str] = OPERATION_KINDS,
    extra: Sequence[st.SearchStrategy[Operation]] = (),
    min_size: int = 1,
    max_size: int = 14,
) -> st.SearchStrategy[list[Operation]]:
    """Lists of operations over ``agents`` agents (by index into the race's handles).

    ``kinds`` narrows the built-in operations (names in :data:`OPERATION_KINDS`); ``extra``
    adds strategies of your own operations, drawn as often as any built-in kind.
    """
    index = st.integers(0, max(agents, 1) - 1)
    choices = [_kind(k, index) for k in kinds] + list(extra)
    if not choices:
        raise ValueError("operations() needs at least one kind or extra strategy")
    return st.lists(st.one_of(choices), min_size=min_size, max_size=max_size)


def model_scripts(
    *,
    tools: Sequence[str] = DEFAULT_TOOLS,
    min_size: int = 1,
    max_size: int = 4,
    failures: bool = True,
) -> st.SearchStrategy[list[Behaviour]]:
    """Scripts of model behaviours: text, reasoning, tool calls of ``tools``, provider errors
    (``failures``), stalls and max-tokens. The model plays one per call, cycling."""
    options: list[st.SearchStrategy[Behaviour]] = [
        st.builds(Say, _TEXT),
        st.builds(Think, _TEXT, _TEXT),
        st.builds(Stall, st.integers(1, 4).map(float), _TEXT),
        st.builds(MaxTokens, _TEXT),
    ]
    if tools:
        options.append(st.builds(
            CallTools, st.lists(st.sampled_from(list(tools)), min_size=1, max_size=3).map(tuple),
            st.sampled_from(["", "let me check"]),
        ))
    if failures:
        options.append(st.builds(Fail, st.sampled_from([None, 429, 500, 503]),
                                 st.integers(0, 2)))
    return st.lists(st.one_of(options), min_size=min_size, max_size=max_size)
