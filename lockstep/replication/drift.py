"""Replicas that cannot drift silently: a cheap, periodic comparison of every rank's weights.

Data parallelism keeps replicas identical only if every rank applies the same update to
the same weights. A rank that mutated its weights (a bug in user code, an extra step), a
non-deterministic kernel, or a flipped bit in memory breaks that silently: training goes
on, averaging gradients of models that are no longer the same.

Every `every` steps, each rank sums the *bit patterns* of each parameter and buffer (one
integer per tensor: any single changed bit changes it) and the ranks all-reduce the
vector of sums and of their negations with MAX -- one small collective that yields every
entry's maximum and minimum. Equal everywhere: nothing more is sent. Otherwise the sums are
gathered once to name the first differing tensor and which ranks hold which version, and
`repair` re-broadcasts the state of the largest group of agreeing ranks (the majority;
with no majority, the group containing the lowest rank).

Given a parallel wrapper rather than a plain module, the check compares only what its
replicas hold identically by design (its `replicated_tensors()`), and only when they do
(`in_sync()`):
- DataParallel: the parameters. Not the buffers: a forward in training mode updates them
  from each rank's own batch (BatchNorm's statistics), so they differ after it by design
  (with `broadcast_buffers`, rank 0's are restored before the next forward).
- ZeRO stages 1-2: the whole parameters; each rank's optimizer state is a shard no other
  rank holds, so a repair leaves it as it is (there is no copy to restore it from).
  Stage 3 is refused: a parameter is only its shards, none of which has a replica to
  compare with (every rank's gathered parameters are the same bytes by construction).
- Local SGD and DiLoCo: replicas differ between rounds by design; a check due mid-round
  waits for the round's end, and each rank's inner optimizer state is its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.logs import get_logger

log = get_logger(__name__)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DriftError(RuntimeError):
    """Replicas differ and were not repaired."""


@dataclass(frozen=True)
class Drift:
    """What a check found: which tensors differ, and who holds which version."""

    step: int | None
    names: list[str]
    """Every tensor that differs somewhere, in registration order."""
    versions: list[list[int]]
    """Groups of ranks holding identical replicas, largest first."""

    @property
    def first(self) -> str:
        return self.names[0]

    @property
    def majority(self) -> list[int]:
        return self.versions[0]

    @property
    def drifted(self) -> list[int]:
        return sorted(r for group in self.versions[1:] for r in group)

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        more = f" and {len(self.names) - 1} more" if len(self.names) > 1 else ""
        return (f"replicas differ{at}: first in {self.first}{more}; rank(s) {self.drifted} "
                f"hold a different version from rank(s) {self.majority}")


def checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' bit patterns (wrapping on
    overflow). Exact: two bitwise-equal tensors always agree."""
    sums = []
    for t in tensors:
        if t.numel() and t.untyped_storage().nbytes() == 0:  # reading it would crash
            raise ValueError("a tensor without values (a ZeRO-3 parameter released to its "
                             "shard) cannot be checksummed")
        flat = t.detach().contiguous().reshape(-1)
        if flat.dtype.is_complex:
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(_INT_OF_SIZE[flat.element_size()]) if flat.dtype != torch.bool \
            else flat.to(torch.int8)
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def replicated(module: nn.Module, params: bool = True, buffers: bool = True
               ) -> dict[str, torch.Tensor]:
    """A module's parameters (all, or with `params=False` only the frozen ones) and
    buffers, named as a drift report names them."""
    named: dict[str, torch.Tensor] = {
        f"parameter '{n}'": p for n, p in module.named_parameters()
        if params or not p.requires_grad}
    if buffers:
        named.update({f"buffer '{n}'": b for n, b in module.named_buffers()})
    return named


def versions_of(per_rank: list[list[int]]) -> list[list[int]]:
    """Ranks grouped by identical checksum vectors, largest group first (ties: the group
    with the lowest rank first)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, sums in enumerate(per_rank):
        groups.setdefault(tuple(sums), []).append(rank)
    return sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))


class DriftCheck:
    """Compares every rank's copy of `model` through `group`.

    `model` is a plain module (its parameters and buffers are compared) or a parallel
    wrapper -- DataParallel, lockstep.shard's model, LocalSGD, DiLoCo -- whose
    `replicated_tensors()` says what its replicas hold identically and `in_sync()` when
    (see the module docstring; its group is used unless `group` is given).
    `check()` is collective; call it on every rank at the same step (`due(step)` says when,
    every `every` steps, deferred to the end of a local round). `repair(drift)` makes every
    replica the majority's again, optionally with the optimizers' state where it is
    replicated.
    """

    def __init__(self, model: nn.Module, every: int = 100, group: comm.Group = None,
                 buffers: bool = True) -> None:
        if every < 0:
            raise ValueError(f"check every must be >= 0 steps (0: never), got {every}")
        wrapper = callable(getattr(model, "replicated_tensors", None))
        self.replica: Any = model if wrapper else None
        self.module: nn.Module = model.module if wrapper else model  # type: ignore[assignment]
        self.every = every
        self.group: comm.Group = group if group is not None or not wrapper \
            else getattr(model, "group", None)
        named = model.replicated_tensors() if wrapper else replicated(model)  # type: ignore[operator]
        if not buffers:
            named = {n: t for n, t in named.items() if not n.startswith("buffer ")}
        self.names = list(named)
        self.tensors = list(named.values())
        self.optimizer_replicated = bool(getattr(model, "replicated_optimizer", True))
        self.checks = 0
        self._owed = False  # a check came due mid-round: run it at the round's end

    def due(self, step: int) -> bool:
        """Whether to check after `step`: every `every` steps, or at the end of the local
        round in which a check came due. True once per check."""
        if self.every > 0 and step > 0 and step % self.every == 0:
            self._owed = True
        if not (self._owed and self.in_sync()):
            return False
        self._owed = False
        return True

    def in_sync(self) -> bool:
        """Whether the replicas should be identical now (always, but mid-round in local
        SGD and DiLoCo, where they differ by design). The same answer on every rank."""
        return self.replica is None or bool(self.replica.in_sync())

    def check(self, step: int | None = None) -> Drift | None:
        """None if every replica is bitwise the same (or, mid-round, should not be); else
        what differs. Collective."""
        if not self.in_sync() or not self.tensors:
            return None
        self.checks += 1
        self._owed = False
        try:
            local = checksums(self.tensors).to(comm.device_of(self.group))
        except ValueError as error:
            raise ValueError(f"rank {comm.rank_of(self.group)}: DriftCheck: {error}; give "
                             "DriftCheck the sharded model (lockstep.shard's result), which "
                             "says what every rank holds, not its module") from None
        both = torch.cat([local, -local])  # max of -x is -min x: one all-reduce for both
        comm.all_reduce(both, "drift check: all-reduce of parameter checksums", self.group,
                        op=torch.distributed.ReduceOp.MAX)
        n = len(self.tensors)
        differing = (both[:n] != -both[n:]).nonzero().flatten().tolist()
        if not differing:
            return None
        per_rank = comm.all_gather_object(local.tolist(), "drift check: gathering checksums",
                                          self.group)
        return Drift(step, [self.names[i] for i in differing], versions_of(per_rank))

    def repair(self, drift: Drift, optimizers: Sequence[Any] = ()) -> None:
        """Overwrite every replica with that of the majority's lowest rank: what the
        replicas share, and (if given) the optimizers' state where every rank holds the
        same. Each rank's own optimizer state -- a ZeRO shard, a local round's inner
        optimizer -- has no copy elsewhere to restore from, and is kept. Collective."""
        source = drift.majority[0]
        comm.broadcast_tensors(self.tensors, source, "drift repair: broadcast of the "
                               "majority's parameters and buffers", self.group)
        mine = comm.rank_of(self.group) == source
        for optimizer in self.replicated_optimizers(optimizers):
            state = comm.broadcast_object(optimizer.state_dict() if mine else None, source,
                                          "drift repair: the majority's optimizer state",
                                          self.group)
            if not mine:
                optimizer.load_state_dict(state)

    def replicated_optimizers(self, optimizers: Sequence[Any]) -> list[Any]:
        """Those of `optimizers` whose state every rank holds whole and the same. (A
        ZeroOptimizer's state_dict is this rank's shard: loading rank 0's into every rank
        would give each the wrong shard, silently.)"""
        if not self.optimizer_replicated:
            return []
        return [o for o in optimizers if not getattr(o, "per_rank_state", False)]

    def check_and_repair(self, step: int, optimizers: Sequence[Any] = (),
                         repair: bool = True) -> Drift | None:
        """Check; on drift, warn (naming the tensor and the ranks) and repair from the
        majority, or raise DriftError if `repair` is off. Collective."""
        drift = self.check(step)
        if drift is None:
            return None
        if not repair:
            raise DriftError(f"rank {comm.rank_of(self.group)}: {drift}")
        if comm.rank_of(self.group) == 0:  # the same words on every rank: say them once
            log.warning("%s; repairing from rank %d", drift, drift.majority[0])
        self.repair(drift, optimizers)
        return drift
