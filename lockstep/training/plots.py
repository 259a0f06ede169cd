"""training.png: one picture of a run from its metrics.jsonl and config.json.

Four panels -- loss (train and test), test accuracy, learning rate, throughput -- and, for
a run with a step timeline, two of its attribution (step time; communication hidden and the
slowest rank, named where it fell behind), under a title that names the run and its main
settings, so a PNG passed around still says what it shows. Needs matplotlib; without it
the plot is skipped and the user told once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lockstep.training.optional import report_missing

_SHOWN = ("global_batch_size", "max_batch_per_rank", "epochs", "max_steps", "lr",
          "base_batch_size", "warmup_steps", "decay", "grad_clip_norm", "precision", "mode",
          "zero", "compress", "algorithm", "seed")
"""Config fields worth a place in the title (all of them are in config.json)."""

ENV = "LOCKSTEP_PLOT"
"""Set to 0, the Trainer draws no training.png (matplotlib takes up to a second at the end
of a run; the test suite, which runs hundreds, sets it)."""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A resumed run re-logs the steps after its checkpoint: keep the latest of each."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        latest[(r["kind"], r["step"])] = r
    return sorted(latest.values(), key=lambda r: (r["kind"], r["step"]))


def config_line(run_dir: Path) -> str:
    """The run's main settings in one line ('' without a config.json)."""
    path = run_dir / "config.json"
    if not path.is_file():
        return ""
    config = json.loads(path.read_text())
    return ", ".join(f"{k}={config[k]}" for k in _SHOWN
                     if config.get(k) not in (None, "none", "auto", "native", "sync", "fp32", 0)
                     or k in ("global_batch_size", "lr", "seed"))


def plot_at_end(run_dir: Path) -> None:
    """The Trainer's picture of the run it finished, unless LOCKSTEP_PLOT=0."""
    if os.environ.get(ENV, "1") != "0":
        plot_run(run_dir)


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    """Write the run's PNG (run_dir/training.png by default). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report_missing("training.png", "pip install matplotlib (or 'lockstep[plots]')")
        return None
    panels = _panels(last_per_step(read_metrics(run_dir)))
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows))
    for ax, (_, draw) in zip(axes.flat, panels, strict=True):
        draw(ax)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
    name = f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name else run_dir.name
    fig.suptitle(f"{name}\n{_wrap(config_line(run_dir))}", fontsize=10)
    fig.tight_layout()
    out = out or run_dir / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


Panel = tuple[str, Callable[[Any], None]]


def _panels(records: list[dict[str, Any]]) -> list[Panel]:
    """What the picture shows, in order: four panels, and two more for the step timeline's
    attribution when the run recorded one (TrainConfig(timeline=...), lockstep run
    --timeline)."""
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    timeline = [r for r in records if r["kind"] == "timeline"]
    panels: list[Panel] = [
        ("loss", lambda ax: _loss(ax, train, evals)),
        ("test accuracy", lambda ax: _accuracy(ax, evals)),
        ("learning rate", lambda ax: _series(ax, train, "lr", "learning rate", "tab:purple")),
        ("throughput", lambda ax: _series(ax, train, "samples_per_s",
                                          "throughput (samples/s)", "tab:orange"))]
    if timeline:
        panels += [("step time", lambda ax: _series(ax, timeline, "timeline_step_ms",
                                                    "step time (ms), slowest rank", "tab:blue")),
                   ("communication and stragglers", lambda ax: _who_waited(ax, timeline))]
    return panels


def panel_titles(run_dir: Path) -> list[str]:
    return [title for title, _ in _panels(last_per_step(read_metrics(run_dir)))]


def _who_waited(ax: Any, timeline: list[dict[str, Any]]) -> None:
    """The share of communication hidden behind backward, and how far the slowest rank's
    own work was behind the others' -- with the rank and its cause where it passed 10%."""
    steps = [r["step"] for r in timeline]
    ax.plot(steps, [100 * r["timeline_hidden"] for r in timeline], color="tab:green",
            lw=1, label="communication hidden behind backward (%)")
    ax.plot(steps, [100 * r["timeline_behind"] for r in timeline], color="tab:red", lw=1,
            label="slowest rank behind the others (%)")
    for r in timeline:
        if r["timeline_behind"] > 0.10:
            ax.annotate(f"rank {r['timeline_slowest']}", (r["step"], 100 * r["timeline_behind"]),
                        fontsize=7, color="tab:red")
    last = timeline[-1]
    ax.set_title(f"communication and stragglers\nlast window: rank {last['timeline_slowest']} "
                 f"slowest ({last['timeline_cause']})", fontsize=10)
    ax.legend(loc="lower left", fontsize=8)


def _wrap(text: str, width: int = 130) -> str:
    """Break a 'k=v, k=v, ...' line between items, not inside one."""
    lines: list[str] = []
    for part in text.split(", ") if text else []:
        if lines and len(lines[-1]) + len(part) + 2 <= width:
            lines[-1] += f", {part}"
        else:
            lines.append(part)
    return "\n".join(lines)


def _loss(ax: Any, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    values = [r["loss"] for r in train + evals if r.get("loss", 0) > 0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="test")
    if values and max(values) / min(values) > 30:  # a log axis only pays across decades
        from matplotlib.ticker import LogLocator, ScalarFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_title("loss")
    ax.legend()


def _accuracy(ax: Any, evals: list[dict[str, Any]]) -> None:
    ax.set_title("test accuracy")
    points = [(r["step"], r["accuracy"]) for r in evals if "accuracy" in r]
    if not points:
        ax.text(0.5, 0.5, "no evaluation", ha="center", va="center", transform=ax.transAxes)
        return
    ax.plot(*zip(*points, strict=True), "o-", color="tab:green")
    step, accuracy = points[-1]
    if len(points) == 1:  # the run's whole span, as the other panels show it
        ax.set_xlim(0, step * 1.05)
    note = "one evaluation, at the end" if len(points) == 1 else f"last, at step {step}"
    # In a corner, where a rising curve is not: a label on the point would cover the line.
    ax.text(0.98, 0.04, f"{accuracy:.4f} ({note})", transform=ax.transAxes, ha="right")


def _series(ax: Any, records: list[dict[str, Any]], key: str, title: str, color: str) -> None:
    """A rate over the steps, from zero: a constant one reads as constant, not as noise."""
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
        ax.plot(*zip(*points, strict=True), color=color, lw=1)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
