"""ZeRO's gradient reductions through one host's memory: the "shm" algorithm's other half.

Where every rank of the job is on one host's CPU (hostshards.py), a gradient bucket need not
cross loopback sockets to be summed either. Each rank copies the parts of its bucket that
its peers own into a staging slot of host memory; after a host barrier each rank adds its
peers' copies of its own part -- the bytes Gloo's all-to-all would carry, copied once in
user space instead of through the kernel. That is the reduce-scatter of stages 2-3. Stage 1
needs the whole sum on every rank: each rank then leaves its summed part in a second slot,
and after another barrier copies its peers' parts back into its bucket.

The slots are small and of a fixed size (STAGING_BYTES per dtype the buckets come in, as
NCCL's buffers are), so no memory grows with the model: a bucket is summed piece by piece,
a barrier per step of a piece. Each kind of slot comes in two, used in turn: a rank writes
one again two pieces later, past a barrier every rank reaches only after it has read that
slot.

The ranks' non-finite flags are summed here too (HostFlags), after the barrier at
backward's end, so that a step on one host waits on no socket at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep import comm
from lockstep.comm.shm import HostBarrier, HostFlags, HostMemory
from lockstep.replication.nonfinite import flags_numel

# Host memory per rank for the staging slots: between two ranks, pieces of 128K floats (a
# reduce-scatter) or 64K (stage 1's all-reduce), each copied in ~50 µs or less, against a few
# µs for the barrier between them.
STAGING_BYTES = 1 << 20


class Staging:
    """Sums gradient buckets (padded to split evenly among the host's ranks) through
    staging slots in host memory, a set per dtype the buckets come in. Collective over the
    host: every rank reduces the same buckets in the same order."""

    def __init__(self, memory: HostMemory, barrier: HostBarrier, stage: int,
                 dtypes: Sequence[torch.dtype]) -> None:
        self.barrier = barrier
        self.me, self.world = memory.local_rank, comm.size_of(memory.group)
        parts = max(1, self.world - 1 + (1 if stage == 1 else 0))  # per slot pair, in pieces
        # Per dtype (in the same order on every rank: the slots are allocated collectively):
        # elements a piece holds, and per use in turn every rank's slot as this rank sees it.
        # One counter of pieces for all: a slot's next use is still two pieces later.
        self.piece = {d: max(1, STAGING_BYTES // 2 // parts // d.itemsize) for d in dtypes}
        self.parts = {d: [memory.allocate(self.piece[d] * (self.world - 1), d)
                          for _ in range(2)] for d in self.piece}
        self.sums = {d: [memory.allocate(self.piece[d], d) for _ in range(2)]
                     for d in self.piece} if stage == 1 else {}
        self.flags = HostFlags(memory, flags_numel(self.world), torch.int32)
        self._pieces = 0

    def reduce_scatter(self, flat: torch.Tensor, label: str) -> torch.Tensor:
        """This rank's shard of the sum over the host's ranks of their `flat`: summed in
        place into `flat`'s own shard, which is returned."""
        size, piece = flat.numel() // self.world, self.piece[flat.dtype]
        for start in range(0, size, piece):
            self._sum_piece(flat, size, start, min(start + piece, size),
                            f"ZeRO (shm): every rank's {label}, before its reduce-scatter")
        return flat[self.me * size:(self.me + 1) * size]

    def all_reduce(self, flat: torch.Tensor, label: str) -> None:
        """The sum over the host's ranks of their `flat`, in place in every rank's."""
        size, piece = flat.numel() // self.world, self.piece[flat.dtype]
        for start in range(0, size, piece):
            stop = min(start + piece, size)
            self._sum_piece(flat, size, start, stop,
                            f"ZeRO (shm): every rank's {label}, before its all-reduce")
            self._share_piece(flat, size, start, stop, label)

    def _sum_piece(self, flat: torch.Tensor, size: int, start: int, stop: int,
                   what: str) -> None:
        """Elements [start, stop) of this rank's shard of `flat`, summed over the ranks."""
        slots, piece = self.parts[flat.dtype][self._pieces % 2], self.piece[flat.dtype]
        self._pieces += 1
        count = stop - start
        own = slots[self.me]
        for k in range(self.world):
            if k != self.me:
                at = _segment(k, self.me) * piece
                own[at:at + count].copy_(flat[k * size + start:k * size + stop])
        self.barrier.wait(what, in_backward=True)
        mine = flat[self.me * size + start:self.me * size + stop]
        for k, slot in enumerate(slots):
            if k != self.me:
                at = _segment(self.me, k) * piece
                mine.add_(slot[at:at + count])

    def _share_piece(self, flat: torch.Tensor, size: int, start: int, stop: int,
                     label: str) -> None:
        """Stage 1: every rank's summed piece [start, stop) copied into every rank's `flat`.
        (Its slot was last read before the barrier of the piece summed just now.)"""
        slots = self.sums[flat.dtype][(self._pieces - 1) % 2]
        count = stop - start
        slots[self.me][:count].copy_(flat[self.me * size + start:self.me * size + stop])
        self.barrier.wait(f"ZeRO (shm): every rank's sum of its part of {label}",
                          in_backward=True)
        for k, slot in enumerate(slots):
            if k != self.me:
                flat[k * size + start:k * size + stop].copy_(slot[:count])

    def end_of_backward(self) -> None:
        """Every rank has written its flags and read the last piece of every bucket."""
        self.barrier.wait("ZeRO (shm): every rank at the end of backward")

    def slots(self) -> list[list[torch.Tensor]]:
        """Every rank's slots, as this rank maps them."""
        return [*(s for pair in self.parts.values() for s in pair),
                *(s for pair in self.sums.values() for s in pair), self.flags.slots]


def _segment(reader: int, writer: int) -> int:
    """Where in `writer`'s slot the part that `reader` owns goes (its own is not there)."""
    return reader if reader < writer else reader - 1
