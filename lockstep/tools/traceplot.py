"""A picture of a step timeline: the last steps of a merged trace (comm/timeline.py's Chrome
trace event file), one row per rank and track, a bar per span coloured by what it was.

    python -m lockstep.tools.traceplot runs/gpt/timeline.json trace.png [--steps 2]

Perfetto and chrome://tracing show the whole file interactively; this is for a page (the
README's picture) or a report. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = {"data": "data", "forward": "forward", "backward": "backward",
         "optimizer": "optimizer", "wait for communication": "waiting"}
COLOURS = {"data": "#8da0cb", "forward": "#66c2a5", "backward": "#fc8d62",
           "optimizer": "#e78ac3", "waiting": "#d62728", "communication": "#a6d854",
           "other": "#b3b3b3"}


@dataclass
class Bar:
    row: str
    kind: str
    start_ms: float
    length_ms: float


def kind_of(name: str, category: str) -> str:
    if category == "comm":
        return "communication"
    return KINDS.get(name, "other")


def bars(trace: dict[str, Any], steps: int) -> tuple[list[str], list[Bar], list[int]]:
    """The rows (rank, track) and bars of the last `steps` training steps every rank kept
    (a step that also evaluated or saved would dwarf the others; taken only if there are
    too few without), times from the first of them; and those steps' numbers."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"].split(" (")[0] for e in events  # "rank 3"
             if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    kept = set.intersection(*({e["args"]["step"] for e in spans if e["pid"] == pid}
                              for pid in names)) if names else set()
    busy = {e["args"]["step"] for e in spans if kind_of(e["name"], e["cat"]) == "other"}
    plain = sorted(kept - busy)
    chosen = plain[-steps:] if len(plain) >= steps else sorted(kept)[-steps:]
    shown = [e for e in spans if e["args"]["step"] in chosen]
    if not shown:
        return [], [], []
    origin = min(e["ts"] for e in shown)
    rows = [f"{names[pid]} {track}" for pid in sorted(names) for track in ("compute", "comm")
            if any(e["pid"] == pid and e["cat"] == track for e in shown)]
    return rows, [Bar(f"{names[e['pid']]} {e['cat']}", kind_of(e["name"], e["cat"]),
                      (e["ts"] - origin) / 1000, e["dur"] / 1000) for e in shown], chosen


def draw(trace_path: str | Path, out: str | Path, steps: int = 2) -> list[str]:
    """Write the picture; returns its rows, top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    trace = json.loads(Path(trace_path).read_text())
    rows, drawn, chosen = bars(trace, steps)
    if not rows:
        raise ValueError(f"{trace_path}: no step that every rank kept")
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.4))
    y = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    # Outer spans first (backward holds its waits): longer bars under shorter ones.
    for bar in sorted(drawn, key=lambda b: -b.length_ms):
        ax.broken_barh([(bar.start_ms, max(bar.length_ms, 0.05))], (y[bar.row] - 0.4, 0.8),
                       facecolors=COLOURS[bar.kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), list(reversed(rows)))
    ax.set_xlabel("ms")
    error = trace.get("otherData", {}).get("clock_alignment_error_us")
    numbers = f"step {chosen[0]}" if len(chosen) == 1 else f"steps {chosen[0]}-{chosen[-1]}"
    ax.set_title(f"{numbers} of {Path(trace_path).name}"
                 + (f"; clocks aligned to within {error:.0f} us" if error is not None else ""))
    used = sorted({b.kind for b in drawn}, key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(used), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=2, help="how many of the last steps")
    args = p.parse_args(argv)
    rows = draw(args.trace, args.out, args.steps)
    print(f"{args.out}: {len(rows)} rows ({', '.join(rows)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
