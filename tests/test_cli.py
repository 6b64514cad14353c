"""The ``agentloop`` command line against a fake OpenAI-compatible server on loopback.

The fake server runs on a thread (stdlib ``http.server``), so it serves both ``main()`` called
in-process (which runs its own ``trio.run``) and ``python -m agentloop`` subprocesses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import read_only_prefix
from fake_openai import FakeOpenAI, Reply
from hypothesis import given
from hypothesis import strategies as st

from agentloop import Config
from agentloop._cli import CliError, choose_route
from agentloop._cli_main import main
from agentloop._config import load_config


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A clean environment: no API keys, data and cache dirs under tmp_path."""
    for name in ("OPENAI_API_KEY", "DEEPSEEK_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return dict(os.environ)


@pytest.fixture
def config(tmp_path: Path, fake: FakeOpenAI) -> Path:
    path = tmp_path / "agentloop.toml"
    path.write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "fake-model"\n'
    )
    return path


def cli(
    *args: str, env: dict[str, str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentloop", *args],
        input=stdin, capture_output=True, text=True, timeout=60, env=env,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


HEADER = re.compile(r"^agentloop: \S+/\S+ \(.*\), session \S+( \(not stored\))?$")


def one_error_line(stderr: str) -> str:
    """The one error line, besides the header line saying provider, model and session."""
    lines = [line for line in stderr.strip().splitlines() if not HEADER.match(line)]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("agentloop: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


# --- end to end, in subprocesses ------------------------------------------------------------


@pytest.mark.slow
def test_run_streams_persists_and_sessions_read_it_back(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    db = str(tmp_path / "s.db")
    done = cli("run", "--config", str(config), "--db", db, "--session", "s1", "hello", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Hello from the fake model.\n"
    assert done.stderr.strip().splitlines()[-1] == "session: s1"
    [request] = fake.requests
    assert request["model"] == "fake-model" and request["stream"] is True
    assert request["messages"][-1] == {"role": "user", "content": "hello"}

    listed = cli("sessions", "list", "--db", db, env=env)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[:2] == ["ID", "TURNS"]
    assert row.split()[:2] == ["s1", "1"]
    assert row.rstrip().endswith(os.getcwd())

    shown = cli("sessions", "show", "s1", "--db", db, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "user: hello" in shown.stdout
    assert "assistant (fake/fake-model): Hello from the fake model." in shown.stdout
    assert "--- turn 1 ended: completed, tokens: in 5, out 5 ---" in shown.stdout
    assert "session total, tokens: in 5, out 5" in shown.stdout

    raw = cli("sessions", "show", "s1", "--json", "--db", db, env=env)
    assert raw.returncode == 0, raw.stderr
    events = [json.loads(line) for line in raw.stdout.splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert all(set(e) == {"seq", "type", "turn", "data"} for e in events)
    assert events[0]["type"] == "turn/start" and events[-1]["type"] == "turn/end"
    assert events[-1]["data"]["reason"] == "completed"


def _read_until(stream: Any, needle: str, timeout: float = 30.0) -> str:
    """Read a pipe without waiting for EOF until ``needle`` has arrived."""
    seen = b""
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    while needle.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} never arrived; got {seen!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"EOF before {needle!r}; got {seen!r}"
            seen += chunk
    return seen.decode()


def _popen(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentloop", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )


@pytest.mark.slow
def test_text_reaches_stdout_before_the_reply_is_complete(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    gate = threading.Event()
    fake.replies.append(Reply(gate=gate))
    proc = _popen("run", "--config", str(config), "--no-persist", "hi", env=env)
    try:
        assert _read_until(proc.stdout, "Hello") == "Hello"
        assert proc.poll() is None
        gate.set()
        out, err = proc.communicate(timeout=30)
    finally:
        gate.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.decode() == " from the fake model.\n"


@pytest.mark.slow
def test_ctrl_c_cancels_the_turn_and_exits_130(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    gate = threading.Event()
    fake.replies.append(Reply(gate=gate))
    db = str(tmp_path / "s.db")
    proc = _popen("run", "--config", str(config), "--db", db, "--session", "c1", "hi", env=env)
    try:
        _read_until(proc.stdout, "Hello")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        gate.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err
    raw = cli("sessions", "show", "c1", "--json", "--db", db, env=env)
    events = [json.loads(line) for line in raw.stdout.splitlines()]
    [anchor] = [e for e in events if e["type"] == "assistant/message"]
    assert anchor["data"]["interrupted"] is True
    assert anchor["data"]["content"] == "Hello"
    assert events[-1]["type"] == "turn/end" and events[-1]["data"]["reason"] == "aborted"


@pytest.mark.slow
def test_chat_reads_lines_as_followups_in_one_session(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    fake.replies += [Reply(chunks=["One."]), Reply(chunks=["Two."])]
    db = str(tmp_path / "s.db")
    done = cli(
        "chat", "--config", str(config), "--db", db, "--session", "talk",
        env=env, stdin="first\n\nsecond\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "One.\nTwo.\n"
    assert "> " not in done.stderr  # no prompt when stdin is not a terminal
    second = fake.requests[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "One." and second[2]["content"] == "second"
    listed = cli("sessions", "list", "--db", db, env=env)
    assert listed.stdout.splitlines()[1].split()[:2] == ["talk", "2"]


# --- in process -----------------------------------------------------------------------------


def test_resume_continues_a_stored_session(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = str(tmp_path / "s.db")
    assert main(["run", "--config", str(config), "--db", db, "--session", "r1", "one"]) == 0
    assert main(["run", "--config", str(config), "--db", db, "--resume", "r1", "two"]) == 0
    messages = fake.requests[1]["messages"]
    assert [m["content"] for m in messages] == ["one", "Hello from the fake model.", "two"]
    # --session on a stored id resumes it too.
    assert main(["run", "--config", str(config), "--db", db, "--session", "r1", "three"]) == 0
    assert len(fake.requests[2]["messages"]) == 5
    out = capsys.readouterr().out
    assert out == "Hello from the fake model.\n" * 3


def test_a_default_session_id_is_fresh_and_reported(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = str(tmp_path / "s.db")
    assert main(["run", "--config", str(config), "--db", db, "hi"]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("session: run-") and len(last) == len("session: run-") + 8


def test_resume_of_an_unknown_id_is_one_line_and_non_zero(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = str(tmp_path / "s.db")
    code = main(["run", "--config", str(config), "--db", db, "--resume", "nope", "hi"])
    assert code == 2
    assert "'nope'" in one_error_line(capsys.readouterr().err)
    assert fake.requests == []


def test_a_provider_error_ends_with_one_error_line_and_exit_1(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake.replies.append(Reply(status=401, error="bad key"))
    assert main(["run", "--config", str(config), "--no-persist", "hi"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    line = one_error_line(captured.err)
    assert "bad key" in line and "HTTP 401" in line


def test_env_key_provider_is_used_and_the_key_never_printed(
    fake: FakeOpenAI, env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    fake.replies.append(Reply(status=401, error="rejected"))
    assert main(["run", "--no-persist", "hi"]) == 1
    assert main(["run", "--no-persist", "hi"]) == 0
    assert fake.headers[0]["authorization"] == "Bearer sk-secret-123"
    assert fake.requests[0]["model"] == "gpt-4o-mini"
    captured = capsys.readouterr()
    assert "sk-secret-123" not in captured.out + captured.err


def test_session_and_resume_together_are_a_usage_error(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--session", "a", "--resume", "b", "hi"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--no-persist", "--resume", "a", "hi"],
        ["run", "--max-tokens", "0", "hi"],
        ["sessions"],
    ],
)
def test_contradictory_or_invalid_flags_are_usage_errors(
    argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_a_broken_config_file_is_one_line(
    tmp_path: Path, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[providers.x]\nkind = 'carrier-pigeon'\n")
    assert main(["run", "--config", str(bad), "--no-persist", "hi"]) == 2
    assert "providers" in one_error_line(capsys.readouterr().err)


def test_sessions_show_of_an_unknown_id_and_an_empty_store(
    tmp_path: Path, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "none.db"
    assert main(["sessions", "list", "--db", str(db)]) == 0
    assert capsys.readouterr().err == "no stored sessions\n"
    assert not db.exists()
    assert main(["sessions", "show", "ghost", "--db", str(db)]) == 2
    assert "'ghost'" in one_error_line(capsys.readouterr().err)


# --- choosing the provider ------------------------------------------------------------------

FAKE = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "fm"}
KEYS = {"OPENAI_API_KEY": "k1", "DEEPSEEK_API_KEY": "k2", "ANTHROPIC_API_KEY": "k3"}


def _config(**tables: Any) -> Config:
    return load_config(tables)


def test_flags_win_over_config_and_environment() -> None:
    config = _config(providers={"fake": FAKE}, agents=[{"id": "a", "provider": "fake"}])
    route = choose_route("deepseek", "deepseek-reasoner", config, KEYS)
    assert (route.provider, route.model, route.source) == ("deepseek", "deepseek-reasoner", "env")
    route = choose_route("fake", "other", config, KEYS)
    assert (route.provider, route.model, route.source) == ("fake", "other", "config")


def test_config_agent_then_config_provider_then_env_in_order() -> None:
    agent_cfg = _config(
        providers={"fake": FAKE, "second": {**FAKE, "model": "sm"}},
        agents=[{"id": "a", "provider": "second", "model": "am", "max_tokens": 7}],
    )
    route = choose_route(None, None, agent_cfg, KEYS)
    assert (route.provider, route.model, route.max_tokens) == ("second", "am", 7)
    route = choose_route(None, None, _config(providers={"fake": FAKE}), KEYS)
    assert (route.provider, route.model) == ("fake", "fm")
    assert choose_route(None, None, Config(), KEYS).provider == "openai"
    keys = {k: v for k, v in KEYS.items() if k != "OPENAI_API_KEY"}
    assert choose_route(None, None, Config(), keys).model == "deepseek-chat"
    route = choose_route(None, None, Config(), {"ANTHROPIC_API_KEY": "k"})
    assert (route.provider, route.model) == ("anthropic", "claude-3-5-haiku-latest")


def test_provider_problems_are_cli_errors() -> None:
    with pytest.raises(CliError, match="OPENAI_API_KEY"):
        choose_route("openai", None, Config(), {})
    with pytest.raises(CliError, match="unknown provider 'mystery'"):
        choose_route("mystery", None, Config(), {})
    with pytest.raises(CliError, match="has no model"):
        choose_route("fake", None, _config(providers={"fake": {**FAKE, "model": None}}), {})


def test_missing_local_extra_says_how_to_install_it(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "xllamacpp", None)
    with pytest.raises(CliError) as error:
        choose_route(None, None, Config(), {})
    assert error.value.code == 2
    assert main(["run", "--no-persist", "hi"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "pip install -e '.[local]'" in line



# --- sessions only ever read the store --------------------------------------------------------

import sqlite3

import trio
from agentloop_sqlite import SqliteSessionStore

from agentloop._json import FrozenDict
from agentloop._model import SessionEvent


def _store_a_session(db: Path, messages: int = 1) -> None:
    log = [
        ("turn/start", FrozenDict(turn=1)),
        *[("user/message", FrozenDict(message_id=f"m{i}", content="hello", source=None))
          for i in range(1, messages + 1)],
        ("turn/end", FrozenDict(turn=1, reason="completed")),
    ]

    async def build() -> None:
        async with SqliteSessionStore(db) as store:
            await store.create("s1", FrozenDict(cwd="/work"))
            for seq, (kind, data) in enumerate(log, start=1):
                store.append("s1", SessionEvent(seq, kind, 1, data))
            await store.flush("s1", len(log))

    trio.run(build)


def _files(db: Path) -> tuple[bytes, list[str]]:
    return db.read_bytes(), sorted(os.listdir(db.parent))


@pytest.mark.parametrize("command", [["list"], ["show", "s1"]])
def test_sessions_refuse_another_applications_database_untouched(
    tmp_path: Path, env: dict[str, str], capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    db = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
    before = _files(db)
    assert main(["sessions", *command, "--db", str(db)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(db) in line and "not a session store" in line
    assert _files(db) == before
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)




@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "filesystem"])
def test_sessions_read_a_store_in_a_read_only_place(
    tmp_path: Path, env: dict[str, str], kind: str
) -> None:
    db = tmp_path / "ro" / "sessions.db"
    _store_a_session(db)
    before = _files(db)
    prefix = read_only_prefix(kind, db.parent)
    if kind == "directory":
        db.chmod(0o444)
        db.parent.chmod(0o555)

    def sessions(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*prefix, sys.executable, "-m", "agentloop", "sessions", *args, "--db", str(db)],
            capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
        )

    try:
        listed = sessions("list")
        shown = sessions("show", "s1")
        ghost = sessions("show", "ghost")
    finally:
        db.parent.chmod(0o755)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:2] == ["s1", "1"]
    assert shown.returncode == 0, shown.stderr
    assert "user: hello" in shown.stdout
    assert "--- turn 1 ended: completed ---" in shown.stdout
    assert ghost.returncode == 2
    assert "'ghost'" in one_error_line(ghost.stderr)
    assert _files(db) == before


# --- honest output ----------------------------------------------------------------------------


def test_run_says_provider_model_and_session_on_one_line_unless_quiet(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = str(tmp_path / "s.db")
    assert main(["run", "--config", str(config), "--db", db, "--session", "h1", "hi"]) == 0
    first, *_, last = capsys.readouterr().err.splitlines()
    assert first == "agentloop: fake/fake-model (from the config), session h1"
    assert last == "session: h1"
    assert main(["run", "--config", str(config), "--no-persist", "--quiet", "hi"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out == "Hello from the fake model.\n"


def test_a_model_without_a_provider_is_refused_rather_than_run_locally(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("agentloop_local")
    import agentloop_local

    if agentloop_local.missing_requirements():
        pytest.skip("the local extra is not installed")
    with pytest.raises(CliError, match="--model gpt-4o names no provider") as error:
        choose_route(None, "gpt-4o", Config(), {})
    assert error.value.code == 2
    assert main(["run", "--model", "gpt-4o", "--no-persist", "hi"]) == 2
    assert "--provider" in one_error_line(capsys.readouterr().err)
    # With a key in the environment the model goes to that provider, and the header says so.
    route = choose_route(None, "gpt-4o", Config(), {"OPENAI_API_KEY": "k"})
    assert (route.provider, route.model) == ("openai", "gpt-4o")
    assert route.origin == "from OPENAI_API_KEY"
    assert choose_route("local", "gemma-3-270m", Config(), {}).source == "local"


def test_a_base_url_without_a_key_is_called_keyless_with_a_warning(
    fake: FakeOpenAI, env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    assert main(["run", "--no-persist", "--model", "served", "hi"]) == 0
    assert "authorization" not in fake.headers[0]
    assert fake.requests[0]["model"] == "served"
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"agentloop: warning: OPENAI_BASE_URL is set without OPENAI_API_KEY: calling {fake.url}"
        " without an API key"
    )
    assert err[1].startswith("agentloop: openai/served (OPENAI_BASE_URL, no key), session run-")
    assert main(["run", "--no-persist", "-q", "hi"]) == 0
    assert "pass --model" in capsys.readouterr().err


# --- exit codes and usage -----------------------------------------------------------------


@pytest.mark.slow
def test_usage_errors_are_one_line_and_a_hint(env: dict[str, str]) -> None:
    for argv in (["run"], ["chat", "--bogus"], ["run", "--max-tokens", "0", "hi"], ["nope"]):
        done = cli(*argv, env=env)
        assert done.returncode == 2, done.stderr
        error, hint = done.stderr.splitlines()
        assert error.startswith("agentloop: error: "), done.stderr
        assert hint.startswith("hint: agentloop") and hint.endswith("--help shows the options")
    done = cli("run", "--no-persist", "--resume", "x", "hi", env=env)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == (
        "agentloop: error: --resume needs the session store; drop --no-persist"
    )


def test_version(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    import agentloop

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"agentloop {agentloop.__version__}\n"


def test_a_missing_key_is_a_configuration_error(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--provider", "anthropic", "--no-persist", "hi"]) == 2
    assert "ANTHROPIC_API_KEY" in one_error_line(capsys.readouterr().err)


def test_an_unwritable_store_is_a_configuration_error(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    db = str(blocker / "sessions.db")
    assert main(["run", "--config", str(config), "--db", db, "hi"]) == 2
    one_error_line(capsys.readouterr().err)
    assert fake.requests == []


@pytest.mark.slow
def test_chat_exits_1_when_its_last_turn_failed(
    tmp_path: Path, config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    fake.replies += [Reply(chunks=["One."]), Reply(status=400, error="no good")]
    done = cli("chat", "--config", str(config), "--no-persist", env=env, stdin="a\nb\n")
    assert done.returncode == 1, done.stderr
    assert done.stdout == "One.\n"
    assert "agentloop: error: no good (HTTP 400, auth)" in done.stderr
    fake.replies += [Reply(status=400, error="no good"), Reply(chunks=["Fine."])]
    done = cli("chat", "--config", str(config), "--no-persist", env=env, stdin="a\nb\n")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_sessions_show_into_a_closed_pipe_exits_quietly(
    tmp_path: Path, env: dict[str, str]
) -> None:
    db = tmp_path / "s.db"
    # Far more than a pipe holds, so the writer is still writing when head has gone.
    _store_a_session(db, messages=20_000)
    shell = f"{sys.executable} -m agentloop sessions show s1 --db {db} | head -n 1; "
    shell += "echo \"${PIPESTATUS[0]}\" >&2"
    done = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, timeout=60, env=env,
    )
    assert done.stdout == "session s1 (cwd /work)\n"
    assert done.stderr == "0\n"


def test_a_broken_pipe_is_quiet_and_exit_0(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = tmp_path / "s.db"
    _store_a_session(db)
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    with open(write_fd, "w", buffering=1) as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert main(["sessions", "show", "s1", "--db", str(db)]) == 0
    assert capsys.readouterr().err == ""


def test_sessions_honour_config(
    tmp_path: Path, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "configured.db"
    _store_a_session(db)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[persistence]\nbackend = "sqlite"\npath = "{db}"\n')
    assert main(["sessions", "list", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["s1", "1"]
    assert main(["sessions", "show", "s1", "--config", str(cfg)]) == 0
    assert "user: hello" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[persistence]\nbackend = 'floppy'\n")
    assert main(["sessions", "list", "--config", str(bad)]) == 2


# --- approvals ----------------------------------------------------------------------------

ASK_PLUGIN = """
import agentloop
from agentloop import events


async def plugin(ctx, *, task_status=None):
    @ctx.tools.tool()
    async def wipe(path: str) -> str:
        \"\"\"Delete a path.

        Args:
            path: what to delete.
        \"\"\"
        return f"wiped {path}"

    ctx.events.on(events.ToolPreExecute, lambda e: agentloop.Ask("really wipe?"))
    if task_status is not None:
        task_status.started()
"""


@pytest.fixture
def ask_config(tmp_path: Path, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "agentloop_clitest_ask.py").write_text(ASK_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "ask.toml"
    path.write_text(
        'plugins = ["clitest_ask"]\n'
        f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "fake-model"\n'
    )
    return path


def test_run_refuses_approvals_with_a_clear_message(
    ask_config: Path, fake: FakeOpenAI, env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake.replies += [Reply(chunks=["Wiping."], tool=("wipe", {"path": "/tmp/x"})),
                     Reply(chunks=["Not allowed."])]
    assert main(["run", "--config", str(ask_config), "--no-persist", "wipe it"]) == 0
    captured = capsys.readouterr()
    assert '[approval] wipe {"path":"/tmp/x"} (really wipe?)' in captured.err
    assert "DENIED" in json.dumps(fake.requests[1]["messages"][-1]) or (
        "cannot ask for approval" in fake.requests[1]["messages"][-1]["content"]
    )
    assert "agentloop chat" in fake.requests[1]["messages"][-1]["content"]
    assert captured.out == "Wiping.\nNot allowed.\n"


@pytest.mark.slow
def test_chat_asks_approvals_as_y_or_n(
    tmp_path: Path, ask_config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    fake.replies += [Reply(chunks=["Wiping."], tool=("wipe", {"path": "/a"})),
                     Reply(chunks=["Done."]),
                     Reply(chunks=["Again."], tool=("wipe", {"path": "/b"})),
                     Reply(chunks=["Refused."])]
    run_env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"}
    done = cli("chat", "--config", str(ask_config), "--no-persist", env=run_env,
               stdin="wipe a\ny\nwipe b\nn\n")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("approve wipe? [y/n] ") == 2
    assert fake.requests[1]["messages"][-1]["content"] == "wiped /a"
    assert "denied at the terminal" in fake.requests[3]["messages"][-1]["content"]


def test_reasoning_goes_to_stderr_undimmed_when_it_is_not_a_terminal(
    config: Path, fake: FakeOpenAI, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    fake.replies.append(Reply(chunks=["Blue."], reasoning=["Light ", "scatters."]))
    assert main(["run", "--config", str(config), "--no-persist", "-q", "why?"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Blue.\n"
    assert captured.err == "Light scatters.\n"


def test_sessions_show_prints_each_turns_usage_and_the_session_total() -> None:
    from agentloop import FrozenDict, SessionEvent
    from agentloop._cli import transcript

    events = [
        SessionEvent(1, "turn/start", 1, FrozenDict(turn=1)),
        SessionEvent(2, "turn/end", 1, FrozenDict(
            turn=1, reason="completed",
            usage=FrozenDict(input_tokens=12, output_tokens=3, cache_read_tokens=8))),
        SessionEvent(3, "turn/start", 2, FrozenDict(turn=2)),
        SessionEvent(4, "turn/end", 2, FrozenDict(turn=2, reason="completed")),
    ]
    lines = list(transcript(events))
    assert lines[1] == "--- turn 1 ended: completed, tokens: in 12, out 3, cache read 8 ---"
    assert lines[3] == "--- turn 2 ended: completed ---"


# --- the terminal UI's parts (the screen itself: tests/test_cli_tui.py) ---------------------

MARKDOWN_DOC = """# Title
Para line one
line two

- a
- b

  continued item paragraph
- c

```py
x = 1

y = 2
```
Tail with **bold**"""

MARKDOWN_BLOCKS = [
    "# Title",
    "Para line one\nline two",
    "- a\n- b\n\n  continued item paragraph\n- c",
    "```py\nx = 1\n\ny = 2\n```",
    "Tail with **bold**",
]


def _blocks_of(chunks: Sequence[str]) -> list[str]:
    from agentloop._cli_render import MarkdownBlocks

    splitter = MarkdownBlocks()
    out = [block for chunk in chunks for block in splitter.feed(chunk)]
    rest = splitter.finish()
    return out if rest is None else [*out, rest]


def test_markdown_blocks_close_at_blank_lines_headings_and_fences() -> None:
    from agentloop._cli_render import MarkdownBlocks

    assert _blocks_of([MARKDOWN_DOC]) == MARKDOWN_BLOCKS
    splitter = MarkdownBlocks()
    # A heading closes at once; a paragraph waits for the next block to start (a list item's
    # indented paragraph would still belong to it).
    assert splitter.feed("## Now\nSome text\n\n") == ["## Now"]
    assert splitter.view().count == 1
    assert splitter.feed("   more of it\nlazily continued\n") == []
    assert splitter.feed("\nNext\n") == ["Some text\n\n   more of it\nlazily continued"]
    # Blank lines inside a fence do not close it; the closing fence does.
    assert splitter.feed("~~~\n\n\nstill code\n") == ["Next"]
    assert splitter.feed("~~~\n") == ["~~~\n\n\nstill code\n~~~"]
    assert splitter.finish() is None


@given(cuts=st.lists(st.integers(0, len(MARKDOWN_DOC)), max_size=30))
def test_markdown_blocks_do_not_depend_on_how_the_text_was_chunked(cuts: list[int]) -> None:
    points = sorted({0, *cuts, len(MARKDOWN_DOC)})
    chunks = [MARKDOWN_DOC[a:b] for a, b in itertools.pairwise(points)]
    assert _blocks_of(chunks) == MARKDOWN_BLOCKS


needs_tui = pytest.mark.skipif(
    importlib.util.find_spec("rich") is None, reason="the tui extra (rich) is not installed"
)


@needs_tui
def test_a_block_is_rendered_with_styles_and_without_its_markup() -> None:
    from agentloop._cli_render import MarkdownRenderer

    rendered = MarkdownRenderer().render("Some **bold** and `code`.", 60)
    assert "\x1b[1mbold\x1b[0m" in rendered
    assert "**" not in rendered and "`" not in rendered
    assert rendered.endswith(".\n")  # no padding to the width, no blank lines around it
    listing = MarkdownRenderer().render("- one\n- two", 60)
    assert re.sub(r"\x1b\[[0-9;]*m", "", listing) == " • one\n • two\n"


@needs_tui
def test_the_live_area_draws_only_the_tail_of_a_long_open_block() -> None:
    from agentloop._cli_render import MarkdownBlocks, MarkdownRenderer, live_markdown

    splitter = MarkdownBlocks()
    assert splitter.feed("```\n" + "".join(f"line {i}\n" for i in range(5000)) + "line 50") == []
    draw = live_markdown(splitter.view())
    assert draw is not None
    shown = re.sub(r"\x1b\[[0-9;]*m", "", draw(MarkdownRenderer(), 60, 8)).splitlines()
    assert len(shown) <= 8
    assert [row.strip() for row in shown if row.strip()][-2:] == ["line 4999", "line 50"]
    # The view does not move with later input.
    splitter.feed("00\n```\n")
    again = re.sub(r"\x1b\[[0-9;]*m", "", draw(MarkdownRenderer(), 60, 8)).splitlines()
    assert again == shown


def test_the_context_window_comes_from_the_config_the_adapter_or_the_model_name() -> None:
    from agentloop._cli_render import context_window

    @attrs.frozen
    class Sized:
        context_tokens: int

    @attrs.frozen
    class Wrapper:
        wrapped: object

    plain = Config()
    compact = load_config({"compact": {"max_context_tokens": 9000}})
    assert context_window(Sized(2048), "m", compact) == 9000
    assert context_window(Sized(2048), "m", plain) == 2048
    assert context_window(Wrapper(Sized(4096)), "m", plain) == 4096
    assert context_window(None, "gpt-4o-mini", plain) == 128_000
    assert context_window(None, "claude-3-5-haiku-latest", plain) == 200_000
    assert context_window(None, "my-model", plain) is None
    assert context_window(object(), None, plain) is None


def test_the_status_line_says_the_context_left() -> None:
    from agentloop._cli_render import context_use, status_line

    used = context_use({"input_tokens": 1500, "output_tokens": 36, "cache_read_tokens": 12})
    assert used == 1548
    line = status_line(route="local/gemma", session="s1", turn=3, tokens=4321, window=2048,
                       used=used, busy=False)
    assert line == ("local/gemma · turn 3 · 4,321 tokens · context left 500/2,048 (24%) · "
                    "idle · session s1")
    line = status_line(route="p/m", session="s1", turn=1, tokens=0, window=None, used=None,
                       busy=True)
    assert "context left unknown" in line and "running, Ctrl-C cancels" in line
    assert context_use(None) is None and context_use({"other": 1}) is None


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_screen_ui_needs_a_terminal_and_the_extra_and_plain_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentloop._cli_main import build_parser
    from agentloop._cli_render import tui_available
    from agentloop._cli_screen import _screen_fits

    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stdin", _Tty())
    tty = _Tty()
    args = build_parser().parse_args(["chat"])
    plain = build_parser().parse_args(["chat", "--plain"])
    if tui_available():
        assert _screen_fits(args, tty, tty)
    assert not _screen_fits(plain, tty, tty)
    assert not _screen_fits(args, io.StringIO(), tty)  # stdout is a file
    monkeypatch.setenv("TERM", "dumb")
    assert not _screen_fits(args, tty, tty)
    monkeypatch.setenv("TERM", "xterm")
    # Without the extra the chat keeps the line UI (readline).
    monkeypatch.setitem(sys.modules, "prompt_toolkit", None)
    assert not tui_available()
    assert not _screen_fits(args, tty, tty)


@pytest.mark.slow
def test_think_prints_the_last_reasoning_again(
    config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    fake.replies.append(Reply(chunks=["Blue."], reasoning=["Light ", "scatters."]))
    done = cli("chat", "--config", str(config), "--no-persist", "-q", env=env,
               stdin="why?\n/reasoning\n/think\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Blue.\n"
    assert done.stderr.splitlines() == ["Light scatters.", "[reasoning hidden]",
                                        "Light scatters."]
