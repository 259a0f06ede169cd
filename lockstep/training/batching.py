"""How one global batch is split: over ranks, then over accumulation micro-steps.

Pure integer planning: the same global batch trains the same model at any world size.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
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


def batch_share(step_in_epoch: int, global_batch: int, rank: int, world_size: int,
                max_per_rank: int | None = None) -> list[range]:
    """Rank `rank`'s share of global batch `step_in_epoch` -- positions in the epoch's
    order -- split into micro-batches of at most `max_per_rank`.

    The positions are those ShardedSampler deals: rank r of N takes every N-th from the
    batch's start + r, so where N divides the global batch a step trains each rank on the
    samples the plan_batches path gives it. Where it does not (a fault-tolerant job that
    lost a worker), shares differ by one sample: weight each micro-batch's mean loss by
    global_batch / (its size * N) -- the divisor `share_divisor` gives -- and the average
    over ranks is still the global batch's mean."""
    if world_size > global_batch:
        raise ValueError(f"a global batch of {global_batch} cannot be split over "
                         f"{world_size} ranks: every rank needs at least one sample")
    start = step_in_epoch * global_batch
    mine = range(start + rank, start + global_batch, world_size)
    cap = max_per_rank or len(mine)
    pieces = math.ceil(len(mine) / cap)
    bounds = [len(mine) * k // pieces for k in range(pieces + 1)]
    return [mine[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def share_divisor(global_batch: int, micro_batch: int, world_size: int) -> float:
    """What a micro-batch's mean loss is divided by so that the ranks' average gradient is
    the global batch's mean (with equal shares: the accumulation steps)."""
    return global_batch / (micro_batch * world_size)
