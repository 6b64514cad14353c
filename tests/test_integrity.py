"""Nothing lost, nothing leaked: content that cannot be encoded, hostile tool and model output,
and lifecycle races around persistence. Each test names a defect that once lost data.

Persistence tests use a real SQLite file; the crash test kills a real child process.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import OPTIONS, check_history_valid, check_log_invariants, of_type, turn_ends
from hypothesis import given, settings
from hypothesis import strategies as st
from test_persistence import _run_child_until_ready, lease_pids, rows_of, sqlite_config, stored_rows

import agentloop
from agentloop import events as ev
from agentloop._json import thaw
from agentloop.testing import (
    Finish,
    FunctionModel,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    reply,
)


def deep(levels: int) -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(levels):
        child: list[Any] = []
        node.append(child)
        node = child
    return root


# --- content that cannot be encoded is refused at send --------------------------------------


@pytest.mark.parametrize(
    ("content", "source", "message"),
    [
        ("half an emoji \ud83d", None, r"^content: lone surrogate at 14$"),
        (["a", "b", {"type": "text", "text": "file \udcff.txt"}], None,
         r"^content\[2\]\.text: lone surrogate at 5$"),
        ([{"n": 10**5000}], None, r"^content\[0\]\.n: an integer of more than 4300 digits"),
        ([deep(400)], None, r"^content\[0\](\[0\])+: nested more than 200 levels deep$"),
        ("fine", {"user": "x\udcffy"}, r"^source\.user: lone surrogate at 1$"),
        ([{"bad\ud800key": 1}], None, r"lone surrogate at 3$"),
    ],
)
async def test_send_refuses_what_cannot_be_written_and_changes_nothing(
    rt: agentloop.Context, model: ScriptedModel, content: object, source: object, message: str
) -> None:
    handle = await rt.agents.create(session_id="enc", agent_options=OPTIONS)
    agent = handle.agent
    seen = []
    rt.events.on(ev.InboxSpliced, seen.append)
    with pytest.raises(agentloop.InvalidContent, match=message):
        agent.send(content, source=source)
    assert seen == []
    assert agent.inbox == agentloop.Inbox((), ())
    assert len(agent.session.events) == 0
    assert agent.status == "idle"
    await handle.aclose()


async def test_an_unknown_send_target_is_an_agentloop_error(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    handle = await rt.agents.create(session_id="tgt", agent_options=OPTIONS)
    with pytest.raises(agentloop.AgentLoopError, match=r"target: .*got 'bogus'") as err:
        handle.agent.send("hi", target="bogus")  # type: ignore[arg-type]
    assert isinstance(err.value, ValueError)
    assert handle.agent.inbox == agentloop.Inbox((), ())
    await handle.aclose()


# --- provider and tool text is repaired, and the repair recorded -----------------------------


async def test_a_lone_surrogate_from_the_provider_is_repaired_and_every_session_keeps_storing(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sessions.db"

    async def fn(request: object) -> AsyncIterator[object]:
        yield TextDelta("smile \ud83d")
        yield TextDelta(" done")
        yield Finish("stop")

    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", FunctionModel(fn))
            handle = await rt.agents.create(session_id="bad-text", agent_options=OPTIONS)
            handle.agent.followup("hi")
            await handle.agent.wait_idle()
            chunks = of_type(handle.agent, "assistant/chunk")
            assert [c.data["delta"] for c in chunks] == ["smile \ufffd", " done"]
            assert chunks[0].data["repaired"] is True and "repaired" not in chunks[1].data
            [anchor] = of_type(handle.agent, "assistant/message")
            assert anchor.data["content"] == "smile \ufffd done"
            final = list(handle.agent.session.events)
            await handle.aclose()
            # The store is still alive for everyone: a new session commits.
            other = await rt.agents.create(session_id="other", agent_options=OPTIONS)
            other.agent.followup("again")
            await other.agent.wait_idle()
            other_final = list(other.agent.session.events)
            await other.aclose()
    assert stored_rows(db, "bad-text") == rows_of(final)
    assert stored_rows(db, "other") == rows_of(other_final)


async def test_tool_output_that_is_not_json_is_an_error_result_and_every_call_is_answered(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    outputs: dict[str, object] = {
        "nan": float("nan"),
        "set": {1, 2},
        "object": Opaque(),
        "huge": [10**5000],
        "surrogate": "caf\udce9.txt",
        "nested": {"files": ["ok", "x\udcff"]},
    }

    @rt.tools.tool(concurrency="parallel")
    async def produce(kind: str) -> object:
        """Return something awkward.

        Args:
            kind: which value.
        """
        return outputs[kind]

    model.add(reply("go", tool_calls=[("produce", {"kind": k}, f"c_{k}") for k in outputs]))
    model.add(reply("done"))
    handle = await rt.agents.create(session_id="tools", agent_options=OPTIONS)
    handle.agent.followup("run them")
    await handle.agent.wait_idle()
    results = {e.data["call_id"]: e.data for e in of_type(handle.agent, "tool/result")}
    assert list(results) == [f"c_{k}" for k in outputs]
    for kind in ("nan", "set", "object", "huge"):
        assert results[f"c_{kind}"]["error_code"] == "INVALID_RESULT", kind
        assert results[f"c_{kind}"]["is_error"] is True
    assert results["c_surrogate"]["content"] == "caf\ufffd.txt"
    assert results["c_surrogate"]["repaired"] is True
    assert results["c_nested"]["content"] == '{"files":["ok","x\ufffd"]}'
    assert turn_ends(handle.agent) == ["completed"]
    check_log_invariants(handle.agent.session.events)
    check_history_valid(model.requests[-1].messages)
    await handle.aclose()


@pytest.mark.parametrize(
    "raw",
    ['{"a": 1e400}', json.dumps({"a": deep(300)}), '{"a": -1e999}'],
    ids=["1e400", "deep", "-1e999"],
)
async def test_unusable_tool_arguments_are_an_invalid_arguments_result_and_the_turn_goes_on(
    rt: agentloop.Context, raw: str
) -> None:
    ran = []

    @rt.tools.tool
    async def take(a: Any = None) -> str:
        """Take anything.

        Args:
            a: anything.
        """
        ran.append(a)
        return "ok"

    calls = 0

    async def fn(request: object) -> AsyncIterator[object]:
        nonlocal calls
        calls += 1
        if calls == 1:
            yield ToolCallDelta(0, id="c1", name="take", arguments=raw)
            yield Finish("tool_calls")
        else:
            yield TextDelta("sorry, fixed")
            yield Finish("stop")

    rt.llm.register("scripted", FunctionModel(fn))
    handle = await rt.agents.create(session_id="args", agent_options=OPTIONS)
    handle.agent.followup("go")
    await handle.agent.wait_idle()
    [result] = of_type(handle.agent, "tool/result")
    assert result.data["error_code"] == "INVALID_ARGUMENTS"
    assert ran == []
    assert turn_ends(handle.agent) == ["completed"]
    assert calls == 2
    await handle.aclose()


# --- duplicate call ids ------------------------------------------------------------------------


async def test_duplicate_tool_call_ids_are_made_unique_and_the_model_ids_are_kept(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    @rt.tools.tool(concurrency="parallel")
    async def echo(x: int) -> int:
        """Echo.

        Args:
            x: a number.
        """
        return x

    # Two calls with one id in a step, then a later step reusing it again (local servers do).
    model.add(reply("a", tool_calls=[("echo", {"x": 1}, "call_0"), ("echo", {"x": 2}, "call_0")]))
    model.add(reply("b", tool_calls=[("echo", {"x": 3}, "call_0")]))
    model.add(reply("done"))
    handle = await rt.agents.create(session_id="dups", agent_options=OPTIONS)
    handle.agent.followup("go")
    await handle.agent.wait_idle()
    anchors = of_type(handle.agent, "assistant/message")
    assert [c["id"] for c in anchors[0].data["tool_calls"]] == ["call_0", "call_0_2"]
    renamed = anchors[0].data["renamed_tool_call_ids"]
    assert renamed == ({"id": "call_0_2", "original_id": "call_0"},)
    assert [c["id"] for c in anchors[1].data["tool_calls"]] == ["call_0_3"]
    chunk_ids = [c.data["delta"]["id"] for c in of_type(handle.agent, "assistant/chunk")
                 if c.data["kind"] == "tool_call"]
    assert chunk_ids == ["call_0", "call_0", "call_0"]  # what the model sent stays in the log
    results = [(e.data["call_id"], e.data["content"]) for e in of_type(handle.agent, "tool/result")]
    assert results == [("call_0", "1"), ("call_0_2", "2"), ("call_0_3", "3")]
    last = model.requests[-1].messages
    check_history_valid(last)
    ids = [c.id for m in last for c in m.tool_calls]
    assert len(ids) == len(set(ids)) == 3
    await handle.aclose()


# --- a failing step-result hook leaves no call unanswered ------------------------------------


@pytest.mark.parametrize("how", ["raises", "cancels"])
async def test_a_step_result_hook_that_fails_after_the_anchor_leaves_no_call_unanswered(
    rt: agentloop.Context, model: ScriptedModel, how: str
) -> None:
    ran = []

    @rt.tools.tool
    async def act(n: int) -> str:
        """Act.

        Args:
            n: which.
        """
        ran.append(n)
        return "done"

    handle = await rt.agents.create(session_id="hook", agent_options=OPTIONS)
    agent = handle.agent
    first = True

    async def on_step(event: ev.AgentStepResult) -> None:
        nonlocal first
        if not first:
            return
        first = False
        if how == "raises":
            raise RuntimeError("observer broke")
        agent.cancel()
        await trio.lowlevel.checkpoint()

    rt.events.on(ev.AgentStepResult, on_step)
    model.add(reply("two calls", tool_calls=[("act", {"n": 1}, "c1"), ("act", {"n": 2}, "c2")]))
    model.add(reply("fine"))
    agent.followup("go")
    await agent.wait_idle()
    assert ran == []
    results = of_type(agent, "tool/result")
    assert [(r.data["call_id"], r.data["error_code"]) for r in results] == [
        ("c1", "ABORTED_BEFORE_DISPATCH"), ("c2", "ABORTED_BEFORE_DISPATCH"),
    ]
    assert results[0].data["content"] == "Error: tool call aborted before dispatch"
    assert turn_ends(agent) == ["error" if how == "raises" else "aborted"]
    check_log_invariants(agent.session.events)
    agent.followup("next")
    await agent.wait_idle()
    check_history_valid(model.requests[-1].messages)
    await handle.aclose()


# --- leases: a loser never touches the winner's ----------------------------------------------


async def test_a_same_id_loser_never_releases_the_winners_lease(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as a:
            a.llm.register("scripted", ScriptedModel())
            outcomes: list[str] = []

            async def contender(how: str) -> None:
                async def setup(ctx: agentloop.Context) -> None:
                    await trio.lowlevel.checkpoint()

                try:
                    if how == "create":
                        await a.agents.create(session_id="dup", agent_options=OPTIONS,
                                              setup=setup)
                    else:
                        await a.agents.resume(resume_session_id="dup", agent_options=OPTIONS)
                    outcomes.append("won")
                except agentloop.SessionIdInUse:
                    outcomes.append("lost")
                except agentloop.SessionNotFound:
                    outcomes.append("not-found")

            async with trio.open_nursery() as nursery:
                for how in ("create", "create", "create", "resume"):
                    nursery.start_soon(contender, how)
            assert outcomes.count("won") == 1
            assert "dup" in [x.id for x in a.agents.list()]
            # The winner still holds the lease after every loser rolled back ...
            assert len(lease_pids(db, "dup")) == 1
            # ... so a second runtime can neither resume nor create the session.
            async with agentloop.open_runtime(sqlite_config(db)) as b:
                with pytest.raises(agentloop.AgentLoopError, match="already driven"):
                    await b.agents.resume(resume_session_id="dup", agent_options=OPTIONS)
                assert b.agents.get("dup") is None


# --- resume ------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_crash_recovery_happens_inside_resume_before_setup(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    await _run_child_until_ready(db, "tool", tmp_path / "child.log")
    seen_in_setup: list[str] = []
    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:

            async def setup(ctx: agentloop.Context) -> None:
                session = ctx.sessions.get("crashy") or None
                assert session is None  # unpublished until setup returns
                seen_in_setup.append("ran")

            handle = await rt.agents.resume(resume_session_id="crashy", agent_options=OPTIONS,
                                            setup=setup)
            # No checkpoint since resume returned: the driver has not run, yet it is valid.
            events = handle.agent.session.events
            assert [e.type for e in events[-2:]] == ["tool/result", "turn/end"]
            assert events[-2].data["error_code"] == "INTERRUPTED"
            assert (events[-1].data["reason"], events[-1].data["cause"]) == ("aborted", "crash")
            check_log_invariants(events)
            check_history_valid(handle.agent.session.messages())
            assert seen_in_setup == ["ran"]
            final = list(events)
            await handle.aclose()
    assert stored_rows(db, "crashy") == rows_of(final)


async def test_resume_continues_with_the_explicit_settings_of_its_last_request(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sessions.db"
    model = ScriptedModel(["one", "two", "three"])
    with trio.fail_after(10):
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", model)
            options = agentloop.AgentOptions(provider="scripted", model="m-1",
                                             reasoning_effort="low")
            handle = await rt.agents.create(session_id="settings", agent_options=options)
            handle.agent.followup("a")
            await handle.agent.wait_idle()
            await handle.aclose()
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", model)
            handle = await rt.agents.resume(resume_session_id="settings")
            handle.agent.followup("b")
            await handle.agent.wait_idle()
            assert turn_ends(handle.agent) == ["completed", "completed"]
            config = model.requests[-1].config
            assert (config.provider, config.model, config.reasoning_effort) == (
                "scripted", "m-1", "low")
            await handle.aclose()
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", model)
            handle = await rt.agents.resume(
                resume_session_id="settings",
                agent_options=agentloop.AgentOptions(model="m-2"),
            )
            handle.agent.followup("c")
            await handle.agent.wait_idle()
            config = model.requests[-1].config
            assert (config.provider, config.model, config.reasoning_effort) == (
                "scripted", "m-2", "low")
            await handle.aclose()


# --- creation that cannot be stored or owned ---------------------------------------------------


class RefusingStore:
    """A backend whose ``create`` fails: the runtime's reaction is under test, not the store."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def exists(self, session_id: str) -> bool:
        return False

    async def list(self) -> list[agentloop.SessionInfo]:
        return []

    async def load(self, session_id: str) -> agentloop.StoredSession:
        raise agentloop.SessionNotFound(session_id)

    async def create(self, session_id: str, meta: object) -> None:
        raise agentloop.PersistenceError(f"session {session_id!r}: the disk is full")

    def append(self, session_id: str, event: object) -> None:
        raise AssertionError("nothing may be appended for a session that was never created")

    async def flush(self, session_id: str, seq: int) -> None:
        pass

    async def acquire(self, session_id: str, owner: str) -> None:
        pass

    async def release(self, session_id: str, owner: str) -> None:
        self.released.append(session_id)


async def test_create_fails_when_its_session_cannot_be_stored() -> None:
    store = RefusingStore()

    async def plugin(ctx: agentloop.Context) -> None:
        ctx.provide_persistence(store)  # type: ignore[arg-type]

    async with agentloop.open_runtime(plugins=[plugin]) as rt:
        rt.llm.register("scripted", ScriptedModel(["never"]))
        created = []
        rt.events.on(ev.AgentCreated, created.append)
        with pytest.raises(agentloop.PersistenceError, match="disk is full"):
            await rt.agents.create(session_id="nostore", agent_options=OPTIONS)
        assert rt.agents.get("nostore") is None and rt.sessions.get("nostore") is None
        assert created == []
        assert store.released == ["nostore"]


async def test_an_owner_that_closes_during_setup_rolls_the_create_back(
    rt: agentloop.Context, model: ScriptedModel
) -> None:
    owner = rt.child("owner")
    in_setup = trio.Event()
    release = trio.Event()
    created = []
    rt.events.on(ev.AgentCreated, created.append)

    async def setup(ctx: agentloop.Context) -> None:
        in_setup.set()
        await release.wait()

    outcome: list[BaseException] = []

    async def create() -> None:
        try:
            await owner.agents.create(session_id="orphan", agent_options=OPTIONS, setup=setup)
        except agentloop.AgentLoopError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(create)
        await in_setup.wait()
        nursery.start_soon(owner.aclose)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    [err] = outcome
    assert isinstance(err, agentloop.AgentDisposed)
    assert "owner closed" in str(err)
    assert rt.agents.get("orphan") is None and rt.sessions.get("orphan") is None
    assert created == []
    # The id is free again.
    again = await rt.agents.create(session_id="orphan", agent_options=OPTIONS)
    await again.aclose()


# --- disposal is an input barrier ---------------------------------------------------------------


async def test_disposal_refuses_input_from_the_moment_it_begins(rt: agentloop.Context) -> None:
    release = trio.Event()

    async def fn(request: object) -> AsyncIterator[object]:
        yield TextDelta("working")
        await release.wait()
        yield Finish("stop")

    rt.llm.register("scripted", FunctionModel(fn))
    handle = await rt.agents.create(session_id="barrier", agent_options=OPTIONS)
    agent = handle.agent
    agent.followup("go")
    await trio.testing.wait_all_tasks_blocked()
    assert agent.status == "running"
    at_barrier: list[object] = []

    def on_status(event: ev.AgentStatus) -> None:
        if event.status != "disposed":
            return
        # The moment disposal begins, while the running turn has not closed yet.
        at_barrier.append(turn_ends(agent))
        for send in (agent.followup, agent.steer, agent.inject):
            with pytest.raises(agentloop.AgentDisposed):
                send("too late")
        at_barrier.append(agent.status)

    rt.events.on(ev.AgentStatus, on_status)
    await handle.aclose()
    assert at_barrier == [[], "disposed"]
    assert turn_ends(agent) == ["disposed"]
    assert agent.status == "disposed"
    assert all(e.data.get("content") != "too late" for e in agent.session.events)


# --- property: whatever send accepts is stored and sent unchanged; a refusal changes nothing ----

_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_TEXT = st.text(st.one_of(st.characters(), _SURROGATES), max_size=12)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.builds(lambda: 10**4400),  # built lazily: hypothesis cannot print it
    st.floats(allow_nan=True, allow_infinity=True),
    _TEXT,
)
_JSONISH = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(_TEXT, children, max_size=3),
    ),
    max_leaves=8,
)
_CONTENT = st.one_of(
    _TEXT,
    st.lists(st.one_of(_JSONISH, st.builds(lambda t: {"type": "text", "text": t}, _TEXT)),
             max_size=3),
    st.builds(lambda n: [deep(n)], st.integers(150, 260)),
)


def _as_text(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@pytest.mark.slow
@settings(max_examples=40)
@given(contents=st.lists(st.tuples(_CONTENT, _JSONISH), min_size=1, max_size=3))
def test_send_accepts_exactly_what_can_be_stored_and_sent_unchanged(
    tmp_path_factory: pytest.TempPathFactory, contents: list[tuple[object, object]]
) -> None:
    db = tmp_path_factory.mktemp("prop") / "sessions.db"

    async def fn(request: Any) -> AsyncIterator[object]:
        yield TextDelta("ok")
        yield Finish("stop")

    model = FunctionModel(fn)

    async def main() -> None:
        async with agentloop.open_runtime(sqlite_config(db)) as rt:
            rt.llm.register("scripted", model)
            handle = await rt.agents.create(session_id="prop", agent_options=OPTIONS)
            agent = handle.agent
            accepted: list[object] = []
            for content, source in contents:
                before = (len(agent.session.events), agent.inbox)
                try:
                    agent.followup(content, source=source)
                except agentloop.InvalidContent:
                    assert (len(agent.session.events), agent.inbox) == before
                    continue
                accepted.append(content)
                await agent.wait_idle()
            logged = of_type(agent, "user/message")
            assert [_as_text(thaw(e.data["content"])) for e in logged] == [
                _as_text(c) for c in accepted
            ]
            sent = [r.messages[-1].content for r in model.requests[-len(accepted):]] \
                if accepted else []
            assert [_as_text(thaw(c)) for c in sent] == [_as_text(c) for c in accepted]
            final = list(agent.session.events)
            await handle.aclose()
        assert stored_rows(db, "prop") == rows_of(final)

    model.requests.clear()
    trio.run(main)


@pytest.mark.slow
def test_a_command_line_argument_that_is_not_text_is_a_usage_error(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": "http://127.0.0.1:9",
           "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "agentloop", "run", "--provider", "openai", "--model", "x",
         os.fsdecode(b"bad \xff arg")],
        capture_output=True, env=env, timeout=60, check=False,
    )
    assert done.returncode == 2, done.stderr
    # One line of error, saying what is wrong with the argument and where.
    assert done.stderr.decode().strip().splitlines()[-1] == (
        "agentloop: error: the prompt is not valid UTF-8 (byte 0xff at byte 4)"
    )
