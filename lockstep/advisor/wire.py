"""What the advisor measures of the network: every collective the modes would issue, at the
sizes they would issue it, timed on the job's own ranks and links -- but PowerSGD's and
TopK's, which are timed with the compressors themselves (compression.py).

The modes' predictions are first made against `Asking`, which answers 0 and writes down
each (collective, size) asked for; those are timed -- the all-reduce with each algorithm
lockstep offers for this layout, as DataParallel would run it, reduce-scatter and ZeRO's
gather of shards with the backend's own, as ZeRO does -- and the predictions are made again
against the timings. Timing the sizes themselves, not a line through two of them, matters:
Gloo's all-gather took 0.3 ms at 64 KB, 3.5 ms at 800 KB and 4.2 ms at 8 MB on loopback
here, a curve no alpha-beta line follows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

import torch

from lockstep import comm
from lockstep.advisor.costmodel import bus_bandwidth, slowest_median, time_reduction
from lockstep.comm.shm import HostBarrier, HostMemory, peers_mappable, shm_available
from lockstep.comm.world import current
from lockstep.replication.choices import make_algorithm
from lockstep.replication.compress import HALF_DTYPES
from lockstep.sharding.staging import Staging

ALL_REDUCE, REDUCE_SCATTER = "all-reduce", "reduce-scatter"
GATHER_SHARDS = "shard gather"
"""ZeRO's gather of parameter shards into the whole (comm.gather_shards_async: on Gloo one
broadcast per owner, which costs what an all-gather does not on a slow link)."""
GATHER_SHM = "shard gather shm"
"""The same through host-shared memory (ZeRO's algorithm="auto" where every rank is on one
host's CPU, sharding/hostshards.py): a copy of each peer's shard, then a host barrier.
Timed only where the ranks can map each other's memory; else absent (the sockets' apply)."""
STAGED_REDUCE_SCATTER, STAGED_ALL_REDUCE = "staged reduce-scatter", "staged all-reduce"
"""ZeRO's gradient reductions there (sharding/staging.py): stages 2-3, and stage 1's."""
Kind = str
"""ALL_REDUCE + " " + an algorithm ("all-reduce native"), and a 16-bit dtype where the
buffer is one ("all-reduce native bf16": Gloo sums those at its own pace); REDUCE_SCATTER,
GATHER_SHARDS, or one of the host-memory kinds above."""


class WireCost:
    """Seconds for each collective at each size timed; between sizes, a straight line
    between the nearest two (beyond them, the nearest one's rate). Sizes are the whole
    buffer's bytes: reduce-scatter's input, a gather's output."""

    def __init__(self, timed: dict[Kind, dict[int, float]], world_size: int,
                 local_world_size: int) -> None:
        self.timed, self.world_size, self.local_world_size = timed, world_size, local_world_size

    def time(self, kind: Kind, nbytes: float) -> float:
        if nbytes <= 0 or self.world_size == 1:
            return 0.0
        points = sorted(self.timed[kind].items())
        sizes = [s for s, _ in points]
        at = bisect.bisect_left(sizes, nbytes)
        if at < len(sizes) and sizes[at] == nbytes:
            return points[at][1]
        if at == 0:
            return points[0][1]  # smaller than anything timed: at least its latency
        if at == len(sizes):
            return points[-1][1] * nbytes / sizes[-1]
        (s0, t0), (s1, t1) = points[at - 1], points[at]
        return t0 + (nbytes - s0) / (s1 - s0) * (t1 - t0)

    def all_reduce(self, algorithm: str, nbytes: float) -> float:
        return self.time(f"{ALL_REDUCE} {algorithm}", nbytes)

    def bus_gbit(self) -> float:
        """The native all-reduce's bus bandwidth at the largest size timed, in Gbit/s."""
        points = self.timed.get(f"{ALL_REDUCE} native") or {0: 0.0}
        nbytes, seconds = max(points.items())
        return bus_bandwidth(nbytes, seconds, self.world_size) * 8 / 1e9 if seconds else 0.0


class Asking(WireCost):
    """Answers 0 to every question and remembers it: what the predictions need timed."""

    def __init__(self, world_size: int, local_world_size: int) -> None:
        super().__init__({}, world_size, local_world_size)
        self.asked: set[tuple[Kind, int]] = set()

    def time(self, kind: Kind, nbytes: float) -> float:
        if nbytes > 0:
            self.asked.add((kind, int(nbytes)))
        return 0.0


def algorithms_for(world_size: int, local_world_size: int, device: str = "cpu") -> list[str]:
    """The all-reduce algorithms that apply to this layout: shm inside one host of several
    ranks, hierarchical across hosts of several ranks each (both sum in host memory: on a
    CPU only)."""
    hosts = world_size // local_world_size
    names = ["native", "ring", "tree"]
    if local_world_size > 1 and device == "cpu":
        names.append("shm" if hosts == 1 else "hierarchical")
    return names


def measure_wire(asked: Iterable[tuple[Kind, int]], local_world_size: int,
                 budget_s: float = 0.1) -> WireCost:
    """Time every (collective, size) in `asked`. Collective: every rank passes the same."""
    timed: dict[Kind, dict[int, float]] = {}
    wanted: dict[Kind, list[int]] = {}
    on_host, memory = None, None  # whether the ranks can share host memory; that memory
    for kind, nbytes in sorted(set(asked)):
        wanted.setdefault(kind, []).append(max(nbytes // 4 * 4, 4))
    wanted = {kind: sorted(set(sizes)) for kind, sizes in wanted.items()}
    for kind, sizes in wanted.items():
        if kind.startswith(ALL_REDUCE) and len(kind.split()) == 3:  # a 16-bit buffer
            dtype = HALF_DTYPES[kind.split()[2]]
            timed[kind] = {n: slowest_median(_all_reduce(n, dtype), budget_s, 100) for n in sizes}
        elif kind.startswith(ALL_REDUCE):
            algorithm = make_algorithm(kind.split()[1], None, local_world_size)
            try:
                timed[kind] = {n: time_reduction(algorithm, n, budget_s) for n in sizes}
            finally:
                algorithm.close()
        elif kind in ON_HOST:
            if on_host is None:  # (asked once, collectively, for all of them)
                on_host = comm.size_of() == local_world_size and \
                    current().device.type == "cpu" and shm_available() is None and \
                    peers_mappable(None)
                memory = HostMemory(None) if on_host else None
            if memory is not None:
                timed[kind] = {n: slowest_median(ON_HOST[kind](n, memory), budget_s, 100)
                               for n in sizes}
        else:
            start = {REDUCE_SCATTER: _reduce_scatter, GATHER_SHARDS: _gather_shards}[kind]
            timed[kind] = {n: slowest_median(start(n), budget_s, 100) for n in sizes}
    return WireCost(timed, comm.size_of(), local_world_size)


def _buffers(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = comm.size_of()
    per_rank = max(nbytes // 4 // n, 1)
    return torch.zeros(per_rank * n), torch.zeros(per_rank)


def _all_reduce(nbytes: int, dtype: torch.dtype) -> Callable[[], object]:
    flat = torch.zeros(max(nbytes // dtype.itemsize, 1), dtype=dtype)
    return lambda: comm.all_reduce(flat, "advisor: 16-bit all-reduce probe")


def _reduce_scatter(nbytes: int) -> Callable[[], object]:
    whole, mine = _buffers(nbytes)
    return lambda: comm.reduce_scatter(mine, whole, "advisor: reduce-scatter probe")


def _gather_shm(nbytes: int, memory: HostMemory) -> Callable[[], object]:
    """As HostShards.gather and the barrier after it: every peer's shard copied in."""
    whole, mine = _buffers(nbytes)
    shards = memory.allocate(mine.numel(), mine.dtype)
    barrier = HostBarrier(memory, current().timeout.total_seconds())

    def gather() -> None:
        for k, shard in enumerate(shards):
            if k != memory.local_rank:
                whole[k * shard.numel():(k + 1) * shard.numel()].copy_(shard)
        barrier.wait("advisor: shared-memory gather probe")
    return gather


def _staged(stage: int) -> Callable[[int, HostMemory], Callable[[], object]]:
    """As ShardedReduction through host memory: stage 1's all-reduce, else reduce-scatter."""
    def make(nbytes: int, memory: HostMemory) -> Callable[[], object]:
        whole, _ = _buffers(nbytes)
        barrier = HostBarrier(memory, current().timeout.total_seconds())
        staging = Staging(memory, barrier, stage, [whole.dtype])
        if stage == 1:
            return lambda: staging.all_reduce(whole, "advisor: staged all-reduce probe")
        return lambda: staging.reduce_scatter(whole, "advisor: staged reduce-scatter probe")
    return make


ON_HOST = {GATHER_SHM: _gather_shm, STAGED_REDUCE_SCATTER: _staged(2),
           STAGED_ALL_REDUCE: _staged(1)}


def _gather_shards(nbytes: int) -> Callable[[], object]:
    whole, _ = _buffers(nbytes)
    return lambda: comm.gather_shards_async(whole, "advisor: shard gather probe").wait()
