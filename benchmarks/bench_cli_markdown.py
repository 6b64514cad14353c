"""Cost of rendering a streamed answer as markdown in ``agentloop chat``'s screen UI.

The printer feeds each text delta to ``MarkdownBlocks`` and renders every block once, when it
closes; the live area redraws only the tail of the open block, at most every 30 ms. Compared
with re-rendering the whole answer on every delta (the naive way), which is quadratic.

    python benchmarks/bench_cli_markdown.py [--quick]
"""

from __future__ import annotations

import sys
import time

from agentloop._cli_render import MarkdownBlocks, MarkdownRenderer, live_markdown

PARAGRAPH = ("The scheduler keeps **the model's order** for results, while `parallel` calls "
             "share a bounded pool; an *exclusive* call waits for everything before it.\n\n")
LIST = "".join(f"- item {i} with `code` and **bold**\n" for i in range(6)) + "\n"
CODE = "```python\n" + "".join(f"x_{i} = compute({i})  # step {i}\n" for i in range(20)) + "```\n\n"
UNIT = "## Section\n\n" + PARAGRAPH * 3 + LIST + CODE


def answer(units: int) -> str:
    return UNIT * units


def deltas(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def streamed(text: str, width: int = 100) -> float:
    """Seconds to split and render ``text`` block by block, plus one live draw per 30 ms
    worth of deltas (a redraw every 25 deltas at 800 deltas/s)."""
    blocks, out, live = MarkdownBlocks(), MarkdownRenderer(), MarkdownRenderer()
    start = time.perf_counter()
    for i, delta in enumerate(deltas(text)):
        for block in blocks.feed(delta):
            out.render(block, width)
        if i % 25 == 0:
            draw = live_markdown(blocks.view())
            if draw is not None:
                draw(live, width, 26)
    rest = blocks.finish()
    if rest is not None:
        out.render(rest, width)
    return time.perf_counter() - start


def naive(text: str, width: int = 100) -> float:
    """Seconds to re-render everything received so far at each redraw (every 25 deltas)."""
    out = MarkdownRenderer()
    start = time.perf_counter()
    received = ""
    for i, delta in enumerate(deltas(text)):
        received += delta
        if i % 25 == 0:
            out.render(received, width)
    return time.perf_counter() - start


def main() -> None:
    quick = "--quick" in sys.argv
    streamed(answer(1))  # warm up rich and pygments
    for units in (1, 2) if quick else (5, 10, 20, 40):
        text = answer(units)
        seconds = streamed(text)
        print(f"{len(text):>8,} chars, {len(deltas(text)):>6,} deltas: block by block "
              f"{seconds * 1000:8.1f} ms ({seconds / len(deltas(text)) * 1e6:5.1f} us/delta)")
    for units in (1,) if quick else (5, 10, 20):
        text = answer(units)
        seconds = naive(text)
        print(f"{len(text):>8,} chars: whole answer re-rendered per redraw "
              f"{seconds * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
