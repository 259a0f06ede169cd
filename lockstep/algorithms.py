"""How a gradient bucket is summed across ranks: the reducer decides *what* and *when*; an
algorithm decides *how*, and where bucket memory lives.

- native: the backend's own all-reduce (Gloo's or NCCL's), issued from the backward hooks.
- ring: reduce-scatter then all-gather over point-to-point chunks; each rank sends
  2(N-1)/N of the bucket, whatever N is -- bandwidth-optimal for large buckets.
- tree: reduce up and broadcast down a binary tree: 2*ceil(log2 N) steps instead of
  2(N-1) -- fewer latencies for small buckets, but every step carries the whole bucket.
- shm: ranks on one host sum through shared memory: bucket buffers live in memory every
  local rank can map, each rank adds up its 1/L slice from everyone's buffer, then copies
  the others' finished slices -- no sockets, no kernel copies.
- hierarchical: shm's reduce-scatter inside each host, then each local rank all-reduces its
  slice with the ranks holding the same slice on the other hosts (one process per host per
  slice, so every host sends the bucket once over its link, in L parallel streams), then
  shm's gather inside the host.

All but native run on one communication thread per reducer, which takes buckets in launch
order (so the in-order invariant holds) over a process group of their own (so their
point-to-point traffic never interleaves with the main thread's collectives).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Protocol

import torch

from lockstep import comm
from lockstep.shm import HostMemory
from lockstep.topology import Topology, check_layout

ALGORITHMS = ("native", "ring", "tree", "shm", "hierarchical")


class Handle(Protocol):
    def wait(self) -> None: ...


class AllReduce:
    """Sums flat buckets across ranks. Subclasses choose where buckets live and how."""

    name = "?"

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def start(self, flat: torch.Tensor, label: str) -> Handle:
        raise NotImplementedError

    def free(self, flat: torch.Tensor) -> None:
        """A bucket from `allocate` is no longer used (the plan was rebuilt)."""

    def end_of_backward(self) -> None:
        """Called once all of a backward's buckets are done."""

    def close(self) -> None:
        """Release threads and memory."""


class Native(AllReduce):
    name = "native"

    def __init__(self, group: comm.Group) -> None:
        self.group = group

    def start(self, flat: torch.Tensor, label: str) -> Handle:
        return comm.all_reduce_async(flat, label, self.group)


class _FutureHandle:
    __slots__ = ("future",)

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


class Threaded(AllReduce):
    """Runs `reduce` for each bucket on one thread, in the order buckets were started."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[torch.Tensor, str, Future[None]] | None] = \
            queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"lockstep-{self.name}",
                                        daemon=True)
        self._thread.start()

    def start(self, flat: torch.Tensor, label: str) -> Handle:
        future: Future[None] = Future()
        self._queue.put((flat, label, future))
        return _FutureHandle(future)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            flat, label, future = item
            if self._failure is not None:  # once out of step with peers, stay failed
                future.set_exception(self._failure)
                continue
            try:
                self.reduce(flat, label)
                future.set_result(None)
            except BaseException as error:
                self._failure = error
                future.set_exception(error)

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._queue.put(None)


class Ring(Threaded):
    name = "ring"

    def __init__(self, group: comm.Group) -> None:
        self.group = group
        self.ranks = comm.group_ranks(group)
        self.me = comm.rank_of(group)
        super().__init__()

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        ring_all_reduce(flat, self.ranks, self.me, self.group, label)


def ring_all_reduce(flat: torch.Tensor, ranks: list[int], me: int, group: comm.Group,
                    label: str) -> None:
    n = len(ranks)
    if n == 1:
        return
    chunks = list(torch.tensor_split(flat, n))
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    scratch = torch.empty(max(len(c) for c in chunks), dtype=flat.dtype, device=flat.device)
    for step in range(n - 1):  # reduce-scatter: afterwards chunk me+1 is complete here
        send, arrive = chunks[(me - step) % n], chunks[(me - step - 1) % n]
        incoming = scratch[: len(arrive)]
        comm.exchange(send, right, incoming, left, f"ring reduce-scatter of {label}", group)
        arrive.add_(incoming)
    for step in range(n - 1):  # all-gather: pass the complete chunks around
        send, arrive = chunks[(me + 1 - step) % n], chunks[(me - step) % n]
        comm.exchange(send, right, arrive, left, f"ring all-gather of {label}", group)


class Tree(Threaded):
    name = "tree"

    def __init__(self, group: comm.Group) -> None:
        self.group = group
        self.ranks = comm.group_ranks(group)
        self.me = comm.rank_of(group)
        super().__init__()

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        n, me, ranks = len(self.ranks), self.me, self.ranks
        children = [c for c in (2 * me + 1, 2 * me + 2) if c < n]
        parent = (me - 1) // 2
        incoming = torch.empty_like(flat) if children else flat
        for child in children:  # reduce up: the root ends with the sum
            comm.recv(incoming, ranks[child], f"tree reduce of {label}", self.group)
            flat.add_(incoming)
        if me != 0:
            comm.send(flat, ranks[parent], f"tree reduce of {label}", self.group)
            comm.recv(flat, ranks[parent], f"tree broadcast of {label}", self.group)
        for child in children:  # broadcast down
            comm.send(flat, ranks[child], f"tree broadcast of {label}", self.group)


class SharedMemory(Threaded):
    """Ranks on one host sum through shared bucket memory (see shm.py)."""

    name = "shm"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.memory = HostMemory(topology.local_group)
        self.me, self.size = topology.local_rank, topology.local_world_size
        self._peers: dict[int, list[torch.Tensor]] = {}  # own data_ptr -> every rank's buffer
        super().__init__()

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError(f"{self.name} reduction works on CPU tensors, not {device}")
        buffers = self.memory.allocate(numel, dtype)
        own = buffers[self.me]
        self._peers[own.data_ptr()] = buffers
        return own

    def free(self, flat: torch.Tensor) -> None:
        self._peers.pop(flat.data_ptr(), None)  # unmapping the peers' copies frees them

    def _slice(self, numel: int, local_rank: int) -> slice:
        return slice(local_rank * numel // self.size, (local_rank + 1) * numel // self.size)

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        buffers = self._peers[flat.data_ptr()]
        local = self.topology.local_group
        comm.barrier(f"shm: every rank on the host has bucket {label}", local)
        mine = self._slice(len(flat), self.me)
        for rank, buffer in enumerate(buffers):  # sum my slice from everyone's buffer
            if rank != self.me:
                flat[mine].add_(buffer[mine])
        self.between_stages(flat[mine], label)
        comm.barrier(f"shm: every slice of {label} is summed", local)
        for rank, buffer in enumerate(buffers):  # collect the others' finished slices
            if rank != self.me:
                theirs = self._slice(len(flat), rank)
                flat[theirs].copy_(buffer[theirs])

    def between_stages(self, my_slice: torch.Tensor, label: str) -> None:
        """Hook for hierarchical: finish the slice across hosts."""

    def end_of_backward(self) -> None:
        # Peers read this rank's buffers until their last copy; no rank may write its
        # buckets again (the next backward) before every rank has finished reading.
        comm.barrier("shm: every rank has finished reading this step's buckets",
                     self.topology.local_group)


class Hierarchical(SharedMemory):
    name = "hierarchical"

    def between_stages(self, my_slice: torch.Tensor, label: str) -> None:
        if self.topology.hosts > 1:
            comm.all_reduce(my_slice, f"cross-host all-reduce of a slice of {label}",
                            self.topology.cross_group)


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
    return SharedMemory(topology) if name == "shm" else Hierarchical(topology)
