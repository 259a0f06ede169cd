"""AsyncTrainer: asynchronous training through a parameter server, a loop of its own.

    trainer = lockstep.AsyncTrainer(model, optimizer, train_set, test_set,
                                    config=TrainConfig(parallel=AsyncConfig(max_staleness=4)))

Rank 0 serves the parameters and applies gradients (paramserver.py); the other ranks pull,
run a global batch's share, and push, without waiting for each other (up to
`max_staleness` steps apart). Then every rank evaluates the final model.

What it supports, plainly: fp32, the learning-rate schedule of TrainConfig (lr, warmup,
decay), logging and evaluation. What it refuses rather than skip: other precisions,
gradient clipping, a scheduler object, callbacks, and checkpoints (an asynchronous run
has no step at which every replica agrees) -- each is an error naming the setting.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import comm
from lockstep.comm.world import init
from lockstep.lowcomm.paramserver import AsyncConfig, ParameterServer, Worker, session_prefix
from lockstep.replication.syncbn import SyncBatchNorm
from lockstep.seeding import seed_everything
from lockstep.training import checkpoint, configfile
from lockstep.training.batching import plan_batches
from lockstep.training.config import TrainConfig
from lockstep.training.evaluation import LossFn, evaluate, flat_cross_entropy
from lockstep.training.feed import micro_batches, steps_per_epoch
from lockstep.training.runlog import RunLog, plot_at_end
from lockstep.training.sampler import ShardedSampler


class AsyncTrainer:
    """Asynchronous training with a parameter server on rank 0. Call `fit()` on every rank
    (at least two: a server and a worker)."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module],
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 train_set: Dataset[Any], eval_set: Dataset[Any] | None = None,
                 loss_fn: LossFn = flat_cross_entropy,
                 config: TrainConfig | None = None) -> None:
        self.config = config or TrainConfig(parallel=AsyncConfig())
        self.config.validate()
        self.parallel = _check_supported(self.config)
        self.world = init()
        if self.world.world_size < 2:
            raise ValueError("asynchronous training needs at least 2 ranks: a server and a "
                             "worker")
        self.plan = plan_batches(self.config.global_batch_size, self.world.world_size - 1,
                                 self.config.max_batch_per_rank)
        self.train_set, self.eval_set, self.loss_fn = train_set, eval_set, loss_fn
        self.steps_per_epoch = steps_per_epoch(train_set, self.config.global_batch_size)
        if not isinstance(model, nn.Module):
            seed_everything(self.config.seed)
            model = model()
        _refuse_sync_batchnorm(model)
        self.module = model.to(self.world.device)
        comm.broadcast_tensors(list(self.module.state_dict().values()), 0,
                               "broadcast of rank 0's model")
        self.optimizer = optimizer(self.module.parameters())
        self.total_steps = min(self.steps_per_epoch * self.config.epochs,
                               self.config.max_steps or 1 << 62)
        self.schedule = self.config.lr_schedule(self.total_steps)
        self.run_dir = Path(self.config.run_dir)

    def fit(self) -> dict[str, Any]:
        """Serve (rank 0) or train (the others) until the server has applied every update,
        then evaluate the final model on every rank."""
        world, prefix = self.world, session_prefix()
        runlog = RunLog(self.run_dir, world.rank == 1, self.total_steps, 0,
                        self.config.progress, configfile.as_record(self.config),
                        self.config.trackers)
        started = time.perf_counter()
        try:
            samples, stats = self._serve(prefix) if world.rank == 0 else \
                (self._work_or_say_why(prefix, runlog), {})
            totals = comm.control_tensor([float(samples), time.perf_counter() - started],
                                         dtype=torch.float64)
            comm.all_reduce(totals, "async: samples trained")
            stats = comm.broadcast_object(stats, 0, "async: server statistics")
            metrics = self._evaluate(runlog)
        finally:
            runlog.close()
        if world.rank == 1:
            plot_at_end(self.run_dir)
        return {"steps": self.total_steps,
                "samples_per_s": totals[0].item() / (totals[1].item() / world.world_size),
                "test_loss": metrics.get("loss"), "test_accuracy": metrics.get("accuracy"),
                "fingerprint": checkpoint.fingerprint(self.module),
                "world_size": world.world_size, "run_dir": str(self.run_dir), "server": stats}

    def _serve(self, prefix: str) -> tuple[int, dict[str, Any]]:
        updates = self.total_steps * (self.world.world_size - 1)
        server = ParameterServer(self.module, lambda _: self.optimizer, prefix, updates,
                                 self.parallel.max_staleness, self.parallel.dead_after_s,
                                 self.schedule)
        return 0, dict(server.serve().summary())

    def _work_or_say_why(self, prefix: str, runlog: RunLog) -> int:
        worker = Worker(self.module, prefix, self.parallel.max_staleness)
        try:
            return self._work(worker, runlog)
        except Exception as error:
            worker.fail(error)  # the server drops this worker now, not after a timeout
            raise

    def _work(self, worker: Worker, runlog: RunLog) -> int:
        """A worker's loop: pull, accumulate micro-batches, push -- until the server has
        spent its budget of updates. Returns the samples this worker trained on."""
        c, module = self.config, self.module
        batches = self._epochs_of_micro_batches()
        trained, pushes, window, window_loss = 0, 0, time.perf_counter(), 0.0
        # Synchronous rounds (bound 0): exactly total_steps each. Otherwise: until told.
        rounds = self.total_steps if self.parallel.max_staleness == 0 else None
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

    def _epochs_of_micro_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This worker's micro-batches, epoch after epoch, full steps only."""
        sampler = ShardedSampler(self.train_set, shuffle=True, seed=self.config.seed,  # type: ignore[arg-type]
                                 rank=self.world.rank - 1, world_size=self.world.world_size - 1)
        per_epoch = self.steps_per_epoch * self.plan.accumulation
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from itertools.islice(micro_batches(
                self.train_set, sampler, self.plan.micro_batch, epoch, self.world.device),
                per_epoch)

    def _evaluate(self, runlog: RunLog) -> dict[str, float]:
        if self.eval_set is None:
            return {}
        metrics = evaluate(self.module, self.eval_set, self.loss_fn,
                           self.config.eval_batch_size, "fp32", self.world.device)
        runlog.record("eval", self.total_steps, **metrics)
        runlog.message(f"step {self.total_steps}: test loss {metrics['loss']:.4f}, "
                       f"test accuracy {metrics['accuracy']:.4f}")
        return metrics


def _refuse_sync_batchnorm(model: nn.Module) -> None:
    """SyncBatchNorm's forward is a collective over every rank, and here the ranks never
    run a forward together: the worker would wait the whole collective timeout for the
    server, then fail."""
    for name, sub in model.named_modules():
        if isinstance(sub, (SyncBatchNorm, nn.SyncBatchNorm)):
            raise ValueError(
                f"rank {comm.rank_of()}: asynchronous training refuses SyncBatchNorm "
                f"('{name or type(model).__name__}'): it all-reduces batch statistics across "
                "ranks in every forward, and here the ranks never run a forward together "
                "(rank 0 serves; workers step apart). Use plain BatchNorm: each worker "
                "normalises with its own batch's statistics")


def _check_supported(config: TrainConfig) -> AsyncConfig:
    if not isinstance(config.parallel, AsyncConfig):
        raise ValueError("AsyncTrainer runs parallel=AsyncConfig(...); for "
                         f"{type(config.parallel).__name__} use lockstep.Trainer")
    refused = {"precision": config.precision != "fp32",
               "grad_clip_norm": config.grad_clip_norm is not None,
               "checkpoint.every_steps": config.checkpoint.every_steps is not None}
    named = [name for name, set_ in refused.items() if set_]
    if named:
        raise ValueError(f"asynchronous training does not support {', '.join(named)}: each "
                         "worker's gradients go to the server as they are, and no step is "
                         "one every replica agrees on (for checkpoints); leave them unset")
    return config.parallel
