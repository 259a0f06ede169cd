"""Summing inside a host through memory its ranks share: the "shm" and "hierarchical"
algorithms (see algorithms.py for the rest, and reduction.py for the seam they implement).

- shm: bucket buffers live in memory every local rank can map, and each rank sums its 1/L
  slice of a bucket from everyone's buffer and writes the sum into everyone's buffer -- no
  sockets, no kernel copies. It runs on the backward thread, as each bucket fills.
- hierarchical: shm's slices inside each host; between hosts each local rank all-reduces
  its slice with the ranks holding the same slice on the other hosts (one process per host
  per slice, so every host sends the bucket once over its link, in L parallel streams).
  With compress="bf16" or "fp16", that cross-host leg alone travels in 16 bits: the host's
  sum is exact, the network carries half the bytes, and the result is widened in place
  before it is shared on the host again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep import comm
from lockstep.comm.shm import HostBarrier, HostFlags, HostMemory
from lockstep.comm.topology import Topology
from lockstep.replication.algorithms import AllReduce, Threaded
from lockstep.replication.nonfinite import flags_numel
from lockstep.replication.reduction import Bucket, Done, Handle, scaled_copy

_DEFER_MIN_ELEMENTS = 64 * 1024


class HostSlices:
    """What shm and hierarchical share inside a host: bucket buffers every local rank maps,
    a barrier through shared flags, and the split of each bucket into L slices.

    For bucket k, once every local rank has it (one barrier), rank r sums slice r over all
    L buffers and writes that sum into slice r of every buffer. Rank r alone touches slice
    r, so no further barrier is needed per bucket -- only one at the end of backward,
    before anyone reads the results or writes its buffers again.
    """

    def __init__(self, topology: Topology, timeout_s: float, in_backward: bool) -> None:
        self.topology = topology
        self.in_backward = in_backward  # buckets summed on backward's thread (not a worker)
        # Deferred: the barrier's flags, the non-finite flags and every bucket are mapped
        # among the ranks in one exchange, once the buckets are made (connect)
        self.memory = HostMemory(topology.local_group, deferred=True)
        self.barrier = HostBarrier(self.memory, timeout_s)
        self.me, self.size = topology.local_rank, topology.local_world_size
        self._peers: dict[int, list[torch.Tensor]] = {}  # own data_ptr -> every rank's buffer
        # Per bucket: parts of my slice still in autograd's tensors, (source, start, scale).
        self._private: dict[int, list[tuple[torch.Tensor, int, float]]] = {}
        self._flags: HostFlags | None = None  # every rank's flags (share_flags)

    def absorb(self, grad: torch.Tensor, view: torch.Tensor, scale: float,
               flat: torch.Tensor) -> None:
        """Copy into shared memory only what the other ranks will read. The part of the
        gradient inside my own slice stays where autograd put it until I sum the slice:
        half the copying, for two ranks per host."""
        offset = (view.data_ptr() - flat.data_ptr()) // view.element_size()
        mine = self.slice_of(len(flat), self.me)
        lo, hi = max(offset, mine.start), min(offset + view.numel(), mine.stop)
        source, slot = grad.reshape(-1), view.view(-1)
        # Deferring a small piece costs a kernel launch in the sum for a few bytes saved.
        if hi - lo < _DEFER_MIN_ELEMENTS:
            scaled_copy(source, slot, scale)
            return
        if lo > offset:
            scaled_copy(source[: lo - offset], slot[: lo - offset], scale)
        if hi < offset + view.numel():
            scaled_copy(source[hi - offset:], slot[hi - offset:], scale)
        self._private.setdefault(flat.data_ptr(), []).append(
            (source[lo - offset: hi - offset], lo, scale))

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError(f"shared-memory reduction works on CPU tensors, not {device}")
        buffers = self.memory.allocate(numel, dtype)
        self._peers[buffers[self.me].data_ptr()] = buffers
        return buffers[self.me]

    def free(self, flat: torch.Tensor) -> None:
        self._peers.pop(flat.data_ptr(), None)  # unmapping the peers' copies frees them

    def slice_of(self, numel: int, local_rank: int) -> slice:
        return slice(local_rank * numel // self.size, (local_rank + 1) * numel // self.size)

    def sum_my_slice(self, flat: torch.Tensor, label: str) -> tuple[torch.Tensor, slice]:
        """Wait for the host's ranks to have this bucket; sum my slice of it in place."""
        self.barrier.wait(label, self.in_backward)  # (a stall names the bucket, as sockets do)
        mine = self.slice_of(len(flat), self.me)
        peers = [b for rank, b in enumerate(self._peers[flat.data_ptr()]) if rank != self.me]
        private = self._private.pop(flat.data_ptr(), [])
        for start, stop in _gaps(mine, [(lo, lo + len(src)) for src, lo, _ in private]):
            for peer in peers:  # my share is already in my buffer here
                flat[start:stop].add_(peer[start:stop])
        for source, lo, scale in private:  # my share is still in autograd's tensor
            part = slice(lo, lo + len(source))
            if not peers:
                scaled_copy(source, flat[part], scale)
                continue
            torch.add(peers[0][part], source, alpha=scale, out=flat[part])
            for peer in peers[1:]:
                flat[part].add_(peer[part])
        return flat[mine], mine

    def publish(self, flat: torch.Tensor, total: torch.Tensor, mine: slice) -> None:
        """Write my finished slice into every other rank's buffer."""
        for rank, buffer in enumerate(self._peers[flat.data_ptr()]):
            if rank != self.me:
                buffer[mine].copy_(total)

    def end_of_backward(self) -> None:
        self.barrier.wait("every rank on the host has written its slices of this step", True)

    def share_flags(self, flags: torch.Tensor) -> Handle | None:
        """Sum the ranks' small `flags` through host memory (HostFlags): waited on after
        `end_of_backward`'s barrier. No rank writes the next backward's flags before every
        rank has read these: the next backward's first bucket waits for all of them at its
        barrier first. None for flags these slots were not made for (`make_flag_slots`)."""
        return self._flags.share(flags) if self._flags is not None else None

    def make_flag_slots(self, numel: int, dtype: torch.dtype) -> None:
        """Host memory for `share_flags` (allocated as the buckets are, mapped with them)."""
        self._flags = HostFlags(self.memory, numel, dtype)

    def close(self) -> None:
        """Unmap the host's buffers and give back the groups (each rank its own end)."""
        self.barrier.leave()
        self._peers.clear()
        self._private.clear()
        comm.destroy_group(self.topology.local_group)
        comm.destroy_group(self.topology.cross_group)


def _gaps(span: slice, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `span` not covered by the disjoint (start, stop) ranges."""
    gaps, cursor = [], span.start
    for start, stop in sorted(covered):
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, stop)
    if cursor < span.stop:
        gaps.append((cursor, span.stop))
    return gaps


class _OnHost:
    """What shm and hierarchical share: buckets in host memory, each rank's share of the
    work on its slice (see HostSlices)."""

    carries_flags = False  # (gradients may be absorbed straight into a peer's memory)

    host: HostSlices

    def absorb(self, grad: torch.Tensor, view: torch.Tensor, scale: float,
               bucket: Bucket) -> None:
        self.host.absorb(grad, view, scale, bucket.flat)

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.host.allocate(numel, dtype, device)

    def free(self, flat: torch.Tensor) -> None:
        self.host.free(flat)

    def connect(self) -> None:
        self.host.memory.exchange()

    def finish(self, buckets: Sequence[Bucket]) -> None:
        self.host.end_of_backward()

    def close(self) -> None:
        self.host.close()
        super().close()  # type: ignore[misc]


class SharedMemory(_OnHost, AllReduce):
    """Ranks on one host sum through shared bucket memory (see HostSlices).

    It runs on the backward thread as each bucket fills -- memory-bound work, so a second
    thread would only compete for the same cores, and working right after the bucket was
    written finds it still in cache."""

    name = "shm"

    def __init__(self, topology: Topology, timeout_s: float) -> None:
        self.host = HostSlices(topology, timeout_s, in_backward=True)
        # The non-finite check's flags (nonfinite.flags_numel) are summed here too: a
        # Gloo all-reduce of a few bytes took 1.4 ms on a 2-core machine -- most of a tiny
        # model's step -- where a barrier in memory takes µs.
        self.host.make_flag_slots(flags_numel(topology.local_world_size), torch.int32)

    def share_flags(self, flags: torch.Tensor) -> Handle | None:
        return self.host.share_flags(flags)

    def all_reduce(self, flat: torch.Tensor, label: str) -> Handle:
        total, mine = self.host.sum_my_slice(flat, label)
        self.host.publish(flat, total, mine)
        return Done()


class Hierarchical(_OnHost, Threaded):
    """shm's slices inside each host; between hosts, each slice is all-reduced among the
    ranks holding it -- network time, so this runs on a thread and overlaps backward."""

    name = "hierarchical"

    def __init__(self, topology: Topology, timeout_s: float,
                 wire_dtype: torch.dtype | None = None) -> None:
        self.host = HostSlices(topology, timeout_s, in_backward=False)
        self.wire_dtype = wire_dtype  # the cross-host leg's dtype (None: the bucket's)
        super().__init__()

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        total, mine = self.host.sum_my_slice(flat, label)
        if self.host.topology.hosts > 1:
            what = f"cross-host all-reduce of a slice of {label}"
            if self.wire_dtype is None:
                comm.all_reduce(total, what, self.host.topology.cross_group)
            else:
                narrow = total.to(self.wire_dtype)
                comm.all_reduce(narrow, f"{what} in {self.wire_dtype}",
                                self.host.topology.cross_group)
                total.copy_(narrow)
        self.host.publish(flat, total, mine)

    def sent_bytes(self, buckets: Sequence[Bucket]) -> int:
        full = super().sent_bytes(buckets)
        if self.wire_dtype is None or not buckets or self.host.topology.hosts == 1:
            return full  # on one host there is no cross-host leg to narrow
        wide = buckets[0].flat.element_size()
        return full * torch.empty(0, dtype=self.wire_dtype).element_size() // wide
