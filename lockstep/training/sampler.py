"""ShardedSampler: each rank's disjoint slice of every epoch, resumable mid-epoch.

One epoch is one permutation of the dataset, fixed by (seed, epoch). The epoch's *global
order* is that permutation; rank r of N takes positions r, r+N, r+2N, ... of it. So after
every rank has drawn k samples, exactly the first k*N positions of the global order have been
consumed -- whatever N is. That is what makes resuming at another world size exact: the
remainder of the global order is simply re-dealt among the new ranks.

With b samples per rank per step, global batch i is positions [i*N*b, (i+1)*N*b) of the
global order: the same set of samples at any world size with the same global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


def global_order(length: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The epoch's order of dataset indices: a permutation fixed by (seed, epoch)."""
    if not shuffle:
        return torch.arange(length)
    # Mix rather than add: with seed + epoch (DistributedSampler's choice), seed 4 at epoch 4
    # would replay seed 3 at epoch 5.
    generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + epoch) % 2**63)
    return torch.randperm(length, generator=generator)


def shard_indices(order: torch.Tensor, start: int, rank: int, world_size: int,
                  drop_last: bool) -> list[int]:
    """Rank `rank`'s share of `order[start:]`, dealt round-robin.

    The remainder is made a multiple of `world_size` so every rank gets the same count (ranks
    that take different numbers of steps deadlock): either by wrapping around to its own
    beginning (padding repeats a few samples) or, with drop_last, by dropping the tail.
    """
    remaining = order[start:]
    n = len(remaining)
    if drop_last:
        remaining = remaining[: n - n % world_size]
    elif n % world_size:
        pad = world_size - n % world_size
        repeats = -(-pad // n)  # a dataset smaller than the world wraps more than once
        remaining = torch.cat([remaining, remaining.repeat(repeats)[:pad]])
    return remaining[rank::world_size].tolist()


def per_rank_count(length: int, start: int, world_size: int, drop_last: bool) -> int:
    n = max(0, length - start)
    return n // world_size if drop_last else -(-n // world_size)


class ShardedSampler(Sampler[int]):
    """Disjoint, equal-length per-rank slices of a dataset, reshuffled every epoch.

    The epoch advances by itself on each new pass (a forgotten `set_epoch` would otherwise
    replay the same order every epoch); `set_epoch(e)` still takes precedence when called.
    `state_dict()` records the position as a global sample index, so `load_state_dict()`
    resumes mid-epoch, at the same or another world size, without repeating or skipping.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        self.dataset_len = len(dataset)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if initialized else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardedSampler: rank {self.rank} is outside world of "
                             f"size {self.world_size}")
        if self.dataset_len == 0:
            raise ValueError(f"ShardedSampler (rank {self.rank}): the dataset is empty")
        self.epoch = 0
        self._start = 0          # global position at which the current epoch (re)starts
        self._drawn = 0          # samples this rank has handed out in the current pass
        self._passed_epoch: int | None = None  # epoch of the last pass begun, for auto-advance

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s order for the next pass. A resumed position survives only if
        `epoch` is the epoch it was saved in."""
        if epoch != self.epoch:
            self._start, self._drawn = 0, 0
        self.epoch = epoch
        self._passed_epoch = None

    def __len__(self) -> int:
        """Samples this rank draws in its next pass (which may be a new, auto-advanced
        epoch starting from the beginning)."""
        start = 0 if self._passed_epoch == self.epoch else self._start
        return per_rank_count(self.dataset_len, start, self.world_size, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        if self._passed_epoch == self.epoch:  # a new pass with no set_epoch in between
            self.epoch += 1
            self._start, self._drawn = 0, 0
        self._passed_epoch = self.epoch
        self._drawn = 0
        order = global_order(self.dataset_len, self.seed, self.epoch, self.shuffle)
        for index in shard_indices(order, self._start, self.rank, self.world_size,
                                   self.drop_last):
            self._drawn += 1
            yield index

    def position(self) -> int:
        """Global samples of the current epoch consumed so far (by all ranks together)."""
        return self._start + self._drawn * self.world_size

    def state_dict(self, drawn: int | None = None) -> dict[str, Any]:
        """The position to resume from. `drawn` overrides how many samples this rank has
        consumed in the current pass -- pass it when a DataLoader with workers prefetches
        indices ahead of what training has used."""
        if drawn is not None:
            self._drawn = drawn
        epoch, start = self.epoch, self.position()
        in_pass = per_rank_count(self.dataset_len, self._start, self.world_size, self.drop_last)
        if start >= self.dataset_len or (self.drop_last and in_pass == self._drawn
                                         and self._passed_epoch == self.epoch):
            epoch, start = epoch + 1, 0  # the pass is complete: resume at the next epoch
        return {"epoch": epoch, "position": min(start, self.dataset_len), "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset_len": self.dataset_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["dataset_len"] != self.dataset_len:
            raise ValueError(f"ShardedSampler (rank {self.rank}): checkpoint was for a dataset "
                             f"of {state['dataset_len']} samples, this one has "
                             f"{self.dataset_len}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self._start, self._drawn = int(state["epoch"]), int(state["position"]), 0
        self._passed_epoch = None
