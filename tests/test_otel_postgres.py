"""The ``otel`` plugin across a fleet: a message routed through PostgreSQL from one runtime
to the runtime that drives its session links the turn it opens to the sender's span (a
throwaway cluster, as ``test_postgres.py`` starts one; skipped without server binaries)."""

from __future__ import annotations

import pytest
import trio
from conftest import OPTIONS

import agentloop
from agentloop.events import AgentTurnEnd
from agentloop.testing import ScriptedModel

pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
pytest.importorskip("opentelemetry.sdk", reason="needs the test extra's opentelemetry-sdk")

from agentloop_otel import traced_source
from test_otel import Telemetry, telemetry  # noqa: F401 - a fixture
from test_postgres import _config, cluster, dsn, schema  # noqa: F401 - fixtures

# Slow: a throwaway PostgreSQL cluster.
pytestmark = pytest.mark.slow


async def test_a_message_routed_through_the_store_links_to_its_sender(
    dsn: str,  # noqa: F811 - the fixture imported above
    telemetry: Telemetry,  # noqa: F811 - the fixture imported above
) -> None:
    sender = telemetry.tracer_provider.get_tracer("app")
    with trio.fail_after(30):
        async with (
            agentloop.open_runtime(_config(dsn), plugins=[telemetry.plugin()]) as driver,
            agentloop.open_runtime(_config(dsn)) as other,
        ):
            driver.llm.register("scripted", ScriptedModel(["ok"]))
            ended = trio.Event()
            driver.events.on(AgentTurnEnd, lambda e: ended.set())
            handle = await driver.agents.create(session_id="routed", agent_options=OPTIONS)
            async with handle:
                with sender.start_as_current_span("app.request") as app_span:
                    await other.sessions.send("routed", "from afar",
                                              source=traced_source({"via": "queue"}))
                await ended.wait()
                [claimed] = [e for e in handle.agent.session.events
                             if e.type == "user/message"]
                assert claimed.data["source"]["sender"]["via"] == "queue"
    [turn] = telemetry.named("invoke_agent routed")
    assert [link.context.span_id for link in turn.links] == [
        app_span.get_span_context().span_id
    ]
    assert turn.context.trace_id != app_span.get_span_context().trace_id
