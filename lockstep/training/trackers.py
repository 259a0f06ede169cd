"""Experiment trackers: where a run's config and metrics go besides metrics.jsonl.

`TrainConfig(trackers=(...))` names them; each writes through its own library and offline by
default, so nothing leaves the machine unless the user says so:

- "tensorboard": events under run_dir/tensorboard, the config as hyperparameters (HPARAMS tab).
- "mlflow": an MLflow run; MLFLOW_TRACKING_URI if set, else a file store in run_dir/mlruns
  (MLflow 3 wants MLFLOW_ALLOW_FILE_STORE=true for it, which is then set;
  `mlflow ui --backend-store-uri run_dir/mlruns` shows it).
- "wandb": a Weights & Biases run in run_dir/wandb, mode WANDB_MODE if set, else "offline"
  (`wandb sync` uploads it later).

Only rank 0 (the process that owns the RunLog) opens trackers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from lockstep.training.optional import available, report_missing

INSTALL = {"tensorboard": "pip install tensorboard (or 'lockstep[plots]')",
           "mlflow": "pip install mlflow", "wandb": "pip install wandb"}
"""What to install for each tracker."""
MODULE = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


class Tracker(Protocol):
    def log(self, kind: str, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check(names: tuple[str, ...] | list[str]) -> None:
    """Unknown names are an error at once; a tracker asked for by name but not installed too
    (the user asked for it: finding out after a long run would be worse). TensorBoard, on by
    default, is merely reported when missing (see `open_trackers`)."""
    for name in names:
        if name not in MODULE:
            raise ValueError(f"unknown tracker {name!r}; choose from {sorted(MODULE)}")
        if name != "tensorboard" and not available(MODULE[name]):
            raise ValueError(f"trackers={list(names)} names {name!r}, which is not installed: "
                             f"{INSTALL[name]}")


def open_trackers(names: tuple[str, ...] | list[str], run_dir: Path,
                  config: dict[str, Any]) -> list[Tracker]:
    """The trackers that can run here, each already holding the run's config."""
    opened: list[Tracker] = []
    for name in names:
        if not available(MODULE[name]):
            report_missing(f"{name} logging", INSTALL[name])
            continue
        try:
            opened.append(_OPENERS[name](run_dir, config))
        except ImportError as error:  # installed, yet broken
            if name != "tensorboard":  # asked for by name: the user sees why it failed
                raise
            report_missing(f"{name} logging", f"it is installed but does not import ({error})")
    return opened


def _scalar_params(config: dict[str, Any]) -> dict[str, Any]:
    """Trackers take numbers, strings and booleans: None and objects go as text."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}


class TensorBoard:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        # Written into this run's own event file (SummaryWriter.add_hparams would make a
        # second run folder), with the eval scalars as the metrics the HPARAMS tab shows.
        events = self.writer.file_writer
        assert events is not None  # made by SummaryWriter.__init__
        for summary in hparams(_scalar_params(config), {"eval/loss": 0.0, "eval/accuracy": 0.0}):
            events.add_summary(summary)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        self.writer.close()


class MLflow:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:  # offline: a file store in the run
            # MLflow 3 keeps its file store (needs no database packages) behind this switch.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "lockstep"))
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params(_scalar_params(config))

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({f"{kind}/{k}": float(v) for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Wandb:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        mode: Any = os.environ.get("WANDB_MODE", "offline")  # wandb checks the value
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lockstep"),
                              name=run_dir.name, dir=str(run_dir), config=config, mode=mode)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


_OPENERS: dict[str, Any] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": Wandb}
