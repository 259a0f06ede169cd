"""What a run leaves behind for people: a progress bar, config.json, metrics.jsonl, the
trackers asked for (TensorBoard by default, when installed; see trackers.py), and a PNG of
the run (plots.py). Rank 0 only."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from lockstep.logs import get_logger
from lockstep.training.plots import plot_at_end, plot_run, read_metrics
from lockstep.training.trackers import Tracker, open_trackers

log = get_logger(__name__)
CONFIG = "config.json"

__all__ = ["CONFIG", "RunLog", "Window", "plot_at_end", "plot_run", "read_metrics", "recorded_eval"]


def recorded_eval(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The evaluation a run recorded at `step` (metrics.jsonl), or None (none, or a damaged
    log: evaluate instead)."""
    try:
        found = [r for r in read_metrics(run_dir) if isinstance(r, dict)
                 and r.get("kind") == "eval" and r.get("step") == step]
    except (OSError, ValueError):
        return None
    return found[-1] if found else None


class RunLog:
    """Records metrics for one run folder. Every method is a no-op off the main rank."""

    def __init__(self, run_dir: Path, is_main: bool, total_steps: int, first_step: int,
                 progress: bool = True, config: dict[str, Any] | None = None,
                 trackers: tuple[str, ...] | list[str] = ("tensorboard",)) -> None:
        self.run_dir, self.is_main = run_dir, is_main
        self._bar: Any = None
        self._trackers: list[Tracker] = []
        self._jsonl: Any = None
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:  # what this run was asked to do, next to what it did
            (run_dir / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        self._jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        self._trackers = open_trackers(trackers, run_dir, config or {})
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def record(self, kind: str, step: int, **values: float | str) -> None:
        """One line of metrics.jsonl; its numbers go to the trackers too (a word, such as
        a straggler's cause, only to the file)."""
        if not self.is_main:
            return
        assert self._jsonl is not None
        self._jsonl.write(json.dumps({"kind": kind, "step": step, "time": time.time(),
                                      **values}) + "\n")
        self._jsonl.flush()
        numbers = {k: v for k, v in values.items() if isinstance(v, int | float)}
        for tracker in self._trackers:
            tracker.log(kind, step, numbers)

    def progress(self, steps: int, **shown: str) -> None:
        """Advance the bar by `steps`; new figures for its right-hand side, if given."""
        if self._bar is not None:
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            self._bar.update(steps)

    def train_window(self, step: int, epoch: int, loss: float, window: Window,
                     global_batch: int, wire: dict[str, Any], lr: float,
                     **extra: float) -> None:
        """A logged window of training: its line in metrics.jsonl (and the trackers), and
        its figures on the progress bar."""
        speed = window.steps * global_batch / max(window.elapsed(), 1e-9)
        if "skipped_steps" in wire:
            extra["skipped_steps"] = wire["skipped_steps"]
        self.record("train", step, loss=loss, samples_per_s=speed, lr=lr, epoch=epoch,
                    bytes_sent=wire["bytes_sent"], compression=wire["compression_ratio"],
                    **extra)
        shown = {"loss": f"{loss:.4f}", "samples_s": f"{speed:.0f}",
                 "sent/step": f"{wire['bytes_sent'] / 1e6:.2f}MB"}
        if wire["compression_ratio"] > 1.0:
            shown["compression"] = f"{wire['compression_ratio']:.1f}x"
        self.progress(0, **shown)

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
        for tracker in self._trackers:
            tracker.close()
        if self._jsonl is not None:
            self._jsonl.close()


class Window:
    """The steps since the metrics were last recorded."""

    def __init__(self) -> None:
        self.steps, self.kept, self.loss = 0, 0, 0.0  # kept: not dropped as non-finite
        self.started = time.perf_counter()

    def add(self, loss: float | None) -> None:
        self.steps += 1
        if loss is not None:
            self.kept, self.loss = self.kept + 1, self.loss + loss

    def mean_loss(self) -> float:
        return self.loss / max(self.kept, 1)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
