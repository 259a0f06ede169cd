"""ZeRO's gathers through host-shared memory: the default where every rank of the job is on
one host's CPU (algorithm="auto"), or asked for by `lockstep.shard(model, k, algorithm="shm")`.

With every rank on one host, a shard need not travel through a socket: each rank's shards
live in anonymous memory files that the host's other ranks map (comm/shm.py), and gathering
a flat group is copying every rank's shard into the full buffer -- a memcpy per rank, where
a Gloo broadcast copies through loopback TCP in the kernel, on the cores the ranks compute
with. The gradients are summed through the host's memory too (staging.py).

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
from lockstep.comm.shm import HostBarrier, HostMemory, peers_mappable, why_not_host_memory
from lockstep.comm.world import current
from lockstep.sharding.staging import Staging

if TYPE_CHECKING:
    from lockstep.sharding.zero import FlatGroup


ALGORITHMS = ("auto", "native", "shm")


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
        # per group, each local rank's shard as this rank sees it
        self.shards = [self._share(g, stage) for g in groups]
        for g in groups:
            g.host = self
        # the gradients' way: summed through the host's memory as well
        dtypes = list(dict.fromkeys(g.flat.dtype for g in groups))  # (in the groups' order)
        self.staging = Staging(self.memory, self.barrier, stage, dtypes)
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

    def gather(self, g: FlatGroup) -> None:
        """Fill `g`'s full buffer with every rank's shard (its own already copied in)."""
        size = g.padded_numel // len(self.shards[g.index])
        for k, shard in enumerate(self.shards[g.index]):
            if k != self.me:
                g.flat[k * size:(k + 1) * size].copy_(shard)


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
