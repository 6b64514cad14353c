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

    fig, grid = plt.subplots(2, 2, figsize=(16, 1.1 * len(labels) + 3.2), sharey=True)
    axes = grid.flatten()
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
    m = data["machine"]
    fig.suptitle(
        f"agentloop beside its peers: zero-latency test models, {data['rounds']} interleaved "
        f"rounds, medians  ({m['cpu']}, {m['cpus']} cpus, Python {m['python']}, "
        f"{data['date']})",
        fontsize=12, x=0.01, ha="left",
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
