"""Hypothesis properties over lifecycle and inbox races, written on ``agentloop.testing``.

Each example is one ``run_race`` (a fresh ``trio.run`` on a MockClock); the kit's built-in
checks (log, history for both providers, inbox fates) run on every example, and each
property adds what it is about.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import agentloop
from agentloop import events as ev
from agentloop.testing import Race, register_race_tools, run_race
from agentloop.testing import strategies as als

# Slow: hypothesis searches over whole runtimes.
pytestmark = pytest.mark.slow

LEGAL = {("idle", "running"), ("running", "idle"), ("idle", "disposed"), ("running", "disposed")}
OPTIONS = agentloop.AgentOptions(provider="race", model="m")


@attrs.frozen
class ProjectionMatchesSplices:
    """A user operation: replaying every splice reproduces each pending list right now."""

    splices: list[ev.InboxSpliced] = attrs.field(eq=False, repr=False)

    async def apply(self, race: Race) -> None:
        for h in race.handles:
            agent = h.agent
            for target, pending in (("next-turn", agent.inbox.next_turn),
                                    ("next-step", agent.inbox.next_step)):
                replayed: list[agentloop.InboxMessage] = []
                for s in self.splices:
                    if s.list == target and s.agent_id == agent.id:
                        replayed[s.index: s.index + s.delete_count] = list(s.inserted)
                assert tuple(replayed) == pending, (agent.id, target, replayed, pending)


INBOX_KINDS = ("followup", "steer", "inject", "edit", "remove", "cancel", "cancel_keep_inbox",
               "advance", "settle", "write_setting")


@settings(max_examples=examples(6))
@given(ops=als.operations(agents=1, kinds=INBOX_KINDS), script=als.model_scripts())
def test_every_accepted_message_has_exactly_one_fate(
    ops: list[als.Operation], script: list[als.Behaviour]
) -> None:
    splices: list[ev.InboxSpliced] = []
    claimed: list[str] = []
    transitions: list[tuple[str, str]] = []

    async def build(ctx: agentloop.Context) -> list[agentloop.AgentHandle]:
        register_race_tools(ctx)
        ctx.events.on(ev.InboxSpliced, splices.append)
        # Only this agent's claims: the kit's delegate tool makes sub-agents, which claim too.
        ctx.events.on(
            ev.InboxClaimed, lambda e: claimed.append(e.message.id) if e.agent_id == "p" else None
        )
        ctx.events.on(ev.AgentStatus, lambda e: transitions.append((e.previous, e.status)))
        return [await ctx.agents.create(session_id="p", agent_options=OPTIONS)]

    def check(ctx: agentloop.Context, handles: Sequence[agentloop.AgentHandle]) -> None:
        agent = handles[0].agent
        logged = [e.data["message_id"] for e in agent.session.events
                  if e.type in ("user/message", "steering/message")]
        assert logged == claimed, "the log records claims in the order they happened"
        assert set(transitions) <= LEGAL, transitions

    checked = ProjectionMatchesSplices(splices)
    run_race([x for op in ops for x in (op, checked)], build=build, check=check, script=script)


# --- lifecycle: creation through owners, failing and cancelled setups, closing owners ---------


@attrs.frozen
class CreateThrough:
    """Start a create through owner ``owner`` whose setup waits ``delay`` and maybe fails."""

    owner: int
    sid: str
    mode: str  # "ok" | "failing" | "cancelled"
    delay: int

    async def apply(self, race: Race) -> None:
        owner = _owner(race, self.owner)
        mode, delay = self.mode, self.delay

        async def setup(ctx: agentloop.Context) -> None:
            await trio.sleep(delay)
            if mode == "failing":
                raise ValueError("setup failed")

        async def create() -> None:
            try:
                with trio.move_on_after(1 if mode == "cancelled" else 1e9):
                    h = await owner.agents.create(session_id=self.sid, agent_options=OPTIONS,
                                                  setup=setup)
                    race.handles.append(h)
            except (ValueError, agentloop.SessionIdInUse, agentloop.RuntimeClosed,
                    agentloop.AgentDisposed, RuntimeError):
                pass

        race.nursery.start_soon(create)


@attrs.frozen
class CloseOwner:
    """Start closing owner ``owner``: every agent it created is disposed with it."""

    owner: int

    async def apply(self, race: Race) -> None:
        race.nursery.start_soon(_owner(race, self.owner).aclose)


@attrs.frozen
class RegistryHasNoDuplicates:
    async def apply(self, race: Race) -> None:
        ids = [a.id for a in race.ctx.agents.list()]
        assert len(ids) == len(set(ids)), f"an id is registered twice: {ids}"


def _owner(race: Race, index: int) -> agentloop.Context:
    owners: dict[int, agentloop.Context] = race.state.setdefault("owners", {})
    if index not in owners:
        owners[index] = race.ctx.child(f"owner-{index}")
    return owners[index]


lifecycle_ops = als.operations(
    kinds=("followup", "cancel", "close", "create_same_id", "advance"),
    extra=[
        st.builds(CreateThrough, st.integers(0, 1), st.sampled_from(["x", "y"]),
                  st.sampled_from(["ok", "ok", "failing", "cancelled"]), st.integers(0, 2)),
        st.builds(CloseOwner, st.integers(0, 1)),
    ],
    max_size=12,
)


@settings(max_examples=examples(6))
@given(ops=lifecycle_ops, script=als.model_scripts(failures=False))
def test_lifecycle_interleavings_keep_the_registry_and_pairing_sound(
    ops: list[als.Operation], script: list[als.Behaviour]
) -> None:
    trace: list[tuple[str, str]] = []

    def build(ctx: agentloop.Context) -> list[agentloop.AgentHandle]:
        register_race_tools(ctx)
        for cls in (ev.AgentCreated, ev.AgentDisposed, ev.AgentStatus, ev.InboxInserted,
                    ev.InboxClaimed):
            ctx.events.on(cls, lambda e, name=cls.name: trace.append((name, e.agent_id)))
        ctx.events.on(ev.SessionEventAppended,
                      lambda e: trace.append(("session/event", e.session_id)))
        return []

    checked = RegistryHasNoDuplicates()
    run_race([x for op in ops for x in (op, checked)], build=build, script=script)
    # Every created agent was disposed exactly once, and nothing of it happened outside its
    # lifetime (the runtime has closed, so every lifetime has ended).
    created: dict[str, int] = {}
    for name, who in trace:
        if name == "agent/created":
            created[who] = created.get(who, 0) + 1
            assert created[who] == 1, f"{who} published twice while live"
        elif name == "agent/disposed":
            assert created.get(who) == 1, f"{who} disposed without being created"
            created[who] = 0
        else:
            assert created.get(who) == 1, f"{name} for {who} outside its lifetime"
    assert all(n == 0 for n in created.values()), created


# --- everything at once: the kit's whole default mix over two agents --------------------------


@settings(max_examples=examples(6))
@given(ops=als.operations(), script=als.model_scripts())
def test_any_mix_of_operations_and_model_behaviours_keeps_every_invariant(
    ops: list[als.Operation], script: list[als.Behaviour]
) -> None:
    seen: dict[str, Any] = {}

    def check(ctx: agentloop.Context, handles: Sequence[agentloop.AgentHandle]) -> None:
        # A turn blocked on approvals (the kit's guarded tool) is a quiescent state too.
        seen["statuses"] = {
            h.agent.status for h in handles
            if not (h.agent.status == "running" and h.agent.pending_approvals)
        }

    run_race(ops, script=script, check=check)
    if not any(isinstance(op, als.Exit) for op in ops):
        assert seen["statuses"] <= {"idle", "disposed"}, "quiescence means no agent is running"
