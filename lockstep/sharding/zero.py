"""ZeRO: shard what every rank would otherwise hold in full (Rajbhandari et al. 2020).

Per rank, with Adam in fp32, model state costs 16 bytes per parameter: 4 parameter, 4
gradient, 8 optimizer state. ZeRO splits it over N ranks:

    stage 1: optimizer state sharded          4 + 4 + 8/N   (4 + 8/N between steps)
    stage 2: ... and gradients                4 + (4 + 8)/N
    stage 3: ... and parameters                   16/N

The unit of sharding is a *flat group*: some parameters laid end to end in one buffer,
padded to a multiple of N, rank r owning elements [r*S/N, (r+1)*S/N). For stages 1 and 2
the groups are the gradient buckets (so a bucket's shard of gradients lines up with its
shard of parameters); for stage 3 they are units of the model -- by default each module
that owns parameters, i.e. a layer.

- Stage 1: gradients are all-reduced as usual; each rank steps its shard (the optimizer
  only ever sees shards), then the shards are all-gathered back into the parameters and
  the gradient buckets are freed until the next backward (optimizer.py).
- Stage 2: each bucket is reduce-scattered as soon as it fills; its full gradient buffer is
  freed after, so no rank keeps the whole gradient.
- Stage 3: parameters exist only as shards. A unit is all-gathered just before its forward
  (and the next unit prefetched) and freed right after; gathered again when backward
  reaches it, and freed once its gradients are reduce-scattered. "Freed" means the flat
  buffer's storage shrinks to nothing: the parameters stay views of it, so autograd's
  saved references remain valid for the moment it is refilled.

Mirrored (under fault tolerance, recovery.py): each rank also keeps the next rank's shard
of parameters and optimizer state, stepped alongside its own from that shard's gradient (at
stage 1 a slice of the all-reduced bucket; from stage 2 a second reduce-scatter of the
bucket rotated by one shard), so a rank's death loses nothing a survivor lacks. It costs
twice the sharded state and, from stage 2, twice the reduce-scatter traffic.

How each flat group's gradient is reduced is gradients.py's ShardedReduction; the
optimizer over the shards is optimizer.py's ZeroOptimizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.comm import timeline
from lockstep.replication.buckets import (
    ParamSlot,
    plan_before_backward,
)
from lockstep.replication.reduction import Done
from lockstep.sharding import compressed


def padded(numel: int, world_size: int) -> int:
    return numel + (-numel) % world_size


def shard_range(padded_numel: int, rank: int, world_size: int) -> slice:
    size = padded_numel // world_size
    return slice(rank * size, (rank + 1) * size)


# ---- the flat groups: where parameters live -------------------------------------------------


@dataclass
class FlatGroup:
    """Parameters laid end to end in one padded buffer, and this rank's shard of it."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    padded_numel: int
    shard: slice
    flat: torch.Tensor = field(repr=False)       # the full buffer (stage 3: on demand)
    shard_param: nn.Parameter = field(repr=False)  # what the optimizer steps
    shard_grad: torch.Tensor = field(repr=False)   # the shard's averaged gradient
    gathered: bool = True
    pending: Any = None                             # an all-gather in flight (prefetch)
    pending_since_ns: int = 0                       # the last gather's launch (timeline)
    mirror: slice | None = None                     # the next rank's shard, kept here too
    mirror_param: nn.Parameter | None = field(default=None, repr=False)
    mirror_grad: torch.Tensor | None = field(default=None, repr=False)
    wire: str = "full"                              # how its gathers travel (compressed.py)
    host: Any = None                                # HostShards: gathered from host memory

    def materialize(self) -> None:
        """Give the full buffer its memory back (contents undefined until gathered)."""
        storage = self.flat.untyped_storage()
        nbytes = self.padded_numel * self.flat.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def start_gather(self, what: str, process_group: comm.Group, exact: bool = False
                     ) -> comm.Pending | compressed.DecodingGather | Done:
        """Bring the full buffer back and start filling it from every rank's shard. The
        own shard is copied in first, so a gather left in flight never sees it stepped.
        With a compressed wire every shard, the own one too, arrives decoded -- unless
        `exact` (a state dict: the masters themselves). From host memory (hostshards.py):
        filled before it returns."""
        self.materialize()
        if self.wire != "full" and not exact:
            self.pending_since_ns = time.time_ns()
            return compressed.start_gather(self.flat, self.shard_param, self.wire, what,
                                           process_group)
        self.flat[self.shard].copy_(self.shard_param.detach())
        self.pending_since_ns = time.time_ns()  # (a prefetch's span starts here)
        if self.host is not None:
            self.host.gather(self)
            return Done()
        return comm.gather_shards_async(self.flat, what, process_group)

    def finish_prefetch(self) -> None:
        """Wait for the gather in flight: the full buffer is whole then."""
        self.pending.wait()
        self.pending = None
        self.gathered = True
        if (recording := timeline.active()) is not None:  # launched -> done, as seen here
            recording.add(f"prefetch of parameter unit {self.index}", self.pending_since_ns,
                          time.time_ns(), "comm", bytes=self.flat.nbytes)

    def release(self) -> None:
        """Shrink the full buffer to nothing; the parameters stay views of it."""
        self.flat.untyped_storage().resize_(0)
        self.gathered = False


def _new_group(index: int, named: list[tuple[str, nn.Parameter]], rank: int, world_size: int,
               sharded_params: bool, mirrored: bool = False, wire: str = "full") -> FlatGroup:
    """Move `named` parameters into one flat buffer (they become views of it)."""
    numel = sum(p.numel() for _, p in named)
    full = padded(numel, world_size)
    first = named[0][1]
    flat = torch.zeros(full, dtype=first.dtype, device=first.device)
    offsets, offset = [], 0
    for _, p in named:
        offsets.append(offset)
        flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    mine = shard_range(full, rank, world_size)
    # Stage 3 keeps the shard in its own memory (the full buffer comes and goes), and so
    # does a compressed wire (the full buffer holds decoded copies; the shard is the
    # master); else stages 1-2 step the shard in place inside the full buffer.
    own = sharded_params or wire != "full"
    shard_data = flat[mine].clone() if own else flat[mine]
    shard_param = nn.Parameter(shard_data)
    group = FlatGroup(index, [p for _, p in named], [n for n, _ in named], offsets, numel, full,
                      mine, flat, shard_param, torch.zeros_like(shard_data), wire=wire)
    if mirrored:  # its own memory at every stage: the all-gathers never write into it
        group.mirror = shard_range(full, (rank + 1) % world_size, world_size)
        group.mirror_param = nn.Parameter(flat[group.mirror].clone())
        group.mirror_grad = torch.zeros_like(group.mirror_param)
    return group


# ---- units for stage 3 -----------------------------------------------------------------------


def plan_units(module: nn.Module, is_unit: Callable[[nn.Module], bool] | None = None
               ) -> list[list[str]]:
    """Parameter names grouped into stage-3 units, in registration order.

    A parameter belongs to its topmost ancestor (below the root) that `is_unit` accepts --
    by default a module owning trainable parameters itself, i.e. a layer -- so a layer that
    reads its children's weights directly (nn.MultiheadAttention reads out_proj.weight
    without calling out_proj) is gathered whole. Parameters under no unit go to the root's
    unit; a shared parameter to the first module that owns it."""
    is_unit = is_unit or (lambda m: any(p.requires_grad for p in m.parameters(recurse=False)))
    seen: set[int] = set()
    units: dict[str, list[str]] = {}
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            owner = _nearest_unit(module, module_name, is_unit)
            full = f"{module_name}.{param_name}" if module_name else param_name
            units.setdefault(owner, []).append(full)
    return list(units.values())


def _nearest_unit(root: nn.Module, name: str, is_unit: Callable[[nn.Module], bool]) -> str:
    """The shallowest module on the path to `name` that is a unit; "" (the root) if none."""
    parts = name.split(".") if name else []
    for depth in range(1, len(parts) + 1):
        candidate = ".".join(parts[:depth])
        if is_unit(root.get_submodule(candidate)):
            return candidate
    return ""


# ---- building it ----------------------------------------------------------------------------


def build_groups(module: nn.Module, stage: int, group: comm.Group, bucket_cap_bytes: int,
                 first_bucket_bytes: int, unit: Callable[[nn.Module], bool] | None = None,
                 mirrored: bool = False, wire: str = "full") -> list[FlatGroup]:
    """Lay the trainable parameters out in flat groups: buckets (stages 1-2) or units (3).
    Groups are in the order gradients become ready (reverse registration). The layout does
    not depend on the world size (only each group's padding does)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    by_name = dict(named)
    rank, world_size = comm.rank_of(group), comm.size_of(group)
    if stage == 3:
        layout = [names for names in reversed(plan_units(module, unit))]
        layout = [list(reversed(names)) for names in layout]
    else:
        slots = [ParamSlot(i, p.numel(), str(p.dtype), p.element_size())
                 for i, (_, p) in enumerate(named)]
        specs = plan_before_backward(slots, bucket_cap_bytes, first_bucket_bytes)
        layout = [[named[i][0] for i in spec.param_indices] for spec in specs]
    return [_new_group(k, [(n, by_name[n]) for n in names], rank, world_size,
                       sharded_params=stage == 3, mirrored=mirrored, wire=wire)
            for k, names in enumerate(layout)]


def reducer_params(groups: list[FlatGroup]) -> list[tuple[str, nn.Parameter]]:
    """The parameters in group order: the Reducer's list, so Sharding's plan indexes it."""
    return [(n, p) for g in groups for n, p in zip(g.names, g.params, strict=True)]
