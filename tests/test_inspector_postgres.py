"""``agentloop ui --db DSN``: the inspector on a PostgreSQL store (a throwaway cluster, as
``test_postgres.py`` starts one; skipped with the reason without server binaries)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
import trio
from conftest import OPTIONS

import agentloop
from agentloop.testing import ScriptedModel

pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
pytest.importorskip("hypercorn", reason="the inspector needs the ui extra (hypercorn)")

from test_inspector import sse, ui_process
from test_postgres import PASSWORD, cluster, dsn, schema  # noqa: F401 - fixtures

# Slow: a throwaway PostgreSQL cluster.
pytestmark = pytest.mark.slow


async def test_the_inspector_reads_and_drives_a_postgres_store(
    dsn: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    async with agentloop.open_runtime({"persistence": {"backend": "postgres", "dsn": dsn}}) as rt:
        rt.llm.register("scripted", ScriptedModel(["stored answer"]))
        async with await rt.agents.create(session_id="pg1", agent_options=OPTIONS) as handle:
            await handle.agent.ask("hello from postgres")
    config = tmp_path / "agentloop.toml"
    config.write_text('[providers.fake]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                      'model = "m"\n')
    async with ui_process(["--config", str(config), "--provider", "fake", "--db", dsn]) as url:
        base, token = url.split("/?token=")
        async with httpx.AsyncClient(timeout=10) as client:
            page = await client.get(url)
            listing = await client.get(base + "/api/sessions", params={"token": token})
            log = await client.get(base + "/api/sessions/pg1", params={"token": token})
            # Answering through the inspector resumes the stored session in its runtime.
            posted = await client.post(base + "/api/sessions/pg1/messages",
                                       json={"content": "and again"},
                                       headers={"Authorization": f"Bearer {token}"})
            # The live stream says when the resumed turn ends.
            events = []
            with trio.fail_after(20):
                async with client.stream("GET", base + "/api/sessions/pg1/stream",
                                         params={"token": token}) as response, \
                        contextlib.aclosing(sse(response)) as stream:
                    async for name, data in stream:
                        if name != "log":
                            continue
                        events.append(data)
                        if sum(e["type"] == "turn/end" for e in events) == 2:
                            break
    assert page.status_code == 200
    assert "postgresql://agentloop@127.0.0.1" in page.text
    assert [row["id"] for row in listing.json()["sessions"]] == ["pg1"]
    texts = [e["data"].get("content") for e in log.json()["events"]]
    assert "hello from postgres" in texts and "stored answer" in texts
    assert posted.status_code == 200
    # The provider at port 9 refuses: the resumed turn ends in an error, read back live.
    assert [e["data"]["reason"] for e in events if e["type"] == "turn/end"] == [
        "completed", "error",
    ]
    for text in (page.text, listing.text, log.text):
        assert PASSWORD not in text
