"""Timing modes side by side, the way every lockstep benchmark does it.

Absolute times on a shared machine mean little; what holds is a comparison made in the
same run, in rounds that run every mode in turn -- the order reversed every other round,
so drift in the machine's load hits all modes alike -- with every rank starting together
and the slowest rank's time counting.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lockstep import comm
from lockstep.tools.cluster import Cluster


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


def run_on_cluster(bandwidth: str, nproc: int, script: str, args: Sequence[str], port: int,
                   result: Path, show_output: bool = False, hosts: int = 2) -> Any:
    """Run `script` on `hosts` emulated hosts joined at `bandwidth`, `nproc` processes each, and
    read the JSON it leaves in `result`; None, with each host's last errors printed, when
    a host failed. `show_output` echoes the hosts' stdout (progress lines)."""
    with Cluster(hosts=hosts, bandwidth=bandwidth) as cluster:
        done = cluster.run_job(nproc, script, list(args), port=port)
    if show_output:
        for host in done:
            print(host.stdout, end="")
    if any(host.returncode for host in done):
        for host in done:
            print(host.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(result.read_text())
