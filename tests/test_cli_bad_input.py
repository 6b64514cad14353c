"""The command line given bad input: one clear error line naming what is wrong, no
traceback, no hang; input that can be used is not lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, Reply


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
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


def cli(*args: str | bytes, env: dict[str, str], stdin: bytes | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "agentloop", *args], input=stdin, capture_output=True,
        timeout=timeout, env=env, stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def errors(stderr: bytes) -> list[str]:
    text = stderr.decode("utf-8", "replace")
    assert "Traceback" not in text, text
    return [line for line in text.splitlines() if line.startswith("agentloop: error: ")]


# --- Medium: a chat line that is not UTF-8 is reported and skipped ---------------------------


@pytest.mark.slow
def test_chat_plain_reports_a_line_that_is_not_utf8_and_goes_on(
    config: Path, fake: FakeOpenAI, env: dict[str, str]
) -> None:
    fake.replies += [Reply(chunks=["One."]), Reply(chunks=["Two."])]
    done = cli("chat", "--plain", "--config", str(config), "--no-persist", env=env,
               stdin=b"first\nab\xffcd\nsecond\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"One.\nTwo.\n"
    said = "agentloop: error: input line 2 is not valid UTF-8 (byte 0xff at byte 2); it was"
    assert errors(done.stderr) == [f"{said} skipped"]
    assert [r["messages"][-1]["content"] for r in fake.requests] == ["first", "second"]


@pytest.mark.slow
@pytest.mark.parametrize("via_stdin", [False, True])
def test_run_says_a_prompt_is_not_utf8_and_where(
    config: Path, fake: FakeOpenAI, env: dict[str, str], via_stdin: bool
) -> None:
    if via_stdin:
        done = cli("run", "--config", str(config), "--no-persist", "-", env=env,
                   stdin=b"abc\xfe")
    else:
        done = cli("run", "--config", str(config), "--no-persist", b"abc\xfe", env=env)
    assert done.returncode == 2, done.stderr
    assert errors(done.stderr) == [
        "agentloop: error: the prompt is not valid UTF-8 (byte 0xfe at byte 3)"
    ]
    assert fake.requests == []


# --- Low: a FIFO or a device where a file goes; TOML nested too deeply ------------------------


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--config", "--db"])
@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_fifo_or_device_for_config_or_db_is_refused_at_once(
    config: Path, fake: FakeOpenAI, env: dict[str, str], fifo: Path, option: str, special: str,
) -> None:
    target = str(fifo) if special == "fifo" else special
    if not os.path.exists(target):
        pytest.skip(f"{target} does not exist here")
    args = ["run", option, target, "hi"] if option == "--config" else \
        ["run", "--config", str(config), "--db", target, "hi"]
    # A hang is the defect: the timeout is the guard that turns it into a failure.
    done = cli(*args, env=env, timeout=30)
    assert done.returncode == 2, done.stderr
    [line] = errors(done.stderr)
    kind = "a FIFO" if special == "fifo" else "a character device" if option == "--db" \
        else "a device"
    assert f"{target} is not a regular file (it is {kind})" in line
    assert fake.requests == []


@pytest.mark.slow
def test_sessions_list_refuses_a_fifo_db(env: dict[str, str], fifo: Path) -> None:
    done = cli("sessions", "list", "--db", str(fifo), env=env, timeout=30)
    assert done.returncode == 2, done.stderr
    [line] = errors(done.stderr)
    assert "is not a regular file (it is a FIFO)" in line


@pytest.mark.slow
def test_deeply_nested_toml_is_one_config_error(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    done = cli("run", "--config", str(path), "hi", env=env, timeout=30)
    assert done.returncode == 2, done.stderr
    [line] = errors(done.stderr)
    assert f"invalid TOML in {path}: arrays or tables nested too deeply" in line
