"""Uneven inputs: let ranks that run out of data early stand in for the ones that have not.

Every grad-enabled forward under `model.join()` starts with one small all-reduce: a flag
per rank saying "I still have data", plus whether this step reduces gradients. A rank whose
loop has ended keeps answering that handshake with "no data" and, while anyone still
trains, issues the same collectives a real step would (buffer broadcast, bucket
all-reduces of zeros, the unused-parameter bitmap). Gradients are divided by the number of
ranks that contributed, so the last partial global batch is averaged over the data it has.
When every rank is out, the replicas are re-synchronised from a rank that trained longest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lockstep import comm

if TYPE_CHECKING:
    from lockstep.replica import DataParallel


class Join:
    def __init__(self, model: DataParallel, sync_final_model: bool) -> None:
        self.model = model
        self.sync_final_model = sync_final_model
        self.world_size = comm.size_of(model.group)
        self.rank = comm.rank_of(model.group)
        self.active_ranks = list(range(self.world_size))  # as of the last handshake

    def agree_on_active(self, active: bool) -> tuple[list[int], bool]:
        """The handshake: which ranks still have data, and whether this step syncs."""
        flags = torch.zeros(self.world_size + 1, dtype=torch.int32)
        if active:
            flags[self.rank] = 1
            flags[-1] = int(self.model.reducer.sync_enabled)
        comm.all_reduce(flags, "join handshake (which ranks still have data)", self.model.group)
        active_ranks = [r for r in range(self.world_size) if flags[r]]
        if active_ranks:
            self.active_ranks = active_ranks
            self.model.reducer.divisor = len(active_ranks)
        return active_ranks, bool(flags[-1])

    def source_rank(self) -> int:
        """Where buffers come from: the lowest rank that is still training."""
        return self.active_ranks[0]

    def finish(self) -> None:
        """This rank is out of data: shadow the others' steps until everyone is."""
        reducer = self.model.reducer
        while True:
            active_ranks, syncs = self.agree_on_active(active=False)
            if not active_ranks:
                break
            reducer.prepare_forward()
            self.model.sync_buffers()
            if syncs:
                reducer.shadow_backward()
        reducer.divisor = self.world_size
        if self.sync_final_model:
            module = self.model.module
            comm.broadcast_tensors([*module.parameters(), *module.buffers()], self.source_rank(),
                                   "join: final broadcast of the model", self.model.group)
