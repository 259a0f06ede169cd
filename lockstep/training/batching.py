"""How one global batch is split: over ranks, then over accumulation micro-steps.

Pure integer planning: the same global batch trains the same model at any world size.
"""

from __future__ import annotations

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
