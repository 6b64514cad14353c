"""Draw ``benchmarks/peers.png`` from the recorded results of ``run.py --json``.

    python benchmarks/peers/chart.py [RESULTS.json] [OUT.png]

Defaults: ``benchmarks/peers/results.json`` (the run recorded in ``benchmarks/README.md``) and
``benchmarks/peers.png``. Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib as mpl

mpl.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
FLOOR_COLOUR, OURS_COLOUR, PEER_COLOUR = "#9e9e9e", "#1f6fb4", "#e08a2c"


def colour(label: str) -> str:
    if label.startswith("bare"):
        return FLOOR_COLOUR
    return OURS_COLOUR if label.startswith("agentloop") else PEER_COLOUR


def panel(ax: Any, labels: list[str], values: list[float | None], title: str, xlabel: str,
          notes: list[str], log: bool = False, label_from: float = 0.0,
          room: float = 1.45) -> None:
    ys = range(len(labels))
    shown = [v or 0.0 for v in values]
    ax.barh(ys, shown, color=[colour(lab) for lab in labels], height=0.65)
    ax.set_yticks(list(ys), labels)
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    top = max(shown) or 1.0
    if log and any(shown):
        ax.set_xscale("log")
        ax.set_xlim(min((v for v in shown if v), default=1.0) / 2, top * 8)
    else:
        ax.set_xlim(0, top * room)
    for y, v, note in zip(ys, values, notes, strict=True):
        text = "not run" if v is None else note
        ax.text(max(v or ax.get_xlim()[0], label_from), y, "  " + text, va="center",
                fontsize=8.5)
    ax.grid(axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def ratio(value: float | None, floor: float | None, fmt: str) -> str:
    return "" if not value or not floor else format(value / floor, fmt)


def wire_panel(ax: Any, w5: dict[str, Any]) -> None:
    """W5: CPU per step over loopback HTTP, each entry with its own client (log scale)."""
    names = {"floor": "bare httpx (floor)", "agentloop": "agentloop"}
    entries = list(w5["entries"])
    labels = [names.get(e, e) for e in entries]
    values = [w5["entries"][e]["cpu_us_per_step"] for e in entries]
    notes = [f"{v:,.0f} us  ({w5['entries'][e]['x_floor']:.2f}x floor)"
             for e, v in zip(entries, values, strict=True)]
    shades = [FLOOR_COLOUR if e == "floor" else OURS_COLOUR if e == "agentloop" else PEER_COLOUR
              for e in entries]
    ys = range(len(labels))
    ax.barh(ys, values, color=shades, height=0.65)
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 2, max(values) * 8)
    for y, v, note in zip(ys, values, notes, strict=True):
        ax.text(v, y, "  " + note, va="center", fontsize=8.5)
    ax.set_title(f"W5: the W1 turn over loopback HTTP, CPU per step ({w5['rounds']} rounds, "
                 "log scale)", fontsize=11, loc="left")
    ax.set_xlabel("CPU microseconds per step of the client process (lower is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def yardstick_panel(ax: Any, y: dict[str, Any]) -> None:
    """The yardstick's ratios before and after, beside the issue's goals."""
    rows = [("W1, x floor", "w1_x_floor", "w1"), ("W1 + 1 subscriber, x W1", "sub1_x", "sub1"),
            ("W2, x floor", "w2_x_floor", "w2"), ("W3 idle agent, KB", "w3_kb", "w3")]
    labels = [r[0] for r in rows]
    ys = list(range(len(rows)))
    before = [y["before"][r[1]] for r in rows]
    after = [y["after"][r[1]] for r in rows]
    names = (y["before"].get("label", "before"), y["after"].get("label", "after"))
    ax.barh([v - 0.2 for v in ys], before, height=0.38, color=FLOOR_COLOUR, label=names[0])
    ax.barh([v + 0.2 for v in ys], after, height=0.38, color=OURS_COLOUR, label=names[1])
    for v, r, b, a in zip(ys, rows, before, after, strict=True):
        goal = y["goals"][r[2]]
        ax.plot([goal, goal], [v - 0.45, v + 0.45], color="black", linewidth=1.2)
        ax.text(max(b, a, goal), v, f"  {b:.2f} -> {a:.2f} (goal {goal:g})", va="center",
                fontsize=8.5)
    ax.set_yticks(ys, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, max(before + after) * 1.6)
    trees = (y["before"]["tree"], y["after"]["tree"])
    which = (f"{names[0]} and {names[1]} ({trees[0]})" if trees[0] == trees[1]
             else f"{names[0]} ({trees[0]}) and {names[1]} ({trees[1]})")
    ax.set_title(f"Yardstick: {which}, {y['rounds']} rounds; black: goal", fontsize=11,
                 loc="left")
    ax.set_xlabel("ratio, or KB (lower is better)")
    ax.legend(loc="lower right", fontsize=8.5)
    ax.grid(axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE.parent / "peers.png"
    data = json.loads(source.read_text())
    rows: dict[str, dict[str, Any]] = data["results"]
    floor = rows[data["floor"]]
    labels = list(rows)

    w1 = [rows[lab].get("w1_us") for lab in labels]
    w2 = [rows[lab].get("w2_us_per_step") for lab in labels]
    w3 = [b / 1024 if (b := rows[lab].get("w3_bytes")) else None for lab in labels]
    w4 = [rows[lab].get("w4_ratio") for lab in labels]
    w1_notes = [f"{v:,.0f} us  ({ratio(v, floor.get('w1_us'), '.1f')}x floor)" if v else ""
                for v in w1]
    w2_notes = [
        f"{v:,.0f} us, {rows[lab]['w2_ms_per_run']:.2f} ms/run  "
        f"({ratio(v, floor.get('w2_us_per_step'), '.1f')}x); "
        f"peak {rows[lab]['w2_peak_bytes'] / 1024:,.0f} KB/run" if v else ""
        for lab, v in zip(labels, w2, strict=True)
    ]
    w3_floor = (floor.get("w3_bytes") or 0) / 1024
    w3_notes = [f"{v:.1f} KB  ({ratio(v, w3_floor, '.1f')}x)" if v else "" for v in w3]
    w4_notes = [f"{v:.2f}x" if v else "" for v in w4]

    extra = [k for k in ("w5", "yardstick") if k in data]
    height = 1.1 * len(labels) + 3.2
    fig = plt.figure(figsize=(16, height + (0.45 * height if extra else 0)))
    rows_of = 3 if extra else 2
    heights = [1.0, 1.0, 0.8] if extra else [1.0, 1.0]
    spec = fig.add_gridspec(rows_of, 2, height_ratios=heights)
    first = fig.add_subplot(spec[0, 0])
    axes = [first, fig.add_subplot(spec[0, 1], sharey=first),
            fig.add_subplot(spec[1, 0], sharey=first), fig.add_subplot(spec[1, 1], sharey=first)]
    # The panels share one y axis: inverting it once puts the first row on top everywhere.
    axes[0].invert_yaxis()
    panel(axes[0], labels, w1, "W1: time per step (log scale)",
          "microseconds per step (lower is better)", w1_notes, log=True)
    runs, steps = next((r["w2_size"] for r in rows.values() if "w2_size" in r), [500, 5])
    panel(axes[1], labels, w2, f"W2: {runs:,} runs at once, {steps} steps each (log scale)",
          "wall time per step of all the runs, microseconds (lower is better)", w2_notes,
          log=True)
    panel(axes[2], labels, w3, "W3: memory per idle agent (2 messages)",
          "KB traced per agent (lower is better)", w3_notes, room=1.6)
    axes[1].set_xlim(right=axes[1].get_xlim()[1] * 6)  # room for the longer notes
    for ax in axes[1::2]:
        ax.tick_params(axis="y", length=0)
    sizes = next((r["w4_sizes"] for r in rows.values() if "w4_sizes" in r), [10, 1000])
    panel(axes[3], labels, w4, f"W4: step time at {sizes[1]:,} vs {sizes[0]} messages",
          "ratio (1.0 = flat; shaded: within 10%)", w4_notes, label_from=1.1)
    axes[3].axvline(1.0, color="black", linewidth=0.8)
    axes[3].axvspan(0.9, 1.1, color="green", alpha=0.08)
    if "w5" in data:
        wire_panel(fig.add_subplot(spec[2, 0]), data["w5"])
    if "yardstick" in data:
        yardstick_panel(fig.add_subplot(spec[2, 1]), data["yardstick"])
    m = data["machine"]
    fig.suptitle(
        f"agentloop beside its peers: zero-latency test models, {data['rounds']} interleaved "
        f"rounds, medians  ({m['cpu']}, {m['cpus']} cpus, Python {m['python']}, "
        f"{data['date']})",
        fontsize=12, x=0.01, ha="left",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
