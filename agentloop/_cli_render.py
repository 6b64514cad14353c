"""What ``agentloop chat``'s terminal UI draws, as plain functions of text and numbers.

Markdown is cut into blocks as it streams (:class:`MarkdownBlocks`); each closed block is
rendered once with rich (:class:`MarkdownRenderer`) and the open one is drawn live, only its
tail; the status line says the route, the turn, the tokens used and the context left. Nothing
here touches the terminal: :mod:`agentloop._cli_screen` does.
"""

from __future__ import annotations

import importlib.util
import io
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs

# The command line is the top layer: it uses only what any program embedding agentloop can.
from agentloop import (
    Config,
    SessionEvent,
)

_FENCE: Final = re.compile(r"^(\s*)(`{3,}|~{3,})")
_HEADING: Final = re.compile(r"^#{1,6}(\s|$)")
_PADDING: Final = re.compile(r" +\n")


def tui_available() -> bool:
    """Whether the ``tui`` extra (prompt_toolkit and rich) is installed."""
    return all(importlib.util.find_spec(name) is not None for name in ("prompt_toolkit", "rich"))


@attrs.frozen(eq=False)
class OpenBlock:
    """What has arrived of the block still open: a view that later input leaves unchanged
    (its lists only grow past the counts, or are replaced)."""

    lines: list[str]
    count: int
    parts: list[str]
    parts_count: int
    fence: str | None

    @property
    def empty(self) -> bool:
        return not self.count and not self.parts_count


class MarkdownBlocks:
    """Cuts streamed markdown into top-level blocks as they close, looking at each line once.

    A block closes at a blank line followed by a line that is not indented (an indented one
    continues a list item), at a heading, at a fence that opens a code block, and at the fence
    that closes it; blank lines inside a fence do not count. Rendering each closed block once
    keeps a long answer linear.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._parts: list[str] = []  # the incomplete last line, as it arrived
        self._fence: str | None = None
        self._fence_line = ""
        self._fence_nested = False  # an indented fence inside a list item ends no block
        self._gap = False

    def feed(self, delta: str) -> list[str]:
        """Add ``delta``; the blocks it closed, in order."""
        if "\n" not in delta:
            if delta:
                self._parts.append(delta)
            return []
        first, *middle, last = delta.split("\n")
        self._parts.append(first)
        lines = ["".join(self._parts), *middle]
        # A fresh list, not a cleared one: a view of the old one stays valid.
        self._parts = [last] if last else []
        done: list[str] = []
        for line in lines:
            self._line(line, done)
        return done

    def finish(self) -> str | None:
        """The open block with its incomplete last line, or None; then nothing is open."""
        partial = "".join(self._parts)
        lines = [*self._lines, partial] if partial else self._lines
        self._lines, self._parts = [], []
        self._fence, self._gap = None, False
        text = "\n".join(lines)
        return text if text.strip() else None

    def view(self) -> OpenBlock:
        fence = self._fence_line if self._fence is not None else None
        return OpenBlock(self._lines, len(self._lines), self._parts, len(self._parts), fence)

    def _close(self) -> str:
        text = "\n".join(self._lines)
        self._lines = []
        self._gap = False
        return text

    def _line(self, line: str, done: list[str]) -> None:
        if self._fence is not None:
            self._lines.append(line)
            fence = _FENCE.match(line)
            if (fence is not None and fence.group(2).startswith(self._fence)
                    and not line[fence.end():].strip()):
                self._fence = None
                if not self._fence_nested:
                    done.append(self._close())
            return
        if not line.strip():
            self._gap = bool(self._lines)
            return
        fence = _FENCE.match(line)
        indented = line[0] in " \t"
        heading = not indented and _HEADING.match(line) is not None
        if self._lines and (heading or (not indented and (self._gap or fence is not None))):
            done.append(self._close())
        elif self._gap:
            self._lines.append("")
        self._gap = False
        self._lines.append(line)
        if fence is not None:
            self._fence, self._fence_line = fence.group(2), line
            self._fence_nested = len(self._lines) > 1
        elif heading:
            done.append(self._close())


class MarkdownRenderer:
    """Markdown to ANSI text with rich; one per thread (a rich ``Console`` is not shared)."""

    def __init__(self) -> None:
        from rich.console import Console

        self._buffer = io.StringIO()
        # NO_COLOR is honoured by rich itself: styles stay, colours go.
        self._console = Console(file=self._buffer, force_terminal=True, highlight=False,
                                emoji=False, width=80)

    def render(self, text: str, width: int) -> str:
        from rich.markdown import Markdown

        self._console.width = max(20, width)
        self._console.print(Markdown(text, hyperlinks=False))
        out = self._buffer.getvalue()
        self._buffer.seek(0)
        self._buffer.truncate()
        # Rich pads lines to the width (they would wrap if the terminal narrows) and spaces
        # its elements apart; blocks printed one by one are spaced by the printer.
        return _PADDING.sub("\n", out).strip("\n") + "\n"


LiveDraw = Callable[[MarkdownRenderer, int, int], str]
"""Draws the live area above the prompt: given a renderer, the width and the rows it may use."""


def _dim_text(text: str, color: bool) -> str:
    return f"\x1b[2m{text}\x1b[0m" if color else text


def live_markdown(view: OpenBlock) -> LiveDraw | None:
    """The open block, rendered; only its tail is drawn, so a redraw costs at most a screen."""
    if view.empty:
        return None

    def draw(markdown: MarkdownRenderer, width: int, rows: int) -> str:
        lines = view.lines[max(0, view.count - rows):view.count]
        if view.fence is not None and view.count > rows:
            lines.insert(0, view.fence)
        partial = "".join(view.parts[:view.parts_count])[-width * rows:]
        if partial:
            lines.append(partial)
        rendered = markdown.render("\n".join(lines), width).rstrip("\n").split("\n")
        return "\n".join(rendered[-rows:]) + "\n"

    return draw


def live_reasoning(parts: list[str], count: int, color: bool) -> LiveDraw:
    """The end of the reasoning streaming now, dimmed, on at most two rows."""

    def draw(markdown: MarkdownRenderer, width: int, rows: int) -> str:
        budget = max(20, 2 * width - 12)
        tail: list[str] = []
        size, i = 0, count
        while i > 0 and size < budget:
            i -= 1
            tail.append(parts[i])
            size += len(parts[i])
        flat = " ".join("".join(reversed(tail)).split())[-budget:]
        return _dim_text(f"thinking… {flat}", color) + "\n"

    return draw


def context_use(usage: object) -> int | None:
    """The tokens a model call's request and reply took: what the context holds after it."""
    if not isinstance(usage, Mapping):
        return None
    counts = [usage.get(k) for k in
              ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")]
    values = [v for v in counts if isinstance(v, int) and not isinstance(v, bool)]
    return sum(values) if values else None


def last_context_use(events: Sequence[SessionEvent]) -> int | None:
    """``context_use`` of the session's latest model call that reported usage."""
    for e in reversed(events):
        if e.type == "assistant/message":
            used = context_use(e.data.get("usage"))
            if used is not None:
                return used
    return None


# Well-known context windows, by model-name prefix; anything else is told by the adapter
# (the local model's ``n_ctx``) or by ``[compact] max_context_tokens``.
_CONTEXT_WINDOWS: Final = (
    ("gpt-4.1", 1_047_576), ("gpt-4o", 128_000), ("deepseek-", 128_000), ("claude-", 200_000),
)


def context_window(adapter: object, model: str | None, config: Config) -> int | None:
    """The model's context window in tokens, or None when nothing says."""
    configured = config.section("compact").get("max_context_tokens")
    told = [getattr(source, "context_tokens", None)
            for source in (adapter, getattr(adapter, "wrapped", None))]
    for value in (configured, *told):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for prefix, size in _CONTEXT_WINDOWS:
        if model and model.startswith(prefix):
            return size
    return None


def status_line(
    *, route: str, session: str, turn: int, tokens: int, window: int | None,
    used: int | None, busy: bool,
) -> str:
    """The status bar: route, turn, tokens so far, the context left, whether a turn runs, and
    the session (what a narrow terminal cuts off comes last)."""
    parts = [route, f"turn {turn}", f"{tokens:,} tokens"]
    if window is None:
        parts.append("context left unknown")
    else:
        left = max(0, window - (used or 0))
        parts.append(f"context left {left:,}/{window:,} ({left * 100 // window}%)")
    parts.append("running, Ctrl-C cancels" if busy else "idle")
    parts.append(f"session {session}")
    return " · ".join(parts)


