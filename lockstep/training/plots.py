"""training.png: one picture of a run from its metrics.jsonl and config.json.

Four panels -- loss (train and test), test accuracy, learning rate, throughput -- under a
title that names the run and its main settings, so a PNG passed around still says what it
shows. Needs matplotlib; without it the plot is skipped and the user told once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lockstep.training.optional import report_missing

_SHOWN = ("global_batch_size", "max_batch_per_rank", "epochs", "max_steps", "lr",
          "base_batch_size", "warmup_steps", "decay", "grad_clip_norm", "precision", "mode",
          "zero", "compress", "algorithm", "seed")
"""Config fields worth a place in the title (all of them are in config.json)."""


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
                     if config.get(k) not in (None, "none", "native", "sync", "fp32", 0)
                     or k in ("global_batch_size", "lr", "seed"))


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    """Write the run's PNG (run_dir/training.png by default). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report_missing("training.png", "pip install matplotlib (or 'lockstep[plots]')")
        return None
    records = last_per_step(read_metrics(run_dir))
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _loss(axes[0][0], train, evals)
    _accuracy(axes[0][1], evals)
    _series(axes[1][0], train, "lr", "learning rate", "tab:purple")
    _series(axes[1][1], train, "samples_per_s", "throughput (samples/s)", "tab:orange")
    axes[1][0].set_ylim(bottom=0)  # a constant rate reads as constant, not as noise
    axes[1][1].set_ylim(bottom=0)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
    name = f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name else run_dir.name
    fig.suptitle(f"{name}\n{_wrap(config_line(run_dir))}", fontsize=10)
    fig.tight_layout()
    out = out or run_dir / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


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


def _series(ax: Any, train: list[dict[str, Any]], key: str, title: str, color: str) -> None:
    points = [(r["step"], r[key]) for r in train if key in r]
    if points:
        ax.plot(*zip(*points, strict=True), color=color, lw=1)
    ax.set_title(title)
