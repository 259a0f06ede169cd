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
state), and fault tolerance only what `Survival` says (survival.py): each step and each
other collective go through it, so with `TrainConfig(elastic=ElasticConfig())` the same
loop survives a worker's death and lets new workers join -- the global batch, sample order,
schedule, precision, evaluation, metrics and checkpoints carrying on through the regroup.
Asynchronous training has its own entry point, AsyncTrainer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import comm
from lockstep.comm import timeline
from lockstep.comm.world import World, current, init
from lockstep.lowcomm.paramserver import AsyncConfig
from lockstep.optim import clip_and_step, set_lr
from lockstep.replication.nonfinite import NonFiniteGradientError
from lockstep.replication.precision import LossScaler, autocast
from lockstep.seeding import seed_everything
from lockstep.sharding.optimizer import ZeroOptimizer
from lockstep.sharding.sharded import ShardConfig
from lockstep.training import advising, checkpoint, configfile, export, tracing
from lockstep.training.batching import plan_batches
from lockstep.training.config import TrainConfig
from lockstep.training.evaluation import LossFn, evaluate, flat_cross_entropy
from lockstep.training.feed import Batch, MicroBatch, Shares, micro_batches, steps_per_epoch
from lockstep.training.protocols import Replica, Survival
from lockstep.training.resume import Checkpoints, RunState
from lockstep.training.runlog import RunLog, Window, plot_at_end, recorded_eval
from lockstep.training.sampler import ShardedSampler
from lockstep.training.survival import CarriedRunState, Steady, elastic_survival


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
        if (asked := advising.requested()) is not None:  # `lockstep advise`: measure instead
            advising.advise_instead(model, optimizer, train_set, loss_fn, self.config, asked)
        if isinstance(self.config.parallel, AsyncConfig):
            raise ValueError("parallel=AsyncConfig is asynchronous training, a loop of its "
                             "own: use lockstep.AsyncTrainer with this config")
        self.train_set, self.eval_set, self.loss_fn = train_set, eval_set, loss_fn
        self.steps_per_epoch = steps_per_epoch(train_set, self.config.global_batch_size)
        self.state = RunState()
        self._carried = CarriedRunState(self.state)
        self._shares = Shares(train_set, self.config.global_batch_size, self.steps_per_epoch,
                              self.config.seed, self.config.max_batch_per_rank)
        self._dropped, self._dropped_before = False, 0
        self.runlog = RunLog(Path(self.config.run_dir), False, 0, 0)  # silent until fit()
        if self.config.elastic is None:
            init()
            replica = self._parallel(model)
            self.optimizer = replica.make_optimizer(optimizer)
        else:  # (the wrapper is built once a membership forms; ZeRO's shards then too)
            module = self._module(model)
            self.optimizer = ZeroOptimizer.unbound(module.parameters(), optimizer) \
                if isinstance(self.config.parallel, ShardConfig) \
                else optimizer(module.parameters())
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        # The default group, whichever it is now: a regroup replaces it.
        self.scaler = LossScaler() if self.config.precision == "fp16" else None
        self.survival: Survival = Steady(replica, self._update) \
            if self.config.elastic is None else self._elastic(module)
        # (elastic=: the world changes; each step's share is planned for the world then)
        self.plan = plan_batches(self.config.global_batch_size, self.world.world_size,
                                 self.config.max_batch_per_rank) \
            if isinstance(self.survival, Steady) else None
        self.schedule = self.config.lr_schedule(self.total_steps)
        self.callbacks = list(callbacks)
        self.run_dir = Path(self.config.run_dir)
        self.finished_before = False  # fit() found the run's checkpoint at its end
        self.timeline: Path | None = None  # where fit() wrote the step timeline (rank 0)
        self.sampler = ShardedSampler(train_set, shuffle=True, seed=self.config.seed,  # type: ignore[arg-type]
                                      rank=self.world.rank, world_size=self.world.world_size)
        self.checkpoints = Checkpoints(
            self.config.checkpoint, self.run_dir / "checkpoints",
            lambda: (self.world, self.model),
            self.optimizer, self.sampler, self.config.global_batch_size, self.steps_per_epoch,
            self._config_record, self.config.seed, self.scheduler, self.scaler)

    def _parallel(self, model: nn.Module | Callable[[], nn.Module]) -> Replica:
        if isinstance(model, Replica):
            return model
        return self.config.parallel.build(self._module(model))  # type: ignore[union-attr]

    def _module(self, model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
        """The plain model, built (after seeding) if given as a function, on the device."""
        if isinstance(model, Replica):
            raise ValueError(
                "TrainConfig(elastic=...) takes the plain model (or a function that builds "
                f"it), not a {type(model).__name__}: the parallel wrapper is built again for "
                "every membership, from config.parallel")
        if not isinstance(model, nn.Module):
            seed_everything(self.config.seed)
            model = model()
        device = current().device if torch.distributed.is_initialized() \
            else torch.device("cpu")  # elastic: the group is formed later, by Elastic
        return model.to(device)

    def _elastic(self, module: nn.Module) -> Survival:
        carried = {"run": self._carried, "scheduler": self.scheduler, "scaler": self.scaler}
        return elastic_survival(module, self.optimizer, self.config, self._update, carried,
                                self.train_set, self.eval_set)

    @property
    def model(self) -> Replica:
        """The parallel model now (under elastic=, rebuilt whenever the members change)."""
        return self.survival.model

    @property
    def world(self) -> World:
        return self.survival.world

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.config.epochs
        return min(total, self.config.max_steps) if self.config.max_steps else total

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to the end (resuming if configured), evaluate, and return a summary. A run
        whose checkpoint is already at the end is not trained, evaluated or plotted again:
        its summary is returned as that run recorded it."""
        self._start()
        self.finished_before = self.state.global_step >= self.total_steps
        if self.finished_before:
            summary = self._summary(0.0, self._recorded_metrics())
            self.survival.finish()
            return summary
        self.runlog = self._open_runlog()
        self.tracing = tracing.Tracing(self.config.timeline)
        try:
            samples, seconds, metrics = self._train_to_end()
            self.timeline = self.tracing.finish(self.survival)
        finally:
            timeline.activate(None)
            self.runlog.close()
        if self.world.is_main:
            plot_at_end(self.run_dir)
        summary = self._summary(samples / seconds if samples else 0.0, metrics)
        self.survival.finish()
        return summary

    def _train_to_end(self) -> tuple[int, float, dict[str, float]]:
        """Every epoch, the final sync and evaluation -- and again from a step elastic ZeRO
        took back meanwhile. Samples and seconds of training only, and the metrics."""
        samples, seconds = 0, 0.0
        while True:
            while self.state.global_step < self.total_steps:
                started, saving = time.perf_counter(), self.checkpoints.seconds
                samples += self._train_epoch()
                seconds += time.perf_counter() - started - (self.checkpoints.seconds - saving)
                finished = self.state.global_step >= self.total_steps
                if not finished and self.state.epoch % self.config.eval_every_epochs == 0:
                    self._evaluate_and_record()
                self._follow_step()  # (back, if elastic ZeRO took a step back meanwhile)
            # every replica identical before the last evaluation
            self.survival.collective(lambda: self.model.finish())
            metrics = self._evaluate_and_record()
            if self.survival.step >= self.state.global_step:
                return samples, seconds, metrics
            self._follow_step()  # a step taken back at the end: trained again

    def _start(self) -> None:
        """Where this run starts: its checkpoint (or the beginning), read by every worker;
        a worker that joined a running job has received the step and state instead."""
        if self.survival.joined_running:
            self.state = self._carried.state  # the step follows; the history came along
            self._follow_step()
            return
        restored = self.survival.collective(lambda: self.checkpoints.restore(self.total_steps))
        assert restored is not None  # (nothing can have trained without this worker yet)
        self.state = self._carried.state = restored
        self.survival.step = self.state.global_step

    def _open_runlog(self) -> RunLog:
        return RunLog(self.run_dir, self.world.is_main, self.total_steps,
                      self.state.global_step, self.config.progress, self._config_record(),
                      self.config.trackers)

    def _follow_step(self) -> bool:
        """Take the step the job reached: one more, several (a worker left out that joined
        again), or one back (elastic ZeRO took back a step: training it again). True when
        it ended an epoch -- not 'the epoch changed': a worker that jumped epochs would
        evaluate where the others, mid-epoch, do not."""
        step, previous = self.survival.step, self.state.global_step
        self.state.global_step = step
        self.state.epoch, self.state.step_in_epoch = divmod(step, self.steps_per_epoch)
        return step > previous and step % self.steps_per_epoch == 0

    def _follow_members(self) -> None:
        """After a regroup: the sampler takes the new rank, and the metrics and progress bar
        follow rank 0 to whichever worker holds it now (the checkpoints ask each time)."""
        world = self.world
        self.sampler.rank, self.sampler.world_size = world.rank, world.world_size
        if self.runlog.is_main != world.is_main:
            self.runlog.close()
            self.runlog = self._open_runlog()

    def _summary(self, speed: float, metrics: dict[str, float]) -> dict[str, Any]:
        return {"steps": self.state.global_step, "samples_per_s": speed,
                "test_loss": metrics.get("loss"), "test_accuracy": metrics.get("accuracy"),
                "fingerprint": checkpoint.fingerprint(self.model.full_state_dict()),
                "world_size": self.world.world_size, "run_dir": str(self.run_dir),
                "already_finished": self.finished_before}

    def _recorded_metrics(self) -> dict[str, float]:
        """The evaluation a finished run recorded at its last step (metrics.jsonl, read by
        rank 0 for all); evaluated again, unrecorded, only where none was recorded."""
        found = recorded_eval(self.run_dir, self.state.global_step) if self.world.is_main \
            else None
        recorded = self.survival.collective(lambda: comm.broadcast_object(
            found, 0, "trainer: the finished run's last evaluation"))
        return dict(recorded) if recorded else self.evaluate()

    def _train_epoch(self) -> int:
        """Run the rest of the current epoch; returns global samples trained."""
        loader = self._micro_batches() if isinstance(self.survival, Steady) else None
        window = Window()
        trained, epoch_done = 0, False
        while not epoch_done and self.state.global_step < self.total_steps:
            window.add(self._train_step(loader))
            trained += self.config.global_batch_size
            self.runlog.progress(self.survival.step - self.state.global_step)  # every step
            epoch_done = self._follow_step()  # (it rolls over before any checkpoint, so a
            self._follow_members()            # checkpoint points at the next sample)
            if self.state.global_step % self.config.log_every_steps == 0 or \
                    self.state.global_step == self.total_steps:
                self._log_window(window)
                window = Window()
            paused = time.perf_counter()
            if self.config.mid_epoch_eval_due(self.state.global_step, self.state.epoch,
                                              epoch_done, self.total_steps):
                self._evaluate_and_record()
            for callback in self.callbacks:
                callback(self)
            if self.checkpoints.due(self.state, epoch_done, self.total_steps):
                with timeline.span("checkpoint"):
                    self.survival.collective(self.save_checkpoint)
            window.started += time.perf_counter() - paused  # its throughput: training only
            if self.survival.step < self.state.global_step:  # elastic ZeRO took it back
                epoch_done = self._follow_step()  # (False: the step is trained again)
        return trained

    def _micro_batches(self) -> Iterator[Batch]:
        assert self.plan is not None
        self.sampler.load_state_dict(self.checkpoints.sampler_state(self.state))
        yield from micro_batches(self.train_set, self.sampler, self.plan.micro_batch,
                                 self.config.seed + self.state.epoch, self.world.device)

    def _train_step(self, loader: Iterator[Batch] | None) -> float | None:
        """One optimizer step over one global batch; returns this rank's mean loss, or
        None for a step dropped for a non-finite gradient (nonfinite="skip") or completed
        by peers while this worker's attempt failed (elastic)."""
        self._dropped = False
        if (recording := timeline.active()) is not None:
            recording.begin_step(self.state.global_step + 1)
        loss = self.survival.run_step(lambda model, step: self._gradients(
            model, self._step_batches(step, loader)))
        if loss is not None:
            self.state.last_loss = loss
        return None if self._dropped else loss

    def _step_batches(self, step: int, loader: Iterator[Batch] | None
                      ) -> list[Callable[[], MicroBatch]]:
        """This rank's micro-batches of global batch `step`, each read when it is used:
        from the epoch's loader, or -- under elastic=, where the world may change between
        steps -- sliced afresh for the world now."""
        if self.schedule is not None:
            set_lr(self.optimizer, self.schedule(step))
        if loader is not None:
            assert self.plan is not None
            accumulation = self.plan.accumulation
            return [lambda: (*next(loader), accumulation)] * accumulation
        return self._shares(step, self.world)

    def _gradients(self, model: Replica, batches: list[Callable[[], MicroBatch]]) -> float:
        """Forward and backward over a step's micro-batches: the gradients, averaged over
        ranks once the last one's backward is done. Returns this rank's mean loss."""
        self._dropped_before = self._dropped_steps()
        return sum(self._micro_step(model, tracing.timed("data", read), last=i == len(batches) - 1)
                   for i, read in enumerate(batches))

    def _update(self) -> None:
        """Apply a step's gradients: once per committed step, on every rank."""
        with timeline.span("optimizer"):
            clip_and_step(self.optimizer, self.model.module.parameters(),
                          self.config.grad_clip_norm, self.scaler)
        if self.scheduler is not None:  # stepped per optimizer step, not per epoch
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._dropped = self._dropped_steps() != self._dropped_before

    def _micro_step(self, model: Replica, batch: MicroBatch, last: bool) -> float:
        x, y, divisor = batch
        with contextlib.nullcontext() if last else model.no_sync():
            with autocast(self.config.precision, self.world.device), timeline.span("forward"):
                loss = self.loss_fn(model(x), y) / divisor
            try:
                with timeline.span("backward"):  # (its end: the wait for communication)
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
            except NonFiniteGradientError as error:
                raise NonFiniteGradientError(
                    f"training step {self.state.global_step + 1} (epoch "
                    f"{self.state.epoch}): {error}") from None
        return float(loss.item())

    def _dropped_steps(self) -> int:
        return int(self.model.comm_stats().get("skipped_steps", 0))

    def _log_window(self, window: Window) -> None:
        def average() -> float:
            mean = comm.control_tensor([window.mean_loss()], dtype=torch.float32)
            comm.all_reduce(mean, "trainer: average of the logged loss")
            return float(mean.item()) / self.world.world_size

        loss = self.survival.collective(average)
        if loss is None:  # left out meanwhile (the others logged this window), or taken back
            return
        wire = self.model.comm_stats()
        extra = {"loss_scale": self.scaler.scale_value} if self.scaler else {}
        self.runlog.train_window(self.state.global_step, self.state.epoch, loss, window,
                                 self.config.global_batch_size, wire,
                                 float(self.optimizer.param_groups[0]["lr"]), **extra)
        self.tracing.window(self.survival, self.runlog, self.state.global_step, window.steps,
                            wire["bytes_sent"])

    # ---- evaluation and checkpoints ------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy over the whole eval set, exact across ranks."""
        if self.eval_set is None:
            return {}
        return evaluate(self.model, self.eval_set, self.loss_fn, self.config.eval_batch_size,  # type: ignore[arg-type]
                        self.config.precision, self.world.device)

    def _evaluate_and_record(self) -> dict[str, float]:
        if self.eval_set is None:
            return {}
        with timeline.span("evaluation"):
            metrics = self.survival.collective(self.evaluate)
        if metrics is None:  # left out meanwhile: the others evaluated without it
            return {}
        self.state.history.append({"step": self.state.global_step, **metrics})
        self.runlog.record("eval", self.state.global_step, **metrics)
        self.runlog.message(f"step {self.state.global_step}: test loss {metrics['loss']:.4f}, "
                       f"test accuracy {metrics['accuracy']:.4f}")
        return metrics

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
        return export.export_run(self.model, path, self.finished_before)

