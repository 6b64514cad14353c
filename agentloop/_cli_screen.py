"""``agentloop chat``'s terminal UI (the ``tui`` extra): a prompt_toolkit screen beside trio.

prompt_toolkit reads the input (editing, history, key bindings, the status bar) on a thread
of its own, because its event loop is asyncio; rich renders the markdown. Typed lines reach
trio through ``TrioToken.run_sync_soon`` and a channel. Output goes the other way as whole
lines printed above the prompt, plus a live area drawn above the prompt for what is still
streaming: the open markdown block, or the reasoning. Both pass through one queue that the
prompt's thread drains in order, so a block leaves the live area in the same redraw that
prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import math
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO, cast

import trio

# The command line is the top layer: it uses only what any program embedding agentloop can.
from agentloop import (
    SessionEvent,
)
from agentloop.events import ToolProgress

from ._cli import (
    EXIT_INTERRUPTED,
    PROG,
    CliError,
    Plan,
    Printer,
    _Chat,
    _error_text,
    _fresh_id,
    _history_path,
    _interrupts,
    _isatty,
    _restore_terminal,
    _runtime,
    _terminal_state,
    progress_line,
)
from ._cli_render import (
    LiveDraw,
    MarkdownBlocks,
    MarkdownRenderer,
    _dim_text,
    context_use,
    live_markdown,
    live_reasoning,
    tui_available,
)


class _Screen:
    """The chat's terminal: a prompt_toolkit prompt on its own thread beside trio.

    Trio calls ``print``, ``update`` and ``refresh`` and sets ``prompt``, ``status`` and
    ``busy``; the prompt's thread reads them when it redraws.
    """

    def __init__(
        self, token: trio.lowlevel.TrioToken, lines: trio.MemorySendChannel[str],
        history: str | None, out: TextIO, color: bool,
    ) -> None:
        self._token = token
        self._lines = lines
        self._history = history
        self._out = out
        self._color = color
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._next_live: LiveDraw | None = None
        self._posted = False
        self._live: LiveDraw | None = None
        self._drawn: tuple[object, ...] = ()
        self._drawing: Any = None
        self._markdown: MarkdownRenderer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._done: asyncio.Event | None = None
        self._app: Any = None
        self._queue_next = False
        self._ready = trio.Event()
        self._thread = threading.Thread(target=self._main, name="agentloop chat input",
                                         daemon=True)
        self.prompt = "> "
        self.status = ""
        self.progress = ""  # the latest progress of a running tool, beside the status
        self.busy = False
        self.talking = False  # until the first prompt, Ctrl-C aborts the start (local model)
        self.interrupt: Callable[[], None] = lambda: None
        self.error: BaseException | None = None

    # -- called from trio --

    async def start(self) -> None:
        self._thread.start()
        await self._ready.wait()
        if self.error is not None:
            raise CliError(f"the terminal UI could not start: {_error_text(self.error)}; "
                           f"{PROG} chat --plain is the line chat")

    async def stop(self) -> None:
        """End the prompt and wait for its thread, which prints what is still queued."""
        if self._thread.ident is None:
            return
        self._call_loop(self._on_stop)
        await trio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    def print(self, text: str) -> None:
        """Print ``text`` (whole lines) above the prompt."""
        with self._lock:
            self._pending.append(text)
            self._post()

    def update(self, text: str, live: LiveDraw | None) -> None:
        """Print ``text`` and, in the same redraw, replace the live area with ``live``."""
        with self._lock:
            if text:
                self._pending.append(text)
            self._next_live = live
            self._post()

    def refresh(self) -> None:
        """Redraw: the prompt, status or live area changed."""
        with self._lock:
            self._post()

    def _post(self) -> None:
        if not self._posted:
            self._posted = self._call_loop(self._wake_up)

    def _call_loop(self, fn: Callable[[], None]) -> bool:
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop has closed
            return False
        return True

    def _deliver(self, line: str) -> None:
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            self._lines.send_nowait(line)

    def _closed(self) -> None:
        self._ready.set()
        self._lines.close()

    # -- on the prompt's thread --

    def _call_trio(self, fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _main(self) -> None:
        try:
            asyncio.run(self._prompt_loop())
        except Exception as exc:  # noqa: BLE001  (trio reports it when the chat ends)
            self.error = exc
        finally:
            self._call_trio(self._closed)

    async def _prompt_loop(self) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, History, InMemoryHistory
        from prompt_toolkit.patch_stdout import patch_stdout

        self._loop = asyncio.get_running_loop()
        done = asyncio.Event()
        self._wake, self._done = asyncio.Event(), done
        history: History = InMemoryHistory()
        if self._history is not None:
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(self._history), exist_ok=True)
                history = FileHistory(self._history)
        self._markdown = MarkdownRenderer()
        # The input line is printed again from the queue, in order with the output.
        session: PromptSession[str] = PromptSession(
            message=self._message, bottom_toolbar=self._toolbar, key_bindings=self._keys(),
            history=history, erase_when_done=True,
        )
        self._app = session.app
        self._app.min_redraw_interval = 0.03
        drain = asyncio.create_task(self._drain(done))
        self._wake.set()  # what was printed before the loop ran
        try:
            with patch_stdout(raw=True):
                self._call_trio(self._ready.set)
                while not done.is_set():
                    try:
                        text = await session.prompt_async()
                    except EOFError:
                        break
                    if done.is_set():
                        break
                    queued, self._queue_next = self._queue_next, False
                    self.print(f"{self.prompt}{text}\n")
                    if queued and text.strip():
                        text = f"/queue {text.strip()}"
                    self._call_trio(self._deliver, text)
                self._call_trio(self._closed)
                await done.wait()
        finally:
            self._wake.set()
            # asyncio, on the prompt's own thread: bounded by its timeout, nothing to shield.
            await asyncio.wait({drain}, timeout=5)  # noqa: ASYNC102
            drain.cancel()
            self._write(self._take()[0], None)  # what came while the last pass printed

    def _take(self) -> tuple[str, LiveDraw | None]:
        with self._lock:
            text, live = "".join(self._pending), self._next_live
            self._pending.clear()
            self._posted = False
        return text, live

    def _write(self, text: str, live: LiveDraw | None) -> None:
        """Print ``text`` above the prompt, which the next redraw shows with ``live`` above it.

        Unlike ``run_in_terminal`` this keeps the terminal in raw mode, so a key pressed while
        output arrives is read as the key (Ctrl-D stays Ctrl-D, not the line discipline's
        end of file) and never echoed by the terminal itself.
        """
        self._live = live
        if not text:
            return
        app = self._app
        try:
            if app is not None and app.is_running:
                app.renderer.erase()
                app.output.write_raw(text)
                app.output.flush()
                app.renderer.reset()
                app.renderer.request_absolute_cursor_position()
            else:
                self._out.write(text)
                self._out.flush()
        except (OSError, ValueError):  # the terminal has gone
            pass

    async def _drain(self, done: asyncio.Event) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._write(*self._take())
            if done.is_set():
                return
            self._app.invalidate()

    def _wake_up(self) -> None:
        assert self._wake is not None
        self._wake.set()

    def _on_stop(self) -> None:
        assert self._done is not None
        self._done.set()
        app = self._app
        if app is not None and app.is_running:
            with contextlib.suppress(Exception):  # it was ending already
                app.exit(result="")

    def _message(self) -> Any:
        from prompt_toolkit.formatted_text import ANSI

        live, prompt = self._live, self.prompt
        size = self._app.output.get_size()
        key = (live, prompt, size.columns, size.rows)
        if key != self._drawn:
            text = ""
            if live is not None and self._markdown is not None:
                text = live(self._markdown, size.columns, max(1, size.rows - 4))
            self._drawn, self._drawing = key, ANSI(text + prompt)
        return self._drawing

    def _toolbar(self) -> str:
        # The progress first: a long status is cut at the terminal's edge.
        return f" {self.progress} · {self.status}" if self.progress else f" {self.status}"

    def _keys(self) -> Any:
        from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

        keys = KeyBindings()

        @keys.add("c-c")
        def _interrupt(event: KeyPressEvent) -> None:
            buffer = event.current_buffer
            if self.busy or not self.talking:
                self._call_trio(self.interrupt)
            elif buffer.text:
                buffer.reset()
            else:
                self.print(_dim_text("(Ctrl-D quits)", self._color) + "\n")

        @keys.add("escape", "enter")
        def _queue(event: KeyPressEvent) -> None:
            self._queue_next = True
            event.current_buffer.validate_and_handle()

        return keys


class _ScreenStream(io.TextIOBase):
    """Text written here is printed above the prompt, a whole line at a time."""

    def __init__(self, screen: _Screen) -> None:
        super().__init__()
        self._screen = screen
        self._partial: list[str] = []

    def write(self, s: str, /) -> int:
        if "\n" in s:
            head, _, tail = s.rpartition("\n")
            self._screen.print("".join([*self._partial, head, "\n"]))
            self._partial = [tail] if tail else []
        elif s:
            self._partial.append(s)
        return len(s)

    def isatty(self) -> bool:
        return True


class _ScreenPrinter(Printer):
    """A turn on the screen: each markdown block printed rendered once it closes, the open one
    drawn live above the prompt; reasoning live while it streams, then one collapsed line
    (``/think`` shows it, ``/reasoning`` keeps it expanded)."""

    def __init__(self, screen: _Screen, stream: TextIO) -> None:
        super().__init__(stream, stream)
        self.screen = screen
        self.show_reasoning = False
        self.on_usage: Callable[[int], None] | None = None
        self._blocks = MarkdownBlocks()
        self._markdown = MarkdownRenderer()
        self._shown = 0
        self._thinking: list[str] = []

    def _show(self, e: SessionEvent) -> None:
        if e.type == "assistant/chunk":
            kind, delta = e.data["kind"], e.data["delta"]
            if kind == "text":
                self._end_reasoning()
                done = self._blocks.feed(delta)
                self.screen.update("".join(self._render(b) for b in done), self._live())
            elif kind == "reasoning":
                self._thinking.append(delta)
                self.screen.update("", self._live())
            return
        if e.type == "request/header":
            self.finish()  # a retried call streams a fresh message
        elif e.type == "assistant/message":
            used = context_use(e.data.get("usage"))
            if used is not None and self.on_usage is not None:
                self.on_usage(used)
        super()._show(e)

    def _live(self) -> LiveDraw | None:
        if self._thinking:
            return live_reasoning(self._thinking, len(self._thinking), self.color)
        return live_markdown(self._blocks.view())

    def _render(self, block: str) -> str:
        gap = "\n" if self._shown else ""
        self._shown += 1
        return gap + self._markdown.render(block, shutil.get_terminal_size().columns)

    def _end_reasoning(self) -> None:
        if not self._thinking:
            return
        text, self._thinking = "".join(self._thinking), []
        self.last_reasoning = text
        if self.show_reasoning:
            line = text.rstrip("\n")
        else:
            line = f"thinking… ({len(text):,} characters, /think to show)"
        self.screen.update(self.dim(line) + "\n", self._live())

    def progress(self, e: ToolProgress) -> None:
        # The status bar's line, redrawn in place: a flood of reports never scrolls.
        self.screen.progress = progress_line(e)
        self.screen.refresh()

    def finish(self) -> None:
        if self.screen.progress:
            self.screen.progress = ""
            self.screen.refresh()
        self._end_reasoning()
        rest = self._blocks.finish()
        text = self._render(rest) if rest is not None else ""
        self._shown = 0
        self.screen.update(text, None)

    def note(self, line: str) -> None:
        self.screen.print(self.dim(line) + "\n")


def _logs_to(stream: TextIO, err: TextIO) -> Callable[[], None]:
    """Point the command line's log handlers at ``stream`` while the screen is up."""
    moved: list[logging.StreamHandler[Any]] = []
    for name in ("agentloop", "agentloop_local"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is err:
                handler.setStream(stream)
                moved.append(handler)

    def restore() -> None:
        for handler in moved:
            handler.setStream(err)

    return restore


def _screen_fits(args: argparse.Namespace, out: TextIO, err: TextIO) -> bool:
    """The screen UI runs on a terminal (stdin, stdout and stderr), unless ``--plain``."""
    if getattr(args, "plain", False) or os.environ.get("TERM") in (None, "", "dumb"):
        return False
    return _isatty(sys.stdin) and _isatty(out) and _isatty(err) and tui_available()


async def _redraw_on_resize(screen: _Screen) -> None:
    # prompt_toolkit can only watch SIGWINCH on the main thread, which is trio's.
    with trio.open_signal_receiver(signal.SIGWINCH) as resizes:
        async for _ in resizes:
            screen.refresh()


async def _chat_on_screen(plan: Plan, out: TextIO, err: TextIO) -> int:
    tx, rx = trio.open_memory_channel[str](math.inf)
    color = not os.environ.get("NO_COLOR")
    screen = _Screen(trio.lowlevel.current_trio_token(), tx, _history_path(), out, color)
    stream = cast("TextIO", _ScreenStream(screen))
    restore_logs = _logs_to(stream, err)
    saved = _terminal_state()
    chat: _Chat | None = None
    code = EXIT_INTERRUPTED
    try:
        await screen.start()
        async with _interrupts() as interrupts:
            screen.interrupt = interrupts.interrupt
            async with (
                _runtime(plan, os.environ, stream, compact=True) as rt,
                trio.open_nursery() as nursery,
            ):
                if threading.current_thread() is threading.main_thread():
                    nursery.start_soon(_redraw_on_resize, screen)
                printer = _ScreenPrinter(screen, stream)
                chat = _Chat(plan, rt, stream, stream, interrupts, rx, True, plan.options,
                             printer, screen=screen)
                printer.on_usage = chat.on_usage
                await chat.sessions(plan.resume or plan.session or _fresh_id("chat"))
                code = chat.code
                nursery.cancel_scope.cancel()
    finally:
        # Even when cancelled: the terminal must get its mode back, and nothing be lost.
        with trio.move_on_after(10, shield=True):
            await screen.stop()
        restore_logs()
        _restore_terminal(saved)
    if screen.error is not None:
        raise CliError(f"the terminal UI failed: {_error_text(screen.error)}")
    if chat is not None and chat.session_id is not None and plan.db is not None and not plan.quiet:
        err.write(f"session: {chat.session_id}\n")
    return code


