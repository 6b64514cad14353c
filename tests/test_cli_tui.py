"""``agentloop chat`` with the ``tui`` extra, in a real terminal, read back as a person sees it.

The chat runs on a pty (``pty_child``, as in ``test_cli_terminal``); what it writes is fed
to ``pyte``, a VT100 emulator, which keeps the screen (and the lines scrolled off it) the way a
terminal does and answers prompt_toolkit's cursor-position requests, so the tests read the
screen itself rather than the escape sequences that drew it. The model is the fake
OpenAI-compatible server of ``test_cli`` on a loopback thread.

Every wait polls the pty under a generous deadline: the machine may be loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pty_child
import pytest
from fake_openai import FakeOpenAI, Reply
from pty_child import CTRL_C, CTRL_D, PtyChild
from test_cli import ASK_PLUGIN

from agentloop._cli_render import tui_available

pyte = pytest.importorskip("pyte", reason="the screen tests read the terminal through pyte")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not tui_available(),
                       reason="the tui extra (prompt_toolkit, rich) is not installed"),
]

COLUMNS, ROWS = 100, 30
ALT_ENTER = "\x1b\r"


class Screen(PtyChild):
    """The chat on a pty whose output is drawn on an emulated terminal."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(argv, env, size=(ROWS, COLUMNS))
        self.raw = b""
        term = self

        class Emulator(pyte.HistoryScreen):  # type: ignore[misc]
            def write_process_input(self, data: str) -> None:
                # A terminal answers a cursor-position request on the input side.
                with contextlib.suppress(OSError):
                    os.write(term.fd, data.encode())

        self.vt = Emulator(COLUMNS, ROWS, history=2000)
        self.stream = pyte.ByteStream(self.vt)

    def received(self, chunk: bytes) -> None:
        self.raw += chunk
        self.stream.feed(chunk)

    def shown(self) -> str:
        return self.text()

    def lines(self) -> list[str]:
        """Every line: those scrolled off the top, then the screen's."""
        width = self.vt.columns
        old = ["".join(line[x].data for x in range(width)).rstrip() for line in self.vt.history.top]
        return old + [line.rstrip() for line in self.vt.display]

    def text(self) -> str:
        return "\n".join(self.lines())

    def until(self, check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            left = deadline - time.monotonic()
            assert left > 0, f"{what} never showed; the screen:\n{self.text()}"
            assert not self.closed, f"the chat exited before {what}; the screen:\n{self.text()}"
            self.read(min(left, 0.2))

    def expect(self, needle: str, timeout: float = 60.0) -> None:
        self.until(lambda: needle in self.text(), repr(needle), timeout)

    def resize(self, *, columns: int, rows: int) -> None:
        """Resize the terminal; the kernel tells the chat with SIGWINCH."""
        self.vt.resize(rows, columns)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    def input_line(self) -> str:
        """The line holding the cursor: the prompt and what is typed."""
        return self.vt.display[self.vt.cursor.y].rstrip()

    def bottom(self) -> str:
        return self.vt.display[-1].rstrip()

    def cells(self, word: str) -> list[Any]:
        """The cells of the first place ``word`` shows on the screen."""
        for y, line in enumerate(self.vt.display):
            x = line.find(word)
            if x >= 0:
                return [self.vt.buffer[y][x + i] for i in range(len(word))]
        raise AssertionError(f"{word!r} is not on the screen:\n{self.text()}")


@pytest.fixture
def terminal_env(tmp_path: Path) -> dict[str, str]:
    return pty_child.terminal_env(tmp_path, "xterm-256color", drop=("COLUMNS", "LINES"))


@pytest.fixture
def open_chat(
    tmp_path: Path, fake: FakeOpenAI, terminal_env: dict[str, str]
) -> Iterator[Callable[..., Screen]]:
    opened: list[Screen] = []

    def start(*extra: str, context: int | None = 4096, plugins: Sequence[str] = ()) -> Screen:
        config = tmp_path / "agentloop.toml"
        if "clitest_ask" in plugins:  # a tool that a hook parks for approval
            (tmp_path / "agentloop_clitest_ask.py").write_text(ASK_PLUGIN)
        env = dict(terminal_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
        text = f"plugins = {json.dumps(list(plugins))}\n"
        text += (f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.url}"\n'
                 'model = "fake-model"\n')
        if context is not None:
            text += f"[compact]\nmax_context_tokens = {context}\n"
        config.write_text(text)
        store = [] if "--no-persist" in extra else ["--db", str(tmp_path / "s.db")]
        argv = [sys.executable, "-m", "agentloop", "chat", "--config", str(config), *store,
                *extra]
        screen = Screen(argv, env)
        opened.append(screen)
        return screen

    try:
        yield start
    finally:
        for screen in opened:
            screen.close()


def test_markdown_is_rendered_as_it_streams_under_a_status_bar_with_the_context_left(
    open_chat: Callable[..., Screen], fake: FakeOpenAI
) -> None:
    gate = threading.Event()
    fake.replies.append(Reply(
        chunks=["# Sky notes\n\nThe sky is **blue", "** because of *scattering*.\n\n",
                "- short waves\n", "- long waves\n\n", "```python\nprint('hi')\n```\n"],
        gate=gate,
    ))
    screen = open_chat("--session", "md")
    try:
        screen.expect("fake/fake-model (from the config), session md")
        screen.until(lambda: "context left 4,096/4,096 (100%)" in screen.bottom(),
                     "the status bar at the bottom row")
        assert "turn 0" in screen.bottom() and "session md" in screen.bottom()
        screen.type("why blue?\r")
        screen.expect("> why blue?")
        # The heading closed with the first chunk and is printed rendered, while the open
        # paragraph is drawn live (the gate holds the rest of the reply back).
        screen.expect("Sky notes")
        screen.expect("The sky is")  # the open paragraph, drawn above the input line
        screen.until(lambda: " · running, " in screen.bottom(), "the running turn's status")
        assert "# Sky notes" not in screen.text()
        assert all(cell.bold for cell in screen.cells("Sky notes"))
        gate.set()
        screen.expect("because of scattering.")
        screen.expect("print('hi')")
        screen.until(lambda: " · idle · " in screen.bottom(), "the idle status")
        text = screen.text()
        assert "**" not in text and "# " not in text and "```" not in text, text
        sky = screen.cells("The sky is blue")
        assert all(cell.bold for cell in sky[-4:]) and not any(cell.bold for cell in sky[:-4])
        assert all(cell.italics for cell in screen.cells("scattering"))
        assert "• short waves" in text and "• long waves" in text
        # The reply used 5 prompt and 5 completion tokens (the fake server's usage).
        screen.until(lambda: "context left 4,086/4,096 (99%)" in screen.bottom(),
                     "the context left after the turn")
        assert "turn 1" in screen.bottom() and "10 tokens" in screen.bottom()
        screen.type(CTRL_D)
        assert screen.wait() == 0
        assert "Traceback" not in screen.text()
    finally:
        gate.set()


def test_ctrl_c_cancels_the_turn_keeping_its_text_then_clears_a_half_typed_line(
    open_chat: Callable[..., Screen], fake: FakeOpenAI
) -> None:
    gate = threading.Event()
    fake.replies += [Reply(chunks=["Counting sheep", " forever."], gate=gate),
                     Reply(chunks=["Back again."])]
    screen = open_chat("--no-persist")
    try:
        screen.expect("(not stored)")
        screen.until(lambda: screen.input_line() == ">", "the prompt")
        screen.type("count\r")
        screen.expect("Counting sheep")
        screen.until(lambda: " · running, " in screen.bottom(), "the running turn's status")
        screen.type(CTRL_C)
        screen.expect("[interrupted; what was shown is kept]")
        screen.until(lambda: " · idle · " in screen.bottom(), "the idle status")
        gate.set()
        assert "Counting sheep" in screen.text()  # printed for good, not only drawn live
        assert "forever" not in screen.text()

        screen.type("half a thou")
        screen.until(lambda: screen.input_line() == "> half a thou", "the typed text")
        screen.type(CTRL_C)
        screen.until(lambda: screen.input_line() == ">", "the line cleared")
        # Input latency: a key typed reaches the screen (prompt_toolkit's redraw) promptly.
        sent = screen.type("x")
        screen.until(lambda: screen.input_line() == "> x", "the echo of x")
        latency = time.monotonic() - sent
        print(f"screen input echo latency: {latency * 1000:.1f} ms")
        assert latency < 2.0, latency
        screen.type(CTRL_C)
        screen.until(lambda: screen.input_line() == ">", "the line cleared again")
        screen.type(CTRL_C)  # on an empty line: a reminder, and the chat goes on
        screen.expect("(Ctrl-D quits)")

        screen.type("again\r")
        screen.expect("Back again.")
        screen.until(lambda: " · idle · " in screen.bottom(), "the idle status")
        assert fake.requests[-1]["messages"][-1]["content"] == "again"
        screen.type(CTRL_D)
        assert screen.wait() == 0
    finally:
        gate.set()


def test_enter_steers_a_running_turn_and_alt_enter_queues_a_follow_up(
    open_chat: Callable[..., Screen], fake: FakeOpenAI
) -> None:
    gate = threading.Event()
    fake.replies += [Reply(gate=gate), Reply(chunks=["Metric it is."]),
                     Reply(chunks=["Queued answer."])]
    screen = open_chat("--no-persist")
    try:
        screen.expect("(not stored)")
        screen.type("hello\r")
        screen.expect("Hello")
        screen.type("use metric\r")
        screen.expect("[steering the running turn]")
        screen.type("and then this" + ALT_ENTER)
        screen.expect("[queued for after this turn]")
        gate.set()
        screen.expect("Metric it is.")
        screen.expect("Queued answer.")
        screen.until(lambda: "turn 2" in screen.bottom() and " · idle · " in screen.bottom(),
                     "the second turn's status")
        assert any(m["content"] == "use metric" for m in fake.requests[1]["messages"])
        assert fake.requests[2]["messages"][-1]["content"] == "and then this"
        screen.type(CTRL_D)
        assert screen.wait() == 0
    finally:
        gate.set()


def test_reasoning_is_dimmed_then_collapsed_and_think_shows_it(
    open_chat: Callable[..., Screen], fake: FakeOpenAI
) -> None:
    fake.replies.append(Reply(chunks=["Blue."], reasoning=["Light ", "scatters."]))
    screen = open_chat("--no-persist", context=None)
    screen.until(lambda: "context left unknown" in screen.bottom(), "an unknown context")
    screen.type("why?\r")
    screen.expect("thinking… (15 characters, /think to show)")
    screen.expect("Blue.")
    assert "Light scatters." not in screen.text()
    assert b"\x1b[2mthinking" in screen.raw  # dimmed
    screen.type("/think\r")
    screen.expect("Light scatters.")
    screen.until(lambda: screen.input_line() == ">", "the prompt")
    screen.type(CTRL_D)
    assert screen.wait() == 0


def test_ctrl_d_exits_1_when_the_last_turn_failed(
    open_chat: Callable[..., Screen], fake: FakeOpenAI
) -> None:
    fake.replies.append(Reply(status=400, error="no good"))
    screen = open_chat("--no-persist")
    screen.expect("(not stored)")
    screen.type("hi\r")
    screen.expect("agentloop: error: no good (HTTP 400, auth)")
    screen.until(lambda: " · idle · " in screen.bottom(), "the idle status")
    screen.type(CTRL_D)
    assert screen.wait() == 1


def test_tool_calls_are_compact_lines_and_approvals_are_asked_at_the_prompt(
    open_chat: Callable[..., Screen], fake: FakeOpenAI
) -> None:
    fake.replies += [Reply(chunks=["Wiping **now**."], tool=("wipe", {"path": "/a"})),
                     Reply(chunks=["Done."])]
    screen = open_chat("--no-persist", plugins=["clitest_ask"])
    screen.expect("(not stored)")
    screen.type("wipe a\r")
    screen.expect('[approval] wipe {"path":"/a"} (really wipe?)')
    screen.until(lambda: screen.input_line() == "approve wipe? [y/n]", "the question")
    screen.type("maybe\r")
    screen.until(lambda: screen.input_line() == "answer y or n:", "the question again")
    screen.type("y\r")
    screen.expect("[tool] wipe -> ok: wiped /a")
    screen.expect("Done.")
    screen.until(lambda: " · idle · " in screen.bottom(), "the idle status")
    assert screen.input_line() == ">"
    text = screen.text()
    # The text before the call was printed rendered, above the call's line.
    assert text.index("Wiping now.") < text.index('[tool] wipe {"path":"/a"}'), text
    assert fake.requests[1]["messages"][-1]["content"] == "wiped /a"
    screen.type(CTRL_D)
    assert screen.wait() == 0


PROGRESS_PLUGIN = """
import pathlib

import trio

import agentloop


async def plugin(ctx, *, task_status=None):
    @ctx.tools.tool()
    async def crunch() -> str:
        \"\"\"Crunch the numbers.\"\"\"
        agentloop.report_progress("crunching", fraction=0.5)
        # Holds until the test has seen the progress: it writes to this FIFO.
        gate = pathlib.Path(__file__).with_name("gate.fifo")
        await trio.to_thread.run_sync(gate.read_text)
        return "crunched"

    if task_status is not None:
        task_status.started()
"""


def test_a_tools_progress_shows_in_the_status_bar_until_the_turn_ends(
    open_chat: Callable[..., Screen], fake: FakeOpenAI, tmp_path: Path
) -> None:
    (tmp_path / "agentloop_clitest_progress.py").write_text(PROGRESS_PLUGIN)
    gate = tmp_path / "gate.fifo"
    os.mkfifo(gate)
    fake.replies += [Reply(chunks=["Crunching."], tool=("crunch", {})), Reply(chunks=["Done."])]
    screen = open_chat("--no-persist", plugins=["clitest_progress"])
    screen.expect("(not stored)")
    screen.type("crunch\r")
    screen.until(lambda: "[progress] crunching (50%)" in screen.bottom(), "the progress")
    # Never printed among the conversation's lines: only the status bar shows it.
    assert "[progress]" not in "\n".join(screen.lines()[:-1])
    gate.write_text("go")
    screen.expect("Done.")
    screen.until(lambda: " · idle · " in screen.bottom(), "the idle status")
    assert "[progress]" not in screen.text()
    screen.type(CTRL_D)
    assert screen.wait() == 0


SLOW_START_PLUGIN = """
import sys

import trio


async def plugin(ctx, *, task_status=None):
    # Stands for the local model being assembled and started: the chat waits for it.
    print("slow plugin starting", file=sys.stderr, flush=True)
    await trio.sleep_forever()
"""


def test_ctrl_c_while_the_chat_starts_gives_up_with_130(
    open_chat: Callable[..., Screen], tmp_path: Path
) -> None:
    (tmp_path / "agentloop_clitest_slow.py").write_text(SLOW_START_PLUGIN)
    screen = open_chat("--no-persist", plugins=["clitest_slow"])
    screen.expect("slow plugin starting")
    screen.type(CTRL_C)
    assert screen.wait() == 130
    assert "Traceback" not in screen.text()


def test_the_status_bar_follows_a_resized_terminal(
    open_chat: Callable[..., Screen]
) -> None:
    screen = open_chat("--no-persist")
    screen.until(lambda: " · idle · " in screen.bottom(), "the status bar")
    screen.resize(columns=72, rows=20)
    screen.until(lambda: screen.bottom().startswith(" fake/fake-model · turn 0"),
                 "the status bar on the new bottom row")
    assert len(screen.bottom()) <= 72
    screen.type(CTRL_D)
    assert screen.wait() == 0
