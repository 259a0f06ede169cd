"""Replica groups: several ranks that train as one replica of streaming DiLoCo.

In practice a DiLoCo replica is a group of accelerators -- a host, a pod -- that average
their gradients every step over the fast links between them, while the replicas exchange
pseudo-gradients rarely over the slow links that join them (Douillard et al. 2023/2025;
torchft's replica groups). With every rank a replica of its own, 4 ranks of 8 samples a
step are 4 replicas each training alone on 8 samples; as 2 replicas of 2 ranks, each
replica trains on 16 -- as one rank of 16 would, to float rounding -- and the rounds have
2 replicas to reconcile instead of 4.

`ReplicaGroups(size)` cuts the world into replicas of `size` consecutive ranks (the ranks
of one host, as launchers number them) and gives each rank two process groups:

- `within`: its replica's ranks. A DataParallel over it averages the gradients every step.
- `across`: the ranks at the same place in every replica. A fragment's pseudo-gradient is
  the same on every rank of a replica, so it is cut into `size` pieces and each rank sends
  only its own piece across: the slow links carry a fragment once per replica, not `size`
  times. The averaged pieces are gathered back within the replica before the outer step.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep import comm
from lockstep.comm.world import current
from lockstep.replication.drift import checksums
from lockstep.replication.replica import DataParallel
from lockstep.replication.wireformat import BLOCK


class ReplicaGroups:
    """This rank's replica (`within`) and its peers at the same place in the others
    (`across`), for replicas of `size` consecutive ranks; `model`: the module, its
    gradients averaged within the replica every step."""

    def __init__(self, size: int, module: nn.Module) -> None:
        world, rank = comm.size_of(), comm.rank_of()
        if size < 1 or world % size:
            raise ValueError(
                f"rank {rank}: replicas of {size} ranks do not divide the world's {world} "
                f"ranks; give replica_size a divisor of the world size (the workers of one "
                f"host: replica_size='host')")
        self.size, self.count, self.place = size, world // size, rank % size
        # every rank creates every group, in the same order (torch.distributed's rule)
        within = [comm.new_group(range(i * size, (i + 1) * size)) for i in range(self.count)]
        across = [comm.new_group(range(j, world, size)) for j in range(size)]
        self.within, self.across = within[rank // size], across[self.place]
        # A NaN is left to the rounds' exchanges, whose flags name its replica on every
        # rank (this DataParallel's own check would stop only the replica's ranks)
        self.model = DataParallel(module, group=self.within, nonfinite="off")

    def stats(self, rounds: dict[str, float]) -> dict[str, float]:
        """The rounds' comm_stats (`bytes_sent`: between replicas, the slow links' share)
        with the bytes a step within the replica, and the compression a replica's (its
        ranks send a piece each)."""
        return {**rounds, "bytes_within_replica": self.model.comm_stats()["bytes_sent"],
                "compression_ratio": rounds["compression_ratio"] / self.size}

    def _piece_length(self, numel: int) -> int:
        """How many values each rank's piece holds at most: whole wire-format blocks, so
        a piece is encoded in fewer bits exactly as the whole fragment would be."""
        blocks = -(-numel // BLOCK)
        return -(-blocks // self.size) * BLOCK

    def piece(self, numel: int) -> slice:
        """This rank's piece of a flat tensor of `numel` values (the last pieces may be
        shorter, or empty)."""
        length = self._piece_length(numel)
        start = min(numel, self.place * length)
        return slice(start, min(numel, start + length))

    def gather(self, piece: torch.Tensor, numel: int, flags: torch.Tensor,
               what: str) -> tuple[torch.Tensor, list[int]]:
        """The whole flat tensor of `numel` values from every rank's piece of it, and the
        replicas whose flag (one per replica, in `flags`) any rank of this one saw set --
        each saw only its own piece's exchange: one all-gather within the replica."""
        length = self._piece_length(numel)
        row = piece.new_zeros(length + self.count)
        row[:piece.numel()] = piece
        row[length:] = flags
        rows = piece.new_empty(self.size, length + self.count)
        comm.all_gather_into(rows.view(-1), row, what, self.within)
        seen = rows[:, length:].ne(0).any(dim=0)
        return rows[:, :length].reshape(-1)[:numel], seen.nonzero().flatten().tolist()

    def named(self, replicas: list[int]) -> str:
        """Replicas (their places in `across`), named by their ranks."""
        ranks = [list(range(r * self.size, (r + 1) * self.size)) for r in replicas]
        return f"the replica(s) of ranks {ranks}"

    def check_identical(self, params: list[torch.Tensor]) -> None:
        """Raise, on every rank of the replica, unless its ranks hold the same `params`
        (after a resume: a checkpoint whose ranks trained apart -- another replica_size --
        would leave the ranks of one replica apart for good)."""
        mine = checksums(params)  # DriftCheck's: bitwise-equal tensors agree exactly
        every = mine.new_empty(self.size * mine.numel())
        comm.all_gather_into(every, mine, "a replica's resumed parameters compared", self.within)
        if not (every.view(self.size, -1) == mine).all():
            raise ValueError(
                f"rank {comm.rank_of()}: the checkpoint gives the ranks of this replica "
                f"different parameters: it was written with another replica_size (its ranks "
                f"trained apart). Resume with the replica_size it was written with, or with "
                f"another number of ranks (each then starts from rank 0's)")

    def close(self) -> None:
        self.model.close()
        comm.destroy_group(self.within)
        comm.destroy_group(self.across)


def resolve_size(replica_size: int | str) -> int:
    """`replica_size` as a number of ranks ("host": the launcher's workers per host), the
    same on every rank -- or an error on every rank. (Only 1, given as a number, asks the
    others nothing: every rank is a replica of its own.)"""
    if replica_size == 1:
        return 1
    try:
        check_size(replica_size)
    except ValueError as error:
        raise ValueError(f"rank {comm.rank_of()}: {error}") from None
    size = current().local_world_size if replica_size == "host" else int(replica_size)
    sizes = sorted({s for s, in comm.all_gather_ints([size], "replica sizes agreed")})
    if len(sizes) > 1:
        raise ValueError(f"rank {comm.rank_of()}: the ranks ask for replicas of different "
                         f"sizes {sizes} (replica_size='host' with hosts of unequal worker "
                         f"counts?); give every rank the same replica_size")
    return size


def check_size(replica_size: int | str) -> None:
    """A replica_size is a number of ranks >= 1, or "host"."""
    if replica_size != "host" and (isinstance(replica_size, bool)
                                   or not isinstance(replica_size, int) or replica_size < 1):
        raise ValueError(f"replica_size must be a number of ranks >= 1 or 'host'; got "
                         f"{replica_size!r}")
