"""The ``otel`` plugin: GenAI spans and metrics, read back from the SDK's in-memory exporter.

Each test gives the plugin its own SDK providers (the global ones can be set once per process);
one test runs the configured form against the global providers in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from conftest import OPTIONS, of_type, turn_ends
from fake_openai import FakeOpenAI, Reply

import agentloop
from agentloop import ProviderError
from agentloop import events as ev
from agentloop.testing import ScriptedModel, reply

pytest.importorskip("opentelemetry.sdk", reason="needs the test extra's opentelemetry-sdk")

from agentloop_otel import otel, traced_source
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

ROOT = Path(__file__).resolve().parent.parent


@attrs.define
class Telemetry:
    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    def plugin(self, *, capture_content: bool = False) -> agentloop.Plugin:
        return otel(capture_content=capture_content, tracer_provider=self.tracer_provider,
                    meter_provider=self.meter_provider)

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name.startswith(prefix)]

    def metrics(self) -> dict[str, list[Any]]:
        data = self.reader.get_metrics_data()
        out: dict[str, list[Any]] = {}
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    out.setdefault(metric.name, []).extend(metric.data.data_points)
        return out


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Telemetry(exporter, reader, tracer_provider, meter_provider)
    tracer_provider.shutdown()
    meter_provider.shutdown()


def attrs_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def parent_of(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> ReadableSpan | None:
    if span.parent is None:
        return None
    return next((s for s in spans if s.context.span_id == span.parent.span_id), None)


# --- one turn with everything --------------------------------------------------------------


async def test_a_turn_with_parallel_tools_an_error_a_retry_a_subagent_and_an_approval(
    telemetry: Telemetry,
) -> None:
    model = ScriptedModel([
        ProviderError("busy", status=429, code="rate_limited"),
        reply("Working on it.", tool_calls=[
            ("lookup", {"q": "a"}, "c1"), ("lookup", {"q": "b"}, "c2"),
            ("broken", {}, "c3"), ("delegate", {"task": "sum"}, "c4"),
            ("rm", {"path": "/tmp/x"}, "c5"),
        ], usage={"input_tokens": 11, "output_tokens": 7}),
        reply("child answer", usage={"input_tokens": 3, "output_tokens": 2}),
        reply("All done.", usage={"input_tokens": 20, "output_tokens": 4}),
    ])
    async with agentloop.open_runtime(plugins=[telemetry.plugin()]) as rt:
        rt.llm.register("scripted", model)
        rt.events.on(ev.AgentRequestError, lambda e: agentloop.Retry())
        rt.events.on(ev.ToolPreExecute,
                     lambda e: agentloop.Ask("remove?") if e.call.name == "rm" else None)
        both_running = trio.Event()
        running = 0

        @rt.tools.tool(concurrency="parallel")
        async def lookup(q: str) -> str:
            """Look it up."""
            nonlocal running
            running += 1
            if running == 2:
                both_running.set()
            await both_running.wait()
            return q.upper()

        @rt.tools.tool(concurrency="parallel")
        async def broken() -> str:
            """Always fails."""
            raise RuntimeError("it broke")

        @rt.tools.tool
        async def delegate(task: str) -> str:
            """Ask a sub-agent."""
            return (await rt.subagents.run(task)).text

        @rt.tools.tool
        async def rm(path: str) -> str:
            """Remove a path."""
            return f"removed {path}"

        handle = await rt.agents.create(session_id="main", agent_options=OPTIONS)
        async with handle:
            agent = handle.agent
            agent.followup("do it")
            with trio.fail_after(10):
                await agent.wait_idle()
            [pending] = agent.pending_approvals
            assert pending.call_id == "c5"
            agent.approve("c5")
            with trio.fail_after(10):
                while agent.status != "idle" or agent.pending_approvals:
                    await agent.wait_idle()
            assert turn_ends(agent) == ["completed"]

    spans = telemetry.spans()
    [turn] = telemetry.named("invoke_agent main")
    assert attrs_of(turn)["gen_ai.operation.name"] == "invoke_agent"
    assert attrs_of(turn)["gen_ai.agent.id"] == "main"
    assert attrs_of(turn)["gen_ai.conversation.id"] == "main"
    assert attrs_of(turn)["agentloop.turn.reason"] == "completed"
    assert attrs_of(turn)["gen_ai.usage.input_tokens"] == 31
    assert turn.parent is None

    chats = [s for s in telemetry.named("chat ") if parent_of(s, spans) is turn]
    assert [c.name for c in chats] == ["chat m"] * 3
    failed, first, last = sorted(chats, key=lambda s: s.start_time or 0)
    assert failed.status.status_code is StatusCode.ERROR
    assert attrs_of(failed)["error.type"] == "rate_limited"
    assert attrs_of(first)["agentloop.retry.attempt"] == 2
    assert attrs_of(first)["gen_ai.operation.name"] == "chat"
    assert attrs_of(first)["gen_ai.provider.name"] == "scripted"
    assert attrs_of(first)["gen_ai.request.model"] == "m"
    assert attrs_of(first)["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert (attrs_of(first)["gen_ai.usage.input_tokens"],
            attrs_of(first)["gen_ai.usage.output_tokens"]) == (11, 7)
    assert first.status.status_code is StatusCode.UNSET
    assert attrs_of(last)["gen_ai.response.finish_reasons"] == ("stop",)

    tools = {attrs_of(s)["gen_ai.tool.call.id"]: s for s in telemetry.named("execute_tool ")}
    assert set(tools) == {"c1", "c2", "c3", "c4", "c5"}
    for span in tools.values():
        assert parent_of(span, spans) is turn
        assert attrs_of(span)["gen_ai.operation.name"] == "execute_tool"
    assert tools["c1"].name == "execute_tool lookup"
    assert attrs_of(tools["c1"])["gen_ai.tool.name"] == "lookup"
    # The two lookups ran at the same time: each started before the other ended.
    c1, c2 = tools["c1"], tools["c2"]
    assert (c1.start_time or 0) < (c2.end_time or 0) and (c2.start_time or 0) < (c1.end_time or 0)
    assert tools["c3"].status.status_code is StatusCode.ERROR
    assert tools["c1"].status.status_code is StatusCode.UNSET
    assert [e.name for e in tools["c5"].events] == [
        "agentloop.approval.requested", "agentloop.approval.answered",
    ]
    assert dict(tools["c5"].events[1].attributes or {}) == {"approved": True}

    # The sub-agent's turn sits under the tool span that started it.
    [child] = telemetry.named("invoke_agent sub-")
    assert parent_of(child, spans) is tools["c4"]
    assert child.context.trace_id == turn.context.trace_id
    [child_chat] = [s for s in spans if parent_of(s, spans) is child]
    assert child_chat.name == "chat m"

    # Nothing recorded content by default.
    for span in spans:
        assert not any(k in attrs_of(span) for k in (
            "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.call.arguments",
            "gen_ai.tool.call.result",
        )), span.name

    metrics = telemetry.metrics()
    tokens = metrics["gen_ai.client.token.usage"]
    by_type = {p.attributes["gen_ai.token.type"]: p for p in tokens}
    assert by_type["input"].sum == 11 + 3 + 20 and by_type["input"].count == 3
    assert by_type["output"].sum == 7 + 2 + 4
    assert all(p.attributes["gen_ai.operation.name"] == "chat" for p in tokens)
    durations = metrics["gen_ai.client.operation.duration"]
    assert sum(p.count for p in durations) == 4
    assert [p.attributes.get("error.type") for p in durations if p.attributes.get("error.type")] \
        == ["rate_limited"]


async def test_a_background_job_runs_under_the_call_that_started_it(
    telemetry: Telemetry,
) -> None:
    async with agentloop.open_runtime(plugins=[telemetry.plugin()]) as rt:
        rt.llm.register("scripted", ScriptedModel([
            reply("", tool_calls=[("background", {}, "b1")]), "started it", "job done",
        ]))
        jobs: list[agentloop.Job] = []

        @rt.tools.tool
        async def background() -> str:
            """Start a job."""
            jobs.append(await rt.jobs.start("work"))
            return jobs[-1].id

        handle = await rt.agents.create(session_id="bg", agent_options=OPTIONS)
        async with handle:
            with trio.fail_after(10):
                await handle.agent.ask("go")
                assert (await jobs[0].result()).text in ("started it", "job done")
    spans = telemetry.spans()
    [tool] = telemetry.named("execute_tool background")
    [child] = [s for s in telemetry.named("invoke_agent ") if s.name != "invoke_agent bg"]
    # The job's turn usually begins after the call has returned; either way it sits under it.
    assert child.parent is not None and child.parent.span_id == tool.context.span_id
    assert child.context.trace_id == tool.context.trace_id
    assert parent_of(child, spans) is tool


async def test_cancel_and_a_failed_turn(telemetry: Telemetry) -> None:
    model = ScriptedModel([
        reply("", tool_calls=[("wait", {}, "w1"), ("wait", {}, "w2")]),
        ProviderError("bad request", status=400, code="invalid_request"),
    ])
    async with agentloop.open_runtime(plugins=[telemetry.plugin()]) as rt:
        rt.llm.register("scripted", model)
        started = trio.Event()

        @rt.tools.tool
        async def wait() -> str:
            """Wait forever."""
            started.set()
            await trio.sleep_forever()
            return "never"

        handle = await rt.agents.create(session_id="c", agent_options=OPTIONS)
        async with handle:
            agent = handle.agent
            agent.followup("go")
            with trio.fail_after(10):
                await started.wait()
            assert agent.cancel()
            with trio.fail_after(10):
                await agent.wait_idle()
            agent.followup("again")
            with trio.fail_after(10):
                await agent.wait_idle()
            assert turn_ends(agent) == ["aborted", "error"]

    cancelled, failed = sorted(telemetry.named("invoke_agent c"), key=lambda s: s.start_time or 0)
    assert attrs_of(cancelled)["agentloop.turn.reason"] == "aborted"
    assert attrs_of(cancelled)["agentloop.turn.cause"] == "user"
    assert cancelled.status.status_code is StatusCode.UNSET
    tools = {attrs_of(s)["gen_ai.tool.call.id"]: s for s in telemetry.named("execute_tool")}
    # The running call and the one the cancel kept from dispatching both end, as errors.
    assert set(tools) == {"w1", "w2"}
    assert attrs_of(tools["w2"])["error.type"] == "ABORTED_BEFORE_DISPATCH"
    assert all(s.end_time for s in tools.values())

    assert failed.status.status_code is StatusCode.ERROR
    assert attrs_of(failed)["error.type"] == "invalid_request"
    spans = telemetry.spans()
    [chat] = [s for s in spans if parent_of(s, spans) is failed]
    assert chat.status.status_code is StatusCode.ERROR
    assert attrs_of(chat)["error.type"] == "invalid_request"


# --- content, secrets, links ---------------------------------------------------------------


KEY = "sk-live-7f3a9c01-SECRET-b2e4"
TOKEN = "tok-9d8c7b6a-PROXY-SECRET"
SECRETS = (KEY, TOKEN)


def everything(telemetry: Telemetry) -> str:
    """Every span, event, link and metric point the exporters hold, as one text."""
    texts = [span.to_json() for span in telemetry.spans()]
    data = telemetry.reader.get_metrics_data()
    if data is not None:
        texts.append(data.to_json())
    return "\n".join(texts)


async def test_content_only_when_asked_and_never_a_key(
    telemetry: Telemetry, fake: FakeOpenAI
) -> None:
    fake.replies = [
        Reply(chunks=["Let me echo."], tool=("echo", {"text": "<b>hi</b>"})),
        Reply(chunks=["Echoed."]),
        Reply(status=401, error=f"Incorrect API key provided: {KEY}."),
    ]
    config = {"providers": {"openai": {
        "kind": "openai", "base_url": fake.url, "api_key": KEY,
        "headers": {"X-Proxy-Token": TOKEN}, "model": "gpt-test",
    }}}
    async with agentloop.open_runtime(
        config, plugins=[telemetry.plugin(capture_content=True)]
    ) as rt:
        @rt.tools.tool
        async def echo(text: str) -> str:
            """Say it back."""
            return text

        handle = await rt.agents.create(session_id="k", agent_options=agentloop.AgentOptions(
            provider="openai", model="gpt-test"))
        async with handle:
            agent = handle.agent
            agent.followup("echo <b>hi</b> please")
            with trio.fail_after(10):
                await agent.wait_idle()
            agent.followup("once more")
            with trio.fail_after(10):
                await agent.wait_idle()
            assert turn_ends(agent) == ["completed", "error"]
    assert fake.headers[0]["authorization"] == f"Bearer {KEY}"

    chats = sorted(telemetry.named("chat gpt-test"), key=lambda s: s.start_time or 0)
    inputs = json.loads(attrs_of(chats[0])["gen_ai.input.messages"])
    assert inputs == [{"role": "user", "parts": [
        {"type": "text", "content": "echo <b>hi</b> please"}]}]
    outputs = json.loads(attrs_of(chats[0])["gen_ai.output.messages"])
    assert outputs[0]["parts"][0] == {"type": "text", "content": "Let me echo."}
    assert outputs[0]["parts"][1]["name"] == "echo"
    [tool] = telemetry.named("execute_tool echo")
    assert json.loads(attrs_of(tool)["gen_ai.tool.call.arguments"]) == {"text": "<b>hi</b>"}
    assert json.loads(attrs_of(tool)["gen_ai.tool.call.result"]) == "<b>hi</b>"
    assert chats[-1].status.status_code is StatusCode.ERROR

    text = everything(telemetry)
    assert "gen_ai.input.messages" in text
    for secret in SECRETS:
        fragments = {secret[i:i + 6] for i in range(len(secret) - 5)}
        shown = sorted(f for f in fragments if f in text)
        assert not shown, shown


async def test_a_routed_message_and_a_resumed_turn_link_to_their_span_contexts(
    telemetry: Telemetry, tmp_path: Path
) -> None:
    config = {"persistence": {"backend": "sqlite", "path": str(tmp_path / "s.db")}}
    sender = telemetry.tracer_provider.get_tracer("app")
    async with agentloop.open_runtime(config, plugins=[telemetry.plugin()]) as rt:
        rt.llm.register("scripted", ScriptedModel([
            "routed answer", reply("", tool_calls=[("rm", {"path": "/x"}, "r1")]),
        ]))
        rt.events.on(ev.ToolPreExecute, lambda e: agentloop.Ask("ok?"))

        @rt.tools.tool
        async def rm(path: str) -> str:
            """Remove."""
            return "removed"

        handle = await rt.agents.create(session_id="r", agent_options=OPTIONS)
        async with handle:
            with sender.start_as_current_span("app.request") as app_span:
                await rt.sessions.send("r", "hello", source=traced_source({"via": "http"}))
            with trio.fail_after(10):
                await handle.agent.wait_idle()
            claimed = of_type(handle.agent, "user/message")[0]
            assert claimed.data["source"]["via"] == "http"
            with sender.start_as_current_span("app.second") as second_span:
                handle.agent.followup("remove it", source=traced_source())
            with trio.fail_after(10):
                await handle.agent.wait_idle()
            assert handle.agent.pending_approvals
        # The runtime closes with the call parked: the turn is suspended.

    async with agentloop.open_runtime(config, plugins=[telemetry.plugin()]) as rt:
        rt.llm.register("scripted", ScriptedModel(["removed it"]))

        @rt.tools.tool
        async def rm(path: str) -> str:
            """Remove."""
            return "removed"

        handle = await rt.agents.resume(resume_session_id="r", agent_options=OPTIONS)
        async with handle:
            handle.agent.approve("r1")
            with trio.fail_after(10):
                while handle.agent.pending_approvals or handle.agent.status != "idle":
                    await handle.agent.wait_idle()
            assert turn_ends(handle.agent) == ["completed", "suspended", "completed"]

    first, suspended, resumed = sorted(telemetry.named("invoke_agent r"),
                                       key=lambda s: s.start_time or 0)
    assert [link.context.span_id for link in first.links] == [app_span.get_span_context().span_id]
    assert first.context.trace_id != app_span.get_span_context().trace_id
    assert attrs_of(suspended)["agentloop.turn.reason"] == "suspended"
    # The resumed turn, in another runtime, links to what the log stored for the turn it
    # resumes: the traceparent its message carried.
    assert [link.context.span_id for link in resumed.links] == [
        second_span.get_span_context().span_id
    ]
    parked = telemetry.named("execute_tool rm")
    assert len(parked) == 2
    assert attrs_of(parked[0])["agentloop.tool.suspended"] is True
    assert [e.name for e in parked[1].events] == ["agentloop.approval.answered"]


async def test_a_suspended_turn_answered_in_the_same_runtime_links_to_it(
    telemetry: Telemetry,
) -> None:
    async with agentloop.open_runtime(plugins=[telemetry.plugin()]) as rt:
        rt.llm.register("scripted", ScriptedModel([
            reply("", tool_calls=[("rm", {"path": "/x"}, "p1")]), "done",
        ]))
        rt.events.on(ev.ToolPreExecute, lambda e: agentloop.Ask("ok?"))

        @rt.tools.tool
        async def rm(path: str) -> str:
            """Remove."""
            return "removed"

        handle = await rt.agents.create(session_id="p", agent_options=OPTIONS)
        async with handle:
            handle.agent.followup("go")
            with trio.fail_after(10):
                await handle.agent.wait_idle()
        handle = await rt.agents.create(session_id="p2", agent_options=OPTIONS)
        await handle.aclose()
    [turn] = telemetry.named("invoke_agent p")
    assert attrs_of(turn)["agentloop.turn.reason"] == "suspended"
    [tool] = telemetry.named("execute_tool rm")
    assert attrs_of(tool)["agentloop.tool.suspended"] is True
    assert parent_of(tool, telemetry.spans()) is turn


# --- the configured form, on the global providers ------------------------------------------


CHILD = textwrap.dedent("""
    import json, trio, agentloop
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from agentloop.testing import ScriptedModel

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        config = {"plugins": ["otel"], "otel": {"capture_content": True}}
        async with agentloop.open_runtime(config) as rt:
            rt.llm.register("scripted", ScriptedModel(["unseen", "hi there"]))
            options = agentloop.AgentOptions(provider="scripted", model="m")
            # Loaded before the application configures its SDK: nothing to record yet.
            async with await rt.agents.create(session_id="early", agent_options=options) as h:
                await h.agent.ask("hello")
            trace.set_tracer_provider(provider)
            async with await rt.agents.create(session_id="g", agent_options=options) as h:
                await h.agent.ask("hello")
        print(json.dumps([[s.name, dict(s.attributes)] for s in exporter.get_finished_spans()]))

    trio.run(main)
""")


@pytest.mark.slow
def test_the_configured_plugin_uses_the_global_providers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spans = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    assert set(spans) == {"chat m", "invoke_agent g"}
    assert "hi there" in spans["chat m"]["gen_ai.output.messages"]

