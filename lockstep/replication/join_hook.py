"""What `join()` needs of a DataParallel (join.JoinHook): its shadow steps and final sync.

Kept apart from replica.py as join.py is: the idea of standing in for a rank's step, told
in terms of the wrapper's reducer and buffers.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep import comm
from lockstep.comm.diagnostics import reporter
from lockstep.replication.join import JoinError
from lockstep.replication.syncbn import SyncBatchNorm


class ReplicaJoinHook:
    """Shadow steps for a DataParallel (`model`); at the end, every replica made the last
    rank's, with the state of `stateful` (optimizers, a LossScaler: whatever has
    state_dict() and load_state_dict())."""

    def __init__(self, model: Any, stateful: list[Any], sync_final_model: bool) -> None:
        self.model, self.stateful = model, stateful
        self.sync_final_model = sync_final_model
        rank = comm.rank_of(model.group)
        if any(isinstance(m, SyncBatchNorm) for m in model.module.modules()):
            raise JoinError(f"rank {rank}: join() cannot stand in for SyncBatchNorm's own "
                            "collectives in its forward and backward; give every rank the "
                            "same number of batches instead (ShardedSampler with drop_last)")

    def set_divisor(self, ranks: int) -> None:
        self.model.reducer.divisor = ranks

    def shadow_step(self, sync: bool, source: int) -> None:
        self.model.reducer.prepare_forward(sync)
        self.model.sync_buffers(sync)
        # A step further where a real forward counts one (_before_training_forward): the
        # backward's collectives then carry the same step number on every rank, so the
        # watchdog sees no desync, and shadowing reads as progress, not as a rank behind.
        reporter.advance()
        if sync:
            self.model.reducer.shadow_backward()

    def sync_final(self, source: int) -> None:
        if not self.sync_final_model:
            return
        model, group = self.model, self.model.group
        tensors: list[torch.Tensor] = [*model.module.parameters()]
        if model.broadcast_buffers:
            tensors += [*model.module.buffers()]
        comm.broadcast_tensors(tensors, source, "join: final broadcast of the model", group)
        mine = comm.rank_of(group) == source
        for holder in self.stateful:
            # A rank that stopped early may hold no state at all yet: send the whole dict.
            state = comm.broadcast_object(holder.state_dict() if mine else None, source,
                                          "join: final broadcast of optimizer state", group)
            if not mine:
                holder.load_state_dict(state)
