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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
        flat = t.detach().contiguous().reshape(-1)
        if flat.dtype.is_complex:
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(_INT_OF_SIZE[flat.element_size()]) if flat.dtype != torch.bool \
            else flat.to(torch.int8)
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def versions_of(per_rank: list[list[int]]) -> list[list[int]]:
    """Ranks grouped by identical checksum vectors, largest group first (ties: the group
    with the lowest rank first)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, sums in enumerate(per_rank):
        groups.setdefault(tuple(sums), []).append(rank)
    return sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))


class DriftCheck:
    """Compares every rank's copy of `module` (parameters and buffers) through `group`.

    `check()` is collective; call it on every rank at the same step (`due(step)` says when,
    every `every` steps). `repair(drift)` makes every replica the majority's again,
    optionally with the optimizers' state.
    """

    def __init__(self, module: nn.Module, every: int = 100, group: comm.Group = None,
                 buffers: bool = True) -> None:
        if every < 0:
            raise ValueError(f"check every must be >= 0 steps (0: never), got {every}")
        self.module, self.every, self.group = module, every, group
        named: list[tuple[str, torch.Tensor]] = [
            (f"parameter '{n}'", p) for n, p in module.named_parameters()]
        if buffers:
            named += [(f"buffer '{n}'", b) for n, b in module.named_buffers()]
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        self.checks = 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def check(self, step: int | None = None) -> Drift | None:
        """None if every replica is bitwise the same; else what differs. Collective."""
        self.checks += 1
        local = checksums(self.tensors).to(comm.device_of(self.group))
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

    def repair(self, drift: Drift, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Overwrite every replica with that of the majority's lowest rank: parameters,
        buffers and (if given) the optimizers' state. Collective."""
        source = drift.majority[0]
        comm.broadcast_tensors(self.tensors, source, "drift repair: broadcast of the "
                               "majority's parameters and buffers", self.group)
        mine = comm.rank_of(self.group) == source
        for optimizer in optimizers:
            state = comm.broadcast_object(optimizer.state_dict() if mine else None, source,
                                          "drift repair: the majority's optimizer state",
                                          self.group)
            if not mine:
                optimizer.load_state_dict(state)

    def check_and_repair(self, step: int, optimizers: Sequence[torch.optim.Optimizer] = (),
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
