"""How a gradient bucket is summed across ranks: the reducer decides *what* and *when*; an
algorithm decides *how*, and where bucket memory lives.

- native: the backend's own all-reduce (Gloo's or NCCL's), issued from the backward hooks.
- ring: reduce-scatter then all-gather over point-to-point chunks; each rank sends
  2(N-1)/N of the bucket, whatever N is -- bandwidth-optimal for large buckets.
- tree: reduce up and broadcast down a binary tree: 2*ceil(log2 N) steps instead of
  2(N-1) -- fewer latencies for small buckets, but every step carries the whole bucket.
- shm: ranks on one host sum through shared memory: bucket buffers live in memory every
  local rank can map, and each rank sums its 1/L slice of a bucket from everyone's buffer
  and writes the sum into everyone's buffer -- no sockets, no kernel copies. It runs on
  the backward thread, as each bucket fills.
- hierarchical: shm's slices inside each host; between hosts each local rank all-reduces
  its slice with the ranks holding the same slice on the other hosts (one process per host
  per slice, so every host sends the bucket once over its link, in L parallel streams).

ring, tree and hierarchical run on one communication thread per reducer, which takes
buckets in launch order (so the in-order invariant holds) over a process group of their
own (so their point-to-point traffic never interleaves with the main thread's
collectives).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from lockstep import comm
from lockstep.reduction import Bucket, Done, Handle, Reduction, scaled_copy
from lockstep.shm import HostBarrier, HostMemory
from lockstep.topology import Topology, check_layout
from lockstep.world import current

ALGORITHMS = ("native", "ring", "tree", "shm", "hierarchical")


class AllReduce(Reduction):
    """A reduction that sums a bucket's flat buffer in place: `all_reduce` is the one thing
    a new algorithm says. Subclasses may also choose where buffers live."""

    def start(self, bucket: Bucket) -> Handle:
        return self.all_reduce(bucket.flat, bucket.label)

    def all_reduce(self, flat: torch.Tensor, label: str) -> Handle:
        """Begin summing `flat` across ranks, in place."""
        raise NotImplementedError

    def for_compressor(self) -> AllReduce:
        """This algorithm over a process group of its own, for a compressor that calls it
        from its own thread (collectives of two threads must never share a group)."""
        raise ValueError(f"the {self.name} algorithm sums only buffers it allocated itself; "
                         "compression sends tensors of its own: use algorithm='native', "
                         "'ring' or 'tree' with compress=")


class Native(AllReduce):
    name = "native"

    def __init__(self, group: comm.Group) -> None:
        self.group = group
        self._own_group = False

    def all_reduce(self, flat: torch.Tensor, label: str) -> Handle:
        return comm.all_reduce_async(flat, label, self.group)

    def for_compressor(self) -> AllReduce:
        own = Native(comm.new_group(comm.group_ranks(self.group)))
        own._own_group = True
        return own

    def close(self) -> None:
        if self._own_group:
            comm.destroy_group(self.group)


class _FutureHandle:
    __slots__ = ("future",)

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


class Worker:
    """One thread that runs submitted jobs in submission order: buckets are submitted in
    launch order, so the in-order invariant holds on the wire. Once a job fails, later ones
    fail with the same error (this rank is out of step with its peers)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...],
                                             Future[None]] | None] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"lockstep-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., None], *args: Any) -> Handle:
        future: Future[None] = Future()
        self._queue.put((fn, args, future))
        return _FutureHandle(future)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(*item)
            del item  # hold no bucket between jobs: a closed owner frees them at once

    def _run(self, fn: Callable[..., None], args: tuple[Any, ...], future: Future[None]) -> None:
        if self._failure is not None:
            future.set_exception(self._failure)
            return
        try:
            fn(*args)
            future.set_result(None)
        except BaseException as error:
            self._failure = error
            future.set_exception(error)

    def close(self) -> None:
        """Finish the jobs submitted, then stop the thread (waited for, unless called from
        that thread itself, as a finalizer may be)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)


class Threaded(AllReduce):
    """Runs `reduce` for each bucket on a Worker thread, in the order buckets started."""

    def __init__(self) -> None:
        self._worker = Worker(self.name)

    def all_reduce(self, flat: torch.Tensor, label: str) -> Handle:
        return self._worker.submit(self.reduce, flat, label)

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._worker.close()
        comm.destroy_group(getattr(self, "group", None))


class _PointToPoint(Threaded):
    """Ring and tree: their own sends and receives among the group's ranks, received into a
    buffer kept between buckets."""

    def __init__(self, group: comm.Group) -> None:
        self.group = group
        self.ranks = comm.group_ranks(group)
        self.me = comm.rank_of(group)
        self._held: torch.Tensor | None = None
        super().__init__()

    def for_compressor(self) -> AllReduce:
        return self  # its own group and thread already
    def _scratch(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A receive buffer of at least `numel` elements kept between buckets: a fresh one
        each time would pay a page fault per 4 KB on first touch (thousands for a large
        bucket)."""
        held = self._held
        if held is None or held.dtype != like.dtype or held.device != like.device or \
                len(held) < numel:
            self._held = held = torch.empty(numel, dtype=like.dtype, device=like.device)
        return held[:numel]


class Ring(_PointToPoint):
    name = "ring"

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        largest_chunk = -(-len(flat) // len(self.ranks))
        ring_all_reduce(flat, self.ranks, self.me, self.group, label,
                        self._scratch(flat, largest_chunk))


_PIPELINE_BLOCK = 1 << 20  # elements: a ring step moves its chunk in blocks of ~4 MB


def ring_all_reduce(flat: torch.Tensor, ranks: list[int], me: int, group: comm.Group,
                    label: str, scratch: torch.Tensor | None = None) -> None:
    n = len(ranks)
    if n == 1:
        return
    chunks = list(torch.tensor_split(flat, n))
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    if scratch is None:
        scratch = torch.empty(max(len(c) for c in chunks), dtype=flat.dtype,
                              device=flat.device)
    for step in range(n - 1):  # reduce-scatter: afterwards chunk me+1 is complete here
        send, arrive = chunks[(me - step) % n], chunks[(me - step - 1) % n]
        _pipelined_step(send, right, arrive, left, scratch[: len(arrive)],
                        f"ring reduce-scatter of {label}", group)
    for step in range(n - 1):  # all-gather: pass the complete chunks around
        send, arrive = chunks[(me + 1 - step) % n], chunks[(me - step) % n]
        _pipelined_step(send, right, arrive, left, None, f"ring all-gather of {label}", group)


def _pipelined_step(send: torch.Tensor, dst: int, arrive: torch.Tensor, src: int,
                    scratch: torch.Tensor | None, what: str, group: comm.Group) -> None:
    """Send `send` to `dst` while receiving into `arrive` from `src` -- added to it through
    `scratch` when given, else received in place -- in blocks, all posted at once, so each
    block's addition overlaps the transfer of the blocks behind it."""
    blocks = max(1, -(-len(arrive) // _PIPELINE_BLOCK))
    sends = [comm.isend(b, dst, what, group) for b in torch.tensor_split(send, blocks)]
    targets = torch.tensor_split(arrive, blocks)
    landing = torch.tensor_split(scratch, blocks) if scratch is not None else targets
    receives = [comm.irecv(b, src, what, group) for b in landing]
    for received, block, target in zip(receives, landing, targets, strict=True):
        received.wait()
        if scratch is not None:
            target.add_(block)
    for sent in sends:
        sent.wait()


class Tree(_PointToPoint):
    name = "tree"

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        n, me, ranks = len(self.ranks), self.me, self.ranks
        children = [c for c in (2 * me + 1, 2 * me + 2) if c < n]
        parent = (me - 1) // 2
        incoming = self._scratch(flat, len(flat)) if children else flat
        for child in children:  # reduce up: the root ends with the sum
            comm.recv(incoming, ranks[child], f"tree reduce of {label}", self.group)
            flat.add_(incoming)
        if me != 0:
            comm.send(flat, ranks[parent], f"tree reduce of {label}", self.group)
            comm.recv(flat, ranks[parent], f"tree broadcast of {label}", self.group)
        for child in children:  # broadcast down
            comm.send(flat, ranks[child], f"tree broadcast of {label}", self.group)


_DEFER_MIN_ELEMENTS = 64 * 1024


class HostSlices:
    """What shm and hierarchical share inside a host: bucket buffers every local rank maps,
    a barrier through shared flags, and the split of each bucket into L slices.

    For bucket k, once every local rank has it (one barrier), rank r sums slice r over all
    L buffers and writes that sum into slice r of every buffer. Rank r alone touches slice
    r, so no further barrier is needed per bucket -- only one at the end of backward,
    before anyone reads the results or writes its buffers again.
    """

    def __init__(self, topology: Topology, timeout_s: float) -> None:
        self.topology = topology
        self.memory = HostMemory(topology.local_group)
        self.barrier = HostBarrier(self.memory, timeout_s)
        self.me, self.size = topology.local_rank, topology.local_world_size
        self._peers: dict[int, list[torch.Tensor]] = {}  # own data_ptr -> every rank's buffer
        # Per bucket: parts of my slice still in autograd's tensors, (source, start, scale).
        self._private: dict[int, list[tuple[torch.Tensor, int, float]]] = {}

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
        self.barrier.wait(f"every rank on the host has {label}")
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
        self.barrier.wait("every rank on the host has written its slices of this step")

    def close(self) -> None:
        """Unmap the host's buffers and give back the groups (each rank its own end)."""
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

    host: HostSlices

    def absorb(self, grad: torch.Tensor, view: torch.Tensor, scale: float,
               bucket: Bucket) -> None:
        self.host.absorb(grad, view, scale, bucket.flat)

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.host.allocate(numel, dtype, device)

    def free(self, flat: torch.Tensor) -> None:
        self.host.free(flat)

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
        self.host = HostSlices(topology, timeout_s)

    def all_reduce(self, flat: torch.Tensor, label: str) -> Handle:
        total, mine = self.host.sum_my_slice(flat, label)
        self.host.publish(flat, total, mine)
        return Done()


class Hierarchical(_OnHost, Threaded):
    """shm's slices inside each host; between hosts, each slice is all-reduced among the
    ranks holding it -- network time, so this runs on a thread and overlaps backward."""

    name = "hierarchical"

    def __init__(self, topology: Topology, timeout_s: float) -> None:
        self.host = HostSlices(topology, timeout_s)
        super().__init__()

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        total, mine = self.host.sum_my_slice(flat, label)
        if self.host.topology.hosts > 1:
            comm.all_reduce(total, f"cross-host all-reduce of a slice of {label}",
                            self.host.topology.cross_group)
        self.host.publish(flat, total, mine)


def make_algorithm(name: str, group: comm.Group, local_world_size: int) -> AllReduce:
    """Build the named algorithm. Collective: creates process groups on every rank."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {name!r}")
    if name == "native":
        return Native(group)
    if name in ("ring", "tree"):
        own = comm.new_group(comm.group_ranks(group))  # its p2p traffic apart from the rest
        return Ring(own) if name == "ring" else Tree(own)
    if group is not None:
        raise ValueError(f"the {name} algorithm spans the whole job; it does not take a group")
    check_layout(comm.size_of(), local_world_size)
    hosts = comm.size_of() // local_world_size
    if name == "shm" and hosts > 1:
        raise ValueError(f"rank {comm.rank_of()}: shm reduces within one host, and this job "
                         f"spans {hosts}; use algorithm='hierarchical' (shm inside hosts, the "
                         "network between them)")
    topology = Topology.build(comm.rank_of(), comm.size_of(), local_world_size)
    timeout_s = current().timeout.total_seconds()
    return SharedMemory(topology, timeout_s) if name == "shm" else \
        Hierarchical(topology, timeout_s)
