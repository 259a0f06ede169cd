"""A run's checkpoints: when one is due, writing it, and picking a run up from one.

A checkpoint holds the model and optimizer (checkpoint.py's format: any world size, any
ZeRO stage), the run's position (`RunState`: epoch, step in it, global step) with the
sampler's state, the learning-rate scheduler, the loss scaler and the config. Resuming
refuses a checkpoint of another run (another global batch, dataset or data order): it would
repeat or skip samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep import comm
from lockstep.comm.world import World
from lockstep.training import checkpoint, jobnote, rank_state
from lockstep.training.sampler import ShardedSampler


@dataclass
class CheckpointConfig:
    """When checkpoints are written and what a run resumes from."""

    every_steps: int | None = None
    """Write a checkpoint every this many steps; None: at the end of every epoch."""
    keep: int = 3
    """How many recent checkpoints to keep."""
    resume: str = "auto"
    """"auto": continue from the newest valid checkpoint in run_dir, if any; "never": start
    fresh; or the path of a checkpoint folder."""

    def validate(self) -> None:
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise ValueError(f"resume={self.resume!r}: not 'auto', 'never' or a folder")
        if self.keep < 1 or (self.every_steps is not None and self.every_steps < 1):
            raise ValueError(f"checkpoint keep must be >= 1 and every_steps >= 1 or None; got "
                             f"{self.keep} and {self.every_steps}")


@dataclass
class RunState:
    """Where training is: what callbacks see and what a checkpoint records."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    last_loss: float = float("nan")
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Checkpoints:
    """The checkpoints of one run, in `run_dir/checkpoints`."""

    config: CheckpointConfig
    root: Path
    # The world and the parallel model (trainer.Replica) now, asked at each use: under
    # elastic= both change, and holding the old model would hold its group's connections
    # open through a regroup (a peer blocked on them waited out its collective timeout)
    current: Callable[[], tuple[World, Any]]
    optimizer: Any
    sampler: ShardedSampler
    global_batch: int
    steps_per_epoch: int
    record: Callable[[], dict[str, Any]]  # the run's config, as JSON
    seed: int = 0
    scheduler: Any = None
    scaler: Any = None
    seconds: float = 0.0  # spent writing, left out of the throughput

    @property
    def world(self) -> World:
        return self.current()[0]

    @property
    def model(self) -> Any:
        return self.current()[1]

    def due(self, state: RunState, epoch_done: bool, total_steps: int) -> bool:
        if not self.model.in_sync():  # replicas differ mid-round: wait for its end
            return False
        every, step = self.config.every_steps, state.global_step
        if every is None:
            return epoch_done or step == total_steps
        return step % every == 0 or step == total_steps

    @property
    def _own_optimizer(self) -> bool:
        """Each rank steps its own optimizer (local SGD, DiLoCo): its state is kept per rank."""
        return not getattr(self.model, "replicated_optimizer", True)

    def sampler_state(self, state: RunState) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "epoch": state.epoch,
                "position": state.step_in_epoch * self.global_batch}

    def save(self, state: RunState) -> Path:
        started = time.perf_counter()
        saved = {"epoch": state.epoch, "step_in_epoch": state.step_in_epoch,
                 "global_step": state.global_step, "global_batch_size": self.global_batch,
                 "sampler": self.sampler_state(state), "history": state.history,
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                 "scaler": self.scaler.state_dict() if self.scaler else None,
                 "config": self.record()}
        folder = checkpoint.save(self.root, state.global_step, self.model.checkpoint_model(),
                                 self.optimizer, saved, self.config.keep,
                                 self.model.checkpoint_tensors(), self._own_optimizer)
        self.seconds += time.perf_counter() - started
        if self.world.is_main:
            jobnote.checkpoint_written(folder, self.config.resume == "auto")  # for Ctrl-C
        return folder

    def restore(self, total_steps: int) -> RunState:
        """Seed a fresh run, or restore one from its checkpoint; returns where it stands."""
        torch.manual_seed(self.seed * 1000 + self.world.rank)
        folder = self._to_resume()
        if folder is None:
            return RunState()
        saved = checkpoint.load(folder, self.model.checkpoint_model(), self.optimizer,
                                self.model.checkpoint_tensors(),
                                verified=self.config.resume == "auto", check=self.state_problem,
                                own_optimizer=self._own_optimizer)
        self._check_resumable(folder, saved)
        loaded = getattr(self.model, "loaded", None)  # a wrapper taking up its own state
        if loaded is not None:
            loaded(own_state=rank_state.own_state_kept(saved.get("world_size")))
        state = RunState(saved["epoch"], saved["step_in_epoch"], saved["global_step"],
                         history=saved["history"])
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved.get("scaler") is not None:
            self.scaler.load_state_dict(saved["scaler"])
        self._announce(folder, state, saved, total_steps)
        return state

    def _announce(self, folder: Path, state: RunState, saved: dict[str, Any],
                  total_steps: int) -> None:
        if not self.world.is_main:
            return
        if state.global_step >= total_steps:
            print(f"run already complete at step {state.global_step} ({folder}); nothing to "
                  "train, evaluate or export again: fit() returns the finished run's results. "
                  "To train again, use a new run_dir.", flush=True)
        else:
            print(f"resumed from {folder} at step {state.global_step} (epoch {state.epoch}, "
                  f"sample {saved['sampler']['position']} of it), written by "
                  f"{saved['world_size']} rank(s)", flush=True)

    def _to_resume(self) -> Path | None:
        if self.world.is_main:  # partial checkpoints of a run that crashed mid-write
            checkpoint.remove_stale(self.root)
        if self.config.resume == "auto":
            fits = checkpoint.expected(self.model.checkpoint_model(), self.optimizer,
                                       self.model.checkpoint_tensors(), self.state_problem,
                                       self._own_optimizer)
            return checkpoint.latest_valid(self.root, fits)
        if self.config.resume != "never":
            return Path(self.config.resume)
        # Rank 0 looks, everyone hears: ranks that decided apart would part ways.
        earlier = comm.broadcast_object(bool(checkpoint.list_checkpoints(self.root)), 0,
                                        "trainer: agree whether run_dir holds checkpoints")
        if earlier:
            raise ValueError(f"rank {self.world.rank}: {self.root} holds checkpoints of an "
                             "earlier run and resume='never' would mix them with this one; "
                             "resume it (resume='auto'), or use another run_dir, or remove "
                             "them")
        return None

    def _check_resumable(self, folder: Path, saved: dict[str, Any]) -> None:
        """The checkpoint must describe this run: same global batch, same data, same order."""
        here = {**self.sampler.state_dict(), "global_batch_size": self.global_batch}
        then = {**saved["sampler"], "global_batch_size": saved["global_batch_size"]}
        for key in ("global_batch_size", "dataset_len", "seed", "shuffle"):
            if here[key] != then[key]:
                raise ValueError(f"rank {self.world.rank}: checkpoint {folder} was written with "
                                 f"{key}={then[key]!r}, this run has {here[key]!r}; resuming "
                                 "would repeat or skip samples. Keep them equal to resume.")
        if saved["step_in_epoch"] >= self.steps_per_epoch:
            raise ValueError(f"rank {self.world.rank}: checkpoint {folder} is at step "
                             f"{saved['step_in_epoch']} of an epoch that has only "
                             f"{self.steps_per_epoch} steps here")

    def state_problem(self, saved: dict[str, Any]) -> str | None:
        """What in a checkpoint's state.json is not a position of a run (the wrong type, out
        of range, inconsistent), naming the field; None if nothing. A checkpoint with such
        a state is skipped like a corrupt one, before anything of it is loaded."""
        problem = _schema_problem(saved, _STATE_FIELDS, "") or \
            _schema_problem(saved["sampler"], _SAMPLER_FIELDS, "sampler.") or \
            _history_problem(saved["history"]) or \
            _like_live(saved["scheduler"], self.scheduler, "scheduler") or \
            _like_live(saved.get("scaler"), self.scaler, "scaler")
        if problem is not None:
            return problem
        same_epochs = saved["global_batch_size"] == self.global_batch and \
            saved["sampler"]["dataset_len"] == self.sampler.dataset_len
        if same_epochs and saved["step_in_epoch"] >= self.steps_per_epoch:
            return (f"field 'step_in_epoch' is {saved['step_in_epoch']}, past the end of an "
                    f"epoch of {self.steps_per_epoch} steps")
        position = saved["step_in_epoch"] * saved["global_batch_size"]
        if same_epochs and (saved["global_step"] != saved["epoch"] * self.steps_per_epoch
                            + saved["step_in_epoch"] or saved["sampler"]["position"] != position
                            or saved["sampler"]["epoch"] != saved["epoch"]):
            return ("fields 'global_step', 'epoch', 'step_in_epoch' and 'sampler' disagree on "
                    "where the run stands")
        return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive(value: Any) -> bool:
    return _count(value) and value > 0


def _optional_map(value: Any) -> bool:
    return value is None or isinstance(value, dict)


# field: (check, what it must be). Every field Checkpoints.save writes, checked on resume.
_Fields = dict[str, tuple[Callable[[Any], bool], str]]
_STATE_FIELDS: _Fields = {
    "epoch": (_count, "a whole number >= 0"),
    "step_in_epoch": (_count, "a whole number >= 0"),
    "global_step": (_count, "a whole number >= 0"),
    "global_batch_size": (_positive, "a whole number > 0"),
    "world_size": (_positive, "a whole number > 0"),
    "sampler": (lambda v: isinstance(v, dict), "an object"),
    "history": (lambda v: isinstance(v, list), "a list"),
    "scheduler": (_optional_map, "an object or null"),
    "scaler": (_optional_map, "an object or null"),
}
_SAMPLER_FIELDS: _Fields = {
    "epoch": (_count, "a whole number >= 0"),
    "position": (_count, "a whole number >= 0"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    "shuffle": (lambda v: isinstance(v, bool), "true or false"),
    "dataset_len": (_count, "a whole number >= 0"),
}


def _schema_problem(saved: dict[str, Any], fields: _Fields, prefix: str) -> str | None:
    for name, (valid, what) in fields.items():
        if name not in saved:
            return f"field '{prefix}{name}' is missing"
        if not valid(saved[name]):
            return f"field '{prefix}{name}' is {_shown(saved[name])}, not {what}"
    return None


def _like_live(saved: dict[str, Any] | None, live: Any, field: str) -> str | None:
    """A scheduler's or scaler's saved state has only the entries its live state_dict has,
    each of the same kind: load_state_dict copies what it is given into the object."""
    if saved is None or live is None:
        return None
    own = live.state_dict()
    for key, value in saved.items():
        if key not in own:
            return f"field '{field}' has an entry {key[:40]!r} that this {field} does not"
        if own[key] is not None and _kind(value) != _kind(own[key]):
            return f"field '{field}.{key}' is {_shown(value)}, not like {_shown(own[key])}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "list" if isinstance(value, (list, tuple)) else type(value).__name__


def _history_problem(history: list[Any]) -> str | None:
    for i, row in enumerate(history):
        if not (isinstance(row, dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in row.values())):
            return f"field 'history' entry {i} is not a map of numbers"
    return None


def _shown(value: Any) -> str:
    """A value for a message: its type and a short form (a crafted one may be huge)."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
