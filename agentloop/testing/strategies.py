"""Hypothesis strategies for lifecycle races (needs ``hypothesis``, a test dependency).

``operations()`` draws lists of :class:`~agentloop.testing.Operation` values,
``model_scripts()`` lists of model behaviours and ``seeds()`` the seed of trio's scheduling
tie-breaks; hand all three to :func:`run_race`::

    from hypothesis import given
    from agentloop.testing import run_race
    from agentloop.testing import strategies as als

    @given(ops=als.operations(), script=als.model_scripts(), seed=als.seeds())
    def test_my_plugin_survives_races(ops, script, seed):
        run_race(ops, script=script, seed=seed, plugins=[my_plugin])

The draw is biased toward what finds lifecycle races: operations armed to land mid-tool,
mid-stream or inside a synchronous handler at an extension point (:class:`When`), answers to
parked approvals, an approve and a cancel in one tick (:class:`Together`), keep-inbox cancels
behind queued input, closes, resumes, crashes and the passing of virtual time.

Users' own operations join the mix through ``operations(extra=[my_strategy, ...])``: any
strategy of objects with ``async def apply(self, race)`` (see :class:`Operation`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from hypothesis import strategies as st

from ._ops import HOOK_POINTS, POINTS
from ._race import (
    DEFAULT_SCRIPT,
    DEFAULT_TOOLS,
    Advance,
    Approve,
    Behaviour,
    CallTools,
    Cancel,
    Close,
    Crash,
    CreateSameId,
    Deny,
    Edit,
    Exit,
    Fail,
    Followup,
    Hibernate,
    Hold,
    Inject,
    Instant,
    MaxTokens,
    Operation,
    Race,
    Remove,
    Resume,
    Say,
    Settle,
    Spawn,
    Stall,
    Steer,
    Subscribe,
    Think,
    Together,
    Wake,
    When,
    WriteSetting,
    run_race,
)

__all__ = [
    "operations",
    "model_scripts",
    "seeds",
    "OPERATION_KINDS",
    "DEFAULT_KINDS",
    "WEIGHTS",
    "POINTS",
    "DEFAULT_TOOLS",
    "DEFAULT_SCRIPT",
    "run_race",
    "Race",
    "Operation",
    "Instant",
    "Followup", "Steer", "Inject", "Edit", "Remove", "Cancel", "Close", "CreateSameId",
    "WriteSetting", "Advance", "Settle", "Spawn", "Exit", "Approve", "Deny", "Together",
    "When", "Resume", "Subscribe", "Crash", "Hold", "Hibernate", "Wake", "HOOK_POINTS",
    "Behaviour", "Say", "Think", "CallTools", "Fail", "Stall", "MaxTokens",
]

OPERATION_KINDS = (
    "followup", "steer", "inject", "edit", "remove", "cancel", "cancel_keep_inbox", "close",
    "create_same_id", "write_setting", "advance", "settle", "spawn", "exit", "approve", "deny",
    "together", "when", "resume", "subscribe", "crash", "hold", "hibernate", "wake",
)
"""Every built-in operation kind; ``spawn`` acts only where ``ctx.subagents`` exists, and
``exit`` leaves the runtime at once (turns in flight are disposed; later operations skipped);
``hibernate`` and ``wake`` act on agents of a persisted session only."""

DEFAULT_KINDS = tuple(k for k in OPERATION_KINDS if k not in ("exit", "hibernate", "wake"))
"""The kinds drawn by default: all but ``exit`` (after which ``check`` would run mid-turn)
and the hibernation ones (draw them with ``kinds=(*DEFAULT_KINDS, "hibernate", "wake")``)."""

WEIGHTS: Mapping[str, int] = {
    "followup": 4, "steer": 3, "inject": 1, "edit": 1, "remove": 1, "cancel": 2,
    "cancel_keep_inbox": 3, "close": 2, "create_same_id": 1, "write_setting": 1,
    "advance": 3, "settle": 1, "spawn": 1, "exit": 1, "approve": 2, "deny": 1,
    "together": 2, "when": 5, "resume": 1, "subscribe": 1, "crash": 1, "hold": 2,
}
"""How often each kind is drawn relative to the others (an ``extra`` strategy weighs 1)."""

_T = TypeVar("_T")


def _copies(
    n: int, make: Callable[[], st.SearchStrategy[_T]],
) -> list[st.SearchStrategy[_T]]:
    """``n`` equal strategies, each a distinct object: ``one_of`` counts a strategy object
    once however often it is listed, and hypothesis hands back one cached object for equal
    ``builds``/``integers``/... calls, so a weight is made of distinct ``map`` wrappers."""
    return [make().map(_same) for _ in range(n)]


def _same(value: _T) -> _T:
    return value


_TEXT = st.sampled_from(["hi", "go on", "stop that", "why?", "and then"])


def _instant(agents: st.SearchStrategy[int]) -> st.SearchStrategy[Instant]:
    """What lands mid-turn: the run controls and input, the close and the approvals (stops
    drawn most)."""
    return st.one_of(
        *_copies(3, lambda: st.builds(Cancel, agents, st.booleans())),
        *_copies(2, lambda: st.builds(Close, agents)),
        st.builds(Steer, agents, _TEXT),
        st.builds(Followup, agents, _TEXT),
        st.builds(Approve, agents, st.integers(0, 2)),
        st.builds(Deny, agents, st.integers(0, 2)),
        st.builds(Spawn, _TEXT),
    )


# Where a When fires, the points inside tools and streams drawn most.
_POINTS_DRAWN = st.sampled_from([
    "tool-start", "tool-start", "tool-start", "pre-execute", "step-result", "stream", *POINTS,
])
# Where a stop armed before a turn lands: inside its tools and its stream, most of all.
_ARMED_AT = st.sampled_from(
    ["tool-start", "tool-start", "pre-execute", "step-result", "step-result", "stream"]
)
# Where a slow hook holds a turn: between a reply's anchor and its tools, most of all.
_HELD_AT = st.sampled_from(["step-result"] * 12 + list(HOOK_POINTS))
# The kit's tools whose lifecycle matters most (approval, slow cancellation, a sub-agent).
_LIFECYCLE_TOOLS = ("guarded", "slow", "delegate")


def _kind(name: str, agents: st.SearchStrategy[int]) -> st.SearchStrategy[Operation]:
    simple: dict[str, st.SearchStrategy[Operation]] = {
        "followup": st.builds(Followup, agents, _TEXT),
        "steer": st.builds(Steer, agents, _TEXT),
        "inject": st.builds(Inject, agents, _TEXT),
        "edit": st.builds(Edit, agents, st.integers(0, 3), _TEXT),
        "remove": st.builds(Remove, agents, st.integers(0, 3)),
        "cancel": st.builds(Cancel, agents, st.just(False)),
        "cancel_keep_inbox": st.builds(Cancel, agents, st.just(True)),
        "close": st.builds(Close, agents),
        "create_same_id": st.builds(CreateSameId, agents),
        # Zero is invalid: the write is refused and must change nothing.
        "write_setting": st.one_of(
            st.builds(WriteSetting, st.just("agent-loop.max_parallel_tool_calls"),
                      st.integers(0, 4)),
            # Calls parked for approval are denied once it runs out (on the virtual clock).
            st.builds(WriteSetting, st.just("agent-loop.approval_timeout"),
                      st.sampled_from([1.0, 5.0, None, 0])),
        ),
        "advance": st.builds(Advance, st.sampled_from([0.5, 1.0, 2.0, 3.0, 6.0, 40.0])),
        "settle": st.just(Settle()),
        "spawn": st.builds(Spawn, _TEXT),
        "exit": st.just(Exit()),
        "approve": st.builds(Approve, agents, st.integers(0, 2)),
        "deny": st.builds(Deny, agents, st.integers(0, 2)),
        "together": st.builds(lambda a, keep: Together((Approve(a), Cancel(a, keep))),
                              agents, st.booleans()),
        "when": st.builds(When, _POINTS_DRAWN, _instant(agents)),
        "resume": st.builds(Resume, agents),
        "subscribe": st.builds(Subscribe, st.integers(1, 2), st.just(1.0)),
        "crash": st.builds(Crash, st.integers(0, 12)),
        "hold": st.builds(Hold, st.sampled_from(HOOK_POINTS), st.sampled_from([1.0, 2.0])),
        "hibernate": st.builds(Hibernate, agents),
        "wake": st.builds(Wake, agents),
    }
    if name not in simple:
        raise ValueError(f"unknown operation kind {name!r}; known: {', '.join(OPERATION_KINDS)}")
    return simple[name]


def _patterns(agents: int) -> list[st.SearchStrategy[list[Operation]]]:
    """Short sequences on one agent that reach the states where lifecycle races live."""
    time = st.sampled_from([0.5, 1.0, 2.0, 3.0, 6.0, 40.0]).map(Advance)

    def instant_stops(a: int) -> list[st.SearchStrategy[Instant]]:
        return [
            st.builds(Cancel, st.just(a), st.booleans()), st.just(Close(a)), st.just(Close(a)),
            st.builds(lambda keep: Together((Approve(a), Cancel(a, keep))), st.booleans()),
        ]

    def stop(a: int) -> st.SearchStrategy[Operation]:
        return st.one_of(*instant_stops(a), st.just(Crash(0)))

    def queued(a: int) -> st.SearchStrategy[list[Operation]]:
        # Input queued behind a running turn, then a cancel that keeps or drops it.
        return st.builds(lambda second, keep: [Followup(a), second, Cancel(a, keep)],
                         st.sampled_from([Steer(a), Followup(a), Inject(a)]), st.booleans())

    def started(a: int) -> st.SearchStrategy[list[Operation]]:
        # A turn started, time passing into its stream or its tools, then a stop.
        return st.builds(lambda t, s: [Followup(a), t, s], time, stop(a))

    def disposed(a: int) -> st.SearchStrategy[list[Operation]]:
        # A turn started, then its agent closed while the stream or a tool runs.
        return st.builds(lambda t: [Followup(a), Advance(t), Close(a)],
                         st.sampled_from([0.5, 1.0, 2.0, 3.0]))

    def parked(a: int) -> st.SearchStrategy[list[Operation]]:
        # A turn parked on an approval, answered or raced, closed, resumed, answered.
        return st.builds(
            lambda t, answer: [Followup(a), t, *answer, Close(a), Resume(a), Approve(a)],
            time, st.sampled_from([
                [Approve(a), Cancel(a)], [Together((Approve(a), Cancel(a)))],
                [Approve(a), Cancel(a, True)], [Approve(a)], [Deny(a)], [Cancel(a, True)],
            ]),
        )

    def armed(a: int) -> st.SearchStrategy[list[Operation]]:
        # A stop armed at a point of the turn a follow-up then starts: mid-tool, mid-stream,
        # or inside a synchronous handler at an extension point.
        return st.builds(lambda p, s, t: [When(p, s), Followup(a), t], _ARMED_AT,
                         st.one_of(instant_stops(a)), time)

    def answered(a: int) -> st.SearchStrategy[list[Operation]]:
        # A cancel inside the handler of a reply's step result: the turn's work may be done
        # (a reply without calls) before it notices, and still it must not end completed.
        return st.builds(lambda keep, t: [When("step-result", Cancel(a, keep)), Followup(a), t],
                         st.booleans(), time)

    def watched(a: int) -> st.SearchStrategy[list[Operation]]:
        # A slow subscriber, then a burst of input it cannot keep up with.
        return st.just([Subscribe(1, 1.0), Followup(a), Steer(a), Followup(a), Cancel(a)])

    def held(a: int) -> st.SearchStrategy[list[Operation]]:
        # A slow hook at an extension point, and a stop that lands while it waits.
        return st.builds(lambda p, s: [Hold(p, 2.0), Followup(a), Advance(0.5), s],
                         _HELD_AT, stop(a))

    # One strategy per agent, fixed when operations() is built: drawing them anew for each
    # example (a flatmap) cost as much as running it, and shrank poorly.
    # Slow hooks most: a stop that lands between a reply's anchor and its tools needs one.
    return [st.one_of([f(a) for a in range(agents)])
            for f in (queued, queued, started, started, disposed, disposed, parked, parked, armed,
                      armed, answered, answered, held, held, held, held, held, held, watched)]


def operations(
    *,
    agents: int = 2,
    kinds: Iterable[str] = DEFAULT_KINDS,
    extra: Sequence[st.SearchStrategy[Operation]] = (),
    min_size: int = 1,
    max_size: int = 12,
    weights: Mapping[str, int] = WEIGHTS,
    patterns: bool = True,
) -> st.SearchStrategy[list[Operation]]:
    """Lists of operations over ``agents`` agents (by index into the race's handles).

    ``kinds`` narrows the built-in operations (names in :data:`OPERATION_KINDS`), drawn as
    often as ``weights`` says; ``extra`` adds strategies of your own operations. With
    ``patterns`` (and the default kinds) the list is also built from short sequences on one
    agent that reach mid-turn states: queued input then a cancel, a turn started then time
    then a stop, a close while its tools run, a stop armed inside its tools, stream or step
    result, a slow hook with a stop inside it, a parked approval answered, closed and resumed.
    """
    index = st.integers(0, max(agents, 1) - 1)
    kinds = tuple(kinds)
    choices: list[st.SearchStrategy[Operation]] = []
    for k in kinds:
        choices.extend(_copies(max(1, weights.get(k, 1)), functools.partial(_kind, k, index)))
    choices.extend(extra)
    if not choices:
        raise ValueError("operations() needs at least one kind or extra strategy")
    single = st.one_of(choices)
    chunks: list[st.SearchStrategy[list[Operation]]] = []
    if patterns and set(kinds) >= set(DEFAULT_KINDS):
        chunks.extend(_patterns(max(agents, 1)))  # first: hypothesis leans toward early branches
    chunks.extend(_copies(3, lambda: single.map(lambda op: [op])))
    return st.lists(st.one_of(chunks), min_size=1, max_size=max_size).map(
        lambda parts: [op for part in parts for op in part][:max_size]
    ).filter(lambda ops: len(ops) >= min_size)


def model_scripts(
    *,
    tools: Sequence[str] = DEFAULT_TOOLS,
    min_size: int = 1,
    max_size: int = 4,
    failures: bool = True,
) -> st.SearchStrategy[list[Behaviour]]:
    """Scripts of model behaviours: text, reasoning, tool calls of ``tools`` (one or several
    in parallel), provider errors (``failures``), stalls and max-tokens. The model plays one
    per call, cycling. Tool calls and stalls are drawn most, since turns that take time are
    where operations land mid-turn."""
    # The interesting branches first: hypothesis leans toward early ones in small examples.
    def stall() -> st.SearchStrategy[Behaviour]:
        return st.builds(Stall, st.sampled_from([1.0, 2.0, 4.0]), _TEXT)

    options: list[st.SearchStrategy[Behaviour]] = []
    if tools:
        names = st.lists(
            st.sampled_from([*tools, *[t for t in tools if t in _LIFECYCLE_TOOLS] * 2]),
            min_size=1, max_size=3,
        ).map(tuple)
        options.extend(_copies(
            3, lambda: st.builds(CallTools, names, st.sampled_from(["", "let me check"])),
        ))
    options.extend([*_copies(2, stall), st.builds(Say, _TEXT), st.builds(Think, _TEXT, _TEXT),
                    st.builds(MaxTokens, _TEXT)])
    if failures:
        options.append(st.builds(Fail, st.sampled_from([None, 429, 500, 503]),
                                 st.integers(0, 2)))
    return st.lists(st.one_of(options), min_size=min_size, max_size=max_size)


def seeds() -> st.SearchStrategy[int]:
    """Seeds of trio's scheduling tie-breaks (shrinking toward 0)."""
    return st.integers(0, 2**32 - 1)
