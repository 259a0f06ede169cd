"""What a run leaves behind for people: a progress bar, metrics.jsonl, TensorBoard events when
TensorBoard is installed, and a PNG of loss, accuracy and throughput. Rank 0 only."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from lockstep.logs import get_logger

log = get_logger(__name__)


class RunLog:
    """Records metrics for one run folder. Every method is a no-op off the main rank."""

    def __init__(self, run_dir: Path, is_main: bool, total_steps: int, first_step: int,
                 progress: bool = True) -> None:
        self.run_dir, self.is_main = run_dir, is_main
        self._bar: Any = None
        self._tensorboard: Any = None
        self._jsonl: Any = None
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass  # optional: metrics.jsonl and the PNG carry the same numbers
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def record(self, kind: str, step: int, **values: float) -> None:
        if not self.is_main:
            return
        assert self._jsonl is not None
        self._jsonl.write(json.dumps({"kind": kind, "step": step, "time": time.time(),
                                      **values}) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(f"{kind}/{name}", value, step)

    def progress(self, steps: int, **shown: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(steps)

    def message(self, text: str) -> None:
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            log.info(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._jsonl is not None:
            self._jsonl.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    """Loss, accuracy and throughput against step, as one PNG. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = _last_per_step(read_metrics(run_dir))
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="test")
        ax_acc.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-",
                    color="tab:green")
    ax_loss.set(title="loss", xlabel="step", yscale="log")
    ax_loss.legend()
    ax_acc.set(title="test accuracy", xlabel="step")
    ax_speed.plot([r["step"] for r in train], [r["samples_per_s"] for r in train],
                  color="tab:orange", lw=1)
    ax_speed.set(title="throughput (samples/s)", xlabel="step", ylim=(0, None))
    for ax in (ax_loss, ax_acc, ax_speed):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = out or run_dir / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A resumed run re-logs the steps after its checkpoint: keep the latest of each."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        latest[(r["kind"], r["step"])] = r
    return sorted(latest.values(), key=lambda r: (r["kind"], r["step"]))
