"""The alpha-beta cost model: how long an all-reduce should take, before running it.

A message of S bytes over a link costs alpha + S * beta (alpha: latency, beta: seconds per
byte); summing S bytes into a buffer costs S * gamma. beta is measured with both
directions of the link busy, as in a ring; a message sent while the way back is idle, as
in a tree, costs beta_one_way per byte instead. On a full-duplex network link the two are
equal; on loopback the "link" is the CPU copying bytes, which one direction alone gets to
itself. gamma is measured with every rank summing at once, as inside an all-reduce (ranks
on one host share its memory bandwidth: two summing together can get half of what one
gets alone).

`probe` measures a link, `probe_host` the shared-memory stage inside a host; `predict`
turns them into a time per algorithm:

    ring (and native, which is a ring):  2(N-1) alpha + 2(N-1)/N S beta + (N-1)/N S gamma
    tree:         the critical path of reduce-up then broadcast-down a binary tree, each
                  message the whole bucket (simulated, since a parent takes its children
                  one after the other, and messages leaving one host share its link)
    shm:          within one host: fixed + the time S adds, both probed on the
                  shared-memory stage itself (`probe_host`), which is the "link" inside a
                  host; the time is interpolated between the probed sizes
    hierarchical: shm inside each host, then a ring among the H hosts carrying the whole
                  bucket over each host's link (its L slices travel side by side)

Bus bandwidth, the usual way to compare all-reduce implementations across sizes and world
sizes, is 2(N-1)/N * S / time: what each link carried per second in a bandwidth-optimal
all-reduce.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lockstep import comm
from lockstep.comm.topology import Topology
from lockstep.comm.world import current
from lockstep.replication.algorithms import AllReduce
from lockstep.replication.hostreduce import SharedMemory


@dataclass(frozen=True)
class LinkCost:
    alpha: float
    """Seconds of latency per message."""
    beta: float
    """Seconds per byte sent."""
    gamma: float
    """Seconds per byte summed (a += b) in memory."""
    beta_one_way: float
    """Seconds per byte sent while nothing comes back the other way."""

    def message(self, nbytes: float) -> float:
        """One message, the reverse direction idle (a tree's edges)."""
        return self.alpha + nbytes * self.beta_one_way


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """Bytes per second each link carried, as in nccl-tests."""
    return 2 * (world_size - 1) / world_size * nbytes / seconds


def ring_time(link: LinkCost, world_size: int, nbytes: float) -> float:
    n = world_size
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes * link.beta + \
        (n - 1) / n * nbytes * link.gamma


def tree_time(link: LinkCost, world_size: int, nbytes: float,
              local: LinkCost | None = None, local_world_size: int | None = None) -> float:
    """Critical path of algorithms.Tree: node i's children are 2i+1 and 2i+2; a parent
    receives and sums its children in order, then sends up; then the sum comes down. An
    edge between ranks on one host costs `local`, between hosts `link`; messages leaving
    one host take turns on its link (a parent and its child on one host can both be
    sending across at once, as 0 and 1 are when 4 ranks sit 2 to a host). The turns are
    given in rank order, not in order of readiness: exact for 2 ranks per host, an
    approximation (within ~30% up to 64 ranks) for more."""
    n, local, per_host = world_size, local or link, local_world_size or world_size
    link_free: dict[int, float] = {}  # per host: when its outgoing link is next idle

    def delivered(sender: int, receiver: int, ready: float) -> float:
        host = sender // per_host
        if host == receiver // per_host:
            return ready + local.message(nbytes)
        start = max(ready, link_free.get(host, 0.0))
        link_free[host] = start + link.message(nbytes)
        return link_free[host]

    reduced = [0.0] * n  # when node i holds its subtree's sum
    for node in reversed(range(n)):
        ready = 0.0
        for child in (2 * node + 1, 2 * node + 2):
            if child < n:
                ready = delivered(child, node, max(ready, reduced[child])) + \
                    nbytes * link.gamma
        reduced[node] = ready
    has_sum = [0.0] * n
    has_sum[0] = reduced[0]
    for node in range(n):
        sent = has_sum[node]
        for child in (2 * node + 1, 2 * node + 2):
            if child < n:
                sent = has_sum[child] = delivered(node, child, sent)
    return max(has_sum)


@dataclass(frozen=True)
class HostCost:
    """The shared-memory stage inside a host (shm, and hierarchical's first and last
    steps): a fixed cost -- its barriers -- and the time each bucket byte adds, which
    depends on the bucket's size. Probed on the stage itself, like a link: summing what
    another core just wrote, and writing where another core will read, costs more than
    gamma's private buffers (cache lines cross between cores), and a bucket whose copies
    still fit the caches runs two to four times faster than one that spills to memory.
    Rather than guess where the caches end, the probe times a few sizes two octaves apart;
    between them the time is interpolated linearly (so it reproduces every probe and grows
    with the bucket), and beyond the ends the nearest end's seconds per byte holds."""

    fixed: float
    sizes: tuple[int, ...]
    """Probed bucket sizes in bytes, ascending."""
    seconds: tuple[float, ...]
    """The stage's time at each probed size beyond the fixed cost."""

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError(f"HostCost needs one time per probed size; got sizes "
                             f"{self.sizes} and times {self.seconds}")
        if self.sizes[0] <= 0 or any(b <= a for a, b in itertools.pairwise(self.sizes)):
            raise ValueError(f"HostCost's probed sizes must be positive and ascending, "
                             f"got {self.sizes}")
        if self.fixed < 0 or any(t <= 0 for t in self.seconds):
            raise ValueError(f"HostCost's times must be positive, got fixed {self.fixed} "
                             f"and {self.seconds}")

    def time(self, nbytes: float) -> float:
        """One bucket of `nbytes`."""
        points = list(zip(self.sizes, self.seconds, strict=True))
        if nbytes <= points[0][0]:
            return self.fixed + nbytes * points[0][1] / points[0][0]
        for (lo, t_lo), (hi, t_hi) in itertools.pairwise(points):
            if nbytes <= hi:
                return self.fixed + t_lo + (nbytes - lo) / (hi - lo) * (t_hi - t_lo)
        return self.fixed + nbytes * points[-1][1] / points[-1][0]


def predict(algorithm: str, nbytes: float, world_size: int, local_world_size: int,
            link: LinkCost, local: LinkCost | None = None,
            host: HostCost | None = None) -> float:
    """Seconds for one all-reduce of `nbytes`. `link` is the slowest link a flat algorithm
    crosses; `local` a link inside a host (a tree's edges there; defaults to `link`);
    `host` the shared-memory stage, for shm and hierarchical."""
    local = local or link
    hosts = world_size // local_world_size
    if algorithm in ("native", "ring"):
        return ring_time(link, world_size, nbytes)
    if algorithm == "tree":
        return tree_time(link, world_size, nbytes, local, local_world_size)
    if algorithm not in ("shm", "hierarchical"):
        raise ValueError(f"no cost model for algorithm {algorithm!r}")
    if host is None:
        raise ValueError(f"predicting {algorithm} needs the host stage's cost (probe_host)")
    if algorithm == "shm" or hosts == 1:
        return host.time(nbytes)
    return host.time(nbytes) + ring_time(link, hosts, nbytes)


def time_reduction(algorithm: AllReduce, nbytes: int, budget_s: float = 1.0,
                   most: int = 200) -> float:
    """Median seconds of one all-reduce of `nbytes` with `algorithm` (the slowest rank's,
    every rank starting together), over repeats within `budget_s`; the first repeat of a
    large one, which warms buffers and connections, is left out. Collective."""
    flat = algorithm.allocate(nbytes // 4, torch.float32, torch.device("cpu"))

    def reduce() -> None:
        algorithm.all_reduce(flat, f"{nbytes} bytes").wait()
        algorithm.finish([])

    try:
        return slowest_median(reduce, budget_s, most, warm_first=nbytes >= (1 << 20))
    finally:
        algorithm.free(flat)


def slowest_median(run: Callable[[], object], budget_s: float, most: int = 200,
                   warm_first: bool = True) -> float:
    """Median seconds of the collective `run` -- each repeat the slowest rank's, every rank
    starting together -- over repeats within `budget_s` (at least two counted); with
    `warm_first` the first repeat only warms up. Collective."""
    times: list[float] = []
    spent, repeats = 0.0, 0
    while len(times) < 2 or (spent < budget_s and len(times) < most):
        comm.barrier("cost model: start together")
        started = time.perf_counter()
        run()
        elapsed = torch.tensor([time.perf_counter() - started])
        comm.all_reduce(elapsed, "cost model: the slowest rank",
                        op=torch.distributed.ReduceOp.MAX)
        if repeats or not warm_first:
            times.append(elapsed.item())
        spent, repeats = spent + elapsed.item(), repeats + 1
    return statistics.median(times)


HOST_PROBE_SIZES = (512 << 10, 2 << 20, 8 << 20, 32 << 20)
"""Two octaves apart, from where the fixed cost stops dominating to well past the caches:
the range DataParallel's buckets live in (1 MB first, then 4 MB for shm and 25 MB for
hierarchical by default)."""


def probe_host(topology: Topology, timeout_s: float | None = None,
               sizes: tuple[int, ...] = HOST_PROBE_SIZES) -> HostCost:
    """Time the shared-memory stage among each host's ranks (every host at once, as in a
    real step): a 4 KB bucket gives the fixed cost, and each of `sizes` the per-byte cost
    at that size. Collective."""
    stage = SharedMemory(topology, current().timeout.total_seconds() if timeout_s is None
                         else timeout_s)
    try:
        fixed = time_reduction(stage, 4 << 10)
        seconds = [time_reduction(stage, n) for n in sizes]
    finally:
        stage.close()
    # Ranks arriving out of step (after a barrier across a slow link, or a busy
    # neighbour) can inflate the 4 KB time past a larger bucket's whole time; the fixed
    # cost is never let take more than half of the smallest probe's.
    fixed = min(fixed, min(seconds) / 2)
    return HostCost(fixed, tuple(sizes), tuple(t - fixed for t in seconds))


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls, on this rank alone."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def probe(a: int, b: int, large_bytes: int = 8 << 20, repeats: int = 5) -> LinkCost:
    """Measure the link between ranks `a` and `b` with the transports the algorithms use:
    an all-reduce between just the two of them -- a tiny one gives alpha; beta is the
    least-squares slope of its time over five sizes from `large_bytes`/16 to `large_bytes`
    (for two ranks, t = 2 alpha + S beta + S/2 gamma, plus per-message costs the slope
    cancels; on loopback the time per byte drifts with size as buffers outgrow the caches,
    and a fit over the whole range spreads that drift where a slope between two sizes
    would extrapolate it) -- and a large message from a to b sent back once it has arrived
    (t = 2 alpha + 2 S beta_one_way: a tree edge's traffic, the receiver's buffer as warm
    or cold as it is there). gamma comes first, from every rank summing at once (see
    `summing_cost`). Collective: every rank calls it and gets the same LinkCost."""
    gamma = summing_cost()
    pair = comm.new_group(sorted({a, b}))  # every rank takes part in creating it
    result = torch.zeros(3, dtype=torch.float64)
    me = comm.rank_of()
    if me in (a, b):
        tiny, large = torch.zeros(1), torch.zeros(large_bytes // 4)
        sizes = [large_bytes >> k for k in range(4, -1, -1)]  # 1/16 .. 1 of large_bytes
        peer = b if me == a else a

        def reduce(t: torch.Tensor) -> None:
            comm.all_reduce(t, "cost probe", pair)

        def there_and_back() -> None:  # as a tree's edge: up, then down, never both
            if me == a:
                comm.send(large, peer, "cost probe: one-way message", pair)
                comm.recv(large, peer, "cost probe: its way back", pair)
            else:
                comm.recv(large, peer, "cost probe: one-way message", pair)
                comm.send(large, peer, "cost probe: its way back", pair)

        for _ in range(3):  # warm the connections, the buffers and the TCP windows
            reduce(large)
            there_and_back()
        alpha = median_seconds(lambda: reduce(tiny), repeats * 4) / 2
        times = [median_seconds(functools.partial(reduce, large[: n // 4]), repeats)
                 for n in sizes]
        slope = statistics.linear_regression(sizes, times).slope
        beta = max(slope - gamma / 2, 1e-15)
        beta_one_way = max(median_seconds(there_and_back, repeats) - 2 * alpha, 1e-12) / \
            (2 * large_bytes)
        result[:] = torch.tensor([alpha, beta, beta_one_way])
    comm.broadcast(result, a, "cost probe result")
    alpha, beta, beta_one_way = result.tolist()
    return LinkCost(alpha, beta, gamma, beta_one_way)


def summing_cost(large_bytes: int = 64 << 20, repeats: int = 7) -> float:
    """Seconds per byte of `x += y` on buffers larger than the caches, with every rank
    summing at the same time, as inside an all-reduce: ranks on one host share its memory
    bandwidth. The slowest rank's figure. Collective."""
    x, y = torch.zeros(large_bytes // 4), torch.ones(large_bytes // 4)
    x.add_(y)  # touch every page first
    comm.barrier("cost probe: start summing together")
    cost = torch.tensor([median_seconds(lambda: x.add_(y), repeats) / large_bytes],
                        dtype=torch.float64)
    comm.all_reduce(cost, "cost probe: the slowest rank's summing",
                    op=torch.distributed.ReduceOp.MAX)
    return cost.item()


def describe(link: LinkCost) -> str:
    def gbit(beta: float) -> float:
        return 8 / beta / 1e9 if beta > 0 else math.inf

    return (f"alpha {link.alpha * 1e6:.0f} us, beta {gbit(link.beta):.2f} Gbit/s "
            f"({gbit(link.beta_one_way):.2f} one way), sum {1 / link.gamma / 1e9:.1f} GB/s")


def describe_host(host: HostCost) -> str:
    rates = ", ".join(f"{size / seconds / 1e9:.1f} at {size_label(size)}"
                      for size, seconds in zip(host.sizes, host.seconds, strict=True))
    return f"fixed {host.fixed * 1e6:.0f} us, GB/s {rates}"


def size_label(nbytes: int) -> str:
    """A message size as people write it: "512 KB", "32 MB"."""
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
