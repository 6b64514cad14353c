"""``run_race`` across a resume and a crash: what ``check`` sees, and what the fresh runtime
has; and what one example costs to set up (a runtime opened per example)."""

from __future__ import annotations

from typing import Any

import certifi
import pytest

import agentloop
from agentloop._http import verifying_context
from agentloop.events import ToolPreExecute
from agentloop.testing import Race, run_race
from agentloop.testing import strategies as als

pytestmark = pytest.mark.usefixtures("quiet_agentloop")


def test_a_session_resumed_after_its_close_is_seen_once() -> None:
    seen: dict[str, Any] = {}

    def check(race: Race) -> None:
        seen["agents"] = [a.id for a in race.agents]
        seen["sessions"] = list(race.sessions)
        seen["turns"] = race.sessions["race-0"].turns
        seen["latest"] = race.sessions["race-0"] is race.handles[-1].agent.session

    ops = [als.Followup(0), als.Settle(), als.Close(0), als.Settle(), als.Resume(0),
           als.Settle(), als.Followup(2)]
    run_race(ops, script=[als.Say("fine")], check=check)
    assert sorted(seen["agents"]) == ["race-0", "race-0", "race-1"], seen
    # One log per session: the resumed agent's, which continues the first agent's turns.
    assert sorted(seen["sessions"]) == ["race-0", "race-1"], seen
    assert seen["latest"] and seen["turns"] == 2, seen


def test_no_message_counts_twice_across_a_resume() -> None:
    def check(race: Race) -> None:
        ids = [e.data["message_id"] for s in race.sessions.values() for e in s.events
               if e.type == "user/message"]
        assert len(ids) == len(set(ids)) == 2, ids

    ops = [als.Followup(0), als.Settle(), als.Close(0), als.Settle(), als.Resume(0),
           als.Settle(), als.Followup(2)]
    run_race(ops, script=[als.Say("fine")], check=check)


def test_build_runs_again_in_the_runtime_a_crash_resumes() -> None:
    built: list[agentloop.Context] = []
    entered: list[tuple[int, str]] = []

    def build(ctx: agentloop.Context) -> None:
        built.append(ctx)
        ctx.events.on(ToolPreExecute, lambda e: entered.append((id(ctx), e.call.id)))

    def check(race: Race) -> None:
        assert len(built) == 2 and race.ctx is built[1], built
        # The hook the second build registered saw the resumed runtime's calls.
        assert [c for who, c in entered if who == id(race.ctx)], entered

    ops = [als.Followup(0), als.Settle(), als.Crash(0), als.Followup(0)]
    run_race(ops, script=[als.CallTools(("fast",)), als.Say()], build=build, check=check)


def test_a_build_that_creates_a_stored_id_again_gets_it_resumed() -> None:
    options = agentloop.AgentOptions(provider="race", model="m")

    async def build(ctx: agentloop.Context) -> agentloop.AgentHandle:
        return await ctx.agents.create(session_id="mine", agent_options=options)

    def check(race: Race) -> None:
        assert [h.agent.id for h in race.handles] == ["mine"]
        assert race.sessions["mine"].turns == 2
        assert any("refused" in n for n in race.notes), race.notes

    ops = [als.Followup(0), als.Settle(), als.Crash(0), als.Followup(0)]
    run_race(ops, script=[als.Say()], build=build, check=check)


def test_every_runtime_shares_one_verifying_tls_context(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    # Loading the CA bundle for each runtime's client made it most of a race example's cost.
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    first = verifying_context()
    assert verifying_context() is first
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    assert verifying_context() is not first


def _drawn(strategy: Any, n: int) -> list[Any]:
    # Seeded: the share of a kind moves by 0.1 from one random search to the next, which is
    # more than the margin a test of the weights can keep.
    from hypothesis import HealthCheck, given, seed, settings

    seen: list[Any] = []

    @seed(20261206)
    @settings(max_examples=n, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(value: Any) -> None:
        seen.append(value)

    draw()
    return seen


def test_the_weights_decide_how_often_each_kind_is_drawn() -> None:
    # hypothesis's one_of counts a strategy object once however often it is listed: weights
    # made by repeating one object were all 1.
    weights = {k: (12 if k == "followup" else 1) for k in ("followup", "steer", "advance")}
    lists = _drawn(als.operations(kinds=weights, weights=weights, max_size=4), 300)
    ops = [op for ops in lists for op in ops]
    followups = sum(isinstance(op, als.Followup) for op in ops)
    assert followups > 0.6 * len(ops), (followups, len(ops))


def test_tool_calls_and_stalls_are_most_of_a_script() -> None:
    # 5 of the 8 weighted options (62%; searches drew 59-72%); with every weight 1 they were
    # 2 of 5 (searches drew 38-46%).
    scripts = _drawn(als.model_scripts(failures=False), 500)
    drawn = [b for script in scripts for b in script]
    slow = sum(isinstance(b, (als.CallTools, als.Stall)) for b in drawn)
    assert slow > 0.52 * len(drawn), (slow, len(drawn))


@pytest.mark.parametrize("first", ["close", "spawn"])
def test_a_spawn_refused_by_a_parent_closed_in_the_same_tick_is_not_a_failure(
    first: str,
) -> None:
    close = als.When("tool-start", als.Close(0))
    spawn = als.When("tool-start", als.Spawn("x"))
    armed = [close, spawn] if first == "close" else [spawn, close]
    run_race([*armed, als.Followup(0), als.Advance(6.0)],
             script=[als.CallTools(("delegate",))])


@pytest.mark.parametrize(
    ("ops", "hooked"),
    [
        ([als.Followup(0)], False),
        ([als.When("pre-execute", als.Cancel(0)), als.Followup(0)], True),
        ([als.Together((als.When("pre-execute", als.Cancel(0)),)), als.Followup(0)], True),
    ],
    ids=["no-point-named", "when", "when-in-together"],
)
def test_the_kit_hooks_in_only_where_the_operations_name_a_point(
    ops: list[Any], hooked: bool
) -> None:
    """A race whose operations name no extension point leaves them free, so its steps take
    the paths an application without hooks runs (the scheduler's plain pass)."""
    seen: list[bool] = []

    def check(race: Race) -> None:
        # The kit's pre-execute handler counts the calls it sees on the race's probe.
        seen.append(race.probe.reached.get("pre-execute", 0) > 0)

    run_race(ops, script=[als.CallTools(("fast",)), als.Say("done")], check=check)
    assert seen == [hooked]
