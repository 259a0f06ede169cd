"""A ZeRO optimizer's state as one unsharded torch optimizer state dict, and back.

What `torch.optim.Optimizer.state_dict()` of the same optimizer over the whole model would
hold -- `{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}`, indexed by
the parameters' positions in `params` -- assembled from every rank's shards (a collective),
as torch's ZeroRedundancyOptimizer.consolidate_state_dict and FSDP's full optimizer state
dict do. A framework that saves `optimizer.state_dict()` (Lightning) then writes the same
file with ZeRO as without it, loadable at any stage and world size, and by plain DDP.
The cost: the whole optimizer state on every rank while it is saved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.sharding.optimizer import ZeroOptimizer, numeric_settings
from lockstep.sharding.pieces import elementwise
from lockstep.sharding.zero import FlatGroup


def whole_state_dict(optimizer: ZeroOptimizer, params: list[nn.Parameter]) -> dict[str, Any]:
    """The state dict of the unsharded optimizer over `params` (every rank gets it)."""
    index = {id(p): i for i, p in enumerate(params)}
    state: dict[int, dict[str, Any]] = {}
    for g in optimizer.groups:  # keys in one order on every rank: each gather is collective
        for key, value in sorted(optimizer.inner.state.get(g.shard_param, {}).items()):
            whole = _gathered(g, value, key, optimizer.group) \
                if elementwise(value, g.shard_param) else None
            for name, param, offset in zip(g.names, g.params, g.offsets, strict=True):
                if id(param) not in index:
                    raise ValueError(f"rank {comm.rank_of(optimizer.group)}: parameter {name} "
                                     "is stepped by this ZeRO optimizer but not in the list "
                                     "it is saved for")
                slot = state.setdefault(index[id(param)], {})
                slot[key] = whole[offset:offset + param.numel()].view_as(param).clone() \
                    if whole is not None else _copy(value)
    group = {**optimizer.inner.param_groups[0], "params": list(range(len(params)))}
    return {"state": state, "param_groups": [group]}


def load_whole_state_dict(optimizer: ZeroOptimizer, params: list[nn.Parameter],
                          saved: dict[str, Any]) -> None:
    """Take this rank's shards of an unsharded state dict over `params` (as saved by
    `whole_state_dict`, or by the same torch optimizer without ZeRO)."""
    groups = saved.get("param_groups", [])
    if len(groups) != 1:
        raise ValueError(f"rank {comm.rank_of(optimizer.group)}: a ZeRO optimizer steps one "
                         f"parameter group; this optimizer state has {len(groups)}")
    states = {int(k): v for k, v in saved["state"].items()}
    position = dict(zip((id(params[i]) for i in groups[0]["params"]), groups[0]["params"],
                        strict=True))
    for g in optimizer.groups:
        per_param = [states.get(position.get(id(p), -1), {}) for p in g.params]
        keys = sorted({key for s in per_param for key in s})
        shard_state = optimizer.inner.state[g.shard_param]
        for key in keys:
            shard_state[key] = _sharded(g, [s.get(key) for s in per_param])
    optimizer.inner.param_groups[0].update(numeric_settings(groups[0]))


def _gathered(g: FlatGroup, shard_value: torch.Tensor, key: str, group: comm.Group
              ) -> torch.Tensor:
    """One element-wise state (a momentum) over the group's whole flat buffer."""
    whole = shard_value.new_zeros(g.padded_numel)
    whole[g.shard].copy_(shard_value)
    comm.gather_shards_async(whole, f"ZeRO: gather of optimizer state {key!r} to save it",
                             group).wait()
    return whole


def _sharded(g: FlatGroup, values: list[Any]) -> Any:
    """This rank's shard of one state, from each parameter's whole value (None where a
    parameter has none yet: zeros, as the optimizer would start it). A state is per element
    if it is for some parameter of more than one element; then a one-element parameter's
    (a learned temperature's momentum, shape []) is too."""
    if not any(isinstance(v, torch.Tensor) and elementwise(v, p)
               for v, p in zip(values, g.params, strict=True)):
        return _copy(next(v for v in values if v is not None))  # shared (Adam's step)
    whole = torch.zeros(g.padded_numel, dtype=g.shard_param.dtype, device=g.shard_param.device)
    for value, param, offset in zip(values, g.params, g.offsets, strict=True):
        if isinstance(value, torch.Tensor) and value.numel() == param.numel():
            whole[offset:offset + param.numel()].copy_(value.reshape(-1))
    return whole[g.shard].clone()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
