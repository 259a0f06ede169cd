"""What each step trains on: this rank's micro-batches of one global batch.

Global batch i of an epoch is positions [i*G, (i+1)*G) of the epoch's sample order
(sampler.py), at any world size. A fixed world reads them through a DataLoader over the
ShardedSampler (`micro_batches`); a fault-tolerant job, whose world may change between
steps, slices each step afresh for the world it has then (`Shares`), weighting each
micro-batch so that any split averages to the global batch's mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from lockstep.comm.world import World
from lockstep.training.batching import batch_share, share_divisor
from lockstep.training.sampler import ShardedSampler, global_order

Batch = tuple[torch.Tensor, torch.Tensor]
MicroBatch = tuple[torch.Tensor, torch.Tensor, float]  # inputs, targets, the loss's divisor


def steps_per_epoch(train_set: Dataset[Any], global_batch: int) -> int:
    steps = len(train_set) // global_batch  # type: ignore[arg-type]
    if steps == 0:
        raise ValueError(f"the training set ({len(train_set)} samples) is smaller than one "  # type: ignore[arg-type]
                         f"global batch ({global_batch})")
    return steps


def micro_batches(dataset: Dataset[Any], sampler: ShardedSampler, size: int, seed: int,
                  device: torch.device) -> Iterator[Batch]:
    """Micro-batches in `sampler`'s order, on `device`. A private generator: creating a
    loader iterator otherwise draws from the global RNG, at a different point in a resumed
    run, and shifts every dropout mask after."""
    loader = DataLoader(dataset, batch_size=size, sampler=sampler,
                        generator=torch.Generator().manual_seed(seed))
    for x, y in loader:
        yield x.to(device), y.to(device)


def fetch(dataset: Dataset[Any], indices: torch.Tensor, divisor: float,
          device: torch.device) -> MicroBatch:
    """The samples at `indices`, collated as a DataLoader would, on `device`."""
    x, y = default_collate([dataset[i] for i in indices.tolist()])
    return x.to(device), y.to(device), divisor


class Shares:
    """This rank's micro-batches of global batch `step`, for the world as it is now: each
    a function that reads it when it is used."""

    def __init__(self, dataset: Dataset[Any], global_batch: int, steps_per_epoch: int,
                 seed: int, max_per_rank: int | None) -> None:
        self.dataset, self.global_batch, self.per_epoch = dataset, global_batch, steps_per_epoch
        self.seed, self.max_per_rank = seed, max_per_rank
        self._order: tuple[int, torch.Tensor] | None = None  # the epoch's sample order

    def __call__(self, step: int, world: World) -> list[Callable[[], MicroBatch]]:
        epoch, within = divmod(step, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, global_order(len(self.dataset), self.seed, epoch,  # type: ignore[arg-type]
                                               shuffle=True))
        order, G = self._order[1], self.global_batch
        return [functools.partial(fetch, self.dataset, order[list(positions)],
                                  share_divisor(G, len(positions), world.world_size),
                                  world.device)
                for positions in batch_share(within, G, world.rank, world.world_size,
                                             self.max_per_rank)]
