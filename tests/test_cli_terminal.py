"""``agentloop chat`` in a real terminal: a pseudo-terminal, keys typed as a person types them.

The chat runs as a child process on a pty (``pty_child``), so readline, Ctrl-C and Ctrl-D
behave as at a keyboard. The model is the fake OpenAI-compatible server of ``test_cli``, on
a loopback thread.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pty_child
import pytest
from fake_openai import FakeOpenAI, Reply
from pty_child import CTRL_C, CTRL_D, PtyChild

pytestmark = pytest.mark.slow

UP, LEFT = "\x1b[A", "\x1b[D"


class Terminal(PtyChild):
    """The chat on a pty, read as text: type into it, wait for what it shows."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(argv, env)
        self.screen = ""
        self.mark = 0

    def expect(self, needle: str, timeout: float = 30.0) -> str:
        """Wait until ``needle`` shows after the last match; the text up to it."""
        deadline = time.monotonic() + timeout
        while needle not in self.screen[self.mark:]:
            left = deadline - time.monotonic()
            rest = self.screen[self.mark:]
            assert left > 0, f"{needle!r} never showed; after the last match: {rest!r}"
            self.read(left)
            assert not self.closed, f"the chat exited before {needle!r}: {rest!r}"
        end = self.screen.index(needle, self.mark) + len(needle)
        seen, self.mark = self.screen[self.mark:end], end
        return seen

    def received(self, chunk: bytes) -> None:
        self.screen += chunk.decode("utf-8", "replace")

    def shown(self) -> str:
        return self.screen[self.mark:]


@pytest.fixture
def terminal_env(tmp_path: Path) -> dict[str, str]:
    return pty_child.terminal_env(tmp_path, "xterm")


def _chat(tmp_path: Path, fake: FakeOpenAI, env: dict[str, str], *extra: str) -> Terminal:
    config = tmp_path / "agentloop.toml"
    config.write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "fake-model"\n'
    )
    store = [] if "--no-persist" in extra else ["--db", str(tmp_path / "s.db")]
    # The line-based chat: with the tui extra installed a terminal gets the screen UI instead
    # (tests/test_cli_tui.py).
    argv = [sys.executable, "-m", "agentloop", "chat", "--plain", "--config", str(config),
            *store, *extra]
    return Terminal(argv, env)


def test_a_person_chats_edits_steers_interrupts_switches_model_and_quits(
    tmp_path: Path, fake: FakeOpenAI, terminal_env: dict[str, str]
) -> None:
    steer_gate, cancel_gate = threading.Event(), threading.Event()
    fake.replies += [Reply(gate=steer_gate), Reply(chunks=["Noted."]),
                     Reply(chunks=["Counting", " on"], gate=cancel_gate)]
    term = _chat(tmp_path, fake, terminal_env, "--session", "talk")
    try:
        term.expect("fake/fake-model (from the config), session talk")
        term.expect("> ")
        # Line editing: the cursor moves left and a letter is inserted mid-line.
        term.type("wrld" + LEFT * 3 + "o\r")
        term.expect("Hello")  # streamed: the rest of the reply is held back by the gate
        term.type("use metric\r")
        term.expect("[steering the running turn]")
        steer_gate.set()
        term.expect(" from the fake model.")
        term.expect("turn 1")  # the status line: route, session, turn, tokens
        term.expect("tokens]")
        term.expect("> ")
        assert fake.requests[0]["messages"][-1]["content"] == "world"
        assert any(m["content"] == "use metric" for m in fake.requests[1]["messages"])

        # History: Up recalls the last line; Ctrl-C cancels the running turn, keeps the text.
        term.type("count\r")
        term.expect("Counting")
        term.type(CTRL_C)
        term.expect("[interrupted; what was shown is kept]")
        term.expect("> ")
        cancel_gate.set()

        term.type("/sessions\r")
        term.expect("talk  ")
        term.expect("> ")
        term.type("/model other-model\r")
        term.expect("fake/other-model (from the config), session talk")
        term.expect("> ")
        term.type(UP * 3 + "\r")  # /model, /sessions, count
        term.expect("Hello from the fake model.")
        assert fake.requests[-1]["model"] == "other-model"
        assert fake.requests[-1]["messages"][-1]["content"] == "count"
        term.expect("> ")
        term.type(CTRL_D)
        assert term.wait() == 0
        assert "session: talk" in term.screen
        assert "Traceback" not in term.screen
    finally:
        steer_gate.set()
        cancel_gate.set()
        term.close()


def test_ctrl_c_at_the_prompt_keeps_the_chat_and_input_is_answered_quickly(
    tmp_path: Path, fake: FakeOpenAI, terminal_env: dict[str, str]
) -> None:
    fake.replies += [Reply(chunks=["Blue."], reasoning=["Light scatters."]),
                     Reply(chunks=["Still blue."], reasoning=["Hidden thought."])]
    term = _chat(tmp_path, fake, terminal_env, "--no-persist")
    try:
        term.expect("(not stored)")
        term.expect("> ")
        term.type("why?\r")
        # Reasoning is dimmed on a terminal, and collapsible.
        term.expect("\x1b[2mLight scatters.\x1b[0m")
        term.expect("Blue.")
        term.expect("> ")
        term.type("/reasoning\r")
        term.expect("[reasoning hidden]")
        term.type("again\r")
        term.expect("[reasoning hidden, 15 characters]")
        term.expect("Still blue.")
        term.expect("> ")
        term.type(CTRL_C)
        term.expect("(Ctrl-D quits)")
        term.expect("> ")
        # Input latency: a key typed reaches the screen (readline's echo) promptly.
        sent = term.type("x")
        term.expect("x")
        latency = time.monotonic() - sent
        print(f"input echo latency: {latency * 1000:.1f} ms")
        assert latency < 2.0, latency
        term.type("\b/quit\r")
        assert term.wait() == 0
        assert "Hidden thought" not in term.screen
    finally:
        term.close()
