"""The alpha-beta cost model: how long an all-reduce should take, before running it.

A message of S bytes over a link costs alpha + S * beta (alpha: latency, beta: seconds per
byte); summing S bytes into a buffer costs S * gamma. `probe` measures alpha and beta
between two ranks and gamma locally; `predict` turns them into a time per algorithm:

    ring (and native, which is a ring):  2(N-1) alpha + 2(N-1)/N S beta + (N-1)/N S gamma
    tree:         the critical path of reduce-up then broadcast-down a binary tree, each
                  message the whole bucket (simulated, since a parent takes its children
                  one after the other)
    shm:          within one host: two passes over the bucket in memory plus 3 barriers
    hierarchical: shm inside each host, then a ring among the H hosts carrying the whole
                  bucket over each host's link (its L slices travel side by side)

Bus bandwidth, the usual way to compare all-reduce implementations across sizes and world
sizes, is 2(N-1)/N * S / time: what each link carried per second in a bandwidth-optimal
all-reduce.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from lockstep import comm


@dataclass(frozen=True)
class LinkCost:
    alpha: float
    """Seconds of latency per message."""
    beta: float
    """Seconds per byte sent."""
    gamma: float
    """Seconds per byte summed (a += b) in memory."""

    def message(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


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
    edge between ranks on one host costs `local`, between hosts `link`."""
    n, local, per_host = world_size, local or link, local_world_size or world_size

    def message(a: int, b: int) -> float:
        return (local if a // per_host == b // per_host else link).message(nbytes)

    reduced = [0.0] * n  # when node i holds its subtree's sum
    for node in reversed(range(n)):
        ready = 0.0
        for child in (2 * node + 1, 2 * node + 2):
            if child < n:
                ready = max(ready, reduced[child]) + message(node, child) + nbytes * link.gamma
        reduced[node] = ready
    has_sum = [0.0] * n
    has_sum[0] = reduced[0]
    for node in range(n):
        sent = has_sum[node]
        for child in (2 * node + 1, 2 * node + 2):
            if child < n:
                sent += message(node, child)
                has_sum[child] = sent
    return max(has_sum)


def shm_time(link: LinkCost, local_world_size: int, nbytes: float, fixed: float) -> float:
    """Within a host: sum my 1/L slice from L buffers, write it into the L-1 others; plus
    the fixed cost of the waits (`fixed`, measured on a tiny message)."""
    slice_bytes = nbytes / local_world_size
    summing = (local_world_size - 1) * slice_bytes * link.gamma
    publishing = (local_world_size - 1) * slice_bytes * link.gamma  # a copy ~ one add pass
    return fixed + summing + publishing


def predict(algorithm: str, nbytes: float, world_size: int, local_world_size: int,
            link: LinkCost, local: LinkCost | None = None, fixed: float = 1e-4) -> float:
    """Seconds for one all-reduce of `nbytes`. `link` is the slowest link a flat algorithm
    crosses; `local` the cost inside a host (for shm stages; defaults to `link`); `fixed`
    the shm stages' fixed cost."""
    local = local or link
    hosts = world_size // local_world_size
    if algorithm in ("native", "ring"):
        return ring_time(link, world_size, nbytes)
    if algorithm == "tree":
        return tree_time(link, world_size, nbytes, local, local_world_size)
    intra = shm_time(local, local_world_size, nbytes, fixed)
    if algorithm == "shm" or hosts == 1:
        return intra
    if algorithm == "hierarchical":
        return intra + ring_time(link, hosts, nbytes)
    raise ValueError(f"no cost model for algorithm {algorithm!r}")


def _timed(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def probe(a: int, b: int, large_bytes: int = 4 << 20, repeats: int = 5) -> LinkCost:
    """Measure the link between ranks `a` and `b` with the transport the algorithms use: an
    all-reduce between just the two of them -- a tiny one gives alpha, a large one beta
    (for two ranks, t = 2 alpha + S beta + S/2 gamma). Collective: every rank calls it and
    gets the same LinkCost."""
    pair = comm.new_group(sorted({a, b}))  # every rank takes part in creating it
    gamma = summing_cost()
    result = torch.zeros(3, dtype=torch.float64)
    if comm.rank_of() in (a, b):
        tiny, large = torch.zeros(1), torch.zeros(large_bytes // 4)

        def reduce(t: torch.Tensor) -> None:
            comm.all_reduce(t, "cost probe", pair)

        reduce(large)  # warm the connection and the buffers
        alpha = _timed(lambda: reduce(tiny), repeats * 4) / 2
        large_time = _timed(lambda: reduce(large), repeats)
        beta = max(large_time - 2 * alpha - large_bytes / 2 * gamma, 1e-12) / large_bytes
        result[:] = torch.tensor([alpha, beta, gamma])
    comm.broadcast(result, a, "cost probe result")
    return LinkCost(*result.tolist())


def summing_cost(nbytes: int = 64 << 20) -> float:
    """Seconds per byte of `x += y` on this machine, on buffers larger than the caches."""
    x, y = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
    return _timed(lambda: x.add_(y), 5) / nbytes


def describe(link: LinkCost) -> str:
    gbit = 8 / link.beta / 1e9 if link.beta > 0 else math.inf
    return (f"alpha {link.alpha * 1e6:.0f} us, beta {gbit:.2f} Gbit/s, "
            f"sum {1 / link.gamma / 1e9:.1f} GB/s")
