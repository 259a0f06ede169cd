"""Model and optimizer state in one layout for every ZeRO stage and world size, for checkpoints.

Every parameter is keyed by name as a flat 1-D tensor, `model.<name>` (frozen ones too),
every buffer (BatchNorm's statistics) as `buffer.<name>`, and every
element-wise optimizer state as `optim.<name>.<state>` (exp_avg, momentum_buffer...);
scalar states shared by all parameters (Adam's step) are saved once, `optim.<state>`.
At stage 0 each rank offers whole tensors (rank 0 writes them); under ZeRO each rank offers
only the pieces of each flattened parameter that lie in its shards, as a ShardedTensor
whose chunk offsets follow from the flat layout. Loading builds the same keys for the
*target* layout -- whole tensors or this rank's pieces, as views into the live parameters
and optimizer state -- and lockstep.training.checkpoint_files reads whatever overlaps, so a
checkpoint written at stage 3 on 3 ranks loads at stage 1 on 2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from lockstep import comm
from lockstep.sharding.optimizer import ZeroOptimizer, numeric_settings
from lockstep.sharding.pieces import elementwise
from lockstep.sharding.sharded import ShardedDataParallel
from lockstep.sharding.zero import FlatGroup


def state_dict(model: Any, optimizer: Any) -> dict[str, Any]:
    """Views of this rank's model and optimizer state in the common layout. Loading into
    it (checkpoint_files.fill) writes straight into the model and optimizer."""
    if isinstance(model, ShardedDataParallel):
        _ensure_state(optimizer.inner)
        return {**_sharded(model.zero_groups, optimizer), **_replicated(model.module),
                GROUPS: _settings(optimizer.inner)}
    _ensure_state(optimizer)
    return {**_whole(model.module, optimizer), **_replicated(model.module),
            GROUPS: _settings(optimizer)}


GROUPS = "optim_groups"
"""The optimizer's settings per parameter group (lr, momentum, betas, ...): a learning-rate
scheduler that scales the current rate (StepLR, ReduceLROnPlateau) needs the rate it had
reached, and a resumed run without it went on at the initial one."""


def _settings(optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Each group's numeric settings, as values a checkpoint keeps; loading fills them in
    place, and after_load hands them back."""
    return {str(i): numeric_settings(group) for i, group in enumerate(optimizer.param_groups)}


def after_load(model: Any, optimizer: Any, loaded: dict[str, Any]) -> None:
    """Finish a load: a scalar state (Adam's step), saved once, was loaded into one
    parameter's state -- give it to all; stages 1-2 refill whole parameters from shards."""
    sharded = isinstance(model, ShardedDataParallel)
    inner = optimizer.inner if sharded else optimizer
    for index, settings in loaded.get(GROUPS, {}).items():
        inner.param_groups[int(index)].update(settings)
    for key, value in loaded.items():
        if key.startswith("optim.") and key.count(".") == 1 and isinstance(value, torch.Tensor):
            for state in inner.state.values():
                if key[len("optim."):] in state:
                    state[key[len("optim."):]].copy_(value)
    if sharded and model.stage in (1, 2):
        optimizer.gather_params("all-gather of loaded shards")
    if sharded and optimizer.mirrored:  # (fault tolerance) the next rank's shard, as loaded
        optimizer.refresh_mirrors()


@torch.no_grad()
def _ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """A fresh optimizer has no state tensors to load into: make them with one step at
    learning rate 0 on zero gradients (which moves nothing), then put the gradients and
    learning rates back. (torch's own helper skips this whenever gradients exist.)"""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        if p.requires_grad:  # frozen parameters get no state, as in training
            p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def _replicated(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What every rank holds whole and no optimizer touches: frozen parameters and
    buffers. A resume without them would not be exact (BatchNorm's running statistics)."""
    out = {f"model.{name}": param.detach().view(-1)
           for name, param in module.named_parameters() if not param.requires_grad}
    out.update({f"buffer.{name}": buffer.view(-1) for name, buffer in module.named_buffers()})
    return out


def _whole(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = {id(p): n for n, p in module.named_parameters()}
    for name, param in module.named_parameters():
        if param.requires_grad:
            out[f"model.{name}"] = param.detach().view(-1)
    for owner, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if elementwise(value, owner):
                out[f"optim.{names[id(owner)]}.{key}"] = value.view(-1)
            else:
                out[f"optim.{key}"] = value
    return out


def _sharded(groups: list[FlatGroup], optimizer: ZeroOptimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank, world_size = comm.rank_of(optimizer.group), comm.size_of(optimizer.group)
    for g in groups:
        state = optimizer.inner.state[g.shard_param]
        for name, param, offset in zip(g.names, g.params, g.offsets, strict=True):
            chunks = _chunks(g, offset, param.numel(), world_size)
            out[f"model.{name}"] = _sharded_tensor(g.shard_param.detach(), g, offset, chunks,
                                                   rank, param.numel())
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() == g.shard_param.numel():
                    out[f"optim.{name}.{key}"] = _sharded_tensor(value, g, offset, chunks,
                                                                 rank, param.numel())
                elif isinstance(value, torch.Tensor):
                    out[f"optim.{key}"] = value
    return out


def _chunks(group: FlatGroup, offset: int, numel: int, world_size: int
            ) -> list[tuple[int, int, int]]:
    """(rank, start in the flattened parameter, length) of every rank's piece of it."""
    size = group.padded_numel // world_size
    pieces = []
    for r in range(world_size):
        lo, hi = max(offset, r * size), min(offset + numel, (r + 1) * size)
        if hi > lo:
            pieces.append((r, lo - offset, hi - lo))
    return pieces


def _sharded_tensor(shard: torch.Tensor, group: FlatGroup, offset: int,
                    chunks: list[tuple[int, int, int]], rank: int, numel: int) -> ShardedTensor:
    """This rank's piece of one flattened parameter (a view into `shard`), with every
    rank's pieces described, so no collective is needed to build it. `offset` is where the
    parameter starts in the group's flat buffer."""
    local = []
    for r, start, length in chunks:
        if r == rank:
            at = offset + start - group.shard.start  # position inside this rank's shard
            local.append(Shard(shard[at:at + length],
                               ShardMetadata([start], [length], f"rank:{r}/cpu")))
    metadata = ShardedTensorMetadata(
        [ShardMetadata([start], [length], f"rank:{r}/cpu") for r, start, length in chunks],
        torch.Size([numel]), TensorProperties(dtype=shard.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)
