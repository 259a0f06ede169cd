"""ZeRO's gathers through host-shared memory: the default where every rank of the job is on
one host's CPU (algorithm="auto"), or asked for by `lockstep.shard(model, k, algorithm="shm")`.

With every rank on one host, a shard need not travel through a socket: each rank's shards
live in anonymous memory files that the host's other ranks map (comm/shm.py), and gathering
a flat group is copying every rank's shard into the full buffer -- a memcpy per rank, where
a Gloo broadcast copies through loopback TCP in the kernel, on the cores the ranks compute
with. So do the reduce-scatters of stages 2-3 (`reduce_scatter`): each rank leaves its
peers' shards of a gradient bucket in a slot of host memory and sums its own shard from
theirs. Stage 1's all-reduce stays on the backend.

Where the shared shard is: at stages 1-2 the flat buffer itself (the parameters' memory;
a rank's shard is its slice of it), at stage 3 the shard the optimizer steps (the full
buffer stays this rank's own, coming and going as before).

When a peer's shard may be read: every write to the shared shards -- the optimizer's step,
a checkpoint's load, their first copy here -- is bracketed by host barriers: before it,
every rank has finished reading (its gathers are behind it); after it, every rank has
finished writing, before anyone reads. At stages 1-2, where the shared memory is the
parameters themselves, the gathers that follow a step end with one more barrier, so that
writing the parameters in place after `optimizer.step()` (clamping, an EMA swap) cannot
race a peer still copying them. A barrier among ranks that arrive together costs
microseconds (comm/shm.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lockstep import comm
from lockstep.comm import timeline
from lockstep.comm.shm import (
    HostBarrier,
    HostFlags,
    HostMemory,
    peers_mappable,
    why_not_host_memory,
)
from lockstep.comm.world import current

if TYPE_CHECKING:
    from lockstep.sharding.zero import FlatGroup


ALGORITHMS = ("auto", "native", "shm")
# Host memory per rank for the reduce-scatters' staging (two slots): pieces of 128K floats
# between two ranks take ~0.05 ms to copy, against a few µs for the barrier between them.
STAGING_BYTES = 1 << 20


def pick_algorithm(requested: str, group: comm.Group, stage: int, wire: str,
                   mirror: bool) -> str:
    """The algorithm ZeRO's gathers take. "auto" (the default) is "shm" where every rank of
    the job shares one host's memory and the shards can live there -- as NCCL carries a
    node's traffic through shared memory or NVLink, not its network -- and "native" (the
    backend's sockets) everywhere else. "shm" asked for where it cannot work is refused."""
    if requested == "native":
        return requested
    reason = why_not_shared(group, wire, mirror)
    if requested == "shm" and reason is not None:
        raise ValueError(f"rank {comm.rank_of(group)}: ZeRO with algorithm='shm' "
                         f"(stage {stage}): {reason}")
    if requested == "auto":  # every rank asks its peers, so that all of them pick alike
        shared = comm.size_of(group) > 1 and peers_mappable(group, eligible=reason is None)
        return "shm" if shared else "native"
    return "shm"


def why_not_shared(group: comm.Group, wire: str, mirror: bool) -> str | None:
    """Why this job's shards cannot live in one host's shared memory; None if they can."""
    if (reason := why_not_host_memory(group, "shards")) is not None:
        return reason
    if wire != "full":
        return f"wire={wire!r}: nothing crosses a network to compress; use one or the other"
    if mirror:
        return ("fault tolerance: a rank's shards would die with its memory file's last "
                "mapping; use one or the other")
    return None


class HostShards:
    """Every flat group's shards in host-shared memory, and the gathers that copy them."""

    def __init__(self, groups: list[FlatGroup], stage: int, group: comm.Group) -> None:
        self.memory = HostMemory(group)
        self.barrier = HostBarrier(self.memory, current().timeout.total_seconds())
        self.me = self.memory.local_rank
        self.world = len(self.memory.pids)
        # per group, each local rank's shard as this rank sees it
        self.shards = [self._share(g, stage) for g in groups]
        for g in groups:
            g.host = self
        # Stages 2-3: two slots per rank where a reduce-scatter leaves the pieces of its
        # bucket that the peers own (used in turn), and the non-finite flags' slots.
        dtype = groups[0].flat.dtype
        self.piece = max(1, STAGING_BYTES // 2 // (self.world - 1) // dtype.itemsize)
        self.slots = [self.memory.allocate(self.piece * (self.world - 1), dtype)
                      for _ in range(2)] if stage >= 2 else []
        self.flags = HostFlags(self.memory, self.world + 1, torch.int32) if stage >= 2 else None
        self._pieces = 0
        self.barrier.wait("ZeRO (shm): every rank's shards in host memory")

    def _share(self, g: FlatGroup, stage: int) -> list[torch.Tensor]:
        """Move `g`'s shared part into host memory; every rank's shard of it, mapped."""
        if stage == 3:
            views = self.memory.allocate(g.shard_param.numel(), g.shard_param.dtype)
            views[self.me].copy_(g.shard_param.detach())
            g.shard_param.data = views[self.me]
            return views
        views = self.memory.allocate(g.padded_numel, g.flat.dtype)
        flat = views[self.me]
        flat.copy_(g.flat)
        for p, offset in zip(g.params, g.offsets, strict=True):
            p.data = flat[offset:offset + p.numel()].view_as(p)
        g.flat = flat
        g.shard_param.data = flat[g.shard]
        size = g.padded_numel // len(views)
        return [view[k * size:(k + 1) * size] for k, view in enumerate(views)]

    @contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Around an in-place write to this rank's shards (collective over the host)."""
        self.barrier.wait(f"ZeRO (shm): every rank done reading the shards, before {what}")
        yield
        self.barrier.wait(f"ZeRO (shm): every rank done with {what}, before the shards "
                          "are read")

    def done_reading(self) -> None:
        """Stages 1-2, after the gathers that follow a step: the parameters may be written."""
        self.barrier.wait("ZeRO (shm): every rank done gathering the stepped shards")

    def reduce_scatter(self, flat: torch.Tensor, label: str) -> torch.Tensor:
        """This rank's shard of the sum over the host's ranks of their `flat` (a gradient
        bucket, padded to split evenly): summed in place into `flat`'s own shard, which is
        returned. Piece by piece, each rank copies the parts its peers own into its slot,
        and after a barrier adds its peers' copies of its own part -- the bytes Gloo's
        all-to-all would carry, copied once instead of through loopback sockets.

        The slots are small and of a fixed size (STAGING_BYTES, as NCCL's buffers are), so
        no memory grows with the model. They are used in turn: a rank writes one again two
        pieces later, past the next piece's barrier, which every rank reaches only after
        reading this one."""
        size = flat.numel() // self.world
        for start in range(0, size, self.piece):
            self._exchange(flat, size, start, min(start + self.piece, size), label)
        return flat[self.me * size:(self.me + 1) * size]

    def _exchange(self, flat: torch.Tensor, size: int, start: int, stop: int,
                  label: str) -> None:
        """One piece: elements [start, stop) of every rank's shard of `flat`."""
        slots = self.slots[self._pieces % 2]
        self._pieces += 1
        count = stop - start
        own = slots[self.me]
        for k in range(self.world):
            if k != self.me:
                at = _segment(k, self.me) * self.piece
                own[at:at + count].copy_(flat[k * size + start:k * size + stop])
        with timeline.span("wait for communication"):  # (what backward's end waits for)
            self.barrier.wait(f"ZeRO (shm): every rank's {label}, before its reduce-scatter")
        mine = flat[self.me * size + start:self.me * size + stop]
        for k, slot in enumerate(slots):
            if k != self.me:
                at = _segment(self.me, k) * self.piece
                mine.add_(slot[at:at + count])

    def end_of_backward(self) -> None:
        """Every rank has written its flags (share_flags) and read the last bucket."""
        self.barrier.wait("ZeRO (shm): every rank at the end of backward")

    def gather(self, g: FlatGroup) -> None:
        """Fill `g`'s full buffer with every rank's shard (its own already copied in)."""
        size = g.padded_numel // len(self.shards[g.index])
        for k, shard in enumerate(self.shards[g.index]):
            if k != self.me:
                g.flat[k * size:(k + 1) * size].copy_(shard)


def _segment(reader: int, writer: int) -> int:
    """Where in `writer`'s slot the shard that `reader` owns goes (its own is not there)."""
    return reader if reader < writer else reader - 1


def peers_storages() -> set[int]:
    """Where the other ranks' shards that this process maps begin (their storages' data
    pointers): their memory, counted by their owner -- not by a count of this process's
    live tensors (memory_report never counts them)."""
    import gc

    return {shard.untyped_storage().data_ptr()
            for obj in gc.get_objects() if isinstance(obj, HostShards)
            for shards in obj.shards + obj.slots for k, shard in enumerate(shards)
            if k != obj.me}


def shared_by(groups: list[Any]) -> HostShards | None:
    """The HostShards that `groups` (FlatGroups; none for a model without ZeRO) are
    gathered from, or None where they travel through the backend."""
    return groups[0].host if groups else None


@contextmanager
def writing_shards(groups: list[Any], what: str) -> Iterator[None]:
    """Around an in-place write to ZeRO's shards: bracketed by host barriers where they are
    shared (algorithm="shm")."""
    host = shared_by(groups)
    if host is None:
        yield
        return
    with host.writing(what):
        yield
