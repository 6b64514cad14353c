"""A serving fleet on PostgreSQL (``[fleet] serve = true``, ``agentloop serve``).

Against the throwaway cluster of ``test_postgres.py`` (skipped with its reason without server
binaries or psycopg). A "front" runtime creates sessions and routes input to them with
``ctx.sessions.send``; serving runtimes, in this process or as real ``agentloop serve``
processes, pick them up, drive them and let them go.
"""

# The cluster, schema and dsn fixtures come from test_postgres: tests name them as parameters.
# ruff: noqa: F811

from __future__ import annotations

import collections
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

psycopg = pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")

from agentloop_fleet import FleetConfig
from agentloop_postgres import PostgresSessionStore
from conftest import OPTIONS, check_log_invariants, ready_child
from fake_openai import Reply
from test_postgres import (  # noqa: F401 - fixtures
    PASSWORD,
    Cluster,
    cluster,
    dsn,
    epochs_going_back,
    schema,
    sql,
)

import agentloop
from agentloop import ConfigError, SessionEvent
from agentloop.events import AgentCreated, AgentDisposed, AgentTurnEnd
from agentloop.testing import Finish, FunctionModel, TextDelta

pytestmark = pytest.mark.slow


async def _answer(request: Any) -> AsyncIterator[Any]:
    yield TextDelta("ok")
    yield Finish("stop")


async def _model_plugin(
    ctx: agentloop.Context, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    # Loaded before the fleet plugin: a session picked at startup finds its model there.
    ctx.llm.register("scripted", FunctionModel(_answer))
    task_status.started()
    await trio.lowlevel.checkpoint()


def _serving(dsn: str, **fleet: Any) -> dict[str, Any]:
    return {
        "persistence": {"backend": "postgres", "dsn": dsn, "lease_seconds": 2},
        "fleet": {"serve": True, "idle_seconds": 0.3, "recheck_seconds": 0.5,
                  "provider": "scripted", "model": "m", **fleet},
    }


def _front(dsn: str) -> dict[str, Any]:
    return {"persistence": {"backend": "postgres", "dsn": dsn, "lease_seconds": 2}}


async def _undriven(front: agentloop.Context, *ids: str) -> None:
    """Sessions that exist in the store and that nobody drives."""
    for sid in ids:
        handle = await front.agents.create(session_id=sid, agent_options=OPTIONS)
        await handle.aclose()


async def _logs(dsn: str, ids: list[str]) -> dict[str, tuple[SessionEvent, ...]]:
    async with PostgresSessionStore.open_read_only(dsn) as store:
        return {sid: (await store.load(sid)).events for sid in ids}


def _routed(events: tuple[SessionEvent, ...]) -> list[tuple[str, str]]:
    return [
        (e.data["content"], e.data["source"]["inbox"]) for e in events
        if e.type == "user/message" and e.data.get("source") is not None
    ]


def _check_exactly_once(
    logs: dict[str, tuple[SessionEvent, ...]], acked: dict[str, list[str]]
) -> None:
    """Every acknowledged message in exactly one log, exactly once, in its session's log,
    in the order it was sent; every log gapless and well formed."""
    seen = collections.Counter(mid for events in logs.values() for _, mid in _routed(events))
    for sid, mids in acked.items():
        events = logs[sid]
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), sid
        check_log_invariants(events)
        in_log = [mid for _, mid in _routed(events)]
        assert in_log == mids, (sid, in_log, mids)
        for mid in mids:
            assert seen[mid] == 1, (sid, mid, seen[mid])


# --- in process ---------------------------------------------------------------------------


async def test_a_serving_runtime_claims_drives_and_lets_go_of_a_session(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    ended: list[str] = []
    disposed = trio.Event()
    with trio.fail_after(60):
        async with (
            agentloop.open_runtime(_front(dsn)) as front,
            agentloop.open_runtime(_serving(dsn), plugins=[_model_plugin]) as server,
        ):
            server.events.on(AgentTurnEnd, lambda e: ended.append(e.agent_id))
            server.events.on(AgentDisposed, lambda e: disposed.set())
            await _undriven(front, "f1")
            assert server.agents.get("f1") is None
            mid = await front.sessions.send("f1", "hello")
            # Idle for idle_seconds after its turn, the session is let go.
            await disposed.wait()
            assert ended == ["f1"]
            assert server.agents.get("f1") is None
            logs = await _logs(dsn, ["f1"])
            _check_exactly_once(logs, {"f1": [mid]})
            assert [e.data["reason"] for e in logs["f1"] if e.type == "turn/end"] == [
                "completed"
            ]
            # Let go: the lease is free and the input marked delivered, so nobody picks it.
            [(owner, delivered)] = sql(
                cluster, schema,
                "SELECT l.owner, i.delivered_at IS NOT NULL FROM agentloop_leases l"
                " JOIN agentloop_inbox i USING (session_id) WHERE session_id = 'f1'",
            )
            assert owner is None and delivered
            # Woken again by the next message, from the log it left.
            disposed = trio.Event()
            again = await front.sessions.send("f1", "again")
            await disposed.wait()
            _check_exactly_once(await _logs(dsn, ["f1"]), {"f1": [mid, again]})


async def test_a_picked_session_is_recovered_before_its_input_is_delivered(dsn: str) -> None:
    disposed = trio.Event()
    with trio.fail_after(60):
        async with PostgresSessionStore(dsn) as store:
            # A driver that died mid-turn: the turn is open in the log, the lease is free.
            await store.create("c1", agentloop.FrozenDict())
            await store.acquire("c1", "dead-driver")
            for event in (
                SessionEvent(1, "turn/start", 1, agentloop.FrozenDict(turn=1)),
                SessionEvent(2, "user/message", 1, agentloop.FrozenDict(
                    message_id="m-old", content="cut off", source=None)),
            ):
                store.append("c1", event)
            await store.flush("c1", 2)
            await store.release("c1", "dead-driver")
        async with (
            agentloop.open_runtime(_front(dsn)) as front,
            agentloop.open_runtime(_serving(dsn), plugins=[_model_plugin]) as server,
        ):
            server.events.on(AgentDisposed, lambda e: disposed.set())
            mid = await front.sessions.send("c1", "after the crash")
            await disposed.wait()
    events = (await _logs(dsn, ["c1"]))["c1"]
    ends = [(e.turn, e.data["reason"], e.data.get("cause")) for e in events
            if e.type == "turn/end"]
    assert ends == [(1, "aborted", "crash"), (2, "completed", None)]
    assert [m for _, m in _routed(events)] == [mid]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


async def test_a_session_is_not_let_go_before_its_driver_claims_its_input(dsn: str) -> None:
    async with PostgresSessionStore(dsn) as store:
        await store.create("w1", agentloop.FrozenDict())
        first = await store.send("w1", "first")
        await store.acquire("w1", "me")
        # Sent, not yet claimed by the driver that holds the lease: it is about to arrive.
        assert await store.mark_delivered("w1") == 1
        [claimed] = await store.claim("w1")
        assert claimed.id == first
        # Claimed but not in the log (the agent refused it): not waiting, and not delivered.
        assert await store.mark_delivered("w1") == 0
        store.append("w1", SessionEvent(1, "user/message", 1, agentloop.FrozenDict(
            message_id="m1", content="first", source=agentloop.FrozenDict(inbox=first))))
        await store.flush("w1", 1)
        assert await store.mark_delivered("w1") == 0
        await store.release("w1", "me")
        # Delivered: nothing left for a serving runtime to pick.
        assert await store.pick(10) == []
        second = await store.send("w1", "second")
        assert await store.pick(10) == ["w1"]
        assert await store.pick(10) == []  # reserved: nobody else gets it
        await store.acquire("w1", "me")  # the reservation is handed over
        assert [m.id for m in await store.claim("w1")] == [second]


async def test_a_session_no_runtime_ever_drove_is_served(dsn: str) -> None:
    disposed = trio.Event()
    with trio.fail_after(60):
        async with PostgresSessionStore(dsn) as store:
            # Stored without ever taking a lease: it has no lease row to lock yet.
            await store.create("n1", agentloop.FrozenDict())
        async with (
            agentloop.open_runtime(_front(dsn)) as front,
            agentloop.open_runtime(_serving(dsn), plugins=[_model_plugin]) as server,
        ):
            server.events.on(AgentDisposed, lambda e: disposed.set())
            mid = await front.sessions.send("n1", "first words")
            await disposed.wait()
    _check_exactly_once(await _logs(dsn, ["n1"]), {"n1": [mid]})


async def test_a_dead_drivers_session_is_taken_over_under_a_stream_of_notifications(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    served = trio.Event()
    stop = threading.Event()

    def chatter() -> None:
        # Notifications for a session nobody has, as fast as the server takes them: a busy
        # fleet's traffic, which must not postpone the look for a dead driver's sessions.
        with cluster.connect(schema) as conn:
            while not stop.is_set():
                conn.execute("SELECT pg_notify('agentloop_inbox', 'elsewhere')")

    with trio.fail_after(30):
        async with (
            agentloop.open_runtime(_front(dsn)) as front,
            agentloop.open_runtime(_serving(dsn), plugins=[_model_plugin]) as server,
        ):
            server.events.on(AgentTurnEnd, lambda e: served.set())
            await _undriven(front, "o1")
            # Driven by a process that died a moment ago: its lease runs one more second.
            sql(cluster, schema,
                "UPDATE agentloop_leases SET epoch = epoch + 1, owner = 'dead', host = 'gone',"
                " pid = 1, expires_at = clock_timestamp() + interval '1 second'"
                " WHERE session_id = 'o1'")
            mid = await front.sessions.send("o1", "for the dead driver")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(
                    trio.to_thread.run_sync, chatter, abandon_on_cancel=True))
                try:
                    await served.wait()
                finally:
                    stop.set()
    _check_exactly_once(await _logs(dsn, ["o1"]), {"o1": [mid]})


async def test_two_serving_runtimes_never_drive_the_same_session(
    cluster: Cluster, schema: str, dsn: str
) -> None:
    ids = [f"t{i}" for i in range(12)]
    live: dict[str, str] = {}
    overlaps: list[str] = []
    drivers: dict[str, set[str]] = collections.defaultdict(set)
    idle: dict[str, trio.Event] = {}

    def watch(name: str, rt: agentloop.Context) -> None:
        def created(e: AgentCreated) -> None:
            if e.agent_id in live:
                overlaps.append(f"{e.agent_id}: {live[e.agent_id]} and {name}")
            live[e.agent_id] = name
            drivers[e.agent_id].add(name)

        def gone(e: AgentDisposed) -> None:
            assert live.pop(e.agent_id) == name
            idle.setdefault(e.agent_id, trio.Event()).set()

        rt.events.on(AgentCreated, created)
        rt.events.on(AgentDisposed, gone)

    acked: dict[str, list[str]] = {sid: [] for sid in ids}
    with trio.fail_after(90):
        async with (
            agentloop.open_runtime(_front(dsn)) as front,
            agentloop.open_runtime(_serving(dsn), plugins=[_model_plugin]) as a,
            agentloop.open_runtime(_serving(dsn), plugins=[_model_plugin]) as b,
        ):
            await _undriven(front, *ids)
            watch("a", a)
            watch("b", b)
            for round_ in range(3):
                idle.clear()
                for sid in ids:
                    acked[sid].append(await front.sessions.send(sid, f"m{round_}"))
                for sid in ids:
                    # Every session is driven and let go again before the next round.
                    await idle.setdefault(sid, trio.Event()).wait()
    assert overlaps == []
    assert live == {}
    _check_exactly_once(await _logs(dsn, ids), acked)
    # Both runtimes took work, and the lease epochs never go back along any log.
    assert {name for names in drivers.values() for name in names} == {"a", "b"}
    assert epochs_going_back(cluster, schema) == []


async def test_a_full_runtime_leaves_the_work_to_another(dsn: str) -> None:
    ids = ["cap1", "cap2", "cap3"]
    served: dict[str, str] = {}
    done = trio.Event()

    def on_end(name: str) -> Callable[[AgentTurnEnd], None]:
        def ended(e: AgentTurnEnd) -> None:
            served[e.agent_id] = name
            if len(served) == len(ids):
                done.set()
        return ended

    with trio.fail_after(60):
        async with (
            agentloop.open_runtime(_front(dsn)) as front,
            agentloop.open_runtime(_serving(dsn, max_sessions=1, idle_seconds=30),
                                   plugins=[_model_plugin]) as small,
            agentloop.open_runtime(_serving(dsn, idle_seconds=30),
                                   plugins=[_model_plugin]) as big,
        ):
            small.events.on(AgentTurnEnd, on_end("small"))
            big.events.on(AgentTurnEnd, on_end("big"))
            await _undriven(front, *ids)
            for sid in ids:
                await front.sessions.send(sid, "hi")
            await done.wait()
            assert len(small.agents.list()) <= 1
    assert sorted(served) == ids
    assert list(served.values()).count("small") <= 1


@pytest.mark.parametrize(("table", "message"), [
    ({"idle_seconds": 0}, "fleet.idle_seconds: must be a positive number of seconds, got 0"),
    ({"max_sessions": 0}, "fleet.max_sessions: must be a positive integer, got 0"),
    ({"recheck_seconds": -1}, "fleet.recheck_seconds: must be a positive number"),
    ({"provider": " "}, "fleet.provider: must be a non-empty string"),
    ({"serv": True}, "fleet.serv: unknown key"),
])
def test_the_fleet_table_is_checked(table: dict[str, Any], message: str) -> None:
    config = agentloop.load_config({"fleet": {"serve": True, **table}})
    with pytest.raises(ConfigError) as caught:
        config.section("fleet", FleetConfig)
    assert message in str(caught.value)


async def test_serving_without_postgres_is_refused(tmp_path: Path) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")},
              "fleet": {"serve": True}}
    with pytest.raises(ConfigError, match='needs \\[persistence\\] backend = "postgres"'):
        async with agentloop.open_runtime(config):
            pass


# --- agentloop serve, real processes --------------------------------------------------------


class Arrivals(list[dict[str, Any]]):
    """The fake model server's request list, with a way to wait for a request to arrive."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()

    def append(self, item: dict[str, Any]) -> None:
        with self._cond:
            super().append(item)
            self._cond.notify_all()

    def prompts(self) -> list[str]:
        with self._cond:
            return [r["messages"][-1]["content"] for r in self if r.get("messages")]

    async def until(self, *texts: str) -> None:
        def wait() -> None:
            with self._cond:
                self._cond.wait_for(
                    lambda: set(texts) <= {
                        r["messages"][-1]["content"] for r in self if r.get("messages")
                    },
                    timeout=60,
                )

        await trio.to_thread.run_sync(wait)
        assert set(texts) <= set(self.prompts()), (texts, self.prompts())


def _serve_toml(tmp_path: Path, url: str, dsn: str, *, lease: float = 1) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{url}"\napi_key = "sk-test"\n\n'
        f'[persistence]\nbackend = "postgres"\ndsn = "{dsn}"\nlease_seconds = {lease}\n\n'
        '[fleet]\nidle_seconds = 30\nrecheck_seconds = 0.5\nprovider = "fake"\n'
        'model = "fake-model"\n'
    )
    return path


def _serve_argv(config: Path) -> list[str]:
    return [sys.executable, "-m", "agentloop", "serve", "--config", str(config)]


def _front_config(url: str, dsn: str) -> dict[str, Any]:
    return {
        "providers": {"fake": {"kind": "openai", "base_url": url, "api_key": "sk-test"}},
        **_front(dsn),
    }


async def _until_ended(front: Any, session_id: str, turns: int) -> None:
    """Until the store holds ``turns`` turn/end events of ``session_id`` (read by a tail,
    which the store tells of another process's commits)."""
    ended = 0
    async with front.sessions.tail(session_id) as tail:
        async for event in tail:
            if event.type == "turn/end":
                ended += 1
                if ended == turns:
                    return


async def _stop(proc: trio.Process) -> int:
    proc.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        return await proc.wait()


async def test_agentloop_serve_drives_routed_input_end_to_end(
    fake: Any, tmp_path: Path, cluster: Cluster, schema: str, dsn: str
) -> None:
    fake.requests = arrivals = Arrivals()
    config = _serve_toml(tmp_path, fake.url, dsn)
    async with (
        ready_child(_serve_argv(config), tmp_path / "serve.log", ready=b"serving") as proc,
        agentloop.open_runtime(_front_config(fake.url, dsn)) as front,
    ):
        await _undriven(front, "e1")
        mid = await front.sessions.send("e1", "hello over the fleet")
        with trio.fail_after(60):
            await arrivals.until("hello over the fleet")
        assert await _stop(proc) == 0
    events = (await _logs(dsn, ["e1"]))["e1"]
    assert [m for _, m in _routed(events)] == [mid]
    answers = [e.data["content"] for e in events if e.type == "assistant/message"]
    # Stopped right after the model was asked: the answer is whole or cut, never doubled.
    assert len(answers) <= 1
    log = (tmp_path / "serve.log").read_text()
    assert PASSWORD not in log
    # Stopping released the lease at once.
    assert sql(cluster, schema,
               "SELECT owner FROM agentloop_leases WHERE session_id = 'e1'") == [(None,)]


async def test_agentloop_serve_refuses_a_config_without_postgres(tmp_path: Path) -> None:
    config = tmp_path / "sqlite.toml"
    config.write_text(f'[persistence]\nbackend = "sqlite"\npath = "{tmp_path / "s.db"}"\n')
    with trio.fail_after(60):
        done = await trio.run_process(
            _serve_argv(config), capture_stdout=True, capture_stderr=True, check=False,
            stdin=subprocess.DEVNULL,
        )
    assert done.returncode == 2
    assert b'serve needs [persistence] backend = "postgres"' in done.stderr


async def test_a_killed_serving_process_has_its_sessions_taken_over(
    fake: Any, tmp_path: Path, cluster: Cluster, schema: str, dsn: str
) -> None:
    ids = [f"k{i}" for i in range(4)]
    fake.requests = arrivals = Arrivals()
    # The first turns stall after their first chunk: the killed server dies mid-turn.
    stall = threading.Event()
    fake.replies = [Reply(gate=stall) for _ in ids]
    config = _serve_toml(tmp_path, fake.url, dsn)
    acked: dict[str, list[str]] = {sid: [] for sid in ids}
    try:
        async with agentloop.open_runtime(_front_config(fake.url, dsn)) as front:
            await _undriven(front, *ids)
            async with ready_child(_serve_argv(config), tmp_path / "a.log",
                                   ready=b"serving") as doomed:
                for sid in ids:
                    acked[sid].append(await front.sessions.send(sid, f"first {sid}"))
                with trio.fail_after(60):
                    await arrivals.until(*(f"first {sid}" for sid in ids))
                doomed.send_signal(signal.SIGKILL)
                with trio.fail_after(10):
                    await doomed.wait()
            # Acknowledged while nobody serves: it waits in the store.
            for sid in ids:
                acked[sid].append(await front.sessions.send(sid, f"second {sid}"))
            async with ready_child(_serve_argv(config), tmp_path / "b.log",
                                   ready=b"serving") as heir:
                with trio.fail_after(60):
                    await arrivals.until(*(f"second {sid}" for sid in ids))
                    # Stopped once every second turn is stored as ended: a stop right
                    # after the model was asked would end it "disposed" instead.
                    async with trio.open_nursery() as nursery:
                        for sid in ids:
                            nursery.start_soon(_until_ended, front, sid, 2)
                assert await _stop(heir) == 0
    finally:
        stall.set()
    logs = await _logs(dsn, ids)
    _check_exactly_once(logs, acked)
    for sid, events in logs.items():
        # The dead server's turn was closed by crash recovery before the new input's.
        ends = [(e.data["reason"], e.data.get("cause")) for e in events if e.type == "turn/end"]
        epochs = [e for (e,) in sql(
            cluster, schema,
            "SELECT DISTINCT epoch FROM agentloop_events WHERE session_id = %s", sid,
        )]
        if len(epochs) >= 2:
            # The dead server had stored its open turn: recovery closed it first.
            assert ends == [("aborted", "crash"), ("completed", None)], (sid, ends)
        else:
            # It died before its writer committed anything: the heir delivered both.
            assert [r for r, _ in ends] == ["completed", "completed"], (sid, ends)
    assert PASSWORD not in (tmp_path / "b.log").read_text()


async def test_a_paused_serving_process_is_fenced_and_its_session_served_elsewhere(
    fake: Any, tmp_path: Path, cluster: Cluster, schema: str, dsn: str
) -> None:
    fake.requests = arrivals = Arrivals()
    config = _serve_toml(tmp_path, fake.url, dsn)
    acked: list[str] = []
    async with agentloop.open_runtime(_front_config(fake.url, dsn)) as front:
        await _undriven(front, "p1")
        async with ready_child(_serve_argv(config), tmp_path / "a.log",
                               ready=b"serving") as paused:
            acked.append(await front.sessions.send("p1", "before the pause"))
            with trio.fail_after(60):
                await arrivals.until("before the pause")
            [(holder,)] = sql(cluster, schema,
                              "SELECT pid FROM agentloop_leases WHERE session_id = 'p1'")
            assert holder == paused.pid
            paused.send_signal(signal.SIGSTOP)
            try:
                async with ready_child(_serve_argv(config), tmp_path / "b.log",
                                       ready=b"serving") as other:
                    # Served by the other once the paused one's lease ran out.
                    acked.append(await front.sessions.send("p1", "during the pause"))
                    with trio.fail_after(60):
                        await arrivals.until("during the pause")
                    paused.send_signal(signal.SIGCONT)
                    acked.append(await front.sessions.send("p1", "after the pause"))
                    with trio.fail_after(60):
                        await arrivals.until("after the pause")
                    assert await _stop(other) == 0
            finally:
                paused.send_signal(signal.SIGCONT)
            assert await _stop(paused) == 0
    _check_exactly_once(await _logs(dsn, ["p1"]), {"p1": acked})
    # Every model call was for one message once: the paused process asked nothing again.
    assert sorted(arrivals.prompts()) == sorted(
        ["before the pause", "during the pause", "after the pause"]
    )


def test_serve_is_in_the_help() -> None:
    done = subprocess.run([sys.executable, "-m", "agentloop", "--help"], capture_output=True,
                          text=True, timeout=60, env={**os.environ}, check=False)
    assert "serve" in done.stdout
