"""State each rank holds for itself, kept per rank in a checkpoint.

Most of a checkpoint is the same on every rank (rank 0 writes it) or a ZeRO shard (each
rank its piece of one tensor, lockstep.sharding.reshard). Some state is neither, yet decides
the next step: a compressor's error feedback (what this rank has not sent yet; named with
compress.PER_RANK) and, in local SGD and DiLoCo, each rank's own inner optimizer state.
Each such tensor is saved by its rank under a name of its own, `<key>@rank<r>`, as a
one-piece ShardedTensor (checkpoint_files writes a ShardedTensor's local piece into that
rank's tensor file), and loaded by the rank of the same number.

A checkpoint written by another number of ranks cannot give each rank its own state: every
rank then takes rank 0's optimizer state and starts its error feedback from zero, and the
run goes on without being bitwise the one it continues (a warning says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from lockstep.logs import get_logger
from lockstep.replication.compress import PER_RANK
from lockstep.training.checkpoint_check import STATE, read_json

log = get_logger(__name__)


def for_files(bundle: dict[str, Any], own_optimizer: bool,
              saved_ranks: int | None = None) -> dict[str, Any]:
    """`bundle` (what checkpoint.save writes or load fills) with each rank's own tensors
    renamed to `<key>@rank<r>` and made this rank's piece: its error feedback, and with
    `own_optimizer` the optimizer's state (torch's state-dict layout). Loading, give the
    number of ranks that wrote the checkpoint (`saved_world_size`). The tensors are views:
    filling the result fills `bundle`."""
    rank = dist.get_rank()
    same = own_state_kept(saved_ranks)
    extra = bundle.get("extra", {})
    params = f"{PER_RANK}streaming.local."  # streaming DiLoCo's own parameters
    own_params = any(k.startswith(params) for k in extra)
    feedback = any(k.startswith(PER_RANK) and not k.startswith(params) for k in extra)
    if not same and rank == 0 and (feedback or own_optimizer or own_params):  # else none
        lost = [what for what, held in (("takes rank 0's optimizer state (local rounds)",
                                         own_optimizer),
                                        ("takes rank 0's parameters (streaming DiLoCo's "
                                         "differ per rank between syncs)", own_params),
                                        ("starts its error feedback from zero", feedback))
                if held]
        log.warning("the checkpoint was written by %d rank(s) and this run has %d: each rank "
                    "%s, so training goes on, but not bitwise as it would have", saved_ranks,
                    dist.get_world_size(), " and ".join(lost))
    out = dict(bundle)
    out["extra"] = {k: t for k, t in extra.items() if not k.startswith(PER_RANK)}
    if same:
        out["extra"].update({f"{k}@rank{rank}": _own(t) for k, t in extra.items()
                             if k.startswith(PER_RANK)})
    if own_optimizer and "optim" in bundle:
        source = rank if same else 0
        out["optim"] = {**bundle["optim"], "state": {
            name: {f"{k}@rank{source}" if isinstance(v, torch.Tensor) else k:
                   _own(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for name, state in bundle["optim"]["state"].items()}}
    return out


def own_state_kept(saved_ranks: int | None) -> bool:
    """Whether each rank finds its own state in a checkpoint written by `saved_ranks`
    ranks (None: unknown, taken as this world's)."""
    return saved_ranks in (None, dist.get_world_size())


def saved_world_size(folder: Path) -> int | None:
    """How many ranks wrote the checkpoint in `folder` (None if its state says nothing
    readable: loading it fails later, with the reason)."""
    try:
        ranks = read_json(folder / STATE).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else None


def _own(tensor: torch.Tensor) -> ShardedTensor:
    """`tensor`, flattened (a view), as the one piece of a tensor this rank alone holds."""
    flat = tensor.detach().view(-1)
    piece = ShardMetadata([0], [flat.numel()], f"rank:{dist.get_rank()}/{flat.device}")
    metadata = ShardedTensorMetadata([piece], flat.shape, TensorProperties(dtype=flat.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(flat, piece)],
                                                                     metadata)
