"""A Trainer script under `lockstep advise`: instead of training, the advisor measures the
script's own model, optimizer, loss and batches -- this rank's share of the global batch,
as `fit()` would feed it, gradient accumulation included -- prints its table (rank 0),
writes the advice where it was asked to, and the workers exit."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import comm
from lockstep.advisor.advise import advise, report, requested
from lockstep.comm.world import init
from lockstep.seeding import seed_everything
from lockstep.training.batching import plan_batches
from lockstep.training.config import TrainConfig
from lockstep.training.evaluation import LossFn
from lockstep.training.feed import micro_batches
from lockstep.training.sampler import ShardedSampler

__all__ = ["advise_instead", "requested"]


def advise_instead(model: nn.Module | Callable[[], nn.Module],
                   optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                   train_set: Dataset[Any], loss_fn: LossFn, config: TrainConfig,
                   path: str) -> NoReturn:
    world = init()
    if not isinstance(model, nn.Module):
        seed_everything(config.seed)
        model = model()
    module = getattr(model, "module", model)  # a parallel wrapper: the model inside it
    plan = plan_batches(config.global_batch_size, world.world_size, config.max_batch_per_rank)
    sampler = ShardedSampler(train_set, shuffle=True, seed=config.seed,  # type: ignore[arg-type]
                             rank=world.rank, world_size=world.world_size)

    def batches() -> Iterator[tuple[Any, Any]]:
        for epoch in range(sys.maxsize):
            sampler.set_epoch(epoch)
            yield from micro_batches(train_set, sampler, plan.micro_batch, config.seed + epoch,
                                     world.device)

    advice = advise(module.to(world.device), batches(), optimizer, loss_fn,
                    precision=config.precision, micro_steps=plan.accumulation)
    report(advice, path)
    comm.barrier("advisor: every rank done")
    raise SystemExit(0)
