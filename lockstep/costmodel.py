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


def tree_time(link: LinkCost, world_size: int, nbytes: float) -> float:
    """Critical path of algorithms.Tree: node i's children are 2i+1 and 2i+2; a parent
    receives and sums its children in order, then sends up; then the sum comes down."""
    n, message = world_size, link.message(nbytes)
    reduced = [0.0] * n  # when node i holds its subtree's sum
    for node in reversed(range(n)):
        ready = 0.0
        for child in (2 * node + 1, 2 * node + 2):
            if child < n:
                ready = max(ready, reduced[child]) + message + nbytes * link.gamma
        reduced[node] = ready
    has_sum = [0.0] * n
    has_sum[0] = reduced[0]
    for node in range(n):
        sent = has_sum[node]
        for child in (2 * node + 1, 2 * node + 2):
            if child < n:
                sent += message
                has_sum[child] = sent
    return max(has_sum)


def shm_time(link: LinkCost, local_world_size: int, nbytes: float, barrier: float) -> float:
    """Within a host: sum my 1/L slice from L buffers, copy the other (L-1)/L back."""
    slice_bytes = nbytes / local_world_size
    summing = (local_world_size - 1) * slice_bytes * link.gamma
    gathering = (local_world_size - 1) * slice_bytes * link.gamma  # a copy ~ one add pass
    return 3 * barrier + summing + gathering


def predict(algorithm: str, nbytes: float, world_size: int, local_world_size: int,
            link: LinkCost, local: LinkCost | None = None, barrier: float = 1e-4) -> float:
    """Seconds for one all-reduce of `nbytes`. `link` is the slowest link a flat algorithm
    crosses; `local` the cost inside a host (for shm stages; defaults to `link`)."""
    local = local or link
    hosts = world_size // local_world_size
    if algorithm in ("native", "ring"):
        return ring_time(link, world_size, nbytes)
    if algorithm == "tree":
        return tree_time(link, world_size, nbytes)
    intra = shm_time(local, local_world_size, nbytes, barrier)
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


def probe(a: int, b: int, group: comm.Group = None, large_bytes: int = 4 << 20,
          repeats: int = 5) -> LinkCost:
    """Measure the link between ranks `a` and `b`: a tiny ping-pong gives alpha; a large
    exchange in both directions at once -- what a ring step does -- gives beta. Collective:
    every rank calls it; ranks other than a and b take part only in the closing broadcast.
    Returns the same LinkCost everywhere."""
    me = comm.rank_of()
    result = torch.zeros(3, dtype=torch.float64)
    if me in (a, b):
        peer = b if me == a else a
        tiny = torch.zeros(1)
        send, arrive = torch.zeros(large_bytes // 4), torch.zeros(large_bytes // 4)

        def ping_pong() -> None:
            first, second = (comm.send, comm.recv) if me == a else (comm.recv, comm.send)
            first(tiny, peer, "cost probe", group)
            second(tiny, peer, "cost probe", group)

        def exchange() -> None:
            comm.exchange(send, peer, arrive, peer, "cost probe", group)

        exchange()  # warm the connection
        alpha = _timed(ping_pong, repeats * 4) / 2
        both_ways = _timed(exchange, repeats)
        result[:2] = torch.tensor([alpha, max(both_ways - alpha, 1e-12) / large_bytes])
    result[2] = summing_cost()
    comm.broadcast(result, a, "cost probe result", group)
    return LinkCost(*result.tolist())


def summing_cost(nbytes: int = 16 << 20) -> float:
    """Seconds per byte of `x += y` on this machine."""
    x, y = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
    return _timed(lambda: x.add_(y), 5) / nbytes


def barrier_cost(group: comm.Group = None, repeats: int = 20) -> float:
    return _timed(lambda: comm.barrier("cost probe barrier", group), repeats)


def describe(link: LinkCost) -> str:
    gbit = 8 / link.beta / 1e9 if link.beta > 0 else math.inf
    return (f"alpha {link.alpha * 1e6:.0f} us, beta {gbit:.2f} Gbit/s, "
            f"sum {1 / link.gamma / 1e9:.1f} GB/s")
