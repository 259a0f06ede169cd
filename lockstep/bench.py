"""Timing modes side by side, the way every lockstep benchmark does it.

Absolute times on a shared machine mean little; what holds is a comparison made in the
same run, in rounds that run every mode in turn -- the order reversed every other round,
so drift in the machine's load hits all modes alike -- with every rank starting together
and the slowest rank's time counting.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep import comm


def time_modes(steps_by_mode: dict[str, Callable[[], None]], rounds: int, steps: int
               ) -> dict[str, list[float]]:
    """Seconds per step of each mode, one entry per round. Collective: every rank calls it
    with the same modes."""
    times: dict[str, list[float]] = {name: [] for name in steps_by_mode}
    order = list(steps_by_mode)
    for r in range(rounds):
        for name in order if r % 2 == 0 else list(reversed(order)):
            comm.barrier("bench: start together")
            started = time.perf_counter()
            for _ in range(steps):
                steps_by_mode[name]()
            elapsed = torch.tensor([(time.perf_counter() - started) / steps])
            comm.all_reduce(elapsed, "bench: the slowest rank", op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return times
