"""Uneven inputs: let ranks that run out of data early stand in for the ones that have not.

Every grad-enabled forward under `model.join()` starts with one small all-reduce: a flag
per rank saying "I still have data", plus whether this step reduces gradients. A rank whose
loop has ended keeps answering that handshake with "no data" and, while anyone still
trains, issues the same collectives a real step would (buffer broadcast, bucket
all-reduces of zeros, the unused-parameter bitmap). Gradients are divided by the number of
ranks that contributed, so the last partial global batch is averaged over the data it has.
When every rank is out, parameters, buffers and optimizer state are re-synchronised from a
rank that trained to the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lockstep import comm
from lockstep.diagnostics import reporter
from lockstep.syncbn import SyncBatchNorm

if TYPE_CHECKING:
    from lockstep.replica import DataParallel


class JoinError(RuntimeError):
    """Ranks under `join()` did something the shadow steps cannot mirror."""


class Join:
    def __init__(self, model: DataParallel, optimizers: list[torch.optim.Optimizer],
                 sync_final_model: bool) -> None:
        self.model, self.optimizers = model, optimizers
        self.sync_final_model = sync_final_model
        self.world_size = comm.size_of(model.group)
        self.rank = comm.rank_of(model.group)
        self.active_ranks = list(range(self.world_size))  # as of the last handshake
        if getattr(model, "zero", 0):
            raise JoinError(f"rank {self.rank}: join() does not shadow ZeRO's reduce-scatters "
                            "and gathers; give every rank the same number of batches")
        if any(isinstance(m, SyncBatchNorm) for m in model.module.modules()):
            raise JoinError(f"rank {self.rank}: join() cannot stand in for SyncBatchNorm's "
                            "own collectives in its forward and backward; give every rank the "
                            "same number of batches instead (ShardedSampler with drop_last)")

    def agree_on_active(self, active: bool, stuck: bool = False) -> tuple[list[int], bool]:
        """The handshake: which ranks still have data, whether this step syncs, and which
        ranks cannot go on (so that every rank raises together instead of some waiting)."""
        n = self.world_size
        flags = torch.zeros(2 * n + 1, dtype=torch.int32)  # [active | stuck | syncing]
        if active:
            flags[self.rank] = 1
            flags[-1] = int(self.model.reducer.sync_enabled)
        flags[n + self.rank] = int(stuck)
        comm.all_reduce(flags, "join handshake (which ranks still have data)", self.model.group)
        stuck_ranks = [r for r in range(n) if flags[n + r]]
        if stuck_ranks:
            raise JoinError(f"rank {self.rank}: rank(s) {stuck_ranks} ran out of data in the "
                            "middle of a gradient accumulation window (no_sync micro-batches "
                            "not yet reduced); give every rank a number of batches that is a "
                            "multiple of the accumulation steps")
        active_ranks = [r for r in range(n) if flags[r]]
        syncing = int(flags[-1])
        if 0 < syncing < len(active_ranks):
            raise JoinError(f"rank {self.rank}: under join(), ranks disagree on whether this "
                            f"step synchronises ({syncing} of {len(active_ranks)} are inside "
                            "no_sync()); every rank must accumulate on the same steps")
        if active_ranks:
            self.active_ranks = active_ranks
            self.model.reducer.divisor = len(active_ranks)
        return active_ranks, syncing > 0

    def source_rank(self) -> int:
        """Where buffers and final state come from: the lowest rank still training."""
        return self.active_ranks[0]

    def finish(self) -> None:
        """This rank is out of data: shadow the others' steps until everyone is."""
        reducer = self.model.reducer
        stuck = reducer.has_unsynced_gradients()
        while True:
            active_ranks, syncs = self.agree_on_active(active=False, stuck=stuck)
            if not active_ranks:
                break
            reducer.prepare_forward()
            self.model.sync_buffers()
            if syncs:
                reducer.shadow_backward()
            reporter.advance()  # shadowing is progress: do not look "behind" to peers
        reducer.divisor = self.world_size
        if self.sync_final_model:
            self._sync_final_state()

    def _sync_final_state(self) -> None:
        source, group = self.source_rank(), self.model.group
        module = self.model.module
        comm.broadcast_tensors([*module.parameters(), *module.buffers()], source,
                               "join: final broadcast of the model", group)
        for optimizer in self.optimizers:
            # A rank that stopped early may hold no state at all yet: send the whole dict.
            state = comm.broadcast_object(optimizer.state_dict() if self.rank == source
                                          else None, source,
                                          "join: final broadcast of optimizer state", group)
            if self.rank != source:
                optimizer.load_state_dict(state)
