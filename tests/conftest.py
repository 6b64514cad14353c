from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

import contextlib
import logging
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
import trio
from fake_openai import fake  # noqa: F401 - the command-line tests' server fixture

import agentloop
from agentloop.testing import ScriptedModel, check_history, check_log

OPTIONS = agentloop.AgentOptions(provider="scripted", model="m")


@pytest.fixture
async def rt() -> AsyncIterator[agentloop.Context]:
    async with agentloop.open_runtime() as ctx:
        yield ctx


@pytest.fixture
def model(rt: agentloop.Context) -> ScriptedModel:
    m = ScriptedModel()
    rt.llm.register("scripted", m)
    return m


def types(agent: agentloop.Agent) -> list[str]:
    return [e.type for e in agent.session.events]


def of_type(agent: agentloop.Agent, type_: str) -> list[agentloop.SessionEvent]:
    return [e for e in agent.session.events if e.type == type_]


def turn_ends(agent: agentloop.Agent) -> list[str]:
    return [e.data["reason"] for e in of_type(agent, "turn/end")]


def check_log_invariants(events: Sequence[agentloop.SessionEvent]) -> None:
    """Facts every session log must satisfy, whatever happened (``agentloop.testing``'s
    ``check_log``, with the last turn allowed open), and every call answered."""
    check_log(events, quiescent=False)
    calls = {e.data["call_id"] for e in events if e.type == "tool/call"}
    results = {e.data["call_id"] for e in events if e.type == "tool/result"}
    assert calls == results, f"calls without a result: {sorted(calls - results)}"


def check_history_valid(messages: Sequence[agentloop.Message]) -> None:
    """Every assistant tool call is answered before the next assistant or user message."""
    check_history(messages, "openai")


def examples(factor: int) -> int:
    """``factor`` times the profile's examples per test: cheap properties run more of them."""
    return settings.default.max_examples * factor


def read_only_prefix(kind: str, directory: Path) -> list[str]:
    """A command prefix under which ``directory`` is read-only for the command it runs."""
    if kind == "directory":
        # chmod alone binds only non-root: root ignores permission bits unless it drops the
        # capabilities that let it.
        if os.geteuid() != 0:
            return []
        tool = shutil.which("setpriv")
        prefix = [
            tool or "setpriv",
            "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search",
        ]
        why = "running as root, which permission bits do not bind, and cannot drop that power"
    else:
        tool = shutil.which("unshare")
        script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
        prefix = [tool or "unshare", "--mount", "sh", "-c", script, str(directory)]
        why = "cannot mount a read-only bind here (needs root and mount namespaces)"
    if tool is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip(why)
    return prefix


@pytest.fixture
def quiet_agentloop() -> Iterator[None]:
    """Silence the runtime's logger: in a race search, scripted provider failures log a
    warning each, and hundreds of examples would drown the report."""
    logger = logging.getLogger("agentloop")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def _no_invariant_violations() -> Iterator[None]:
    """With AGENTLOOP_INVARIANTS set, every runtime runs the invariant companion, and any
    request that the log does not explain fails the test that sent it."""
    if not os.environ.get("AGENTLOOP_INVARIANTS"):
        yield
        return
    import agentloop_invariants

    before = len(agentloop_invariants.SEEN)
    yield
    found = agentloop_invariants.SEEN[before:]
    assert not found, f"the invariant companion found mismatches: {found}"


@contextlib.asynccontextmanager
async def ready_child(
    argv: Sequence[str], log: Path, *, ready: bytes = b"READY\n", within: float = 20
) -> AsyncIterator[trio.Process]:
    """Run ``argv`` until it prints ``ready``; the running process, killed and reaped when
    the block ends if it still runs. Its stderr goes to ``log``, shown if it dies first."""
    with log.open("wb") as stderr:
        proc = await trio.lowlevel.open_process(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
        )
    try:
        assert proc.stdout is not None
        output = b""
        with trio.fail_after(within):
            while ready not in output:
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    await proc.wait()
                    pytest.fail(
                        f"the child exited with {proc.returncode} before {ready!r}:\n"
                        + await trio.Path(log).read_text(errors="replace")
                    )
                output += chunk
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()


async def kill_when_ready(argv: Sequence[str], log: Path, *, ready_within: float = 20) -> int:
    """Run ``argv`` until it prints ``READY``, SIGKILL it and reap it; return its pid.

    A kill-and-resume test kills a real process at a known point: the child prints READY
    once the state to recover is durable.
    """
    async with ready_child(argv, log, within=ready_within) as proc:
        proc.send_signal(signal.SIGKILL)
        with trio.fail_after(5):
            await proc.wait()
        assert proc.returncode == -signal.SIGKILL
        return proc.pid
