"""How a gradient bucket is summed across ranks: the reducer decides *what* and *when*; an
algorithm -- a Reduction (reduction.py) whose one word is `all_reduce(flat)` -- decides *how*.

- native: the backend's own all-reduce (Gloo's or NCCL's), issued from the backward hooks.
- ring: reduce-scatter then all-gather over point-to-point chunks; each rank sends
  2(N-1)/N of the bucket, whatever N is -- bandwidth-optimal for large buckets.
- tree: reduce up and broadcast down a binary tree: 2*ceil(log2 N) steps instead of
  2(N-1) -- fewer latencies for small buckets, but every step carries the whole bucket.
- shm and hierarchical, which sum through memory the host's ranks share: hostreduce.py.

ring, tree and hierarchical run on one communication thread per reducer, which takes
buckets in launch order (so the in-order invariant holds) over a process group of their
own (so their point-to-point traffic never interleaves with the main thread's
collectives). choices.py builds them by name.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from lockstep import comm
from lockstep.replication.reduction import Bucket, Handle, Reduction


class AllReduce(Reduction):
    """A reduction that sums a bucket's flat buffer in place: `all_reduce` is the one thing
    a new algorithm says. Subclasses may also choose where buffers live. One that sums
    every element of the buffer on every rank may say `carries_flags = True` (the ranks'
    non-finite flags then ride in the last bucket: reduction.py)."""

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
    carries_flags = True

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
            self.group = None  # Gloo's threads for the group end with its last reference


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

    group: comm.Group = None  # a group of its own, if it has one (given back by close)

    def __init__(self) -> None:
        self._worker = Worker(self.name)

    def all_reduce(self, flat: torch.Tensor, label: str) -> Handle:
        return self._worker.submit(self.reduce, flat, label)

    def reduce(self, flat: torch.Tensor, label: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._worker.close()
        comm.destroy_group(self.group)
        self.group = None  # Gloo's threads for the group end with its last reference


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
    carries_flags = True

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
    carries_flags = True

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
