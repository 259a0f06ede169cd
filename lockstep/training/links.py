"""Whose link is slow: a probe that a logged window's attribution runs when communication
holds the steps up (attribution.py), on a job of three hosts or more.

A transfer between two hosts crosses both hosts' links, so one pair's time cannot say
whose link is slow; three hosts can. The first rank of each pair of hosts swaps
PROBE_BYTES with the other's, both ways at once, one pair at a time; a host's link is
taken to be as fast as the fastest pair it was in (its partner there being fast). A host
whose link carried less than SLOW of the other hosts' median is slow, and its first rank
is named -- the others waited for the bytes that had to cross its link.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from lockstep import comm
from lockstep.comm.topology import this_host

PROBE_BYTES = 512 << 10  # 42 ms at 100 Mbit/s: long against the link's latency and bursts
SLOW = 0.5


@dataclass
class SlowLink:
    host: int
    first_rank: int  # the host's lowest rank: the one a report names
    bits_per_s: float
    others_bits_per_s: float  # the median of the other hosts'

    @property
    def behind(self) -> float:
        """How much longer the same bytes take on this link than on the others'."""
        return self.others_bits_per_s / self.bits_per_s - 1

    def cause(self) -> str:
        return (f"its link ({self.bits_per_s / 1e6:.0f} Mbit/s; the other hosts' "
                f"{self.others_bits_per_s / 1e6:.0f})")


class LinkProbe:
    """This rank's part in probing the hosts' links (every method is collective). A verdict
    stands for REUSE windows while the hosts stay the same: the probe's pairs grow with
    the square of the hosts."""

    REUSE = 5

    def __init__(self) -> None:
        self._hosts: list[int] = []  # each rank's host when the verdict was found
        self._found: SlowLink | None = None
        self._reuses_left = 0

    def slow_link(self) -> SlowLink | None:
        """The host whose link is slow, if one is (None with fewer than three hosts)."""
        # Asked every time (one small all-gather): after an elastic regroup the same world
        # size may hold other workers, numbered anew.
        names = comm.all_gather_object(this_host(), "link probe: every rank's host")
        numbers: dict[str, int] = {}
        hosts = [numbers.setdefault(n, len(numbers)) for n in names]
        if len(numbers) < 3:
            return None
        if hosts == self._hosts and self._reuses_left > 0:
            self._reuses_left -= 1
            return self._found
        first = [hosts.index(h) for h in range(len(numbers))]
        self._hosts, self._found = hosts, verdict(link_rates(first), first)
        self._reuses_left = self.REUSE - 1
        return self._found


def verdict(rates: list[float], first_ranks: list[int]) -> SlowLink | None:
    """The slowest host's link, if it carried less than SLOW of the others' median."""
    if len(rates) < 3 or not all(math.isfinite(r) and r > 0 for r in rates):
        return None
    slowest = min(range(len(rates)), key=rates.__getitem__)
    others = statistics.median(r for h, r in enumerate(rates) if h != slowest)
    if rates[slowest] >= SLOW * others:
        return None
    return SlowLink(slowest, first_ranks[slowest], rates[slowest], others)


def link_rates(first_ranks: list[int]) -> list[float]:
    """Bits per second each host's link carried in the probe; `first_ranks[h]` speaks for
    host h. One pair at a time, a barrier between pairs, so no two pairs share a link."""
    count, rank, device = len(first_ranks), comm.rank_of(), comm.device_of()
    seconds = torch.zeros(count, count, dtype=torch.float64, device=device)
    payload = torch.zeros(PROBE_BYTES // 4, device=device)
    incoming = torch.empty_like(payload)
    for a in range(count):
        for b in range(a + 1, count):
            if rank in (first_ranks[a], first_ranks[b]):
                peer = first_ranks[b] if rank == first_ranks[a] else first_ranks[a]
                started = time.perf_counter()
                sent = comm.isend(payload, peer, f"link probe: hosts {a} and {b}")
                comm.irecv(incoming, peer, f"link probe: hosts {a} and {b}").wait()
                sent.wait()
                if device.type == "cuda":  # NCCL's wait orders the stream, not the host
                    torch.cuda.synchronize(device)
                if rank == first_ranks[a]:
                    seconds[a, b] = time.perf_counter() - started
            comm.barrier(f"link probe: hosts {a} and {b} done")
    comm.all_reduce(seconds, "link probe: every pair's time")
    pair = (seconds + seconds.T).cpu()
    bits = PROBE_BYTES * 8
    return [max(bits / pair[h, o].item() for o in range(count) if o != h)
            for h in range(count)]
