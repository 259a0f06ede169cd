"""Trainer: the training loop people run, with the global batch as the unit.

    trainer = lockstep.Trainer(model, lambda p: torch.optim.AdamW(p), train_set, test_set,
                               config=lockstep.TrainConfig(global_batch_size=256, epochs=3))
    summary = trainer.fit()

The user says how many samples one optimizer step sees (the global batch); lockstep splits
it over ranks and, when a rank may only hold `max_batch_per_rank` samples at once, over
gradient-accumulation micro-steps. Global batch i is always positions [i*G, (i+1)*G) of
the epoch's sample order (see sampler.py), so the same config trains the same model at any
world size, and a checkpoint resumes at any world size where it left off.

One loop serves every synchronous-or-periodic mode: it asks the parallel model only what
`Replica` says (no_sync, after_step, in_sync, finish, comm_stats, and its checkpoint
state). Asynchronous training has its own entry point, AsyncTrainer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lockstep import comm
from lockstep.comm.world import World, init
from lockstep.lowcomm.paramserver import AsyncConfig
from lockstep.optim import LRSchedule, goyal_schedule, set_lr
from lockstep.replication.nonfinite import NonFiniteGradientError
from lockstep.replication.precision import LossScaler, autocast
from lockstep.seeding import seed_everything
from lockstep.training import checkpoint, configfile, export
from lockstep.training.batching import plan_batches
from lockstep.training.config import TrainConfig
from lockstep.training.evaluation import LossFn, evaluate, flat_cross_entropy
from lockstep.training.resume import Checkpoints, RunState
from lockstep.training.runlog import RunLog, plot_run, read_metrics
from lockstep.training.sampler import ShardedSampler

Batch = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class Replica(Protocol):
    """What the loop asks of a parallel model: DataParallel (sharded or not), LocalSGD and
    DiLoCo each answer it."""

    module: nn.Module
    group: comm.Group

    def no_sync(self) -> AbstractContextManager[None]: ...
    def after_step(self) -> None: ...
    def in_sync(self) -> bool: ...
    def finish(self) -> None: ...
    def comm_stats(self) -> dict[str, float]: ...
    def make_optimizer(self, optimizer: Any, **kwargs: Any) -> Any: ...
    def checkpoint_model(self) -> nn.Module: ...
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]: ...
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class Trainer:
    """Data-parallel training loop with exact resume. Call `fit()` on every rank.

    `model` is a module, or a function that builds one (`small_cnn`, `lambda: Net(...)`):
    the Trainer then calls it after `seed_everything(config.seed)`, so the seed decides the
    initial weights too and a run is reproducible end to end. A module already wrapped
    (DataParallel, lockstep.shard, LocalSGD, DiLoCo) is used as it is."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module],
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 train_set: Dataset[Any], eval_set: Dataset[Any] | None = None,
                 loss_fn: LossFn = flat_cross_entropy, config: TrainConfig | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 callbacks: Sequence[Callable[[Trainer], None]] = ()) -> None:
        self.config = config or TrainConfig()
        self.config.validate()
        if isinstance(self.config.parallel, AsyncConfig):
            raise ValueError("parallel=AsyncConfig is asynchronous training, a loop of its "
                             "own: use lockstep.AsyncTrainer with this config")
        self.world: World = init()
        self.plan = plan_batches(self.config.global_batch_size, self.world.world_size,
                                 self.config.max_batch_per_rank)
        self.train_set, self.eval_set, self.loss_fn = train_set, eval_set, loss_fn
        self.steps_per_epoch = steps_per_epoch(train_set, self.config.global_batch_size)
        self.model: Replica = self._parallel(model)
        self.optimizer = self.model.make_optimizer(optimizer)
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.scaler = LossScaler(group=self.model.group) if self.config.precision == "fp16" \
            else None
        self.schedule = lr_schedule(self.config, self.total_steps)
        self.callbacks = list(callbacks)
        self.run_dir = Path(self.config.run_dir)
        self.state = RunState()
        self.finished_before = False  # fit() found the run's checkpoint at its end
        self.sampler = ShardedSampler(train_set, shuffle=True, seed=self.config.seed)  # type: ignore[arg-type]
        self.checkpoints = Checkpoints(
            self.config.checkpoint, self.run_dir / "checkpoints", self.world, self.model,
            self.optimizer, self.sampler, self.plan.global_batch, self.steps_per_epoch,
            self._config_record, self.config.seed, self.scheduler, self.scaler)

    def _parallel(self, model: nn.Module | Callable[[], nn.Module]) -> Replica:
        if isinstance(model, Replica):
            return model
        if not isinstance(model, nn.Module):
            seed_everything(self.config.seed)
            model = model()
        return self.config.parallel.build(model.to(self.world.device))  # type: ignore[union-attr]

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.config.epochs
        return min(total, self.config.max_steps) if self.config.max_steps else total

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to the end (resuming if configured), evaluate, and return a summary. A run
        whose checkpoint is already at the end is not trained, evaluated or plotted again:
        its summary is returned as that run recorded it."""
        self.state = self.checkpoints.restore(self.total_steps)
        self.finished_before = self.state.global_step >= self.total_steps
        if self.finished_before:
            return self._summary(0.0, self._recorded_metrics())
        runlog = RunLog(self.run_dir, self.world.is_main, self.total_steps,
                        self.state.global_step, self.config.progress, self._config_record(),
                        self.config.trackers)
        samples, seconds = 0, 0.0  # training only: evaluation and checkpoints excluded
        try:
            while self.state.global_step < self.total_steps:
                started, saving = time.perf_counter(), self.checkpoints.seconds
                samples += self._train_epoch(runlog)
                seconds += time.perf_counter() - started - (self.checkpoints.seconds - saving)
                finished = self.state.global_step >= self.total_steps
                if not finished and self.state.epoch % self.config.eval_every_epochs == 0:
                    self._evaluate_and_record(runlog)
            self.model.finish()  # every replica identical before the last evaluation
            metrics = self._evaluate_and_record(runlog)
        finally:
            runlog.close()
        if self.world.is_main:
            plot_run(self.run_dir)
        return self._summary(samples / seconds if samples else 0.0, metrics)

    def _summary(self, speed: float, metrics: dict[str, float]) -> dict[str, Any]:
        return {"steps": self.state.global_step, "samples_per_s": speed,
                "test_loss": metrics.get("loss"), "test_accuracy": metrics.get("accuracy"),
                "fingerprint": checkpoint.fingerprint(self.model.full_state_dict()),
                "world_size": self.world.world_size, "run_dir": str(self.run_dir),
                "already_finished": self.finished_before}

    def _recorded_metrics(self) -> dict[str, float]:
        """The evaluation a finished run recorded at its last step (metrics.jsonl, read by
        rank 0 for all); evaluated again, unrecorded, only where none was recorded."""
        found = []
        if self.world.is_main:
            with contextlib.suppress(OSError, ValueError):  # a damaged log: evaluate instead
                found = [r for r in read_metrics(self.run_dir) if isinstance(r, dict)
                         and r.get("kind") == "eval" and r.get("step") == self.state.global_step]
        recorded = comm.broadcast_object(found[-1] if found else None, 0,
                                         "trainer: the finished run's last evaluation")
        return dict(recorded) if recorded else self.evaluate()

    def _train_epoch(self, runlog: RunLog) -> int:
        """Run the rest of the current epoch; returns global samples trained."""
        batches = self._micro_batches()
        window = _Window()
        trained, epoch_done = 0, False
        while not epoch_done and self.state.global_step < self.total_steps:
            window.add(self._train_step(batches))
            trained += self.plan.global_batch
            epoch_done = self._advance(runlog)
            if self.state.global_step % self.config.log_every_steps == 0 or \
                    self.state.global_step == self.total_steps:
                self._log_window(runlog, window)
                window = _Window()
            paused = time.perf_counter()
            if self._mid_epoch_eval_due(epoch_done):
                self._evaluate_and_record(runlog)
            for callback in self.callbacks:
                callback(self)
            if self.checkpoints.due(self.state, epoch_done, self.total_steps):
                self.save_checkpoint()
            window.started += time.perf_counter() - paused  # its throughput: training only
        return trained

    def _advance(self, runlog: RunLog) -> bool:
        """Count a finished step; True when it ended the epoch. The epoch rolls over before
        any checkpoint, so a checkpoint points at the next sample."""
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        runlog.progress(1)  # every step, so the bar ends at 100% whatever log_every says
        if self.state.step_in_epoch < self.steps_per_epoch:
            return False
        self.state.epoch += 1
        self.state.step_in_epoch = 0
        return True

    def _micro_batches(self) -> Iterator[Batch]:
        self.sampler.load_state_dict(self.checkpoints.sampler_state(self.state))
        yield from micro_batches(self.train_set, self.sampler, self.plan.micro_batch,
                                 self.config.seed + self.state.epoch, self.world.device)

    def _train_step(self, batches: Iterator[Batch]) -> float | None:
        """One optimizer step over one global batch; returns this rank's mean loss, or
        None for a step dropped for a non-finite gradient (nonfinite="skip")."""
        dropped_before = self._dropped_steps()
        if self.schedule is not None:
            set_lr(self.optimizer, self.schedule(self.state.global_step))
        total = sum(self._micro_step(next(batches), last=micro == self.plan.accumulation - 1)
                    for micro in range(self.plan.accumulation))
        self._optimizer_step()
        self.model.after_step()
        if self.scheduler is not None:  # stepped per optimizer step, not per epoch
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.last_loss = total
        return total if self._dropped_steps() == dropped_before else None

    def _micro_step(self, batch: Batch, last: bool) -> float:
        x, y = batch
        with contextlib.nullcontext() if last else self.model.no_sync():
            with autocast(self.config.precision, self.world.device):
                loss = self.loss_fn(self.model(x), y) / self.plan.accumulation
            try:
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            except NonFiniteGradientError as error:
                raise NonFiniteGradientError(
                    f"training step {self.state.global_step + 1} (epoch "
                    f"{self.state.epoch}): {error}") from None
        return float(loss.item())

    def _optimizer_step(self) -> None:
        clip = self.config.grad_clip_norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # true gradients, before clipping
        if clip is not None and hasattr(self.optimizer, "clip_grad_norm_"):
            self.optimizer.clip_grad_norm_(clip)  # sharded: the norm over every shard
        elif clip is not None:  # every rank holds the same averaged gradients: same clip
            nn.utils.clip_grad_norm_(self.model.module.parameters(), clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped on every rank if any overflowed
        else:
            self.optimizer.step()

    def _dropped_steps(self) -> int:
        return int(self.model.comm_stats().get("skipped_steps", 0))

    def _log_window(self, runlog: RunLog, window: _Window) -> None:
        mean = comm.control_tensor([window.mean_loss()], dtype=torch.float32)
        comm.all_reduce(mean, "trainer: average of the logged loss")
        loss = mean.item() / self.world.world_size
        speed = window.steps * self.plan.global_batch / max(window.elapsed(), 1e-9)
        wire = self.model.comm_stats()
        extra = {"loss_scale": self.scaler.scale_value} if self.scaler else {}
        if "skipped_steps" in wire:
            extra["skipped_steps"] = wire["skipped_steps"]
        runlog.record("train", self.state.global_step, loss=loss, samples_per_s=speed,
                      lr=float(self.optimizer.param_groups[0]["lr"]), epoch=self.state.epoch,
                      bytes_sent=wire["bytes_sent"], compression=wire["compression_ratio"],
                      **extra)
        shown = {"loss": f"{loss:.4f}", "samples_s": f"{speed:.0f}",
                 "sent/step": f"{wire['bytes_sent'] / 1e6:.2f}MB"}
        if wire["compression_ratio"] > 1.0:
            shown["compression"] = f"{wire['compression_ratio']:.1f}x"
        runlog.progress(0, **shown)

    # ---- evaluation and checkpoints ------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy over the whole eval set, exact across ranks."""
        if self.eval_set is None:
            return {}
        return evaluate(self.model, self.eval_set, self.loss_fn, self.config.eval_batch_size,  # type: ignore[arg-type]
                        self.config.precision, self.world.device)

    def _evaluate_and_record(self, runlog: RunLog) -> dict[str, float]:
        if self.eval_set is None:
            return {}
        metrics = self.evaluate()
        self.state.history.append({"step": self.state.global_step, **metrics})
        runlog.record("eval", self.state.global_step, **metrics)
        runlog.message(f"step {self.state.global_step}: test loss {metrics['loss']:.4f}, "
                       f"test accuracy {metrics['accuracy']:.4f}")
        return metrics

    def _mid_epoch_eval_due(self, epoch_done: bool) -> bool:
        """eval_every_steps says so, and neither the epoch's end nor the run's will."""
        every, step = self.config.eval_every_steps, self.state.global_step
        return every is not None and step % every == 0 and step < self.total_steps and not (
            epoch_done and self.state.epoch % self.config.eval_every_epochs == 0)

    def _config_record(self) -> dict[str, Any]:
        return configfile.as_record(self.config)

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save(self.state)

    def export(self, path: str | Path) -> Path | None:
        """Write the model's weights alone (no optimizer) for inference: a plain state dict
        (.pt) or safetensors (.safetensors). Call on every rank (ZeRO-3 gathers); rank 0
        writes and gets the path, the others None. Load with `lockstep.load_weights`.
        After a `fit()` that found the run already finished, a file already at `path` is
        left as it is (it holds the same weights): remove it to write it again."""
        if self.finished_before and comm.broadcast_object(  # one answer: ZeRO-3 gathers
                Path(path).is_file(), 0, "trainer: is the finished run's export there"):
            if self.world.is_main:
                print(f"{path} exists and this run had already finished: left as it is "
                      "(remove it to export again)", flush=True)
            return Path(path) if self.world.is_main else None
        return export.export_weights(self.model, path)


class _Window:
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


def steps_per_epoch(train_set: Dataset[Any], global_batch: int) -> int:
    steps = len(train_set) // global_batch  # type: ignore[arg-type]
    if steps == 0:
        raise ValueError(f"the training set ({len(train_set)} samples) is smaller than one "  # type: ignore[arg-type]
                         f"global batch ({global_batch})")
    return steps


def lr_schedule(c: TrainConfig, total_steps: int) -> LRSchedule | None:
    if c.lr is None:
        return None
    if c.base_batch_size:
        return goyal_schedule(c.lr, c.global_batch_size, c.base_batch_size, c.warmup_steps,
                              total_steps, c.decay)
    return LRSchedule(c.lr, c.warmup_steps, 0.0, total_steps, c.decay)


def micro_batches(dataset: Dataset[Any], sampler: ShardedSampler, size: int, seed: int,
                  device: torch.device) -> Iterator[Batch]:
    """Micro-batches in `sampler`'s order, on `device`. A private generator: creating a
    loader iterator otherwise draws from the global RNG, at a different point in a resumed
    run, and shifts every dropout mask after."""
    loader = DataLoader(dataset, batch_size=size, sampler=sampler,
                        generator=torch.Generator().manual_seed(seed))
    for x, y in loader:
        yield x.to(device), y.to(device)
