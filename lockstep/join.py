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
                 sync_final_model: bool, divide_by_initial_world_size: bool = False) -> None:
        self.model, self.optimizers = model, optimizers
        self.sync_final_model = sync_final_model
        self.divide_by_initial_world_size = divide_by_initial_world_size
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

    def agree_on_active(self, active: bool, sync: bool = False) -> tuple[list[int], bool]:
        """The handshake before every forward: which ranks still have data, and whether
        this step's backward synchronises (every rank that still trains must agree; one
        that ran out mid-accumulation just shadows the sync)."""
        n = self.world_size
        flags = comm.control_tensor([0] * (n + 1), self.model.group)  # [active | syncing]
        if active:
            flags[self.rank] = 1
            flags[n] = int(sync)
        comm.all_reduce(flags, "join handshake (which ranks still have data)", self.model.group)
        everyone = flags.tolist()
        active_ranks = [r for r in range(n) if everyone[r]]
        syncing = everyone[n]
        if 0 < syncing < len(active_ranks):
            raise JoinError(f"rank {self.rank}: under join(), ranks disagree on whether this "
                            f"step synchronises ({syncing} of {len(active_ranks)} are inside "
                            "no_sync()); every rank must accumulate on the same steps")
        if active_ranks:
            self.active_ranks = active_ranks
            self.model.reducer.divisor = n if self.divide_by_initial_world_size \
                else len(active_ranks)
        return active_ranks, syncing > 0

    def source_rank(self) -> int:
        """Where buffers and final state come from: the highest rank still training (as
        DDP's join picks it)."""
        return self.active_ranks[-1]

    def finish(self) -> None:
        """This rank is out of data: shadow the others' steps until everyone is. What it
        accumulated in an unfinished no_sync window is not contributed (as in DDP)."""
        reducer = self.model.reducer
        while True:
            active_ranks, syncs = self.agree_on_active(active=False)
            if not active_ranks:
                break
            reducer.prepare_forward(syncs)
            self.model.sync_buffers(syncs)
            if syncs:
                reducer.shadow_backward()
            reporter.advance()  # shadowing is progress: do not look "behind" to peers
        reducer.divisor = self.world_size
        if self.sync_final_model:
            self._sync_final_state()

    def _sync_final_state(self) -> None:
        source, group = self.source_rank(), self.model.group
        module = self.model.module
        tensors: list[torch.Tensor] = [*module.parameters()]
        if self.model.broadcast_buffers:
            tensors += [*module.buffers()]
        comm.broadcast_tensors(tensors, source, "join: final broadcast of the model", group)
        for optimizer in self.optimizers:
            # A rank that stopped early may hold no state at all yet: send the whole dict.
            state = comm.broadcast_object(optimizer.state_dict() if self.rank == source
                                          else None, source,
                                          "join: final broadcast of optimizer state", group)
            if self.rank != source:
                optimizer.load_state_dict(state)
