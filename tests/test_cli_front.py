"""The command line's first-run frictions: errors that name the fix, help that shows the way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, Reply

from agentloop import ConfigError, load_config
from agentloop._cli_main import build_parser, main


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "DEEPSEEK_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL",
                 "DEEPSEEK_BASE_URL", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.usefixtures("env")
def test_a_base_url_answering_404_is_named_with_a_hint_at_v1(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = fake.url.removesuffix("/v1")  # the usual mistake: the server's root, not its API
    monkeypatch.setenv("OPENAI_BASE_URL", root)
    fake.replies.append(Reply(status=404, error="File Not Found"))
    assert main(["run", "--no-persist", "--model", "m", "hi"]) == 1
    line = last_line(capsys.readouterr().err)
    assert line.startswith("agentloop: error: ")
    assert f"is the base URL {root} right?" in line
    assert f"OpenAI-compatible servers serve under /v1: {root}/v1" in line


@pytest.mark.usefixtures("env")
def test_a_404_under_v1_names_the_url_without_the_v1_hint(
    fake: FakeOpenAI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[providers.f]\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "m"\n')
    fake.replies.append(Reply(status=404, error="model m not found"))
    assert main(["run", "--no-persist", "--config", str(config), "hi"]) == 1
    line = last_line(capsys.readouterr().err)
    assert f"is the base URL {fake.url} right?" in line
    assert "serve under /v1" not in line


def test_a_base_url_without_a_scheme_is_refused_at_config_load(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[providers.f]\nkind = "openai"\nbase_url = "127.0.0.1:8080/v1"\n')
    with pytest.raises(ConfigError, match=r"providers\.f\.base_url: must start with http:// or "
                                          r"https:// .*got '127\.0\.0\.1:8080/v1'"):
        load_config(config)
    load_config({"providers": {"f": {"kind": "openai", "base_url": "http://127.0.0.1:8080/v1"}}})


@pytest.mark.usefixtures("env")
def test_a_base_url_variable_without_a_scheme_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "localhost:11434/v1")
    assert main(["run", "--no-persist", "hi"]) == 2
    assert last_line(capsys.readouterr().err) == (
        "agentloop: error: OPENAI_BASE_URL must start with http:// or https:// (for example "
        "http://127.0.0.1:8080/v1), got 'localhost:11434/v1'"
    )


@pytest.mark.usefixtures("env")
def test_an_unknown_plugin_fails_before_anything_starts_with_did_you_mean(
    fake: FakeOpenAI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        'plugins = ["local", "retyr"]\n'
        f'[providers.f]\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "m"\n'
    )
    assert main(["run", "--no-persist", "--config", str(config), "hi"]) == 2
    err = capsys.readouterr().err
    assert last_line(err) == (
        "agentloop: error: plugins: unknown plugin 'retyr' (no module 'agentloop_retyr'); "
        "did you mean 'retry'?"
    )
    assert "local model" not in err  # the local plugin never started
    assert fake.requests == []


@pytest.mark.usefixtures("env")
def test_a_relative_database_path_is_relative_to_the_config_file(
    fake: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    config = project / "agentloop.toml"
    config.write_text(
        '[persistence]\nbackend = "sqlite"\npath = "state/sessions.db"\n'
        f'[providers.f]\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "m"\n'
    )
    (project / "state").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["run", "--config", str(config), "--session", "s1", "hi"]) == 0
    assert (project / "state" / "sessions.db").is_file()
    assert not (elsewhere / "state").exists()
    # ``sessions`` reads the same store from anywhere.
    assert main(["sessions", "show", "s1", "--config", str(config)]) == 0


def test_help_shows_defaults_providers_and_examples() -> None:
    parser = build_parser()
    top = parser.format_help()
    run = next(
        a for a in parser._subparsers._group_actions  # type: ignore[union-attr]
    ).choices["run"].format_help()
    for text in (top, run):
        assert "examples:" in text
        assert "OPENAI_BASE_URL=http://127.0.0.1:8080/v1 agentloop run" in text
        assert "providers (the first that applies)" in text
        assert "DEEPSEEK_API_KEY" in text
        assert "first\nstart" in text or "first start" in text
    flat = " ".join(run.split())
    assert "(default: the provider's; 256 for the local model)" in flat
    assert "(default: the config's [persistence], else ~/.local/share/agentloop/" in flat
    assert "(default: None)" not in run
    assert os.linesep in run
