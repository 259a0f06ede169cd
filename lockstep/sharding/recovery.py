"""ZeRO under fault tolerance: what a change of members must not lose, and how the next
membership takes its shards from the survivors.

Built by lockstep.Elastic, a sharded wrapper is *mirrored* (zero.py): each rank steps its
own shard and the next rank's, and the optimizer keeps the state from before its last step
(a step that some ranks finished and others did not is taken back). When the members
change:

1. `hold`: every rank sets aside what it has -- its pieces of the layout at the step it
   committed and, if it stepped since, at the next -- with no collective (a peer may be
   dead), and the wrapper is dropped (`ShardedDataParallel.abandon`).
2. `pool`: on the new group, every rank says which pieces it holds at which step; for each
   shard of the old layout one holder at the step the new membership continues from
   contributes it, the others zeros, and one all-reduce per dtype gives every rank the
   whole state (a joiner holds nothing and receives it all).
3. `restore` gives the module its whole parameters; the wrapper is built again for the new
   world size; `load` hands each rank its shard and mirror of the optimizer state.

Lost: a shard no survivor holds -- two ring neighbours (ranks r and r+1) that died
together. That is refused with the reason; the job resumes from its last checkpoint.
Cost: twice ZeRO's sharded state per rank (still 2/N of replicated training's), the copy
of it before each step, and from stage 2 a second reduce-scatter per bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.sharding.optimizer import ZeroOptimizer, numeric_settings
from lockstep.sharding.pieces import elementwise
from lockstep.sharding.sharded import ShardedDataParallel
from lockstep.sharding.zero import FlatGroup, padded


@dataclass
class Piece:
    """One shard of one flat group: its parameter values and optimizer state."""

    group: int
    shard: int
    param: torch.Tensor
    state: dict[str, torch.Tensor]    # element-wise (momenta), as long as the shard
    scalars: dict[str, torch.Tensor]  # shared by the whole group (Adam's step count)


@dataclass
class Held:
    """What one rank keeps through a change of members."""

    epoch: int                         # the membership whose layout the pieces are in
    world_size: int
    versions: dict[int, list[Piece]]   # step the state is at -> this rank's pieces then
    settings: dict[str, Any]           # the optimizer's lr, momentum... (a scheduler's)
    layout: list[tuple[list[str], list[int], int]]  # per group: names, offsets, numel

    def offer(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "world_size": self.world_size,
                "versions": {v: [(p.group, p.shard) for p in pieces]
                             for v, pieces in self.versions.items()}}

    def shards(self) -> dict[str, Any]:
        """What the quorum is told (every group is sharded alike): which shards this rank
        holds at which step. JSON: the steps are strings."""
        return {"epoch": self.epoch, "world_size": self.world_size,
                "steps": {str(v): sorted({p.shard for p in pieces})
                          for v, pieces in self.versions.items()}}


@dataclass
class Pool:
    """The whole state, put together on every rank of the new membership."""

    params: dict[str, torch.Tensor]         # by parameter name, shaped
    state: list[dict[str, torch.Tensor]]    # per group: key -> the group's whole values
    scalars: list[dict[str, torch.Tensor]]
    settings: dict[str, Any]


def hold(groups: list[FlatGroup], optimizer: ZeroOptimizer, epoch: int, step: int) -> Held:
    """This rank's pieces, at `step` (the steps it committed) and, if its optimizer stepped
    in the attempt at `step`, at step + 1 -- its live state -- with the copy from before.
    If it did not, the copy from before its last step is the state at step - 1: the
    membership goes back there when a peer that had not taken that step died with the
    only other copy of a shard (membership.decide). A step that failed part-way leaves
    only its copy from before as the state at `step`."""
    world_size = comm.size_of(optimizer.group)
    rank = comm.rank_of(optimizer.group)
    live = _pieces(groups, optimizer, rank, world_size, previous=False)
    before = _pieces(groups, optimizer, rank, world_size, previous=True) \
        if optimizer.previous is not None else None
    if optimizer.stepped:
        versions = {step + 1: live, step: before or live}  # (skipped: unchanged)
    elif optimizer.copied and before is not None:
        versions = {step: before}
    elif before is not None and step > 0:
        versions = {step: live, step - 1: before}
    else:
        versions = {step: live}
    layout = [(list(g.names), list(g.offsets), g.numel) for g in groups]
    return Held(epoch, world_size, versions, numeric_settings(optimizer.param_groups[0]),
                layout)


def _pieces(groups: list[FlatGroup], optimizer: ZeroOptimizer, rank: int, world_size: int,
            previous: bool) -> list[Piece]:
    found = []
    for g in groups:
        found.append(_piece(g.index, rank, g.shard_param, optimizer, previous))
        if g.mirror_param is not None:
            found.append(_piece(g.index, (rank + 1) % world_size, g.mirror_param, optimizer,
                                previous))
    return found


def _piece(group: int, shard: int, param: nn.Parameter, optimizer: ZeroOptimizer,
           previous: bool) -> Piece:
    if previous:
        assert optimizer.previous is not None
        values, state = optimizer.previous[param]
    else:
        values = param.detach()
        state = {k: v for k, v in optimizer.state.get(param, {}).items()
                 if isinstance(v, torch.Tensor)}
    wise = {k: v for k, v in state.items() if elementwise(v, values)}
    return Piece(group, shard, values, wise,
                 {k: v for k, v in state.items() if k not in wise})


def pool(held: Held | None, step: int) -> Pool | None:
    """Collective over the current group: the whole state at `step` from the pieces the
    ranks hold. None when no rank holds any (the job's first membership, or not ZeRO)."""
    rank = comm.rank_of()
    offers = comm.all_gather_object(None if held is None else held.offer(),
                                    "ZeRO recovery: which shards each rank holds")
    newest = max((o["epoch"] for o in offers if o is not None), default=None)
    if newest is None:
        return None
    # A worker left out earlier holds an older layout's pieces: only the newest count
    current = [o if o is not None and o["epoch"] == newest else None for o in offers]
    world_size = next(o["world_size"] for o in current if o is not None)
    holders = _holders(current, step, world_size, rank)
    source = min(holders.values())  # its layout, settings and state keys describe all
    description = comm.broadcast_object(
        _describe(held, step) if rank == source else None, source,
        "ZeRO recovery: the layout and optimizer settings")
    return _assemble(held, step, holders, world_size, description)


def _holders(offers: list[dict[str, Any] | None], step: int, world_size: int,
             rank: int) -> dict[tuple[int, int], int]:
    """For every (group, shard) of the old layout, the first rank holding it at `step`."""
    groups = 1 + max(g for o in offers if o is not None
                     for pieces in o["versions"].values() for g, _ in pieces)
    holders: dict[tuple[int, int], int] = {}
    for r, offer in enumerate(offers):
        for piece in (offer or {}).get("versions", {}).get(step, []):
            holders.setdefault(tuple(piece), r)
    lost = [(g, s) for g in range(groups) for s in range(world_size) if (g, s) not in holders]
    if lost:
        group, shard = lost[0]
        raise RuntimeError(
            f"rank {rank}: ZeRO shard {shard} of parameter group {group} (of {world_size} "
            f"ranks) is held at step {step} by no survivor: the ranks that held it (old ranks "
            f"{shard} and {(shard - 1) % world_size}, its mirror) are both gone. One death "
            "at a time loses nothing; two ring neighbours together lose a shard. Resume from "
            "the last checkpoint (rerun the command; the Trainer resumes)")
    return holders


def _describe(held: Held | None, step: int) -> dict[str, Any]:
    """The layout, settings, and the optimizer state's keys at `step` (none before the
    first step: the new optimizer then starts fresh, as this one had)."""
    assert held is not None
    keys = {p.group: ({k: v.dtype for k, v in p.state.items()},
                      {k: (v.dtype, tuple(v.shape), str(v.device))
                       for k, v in p.scalars.items()},
                      p.param.dtype) for p in held.versions[step]}
    return {"layout": held.layout, "settings": held.settings, "keys": keys}


def _assemble(held: Held | None, step: int, holders: dict[tuple[int, int], int],
              world_size: int, description: dict[str, Any]) -> Pool:
    """Each piece from its holder, zeros elsewhere; one all-reduce (a sum) per dtype."""
    rank = comm.rank_of()
    mine = {(p.group, p.shard): p for p in (held.versions.get(step, []) if held else [])}
    layout, keys = description["layout"], description["keys"]
    slots: dict[torch.dtype, list[tuple[Any, int]]] = {}  # dtype -> (where, numel)
    for g, (_, _, numel) in enumerate(layout):
        full = padded(numel, world_size)
        wise, scalars, param_dtype = keys[g]
        slots.setdefault(param_dtype, []).append((("param", g), full))
        for k, dtype in wise.items():
            slots.setdefault(dtype, []).append((("state", g, k), full))
        for k, (dtype, shape, _) in scalars.items():
            slots.setdefault(dtype, []).append((("scalar", g, k), max(1, math.prod(shape))))
    whole: dict[Any, torch.Tensor] = {}
    for dtype, entries in slots.items():
        buffer = torch.zeros(sum(n for _, n in entries), dtype=dtype,
                             device=comm.device_of(None))
        views = dict(zip((w for w, _ in entries),
                         buffer.split([n for _, n in entries]), strict=True))
        for (kind, g, *key), view in views.items():
            _fill(view, kind, g, key, mine, holders, rank, world_size)
        comm.all_reduce(buffer, f"ZeRO recovery: the whole state ({dtype}) from its holders")
        whole.update(views)
    params = {name: whole[("param", g)][offset:]  # shaped by restore(): it has the module
              for g, (names, offsets, _) in enumerate(layout)
              for name, offset in zip(names, offsets, strict=True)}
    state = [{k: whole[("state", g, k)] for k in keys[g][0]} for g in range(len(layout))]
    scalars = [{k: whole[("scalar", g, k)].reshape(shape).to(device)
                for k, (_, shape, device) in keys[g][1].items()} for g in range(len(layout))]
    return Pool(params, state, scalars, description["settings"])


def _fill(view: torch.Tensor, kind: str, group: int, key: list[str],
          mine: dict[tuple[int, int], Piece], holders: dict[tuple[int, int], int], rank: int,
          world_size: int) -> None:
    """Write this rank's contributions to one slot of the pool: the pieces it was chosen
    to give (and a group's scalars with its shard 0)."""
    size = view.numel() // world_size
    for shard in range(world_size):
        if holders[(group, shard)] != rank:
            continue
        piece = mine[(group, shard)]
        if kind == "param":
            view[shard * size:(shard + 1) * size].copy_(piece.param.reshape(-1))
        elif kind == "state":
            view[shard * size:(shard + 1) * size].copy_(piece.state[key[0]].reshape(-1))
        elif shard == 0:
            view.copy_(piece.scalars[key[0]].reshape(-1))


def restore(module: nn.Module, pooled: Pool) -> None:
    """Give the module's parameters their whole values, each in its own memory (a stage-3
    wrapper that was dropped left them as views of freed buffers)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name in pooled.params:
                param.data = pooled.params[name][:param.numel()].view_as(param).clone()
                param.grad = None  # (an interrupted step's, if any: not to be used)


def load(groups: list[FlatGroup], optimizer: ZeroOptimizer, pooled: Pool) -> None:
    """After the wrapper was built again (and the optimizer rebound to it): each rank's
    shard and mirror of the optimizer state, and the settings the job had reached."""
    optimizer.param_groups[0].update(pooled.settings)
    for g in groups:
        targets = [(g.shard_param, g.shard)] + \
            ([(g.mirror_param, g.mirror)] if g.mirror_param is not None else [])
        for param, where in targets:
            state: dict[str, Any] = {k: _padded(v, g)[where].clone()
                                     for k, v in pooled.state[g.index].items()}
            state.update({k: v.clone() for k, v in pooled.scalars[g.index].items()})
            if state:
                optimizer.state[param] = state


def _padded(values: torch.Tensor, group: FlatGroup) -> torch.Tensor:
    """A group's whole values in the old layout's padding, in the new one's."""
    out = torch.zeros(group.padded_numel, dtype=values.dtype, device=group.flat.device)
    out[:group.numel].copy_(values[:group.numel])
    return out


def over_shards(optimizer: Any, model: ShardedDataParallel) -> ZeroOptimizer:
    """The optimizer over `model`'s shards: the same ZeroOptimizer, rebound (so a scheduler
    made over it keeps working)."""
    if not isinstance(optimizer, ZeroOptimizer):
        rank = comm.rank_of(model.group)
        model.abandon()
        raise ValueError(
            f"rank {rank}: under ZeRO the optimizer is built again over each membership's "
            "shards, so lockstep.Elastic needs one it can rebuild: pass "
            "lockstep.ZeroOptimizer.unbound(net.parameters(), lambda params: "
            f"torch.optim.{type(optimizer).__name__}(params, ...)) instead of a "
            f"{type(optimizer).__name__} (a scheduler made over that one follows it)")
    optimizer.rebind(model.zero_groups, model.stage, model.group)
    return optimizer
