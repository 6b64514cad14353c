"""The retry plugin, end to end: a scripted provider fails, the session log shows what happened.

Every test runs under trio's MockClock with autojump, so backoff waits cost no real time and
``trio.current_time()`` measures exactly how long the plugin waited.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import agentloop_retry
import attrs
import pytest
import trio
import trio.testing
from trio.testing import MockClock

import agentloop
from agentloop import ConfigError, ProviderError
from agentloop.events import AgentRequestError, LlmRetry
from agentloop.testing import Finish, FunctionModel, ScriptedModel, TextDelta

OPTIONS = agentloop.AgentOptions(provider="scripted", model="m")
# Guards are in virtual seconds: a hang autojumps straight to the deadline and fails.
GUARD = 100_000


@attrs.define
class Run:
    """What one driven turn left behind."""

    events: tuple[agentloop.SessionEvent, ...]
    retries: list[LlmRetry]
    retry_times: list[float]
    started: float
    elapsed: float

    def of(self, type_: str) -> list[agentloop.SessionEvent]:
        return [e for e in self.events if e.type == type_]

    @property
    def turn_end(self) -> Mapping[str, Any]:
        return self.of("turn/end")[-1].data

    @property
    def headers(self) -> int:
        return len(self.of("request/header"))

    @property
    def delays(self) -> list[float]:
        return [r.delay for r in self.retries]

    @property
    def answer(self) -> str:
        content = self.of("assistant/message")[-1].data["content"]
        assert isinstance(content, str)
        return content


async def drive(
    plugins: Sequence[Any],
    model: Any,
    config: Any = None,
    *,
    options: agentloop.AgentOptions = OPTIONS,
) -> Run:
    """One prompt through a fresh runtime; returns once the agent is idle again."""
    retries: list[LlmRetry] = []
    times: list[float] = []

    def observe(event: LlmRetry) -> None:
        retries.append(event)
        times.append(trio.current_time())

    async with agentloop.open_runtime(config, plugins=plugins) as rt:
        rt.llm.register("scripted", model)
        rt.events.on(LlmRetry, observe)
        handle = await rt.agents.create(session_id="s1", agent_options=options)
        async with handle:
            agent = handle.agent
            started = trio.current_time()
            with trio.fail_after(GUARD):
                agent.followup("hi")
                await agent.wait_idle()
            elapsed = trio.current_time() - started
            return Run(tuple(agent.session.events), retries, times, started, elapsed)


def seeded(seed: int = 7) -> random.Random:
    return random.Random(seed)


# --- the retry loop -------------------------------------------------------------------------


async def test_transient_failures_are_retried_until_the_call_succeeds(
    autojump_clock: MockClock,
) -> None:
    busy = ProviderError("busy", status=429, retry_after=2.0)
    boom = ProviderError("boom", status=500)
    model = ScriptedModel([busy, boom, "ok"])

    run = await drive([agentloop_retry.retry(base_delay=1.0, rng=seeded())], model)

    assert run.turn_end["reason"] == "completed"
    assert run.answer == "ok"
    assert run.headers == 3
    assert len(model.requests) == 3
    assert [r.attempt for r in run.retries] == [1, 2]
    assert [r.error for r in run.retries] == [busy, boom]
    assert {r.agent_id for r in run.retries} == {"s1"}
    # Full jitter from the injected source; Retry-After is a floor on the first wait.
    twin = seeded()
    first = max(2.0, twin.uniform(0.0, 1.0))
    second = twin.uniform(0.0, 2.0)
    assert run.delays == [first, second]
    assert run.delays[0] >= 2.0
    assert 0.0 <= run.delays[1] <= 2.0
    # Each llm/retry is published before its wait, and the waits are all the time that passed.
    assert run.retry_times == [run.started, pytest.approx(run.started + first)]
    assert run.elapsed == pytest.approx(first + second)


async def test_without_jitter_the_wait_doubles_up_to_max_delay(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("down", status=503)] * 5 + ["ok"])

    run = await drive(
        [agentloop_retry.retry(max_attempts=6, base_delay=1.0, max_delay=4.0, jitter=False)],
        model,
    )

    assert run.turn_end["reason"] == "completed"
    assert run.delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert run.elapsed == pytest.approx(15.0)
    assert run.headers == 6


async def test_retry_after_is_a_lower_bound_on_the_wait(autojump_clock: MockClock) -> None:
    model = ScriptedModel(
        [
            ProviderError("slow down", status=429, retry_after=5.0),
            ProviderError("slow down", status=429, retry_after=0.5),
            "ok",
        ]
    )

    run = await drive([agentloop_retry.retry(base_delay=1.0, jitter=False)], model)

    # Retry 1: 5s asked > 1s backoff. Retry 2: 0.5s asked < 2s backoff, the backoff wins.
    assert run.delays == [5.0, 2.0]
    assert run.elapsed == pytest.approx(7.0)
    assert run.turn_end["reason"] == "completed"


@pytest.mark.parametrize(
    "error",
    [
        ProviderError("bad request", status=400),
        ProviderError("unauthorized", status=401),
        ProviderError("forbidden", status=403),
        ProviderError("no such model", status=404),
        ProviderError("unprocessable", status=422),
        ProviderError("quota", status=429, code="insufficient_quota"),
        ProviderError("garbage", code="malformed_stream"),
    ],
    ids=repr,
)
async def test_permanent_failures_end_the_turn_with_error_at_once(
    error: ProviderError, autojump_clock: MockClock
) -> None:
    model = ScriptedModel([error, "never"])

    run = await drive([agentloop_retry.retry()], model)

    assert run.turn_end["reason"] == "error"
    assert run.turn_end["error"]["status"] == error.status
    assert run.turn_end["error"]["code"] == error.code
    assert run.retries == []
    assert run.headers == 1
    assert model.remaining == 1
    assert run.elapsed == 0


async def test_a_route_without_adapter_is_not_retried(autojump_clock: MockClock) -> None:
    run = await drive(
        [agentloop_retry.retry()],
        ScriptedModel(["never"]),
        options=agentloop.AgentOptions(provider="nowhere", model="m"),
    )

    assert run.turn_end["reason"] == "error"
    assert run.turn_end["error"]["code"] == "NO_ADAPTER"
    assert run.retries == []


async def test_bounded_attempts_give_up_after_max_attempts_calls(autojump_clock: MockClock) -> None:
    errors = [ProviderError(f"boom {i}", status=502) for i in range(1, 6)]
    model = ScriptedModel([*errors, "ok"])

    run = await drive([agentloop_retry.retry(max_attempts=3, jitter=False)], model)

    assert run.turn_end["reason"] == "error"
    assert run.turn_end["error"]["message"] == "boom 3"
    assert len(model.requests) == 3
    assert run.headers == 3
    assert [r.attempt for r in run.retries] == [1, 2]
    assert run.elapsed == pytest.approx(1.0 + 2.0)


async def test_default_policy_makes_five_calls(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("overloaded", status=529)] * 6 + ["ok"])

    run = await drive([agentloop_retry.retry(rng=seeded())], model)

    assert run.turn_end["reason"] == "error"
    assert len(model.requests) == 5
    assert [r.attempt for r in run.retries] == [1, 2, 3, 4]
    ceilings = [1.0, 2.0, 4.0, 8.0]
    assert all(0.0 <= d <= c for d, c in zip(run.delays, ceilings, strict=True))


async def test_max_attempts_zero_retries_without_limit(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("flaky", code="connection_error")] * 20 + ["ok"])

    run = await drive(
        [agentloop_retry.retry(max_attempts=0, base_delay=0.5, max_delay=30.0, rng=seeded())],
        model,
    )

    assert run.turn_end["reason"] == "completed"
    assert run.answer == "ok"
    assert [r.attempt for r in run.retries] == list(range(1, 21))
    assert run.headers == 21
    assert all(0.0 <= r.delay <= min(30.0, 0.5 * 2 ** (r.attempt - 1)) for r in run.retries)
    assert run.elapsed == pytest.approx(sum(run.delays))


async def test_an_incomplete_stream_is_retried(autojump_clock: MockClock) -> None:
    calls = 0

    async def flaky(request: object) -> AsyncIterator[Any]:
        nonlocal calls
        calls += 1
        yield TextDelta("partial ")
        if calls > 1:
            yield TextDelta("answer")
            yield Finish("stop")

    run = await drive([agentloop_retry.retry(jitter=False)], FunctionModel(flaky))

    assert [r.error.code for r in run.retries] == ["incomplete_stream"]
    assert run.turn_end["reason"] == "completed"
    assert run.answer == "partial answer"
    assert run.headers == 2


async def test_cancel_during_the_wait_aborts_the_turn_without_another_call(
    autojump_clock: MockClock,
) -> None:
    model = ScriptedModel([ProviderError("boom", status=500), "ok", "again"])
    waiting = trio.Event()
    retries: list[LlmRetry] = []

    def observe(event: LlmRetry) -> None:
        retries.append(event)
        waiting.set()

    async with agentloop.open_runtime(
        plugins=[agentloop_retry.retry(base_delay=30.0, jitter=False)]
    ) as rt:
        rt.llm.register("scripted", model)
        rt.events.on(LlmRetry, observe)
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        async with handle:
            agent = handle.agent
            started = trio.current_time()
            with trio.fail_after(GUARD):
                agent.followup("hi")
                await waiting.wait()
                # Give the plugin every chance to be parked in its sleep.
                await trio.testing.wait_all_tasks_blocked()
                assert agent.cancel() is True
                await agent.wait_idle()
            # The 30 s wait was interrupted, not served.
            assert trio.current_time() == started
            events = agent.session.events
            ends = [e for e in events if e.type == "turn/end"]
            assert [e.data["reason"] for e in ends] == ["aborted"]
            assert ends[0].data["cause"] == "user"
            assert len(model.requests) == 1
            assert [e.type for e in events].count("request/header") == 1
            assert [r.attempt for r in retries] == [1]

            # Nothing of the cancelled retry leaks into the next turn.
            with trio.fail_after(GUARD):
                agent.followup("again")
                await agent.wait_idle()
            ends = [e for e in agent.session.events if e.type == "turn/end"]
            assert [e.data["reason"] for e in ends] == ["aborted", "completed"]
            assert len(model.requests) == 2
            assert len(retries) == 1


async def test_disposing_the_agent_during_the_wait_ends_the_turn_disposed(
    autojump_clock: MockClock,
) -> None:
    model = ScriptedModel([ProviderError("boom", status=500), "ok"])
    waiting = trio.Event()

    async with agentloop.open_runtime(
        plugins=[agentloop_retry.retry(base_delay=30.0, jitter=False)]
    ) as rt:
        rt.llm.register("scripted", model)
        rt.events.on(LlmRetry, lambda _: waiting.set())
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        agent = handle.agent
        started = trio.current_time()
        with trio.fail_after(GUARD):
            agent.followup("hi")
            await waiting.wait()
            await handle.aclose()
        assert trio.current_time() == started
        ends = [e for e in agent.session.events if e.type == "turn/end"]
        assert [e.data["reason"] for e in ends] == ["disposed"]
        assert len(model.requests) == 1


async def test_a_deciding_handler_of_your_own_is_asked_first(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("boom", status=500), "ok"])
    seen: list[int] = []

    async def give_up(ctx: agentloop.Context) -> None:
        async def decide(event: AgentRequestError) -> object:
            seen.append(event.attempt)
            # Anything that is neither None nor Retry() ends dispatch without a retry.
            return False

        ctx.events.on(AgentRequestError, decide)

    run = await drive([agentloop_retry.retry(), give_up], model)

    assert seen == [1]
    assert run.retries == []
    assert run.turn_end["reason"] == "error"


async def test_a_custom_classification_replaces_is_retryable(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("flaky gateway", status=400), "ok"])

    run = await drive(
        [agentloop_retry.retry(retryable=lambda error: error.status == 400, jitter=False)], model
    )

    assert run.turn_end["reason"] == "completed"
    assert [r.error.status for r in run.retries] == [400]


# --- configuration --------------------------------------------------------------------------


async def test_the_plugin_is_loaded_by_name_and_reads_its_config_table(
    autojump_clock: MockClock,
) -> None:
    model = ScriptedModel([ProviderError("boom", status=500)] * 3 + ["ok"])

    run = await drive(
        [],
        model,
        {"plugins": ["retry"], "retry": {"max_attempts": 2, "base_delay": 3, "jitter": False}},
    )

    assert run.turn_end["reason"] == "error"
    assert len(model.requests) == 2
    assert run.delays == [3.0]
    assert run.elapsed == pytest.approx(3.0)


async def test_the_configured_plugin_defaults_without_a_table(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("boom", status=500)] * 2 + ["ok"])

    run = await drive([], model, {"plugins": ["retry"]})

    assert run.turn_end["reason"] == "completed"
    assert [r.attempt for r in run.retries] == [1, 2]
    assert run.delays[0] <= 1.0
    assert run.delays[1] <= 2.0


async def test_an_invalid_table_fails_the_runtime_start(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("boom", status=500), "ok"])
    with pytest.raises(ConfigError, match=r"retry\.max_attempts: .*-1"):
        await drive(["retry"], model, {"retry": {"max_attempts": -1}})


@pytest.mark.parametrize(
    ("fields", "key", "shown"),
    [
        ({"max_attempts": -1}, "retry.max_attempts", "-1"),
        ({"max_attempts": 2.5}, "retry.max_attempts", "2.5"),
        ({"max_attempts": True}, "retry.max_attempts", "True"),
        ({"max_attempts": "3"}, "retry.max_attempts", "'3'"),
        ({"base_delay": 0}, "retry.base_delay", "0"),
        ({"base_delay": -1.5}, "retry.base_delay", "-1.5"),
        ({"base_delay": math.nan}, "retry.base_delay", "nan"),
        ({"base_delay": False}, "retry.base_delay", "False"),
        ({"max_delay": math.inf}, "retry.max_delay", "inf"),
        ({"max_delay": "60"}, "retry.max_delay", "'60'"),
        ({"base_delay": 5.0, "max_delay": 2.0}, "retry.max_delay", "2.0"),
        ({"jitter": "yes"}, "retry.jitter", "'yes'"),
        ({"jitter": 1}, "retry.jitter", "1"),
        ({"max_attempt": 3}, "retry.max_attempt", "did you mean 'max_attempts'?"),
        ({"rng": 3}, "retry.rng", "unknown key"),
        ({"retryable": "always"}, "retry.retryable", "unknown key"),
    ],
)
def test_invalid_settings_name_the_key_and_the_value(
    fields: dict[str, Any], key: str, shown: str
) -> None:
    config = agentloop.Config(sections=agentloop.FrozenDict(retry=fields))
    with pytest.raises(ConfigError) as info:
        config.section("retry", agentloop_retry.RetryPolicy)
    message = str(info.value)
    assert f"{key}: " in message
    assert shown in message


def test_retry_validates_its_arguments_at_once() -> None:
    with pytest.raises(ConfigError, match=r"^max_attempts: .*got -2"):
        agentloop_retry.retry(max_attempts=-2)
    with pytest.raises(ConfigError, match=r"^base_delay: .*got 0"):
        agentloop_retry.RetryPolicy(base_delay=0)


def test_retry_overrides_fields_of_a_given_policy() -> None:
    base = agentloop_retry.RetryPolicy(max_attempts=2, base_delay=0.25)
    plugin = agentloop_retry.retry(base, jitter=False)
    assert plugin.__name__ == "retry"
    assert "max_attempts=2" in (plugin.__doc__ or "")
    assert "base_delay=0.25" in (plugin.__doc__ or "")
    assert "jitter=False" in (plugin.__doc__ or "")


# --- the policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ProviderError("", status=429), True),
        (ProviderError("", status=408), True),
        (ProviderError("", status=409), True),
        (ProviderError("", status=500), True),
        (ProviderError("", status=503), True),
        (ProviderError("", status=529, code="overloaded_error"), True),
        (ProviderError("", status=599), True),
        (ProviderError("", code="overloaded_error"), True),
        (ProviderError("", code="rate_limit_error"), True),
        (ProviderError("", code="connection_error"), True),
        (ProviderError("", code="timeout"), True),
        (ProviderError("", code="incomplete_stream"), True),
        (ProviderError("", status=400), False),
        (ProviderError("", status=401), False),
        (ProviderError("", status=404), False),
        (ProviderError("", status=413), False),
        (ProviderError("", status=400, code="overloaded_error"), False),
        (ProviderError("", status=429, code="insufficient_quota"), False),
        (ProviderError("", status=302), False),
        (ProviderError("", status=600), False),
        (ProviderError("", code="NO_ADAPTER"), False),
        (ProviderError("", code="INVALID_CONFIG"), False),
        (ProviderError("", code="invalid_config"), False),
        (ProviderError("", code="malformed_stream"), False),
        (ProviderError("", code="invalid_stream"), False),
        (ProviderError("", code="script_exhausted"), False),
        (ProviderError("", code="server_error"), True),
        (
            ProviderError(
                "The model produced output that does not match the expected peg-native format",
                code="server_error",
            ),
            False,
        ),
        (ProviderError(""), False),
    ],
    ids=repr,
)
def test_is_retryable(error: ProviderError, expected: bool) -> None:
    assert agentloop_retry.is_retryable(error) is expected


def test_full_jitter_spans_zero_to_the_ceiling() -> None:
    policy = agentloop_retry.RetryPolicy(base_delay=1.0, max_delay=8.0, rng=seeded(3))
    for retry, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (10, 8.0), (5000, 8.0)]:
        delays = [policy.delay(retry) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        # Spread over the whole range, not clustered at the ceiling.
        assert min(delays) < ceiling * 0.1
        assert max(delays) > ceiling * 0.9


def test_ceiling_never_overflows_in_unbounded_mode() -> None:
    policy = agentloop_retry.RetryPolicy(max_attempts=0, base_delay=2.0, max_delay=45.0)
    assert [policy.ceiling(n) for n in (1, 2, 3, 4, 5, 6)] == [2.0, 4.0, 8.0, 16.0, 32.0, 45.0]
    assert policy.ceiling(10**6) == 45.0
    assert policy.allows(10**6)


def test_unusable_retry_after_values_are_ignored() -> None:
    policy = agentloop_retry.RetryPolicy(base_delay=1.0, jitter=False)
    assert policy.delay(1, -3.0) == 1.0
    assert policy.delay(1, math.nan) == 1.0
    assert policy.delay(1, math.inf) == 1.0
    assert policy.delay(1, 90.0) == 90.0


def test_allows_counts_calls_including_the_first() -> None:
    policy = agentloop_retry.RetryPolicy(max_attempts=3)
    assert [policy.allows(n) for n in (1, 2, 3, 4)] == [True, True, False, False]
    assert not agentloop_retry.RetryPolicy(max_attempts=1).allows(1)


def test_policies_compare_by_settings_not_by_random_source() -> None:
    assert agentloop_retry.RetryPolicy(rng=seeded(1)) == agentloop_retry.RetryPolicy(rng=seeded(2))
    assert agentloop_retry.RetryPolicy(max_attempts=2) != agentloop_retry.RetryPolicy()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        agentloop_retry.RetryPolicy().max_attempts = 3  # type: ignore[misc]


# --- which policy: the registration's, the route's, the default -------------------------------


async def test_the_policy_the_registration_captured_is_carried_and_wins(
    autojump_clock: MockClock,
) -> None:
    captured = agentloop_retry.RetryPolicy(max_attempts=2, base_delay=7.0, jitter=False)
    model = ScriptedModel([ProviderError("boom", status=500)] * 4 + ["ok"])
    model.retry = captured
    seen: list[AgentRequestError] = []
    plugin = agentloop_retry.retry(
        max_attempts=5, jitter=False,
        routes={"scripted": agentloop_retry.RetryPolicy(max_attempts=4, jitter=False)},
    )

    async with agentloop.open_runtime(plugins=[plugin]) as rt:
        rt.llm.register("scripted", model)
        rt.events.on(AgentRequestError, seen.append, priority=1000)
        handle = await rt.agents.create(session_id="s1", agent_options=OPTIONS)
        async with handle:
            with trio.fail_after(GUARD):
                handle.agent.followup("hi")
                await handle.agent.wait_idle()
            ends = [e for e in handle.agent.session.events if e.type == "turn/end"]

    assert ends[-1].data["reason"] == "error"
    assert len(model.requests) == 2
    assert [e.retry_policy for e in seen] == [captured, captured]
    assert all(e.retry_policy is captured for e in seen)
    assert [e.routes for e in seen] == [("scripted:m",), ("scripted:m",)]


async def test_a_route_policy_beats_the_default(autojump_clock: MockClock) -> None:
    model = ScriptedModel([ProviderError("boom", status=500)] * 4 + ["ok"])
    plugin = agentloop_retry.retry(
        max_attempts=5, routes={"scripted": agentloop_retry.RetryPolicy(max_attempts=3)}
    )
    run = await drive([plugin], model)
    assert run.turn_end["reason"] == "error"
    assert len(model.requests) == 3


async def test_route_tables_take_their_unset_keys_from_the_retry_table(
    autojump_clock: MockClock,
) -> None:
    model = ScriptedModel([ProviderError("boom", status=500)] * 4 + ["ok"])
    config = {
        "plugins": ["retry"],
        "retry": {
            "max_attempts": 5, "base_delay": 3, "jitter": False,
            "routes": {"scripted": {"max_attempts": 2}, "other": {"base_delay": 9}},
        },
    }
    run = await drive([], model, config)
    assert run.turn_end["reason"] == "error"
    assert len(model.requests) == 2
    assert run.delays == [3.0]

    other = ScriptedModel([ProviderError("boom", status=500)] * 2 + ["ok"])
    async with agentloop.open_runtime(config) as rt:
        rt.llm.register("other", other)
        handle = await rt.agents.create(
            session_id="s1", agent_options=agentloop.AgentOptions(provider="other", model="m")
        )
        async with handle:
            started = trio.current_time()
            with trio.fail_after(GUARD):
                handle.agent.followup("hi")
                await handle.agent.wait_idle()
            # base_delay 9 from the route table, doubling: 9 + 18.
            assert trio.current_time() - started == pytest.approx(27.0)
    assert len(other.requests) == 3


async def test_a_call_without_a_registration_carries_no_policy(
    autojump_clock: MockClock,
) -> None:
    seen: list[AgentRequestError] = []
    async with agentloop.open_runtime() as rt:
        rt.events.on(AgentRequestError, seen.append)
        handle = await rt.agents.create(
            session_id="s1", agent_options=agentloop.AgentOptions(provider="nowhere", model="m")
        )
        async with handle:
            handle.agent.followup("hi")
            await handle.agent.wait_idle()
    assert [(e.error.code, e.retry_policy) for e in seen] == [("NO_ADAPTER", None)]


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"routes": {"a": {"base_delay": 0}}}, "retry.routes.a.base_delay: must be a positive"),
        ({"routes": {"a": {"max_delay": 0.5}}}, "retry.routes.a.max_delay: must be >= base_delay"),
        ({"routes": {"a": {"max_attempt": 1}}}, "retry.routes.a.max_attempt: unknown key; did"),
        ({"routes": {"a": {"jitter": "x"}}}, "retry.routes.a.jitter: expected true or false"),
        ({"routes": {"a": {"rng": 1}}}, "retry.routes.a.rng: unknown key"),
        ({"routes": 3}, "retry.routes: expected a table"),
        ({"max_attempts": -1}, "retry.max_attempts: must be an integer >= 0"),
    ],
)
async def test_an_invalid_route_table_fails_the_runtime_start(
    table: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        async with agentloop.open_runtime({"plugins": ["retry"], "retry": table}):
            pass
    assert problem in str(info.value)


def test_route_policies_must_be_policies() -> None:
    with pytest.raises(TypeError, match="routes\\['a'\\] must be a RetryPolicy"):
        agentloop_retry.retry(routes={"a": 3})  # type: ignore[dict-item]
