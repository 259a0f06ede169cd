"""Trainer: the training loop people run, with the global batch as the unit.

    trainer = lockstep.Trainer(model, lambda p: torch.optim.AdamW(p), train_set, test_set,
                               config=lockstep.TrainConfig(global_batch_size=256, epochs=3))
    summary = trainer.fit()

The user says how many samples one optimizer step sees (the global batch); lockstep splits
it over ranks and, when a rank may only hold `max_batch_per_rank` samples at once, over
gradient-accumulation micro-steps. Global batch i is always positions [i*G, (i+1)*G) of
the epoch's sample order (see sampler.py), so the same config trains the same model at any
world size, and a checkpoint resumes at any world size where it left off.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lockstep import checkpoint, comm, configfile, export, jobnote, trackers
from lockstep.lowcomm import DiLoCo, LocalSGD
from lockstep.nonfinite import NonFiniteGradientError
from lockstep.nonfinite import check_mode as check_nonfinite
from lockstep.optim import LRSchedule, goyal_schedule, set_lr
from lockstep.paramserver import ParameterServer, Worker, session_prefix
from lockstep.precision import LossScaler, autocast, check_precision
from lockstep.replica import DataParallel
from lockstep.runlog import RunLog, plot_run
from lockstep.sampler import ShardedSampler
from lockstep.seeding import seed_everything
from lockstep.sharded import shard
from lockstep.world import World, init

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainConfig:
    """Everything that decides what is trained. The same config gives the same training at
    any world size."""

    global_batch_size: int = 64
    """Samples per optimizer step, over all ranks and accumulation micro-steps."""
    max_batch_per_rank: int | None = None
    """Most samples one rank runs through the model at once (a memory cap); gradient
    accumulation makes up the rest. None: no cap."""
    epochs: int = 1
    """Passes over the training set (each uses len(train) // global_batch_size steps)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps, if sooner."""
    lr: float | None = None
    """Peak learning rate, set on the optimizer every step. None: leave the optimizer's lr
    alone (and step `scheduler` if given)."""
    base_batch_size: int | None = None
    """If set, `lr` is the rate for this batch size and is scaled linearly to the global
    batch (Goyal et al. 2017); warmup then starts from the unscaled rate."""
    warmup_steps: int = 0
    """Steps of linear warmup to the peak learning rate."""
    decay: str = "none"
    """After warmup: "none" (constant) or "cosine" (to zero at the last step)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm (over all parameters) to this value."""
    precision: str = "fp32"
    """"fp32", "bf16" (autocast) or "fp16" (autocast and dynamic loss scaling agreed by
    all ranks). Weights, gradients and optimizer state stay fp32 in every case."""
    eval_every_epochs: int = 1
    """Evaluate on the test set every this many epochs (and always at the end)."""
    eval_every_steps: int | None = None
    """Also evaluate every this many steps (for runs shorter than an epoch)."""
    eval_batch_size: int = 256
    """Per-rank batch for evaluation."""
    checkpoint_every_steps: int | None = None
    """Write a checkpoint every this many steps; None: at the end of every epoch."""
    keep_checkpoints: int = 3
    """How many recent checkpoints to keep."""
    resume: str = "auto"
    """"auto": continue from the newest valid checkpoint in run_dir, if any; "never": start
    fresh; or the path of a checkpoint folder."""
    run_dir: str = "runs/lockstep"
    """Where checkpoints, metrics.jsonl, TensorBoard events and the plot go."""
    seed: int = 0
    """Seeds data order and each rank's RNG, and the model's initial weights when the
    Trainer is given a function that builds the model (see `Trainer`)."""
    log_every_steps: int = 10
    """Average the loss over ranks and record metrics every this many steps."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    trackers: tuple[str, ...] = ("tensorboard",)
    """Where metrics and this config go besides metrics.jsonl and config.json:
    "tensorboard", "mlflow", "wandb" (offline by default; see trackers.py)."""
    bucket_mb: float | None = None
    """DataParallel's gradient bucket cap (None: its default for the algorithm)."""
    find_unused: bool = False
    """DataParallel's find_unused."""
    algorithm: str = "native"
    """DataParallel's reduction algorithm."""
    compress: Any = None
    """DataParallel's compression: None, "bf16", "fp16", PowerSGD(...) or TopK(...)."""
    zero: int = 0
    """ZeRO stage: 0, 1 (optimizer state sharded), 2 (and gradients), 3 (and weights)."""
    nonfinite: str = "error"
    """A NaN or inf in some rank's gradient: "error" stops the run at that step (naming the
    step, the ranks and the first parameter, before any checkpoint takes the bad weights),
    "skip" drops the step on every rank and counts it (`skipped_steps` in the metrics).
    Synchronous mode only; fp16's loss scaler skips overflowing steps in any case."""
    mode: str = "sync"
    """"sync" (gradients averaged every step), "local_sgd" (parameters averaged every
    `sync_every` steps) or "diloco" (an outer Nesterov step every `sync_every` steps)."""
    sync_every: int = 50
    """Local steps per round, for local_sgd and diloco."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (0: plain SGD)."""
    pseudo_grad_bf16: bool = False
    """DiLoCo: send pseudo-gradients in bf16."""
    max_staleness: int = 4
    """async: how many steps a worker may run ahead of the slowest live one (0: sync)."""
    dead_after_s: float = 60.0
    """async: a worker silent this long while others progress no longer holds them back."""

    def validate(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.max_batch_per_rank is not None and self.max_batch_per_rank < 1:
            raise ValueError("max_batch_per_rank must be >= 1")
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise ValueError(f"resume={self.resume!r}: not 'auto', 'never' or a folder")
        check_precision(self.precision)
        check_nonfinite(self.nonfinite)
        trackers.check(self.trackers)
        if self.mode not in ("sync", "local_sgd", "diloco", "async"):
            raise ValueError(f"mode must be 'sync', 'local_sgd', 'diloco' or 'async', not "
                             f"{self.mode!r}")


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split: over ranks, then over accumulation micro-steps."""

    global_batch: int
    world_size: int
    per_rank: int
    micro_batch: int
    accumulation: int


def plan_batches(global_batch: int, world_size: int, max_per_rank: int | None = None
                 ) -> BatchPlan:
    """Split `global_batch` evenly over ranks, then into the fewest equal micro-batches that
    respect `max_per_rank`. Equal sizes keep every sample's weight in the mean equal."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} does not split evenly over {world_size} "
                         f"ranks; choose a multiple of {world_size}")
    per_rank = global_batch // world_size
    cap = max_per_rank or per_rank
    accumulation = next(a for a in range(math.ceil(per_rank / cap), per_rank + 1)
                        if per_rank % a == 0)
    return BatchPlan(global_batch, world_size, per_rank, per_rank // accumulation,
                     accumulation)


@dataclass
class TrainState:
    """Where training is: what callbacks see and what a checkpoint records."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    last_loss: float = float("nan")
    history: list[dict[str, float]] = field(default_factory=list)


def per_sample_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """Fraction of correct argmax predictions per sample (per token, averaged, for
    sequences), or None when outputs are not class scores for these targets."""
    if targets.dtype != torch.long or outputs.shape[:-1] != targets.shape:
        return None
    correct = (outputs.argmax(-1) == targets).float()
    return correct.reshape(len(targets), -1).mean(1)


def flat_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class scores (B, C) or sequences of them (B, T, C)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


class Trainer:
    """Data-parallel training loop with exact resume. Call `fit()` on every rank.

    `model` is a module, or a function that builds one (`small_cnn`, `lambda: Net(...)`):
    the Trainer then calls it after `seed_everything(config.seed)`, so the seed decides the
    initial weights too and a run is reproducible end to end."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module],
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 train_set: Dataset[Any], eval_set: Dataset[Any] | None = None,
                 loss_fn: LossFn = flat_cross_entropy, config: TrainConfig | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 callbacks: Sequence[Callable[[Trainer], None]] = ()) -> None:
        self.config = config or TrainConfig()
        self.config.validate()
        self.world: World = init()
        # In async mode rank 0 serves parameters and the other ranks share the batch.
        trainers = self.world.world_size - (self.config.mode == "async")
        if trainers < 1:
            raise ValueError("mode='async' needs at least 2 ranks: a server and a worker")
        self.plan = plan_batches(self.config.global_batch_size, trainers,
                                 self.config.max_batch_per_rank)
        self.train_set, self.eval_set, self.loss_fn = train_set, eval_set, loss_fn
        self.steps_per_epoch = len(train_set) // self.config.global_batch_size  # type: ignore[arg-type]
        if self.steps_per_epoch == 0:
            raise ValueError(f"the training set ({len(train_set)} samples) is smaller than one "  # type: ignore[arg-type]
                             f"global batch ({self.config.global_batch_size})")
        if not isinstance(model, nn.Module):
            seed_everything(self.config.seed)
            model = model()
        self.model = self._wrap(model)
        self.optimizer = self.model.make_optimizer(optimizer) \
            if isinstance(self.model, DataParallel) else optimizer(self.model.parameters())
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.scaler = LossScaler(group=self.model.group) if self.config.precision == "fp16" \
            else None
        self.schedule = self._lr_schedule()
        self.callbacks = list(callbacks)
        self.run_dir = Path(self.config.run_dir)
        self.state = TrainState()
        self._checkpoint_seconds = 0.0
        self.sampler = ShardedSampler(train_set, shuffle=True, seed=self.config.seed)  # type: ignore[arg-type]

    def _wrap(self, model: nn.Module) -> Any:
        c = self.config
        if isinstance(model, (DataParallel, LocalSGD, DiLoCo)):
            return model
        model = model.to(self.world.device)
        if c.mode == "local_sgd":
            return LocalSGD(model, c.sync_every)
        if c.mode == "diloco":
            return DiLoCo(model, c.sync_every, c.outer_lr, c.outer_momentum,
                          bf16=c.pseudo_grad_bf16)
        if c.mode == "async":
            return LocalSGD(model, every=1)  # a replica; the parameter server keeps it current
        if c.zero:
            return shard(model, c.zero, bucket_mb=c.bucket_mb, find_unused=c.find_unused,
                         nonfinite=c.nonfinite)
        return DataParallel(model, bucket_mb=c.bucket_mb, find_unused=c.find_unused,
                            algorithm=c.algorithm, compress=c.compress, nonfinite=c.nonfinite)

    def _in_sync(self) -> bool:
        """Whether every replica holds the same model now (always, in sync mode)."""
        return not isinstance(self.model, (LocalSGD, DiLoCo)) or self.model.in_sync()

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.config.epochs
        return min(total, self.config.max_steps) if self.config.max_steps else total

    def _lr_schedule(self) -> LRSchedule | None:
        c = self.config
        if c.lr is None:
            return None
        if c.base_batch_size:
            return goyal_schedule(c.lr, c.global_batch_size, c.base_batch_size,
                                  c.warmup_steps, self.total_steps, c.decay)
        return LRSchedule(c.lr, c.warmup_steps, 0.0, self.total_steps, c.decay)

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to the end (resuming if configured), evaluate, and return a summary."""
        if self.config.mode == "async":
            return self._fit_async()
        self._start()
        runlog = RunLog(self.run_dir, self.world.is_main, self.total_steps,
                        self.state.global_step, self.config.progress, self._config_record(),
                        self.config.trackers)
        samples, seconds = 0, 0.0  # training only: evaluation and checkpoints excluded
        try:
            while self.state.global_step < self.total_steps:
                started, saving = time.perf_counter(), self._checkpoint_seconds
                samples += self._train_epoch(runlog)
                seconds += time.perf_counter() - started - (self._checkpoint_seconds - saving)
                finished = self.state.global_step >= self.total_steps
                if not finished and self.state.epoch % self.config.eval_every_epochs == 0:
                    self._evaluate_and_record(runlog)
            if isinstance(self.model, (LocalSGD, DiLoCo)):
                self.model.finish()  # every replica identical before the last evaluation
            metrics = self._evaluate_and_record(runlog)
        finally:
            runlog.close()
        if self.world.is_main:
            plot_run(self.run_dir)
        return {"steps": self.state.global_step,
                "samples_per_s": samples / seconds if samples else 0.0,
                "test_loss": metrics.get("loss"), "test_accuracy": metrics.get("accuracy"),
                "fingerprint": checkpoint.fingerprint(self.model.module),
                "world_size": self.world.world_size, "run_dir": str(self.run_dir)}

    def _train_epoch(self, runlog: RunLog) -> int:
        """Run the rest of the current epoch; returns global samples trained."""
        batches = self._micro_batches()
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        window_kept = 0  # steps whose loss counts: not dropped for a non-finite gradient
        trained, epoch_done = 0, False
        while not epoch_done and self.state.global_step < self.total_steps:
            loss = self._train_step(batches)
            window_steps += 1
            if loss is not None:
                window_loss += loss
                window_kept += 1
            trained += self.plan.global_batch
            self.state.global_step += 1
            self.state.step_in_epoch += 1
            runlog.progress(1)  # every step, so the bar ends at 100% whatever log_every says
            if self.state.step_in_epoch == self.steps_per_epoch:  # roll over before saving,
                self.state.epoch += 1                               # so a checkpoint points
                self.state.step_in_epoch, epoch_done = 0, True      # at the next sample
            if self.state.global_step % self.config.log_every_steps == 0 or \
                    self.state.global_step == self.total_steps:
                self._log_window(runlog, window_loss / max(window_kept, 1), window_steps,
                                 window_start)
                window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
                window_kept = 0
            if self._mid_epoch_eval_due(epoch_done):
                self._evaluate_and_record(runlog)
            for callback in self.callbacks:
                callback(self)
            if self._checkpoint_due(epoch_done):
                self.save_checkpoint()
        return trained

    def _micro_batches(self) -> Iterator[Batch]:
        self.sampler.load_state_dict(self._sampler_state())
        yield from self._loader(self.sampler, self.config.seed + self.state.epoch)

    def _loader(self, sampler: ShardedSampler, seed: int) -> Iterator[Batch]:
        """Micro-batches in `sampler`'s order, on this rank's device. A private generator:
        creating a loader iterator otherwise draws from the global RNG, at a different
        point in a resumed run, and shifts every dropout mask after."""
        loader = DataLoader(self.train_set, batch_size=self.plan.micro_batch,
                            sampler=sampler, generator=torch.Generator().manual_seed(seed))
        for x, y in loader:
            yield x.to(self.world.device), y.to(self.world.device)

    def _train_step(self, batches: Iterator[Batch]) -> float | None:
        """One optimizer step over one global batch; returns this rank's mean loss, or
        None for a step dropped for a non-finite gradient (nonfinite="skip")."""
        dropped_before = self._dropped_steps()
        if self.schedule is not None:
            set_lr(self.optimizer, self.schedule(self.state.global_step))
        total = 0.0
        for micro in range(self.plan.accumulation):
            x, y = next(batches)
            last = micro == self.plan.accumulation - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                with autocast(self.config.precision, self.world.device):
                    loss = self.loss_fn(self.model(x), y) / self.plan.accumulation
                try:
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                except NonFiniteGradientError as error:
                    raise NonFiniteGradientError(
                        f"training step {self.state.global_step + 1} (epoch "
                        f"{self.state.epoch}): {error}") from None
            total += loss.item()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # true gradients, before clipping
        if self.config.grad_clip_norm is not None:
            if hasattr(self.optimizer, "clip_grad_norm_"):  # ZeRO: the norm over every shard
                self.optimizer.clip_grad_norm_(self.config.grad_clip_norm)
            else:  # every rank holds the same averaged gradients: same norm, same clip
                nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped on every rank if any overflowed
        else:
            self.optimizer.step()
        if isinstance(self.model, (LocalSGD, DiLoCo)):
            self.model.after_step()
        if self.scheduler is not None:  # stepped per optimizer step, not per epoch
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.last_loss = total
        return total if self._dropped_steps() == dropped_before else None

    def _dropped_steps(self) -> int:
        return int(self.model.comm_stats().get("skipped_steps", 0))

    def _log_window(self, runlog: RunLog, mean_loss: float, steps: int, started: float) -> None:
        mean = comm.control_tensor([mean_loss], dtype=torch.float32)
        comm.all_reduce(mean, "trainer: average of the logged loss")
        loss = mean.item() / self.world.world_size
        speed = steps * self.plan.global_batch / max(time.perf_counter() - started, 1e-9)
        lr = self.optimizer.param_groups[0]["lr"]
        wire = self.model.comm_stats()
        extra = {"loss_scale": self.scaler.scale_value} if self.scaler else {}
        if "skipped_steps" in wire:
            extra["skipped_steps"] = wire["skipped_steps"]
        runlog.record("train", self.state.global_step, loss=loss, samples_per_s=speed,
                      lr=float(lr), epoch=self.state.epoch, bytes_sent=wire["bytes_sent"],
                      compression=wire["compression_ratio"], **extra)
        shown = {"loss": f"{loss:.4f}", "samples_s": f"{speed:.0f}",
                 "sent/step": f"{wire['bytes_sent'] / 1e6:.2f}MB"}
        if wire["compression_ratio"] > 1.0:
            shown["compression"] = f"{wire['compression_ratio']:.1f}x"
        runlog.progress(0, **shown)

    # ---- asynchronous: a parameter server on rank 0 -------------------------------------

    def _fit_async(self) -> dict[str, Any]:
        """Rank 0 serves parameters and applies gradients; the others train without waiting
        for each other (up to max_staleness); then everyone evaluates the final model."""
        c, world, module = self.config, self.world, self.model.module
        prefix = session_prefix()
        runlog = RunLog(self.run_dir, world.rank == 1, self.total_steps, 0, c.progress,
                        self._config_record(), c.trackers)
        started = time.perf_counter()
        try:
            if world.rank == 0:
                workers = world.world_size - 1
                server = ParameterServer(module, lambda _: self.optimizer, prefix,
                                         self.total_steps * workers, c.max_staleness,
                                         c.dead_after_s, self.schedule)
                stats: dict[str, Any] = dict(server.serve().summary())
                samples = 0
            else:
                worker = Worker(module, prefix, c.max_staleness)
                samples, stats = self._work_async(worker, runlog), {}
            totals = comm.control_tensor([float(samples), time.perf_counter() - started],
                                         dtype=torch.float64)
            comm.all_reduce(totals, "async: samples trained")
            stats = comm.broadcast_object(stats, 0, "async: server statistics")
            metrics = self._evaluate_and_record(runlog)
        finally:
            runlog.close()
        if world.rank == 1:
            plot_run(self.run_dir)
        return {"steps": self.total_steps,
                "samples_per_s": totals[0].item() / (totals[1].item() / world.world_size),
                "test_loss": metrics.get("loss"), "test_accuracy": metrics.get("accuracy"),
                "fingerprint": checkpoint.fingerprint(module), "world_size": world.world_size,
                "run_dir": str(self.run_dir), "server": stats}

    def _work_async(self, worker: Worker, runlog: RunLog) -> int:
        """A worker's loop: pull, accumulate micro-batches, push -- until the server has
        spent its budget of updates. Returns the samples this worker trained on."""
        c, module, world = self.config, self.model.module, self.world
        sampler = ShardedSampler(self.train_set, shuffle=True, seed=c.seed,  # type: ignore[arg-type]
                                 rank=world.rank - 1, world_size=world.world_size - 1)
        batches = self._epochs_of_micro_batches(sampler)
        trained, pushes, window, window_loss = 0, 0, time.perf_counter(), 0.0
        # Synchronous rounds (bound 0): exactly total_steps each. Otherwise: until told.
        rounds = self.total_steps if c.max_staleness == 0 else None
        while (rounds is None or worker.step < rounds) and worker.pull():
            module.zero_grad(set_to_none=True)
            for _ in range(self.plan.accumulation):
                x, y = next(batches)
                part = self.loss_fn(module(x), y) / self.plan.accumulation
                part.backward()
                window_loss += part.item()
            worker.push()
            trained, pushes = trained + self.plan.per_rank, pushes + 1
            if pushes % c.log_every_steps == 0:  # this worker's own steps: a steady window
                speed = c.log_every_steps * self.plan.per_rank / (time.perf_counter() - window)
                loss = window_loss / c.log_every_steps  # the window's mean, as sync logs
                window, window_loss = time.perf_counter(), 0.0
                runlog.record("train", worker.step, loss=loss, samples_per_s=speed,
                              bytes_sent=worker.bytes_sent / pushes)
                runlog.progress(c.log_every_steps, loss=f"{loss:.4f}")
        worker.finish()
        return trained

    def _epochs_of_micro_batches(self, sampler: ShardedSampler) -> Iterator[Batch]:
        """This worker's micro-batches, epoch after epoch, full steps only."""
        per_epoch = self.steps_per_epoch * self.plan.accumulation
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from itertools.islice(self._loader(sampler, epoch), per_epoch)

    # ---- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy over the whole eval set, exact across ranks: the sampler's
        padding samples are not counted, and sums (not means) are reduced."""
        if self.eval_set is None:
            return {}
        sampler = ShardedSampler(self.eval_set, shuffle=False)  # type: ignore[arg-type]
        n = self.world.world_size
        # Rank r holds positions r, r+N, ...; those past the end are padding repeats.
        valid = len(range(self.world.rank, len(self.eval_set), n))  # type: ignore[arg-type]
        loader = DataLoader(self.eval_set, batch_size=self.config.eval_batch_size,
                            sampler=sampler, generator=torch.Generator())  # global RNG untouched
        sums = comm.control_tensor([0, 0, 0], dtype=torch.float64)  # loss, correct, count
        self.model.eval()
        seen = 0
        for x, y in loader:
            x, y = x[: valid - seen].to(self.world.device), y[: valid - seen].to(
                self.world.device)
            seen += len(x)
            if len(x) == 0:
                break
            with autocast(self.config.precision, self.world.device):
                outputs = self.model(x)
                sums[0] += self.loss_fn(outputs, y).float().item() * len(x)
            accuracy = per_sample_accuracy(outputs, y)
            sums[1] += accuracy.sum().item() if accuracy is not None else float("nan")
            sums[2] += len(x)
        self.model.train()
        comm.all_reduce(sums, "trainer: evaluation sums")
        return {"loss": sums[0].item() / sums[2].item(),
                "accuracy": sums[1].item() / sums[2].item()}

    def _evaluate_and_record(self, runlog: RunLog) -> dict[str, float]:
        if self.eval_set is None:
            return {}
        metrics = self.evaluate()
        self.state.history.append({"step": self.state.global_step, **metrics})
        runlog.record("eval", self.state.global_step, **metrics)
        runlog.message(f"step {self.state.global_step}: test loss {metrics['loss']:.4f}, "
                       f"test accuracy {metrics['accuracy']:.4f}")
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------

    def _mid_epoch_eval_due(self, epoch_done: bool) -> bool:
        """eval_every_steps says so, and neither the epoch's end nor the run's will."""
        every, step = self.config.eval_every_steps, self.state.global_step
        return every is not None and step % every == 0 and step < self.total_steps and not (
            epoch_done and self.state.epoch % self.config.eval_every_epochs == 0)

    def _checkpoint_due(self, epoch_done: bool) -> bool:
        if not self._in_sync():  # replicas differ mid-round: wait for its end
            return False
        every = self.config.checkpoint_every_steps
        if every is None:
            return epoch_done or self.state.global_step == self.total_steps
        return self.state.global_step % every == 0 or self.state.global_step == self.total_steps

    def _sampler_state(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "epoch": self.state.epoch,
                "position": self.state.step_in_epoch * self.plan.global_batch}

    def _checkpointed(self) -> nn.Module:
        """DataParallel checkpoints itself in a layout any ZeRO stage and world size can
        load; the low-communication wrappers checkpoint their plain module."""
        return self.model if isinstance(self.model, DataParallel) else self.model.module

    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        """State a low-communication mode keeps besides model and optimizer (DiLoCo's
        outer optimizer)."""
        return self.model.checkpoint_tensors() if isinstance(self.model, (LocalSGD, DiLoCo)) \
            else {}

    def _config_record(self) -> dict[str, Any]:
        return configfile.as_record(self.config)

    def save_checkpoint(self) -> Path:
        started = time.perf_counter()
        state = {"epoch": self.state.epoch, "step_in_epoch": self.state.step_in_epoch,
                 "global_step": self.state.global_step,
                 "global_batch_size": self.plan.global_batch,
                 "sampler": self._sampler_state(), "history": self.state.history,
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                 "scaler": self.scaler.state_dict() if self.scaler else None,
                 "config": self._config_record()}
        folder = checkpoint.save(self.run_dir / "checkpoints", self.state.global_step,
                                 self._checkpointed(), self.optimizer, state,
                                 self.config.keep_checkpoints, self._extra_tensors())
        self._checkpoint_seconds += time.perf_counter() - started
        if self.world.is_main:
            jobnote.checkpoint_written(folder, self.config.resume == "auto")  # for Ctrl-C
        return folder

    def export(self, path: str | Path) -> Path | None:
        """Write the model's weights alone (no optimizer) for inference: a plain state dict
        (.pt) or safetensors (.safetensors). Call on every rank (ZeRO-3 gathers); rank 0
        writes and gets the path, the others None. Load with `lockstep.load_weights`."""
        return export.export_weights(self.model, path)

    def _start(self) -> None:
        """Seed a fresh run, or restore one from its checkpoint."""
        torch.manual_seed(self.config.seed * 1000 + self.world.rank)
        folder = self._checkpoint_to_resume()
        if folder is None:
            return
        saved = checkpoint.load(folder, self._checkpointed(), self.optimizer,
                                self._extra_tensors(), verified=self.config.resume == "auto")
        self._check_resumable(folder, saved)
        self.state = TrainState(saved["epoch"], saved["step_in_epoch"], saved["global_step"],
                                history=saved["history"])
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved.get("scaler") is not None:
            self.scaler.load_state_dict(saved["scaler"])
        if self.world.is_main and self.state.global_step >= self.total_steps:
            print(f"run already complete at step {self.state.global_step} ({folder}); "
                  "nothing to train. To train again, use a new run_dir.", flush=True)
        elif self.world.is_main:
            print(f"resumed from {folder} at step {self.state.global_step} (epoch "
                  f"{self.state.epoch}, sample {saved['sampler']['position']} of it), "
                  f"written by {saved['world_size']} rank(s)", flush=True)

    def _checkpoint_to_resume(self) -> Path | None:
        root = self.run_dir / "checkpoints"
        if self.world.is_main:  # partial checkpoints of a run that crashed mid-write
            checkpoint.remove_stale(root)
        if self.config.resume == "auto":
            return checkpoint.latest_valid(root)
        if self.config.resume != "never":
            return Path(self.config.resume)
        # Rank 0 looks, everyone hears: ranks that decided apart would part ways.
        earlier = comm.broadcast_object(bool(checkpoint.list_checkpoints(root)), 0,
                                        "trainer: agree whether run_dir holds checkpoints")
        if earlier:
            raise ValueError(f"rank {self.world.rank}: {root} holds checkpoints of an earlier "
                             "run and resume='never' would mix them with this one; resume it "
                             "(resume='auto'), or use another run_dir, or remove them")
        return None

    def _check_resumable(self, folder: Path, saved: dict[str, Any]) -> None:
        """The checkpoint must describe this run: same global batch, same data, same order."""
        here = {**self.sampler.state_dict(), "global_batch_size": self.plan.global_batch}
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
