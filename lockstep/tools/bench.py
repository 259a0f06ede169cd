"""Timing modes side by side, the way every lockstep benchmark does it.

Absolute times on a shared machine mean little; what holds is a comparison made in the
same run, in rounds that run every mode in turn -- the order reversed every other round,
so drift in the machine's load hits all modes alike -- with every rank starting together
and the slowest rank's time counting.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lockstep import comm
from lockstep.tools.cluster import Cluster

LINK_SAMPLE_S = 0.05  # how often run_on_cluster(link=...) reads host 0's link counter


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
                   result: Path, show_output: bool = False, hosts: int = 2,
                   link: list[tuple[float, int]] | None = None) -> Any:
    """Run `script` on `hosts` emulated hosts joined at `bandwidth`, `nproc` processes each, and
    read the JSON it leaves in `result`; None, with each host's last errors printed, when
    a host failed. `show_output` echoes the hosts' stdout (progress lines). `link`: filled
    with (time, bytes host 0 has sent on its link) every LINK_SAMPLE_S while the job runs."""
    with Cluster(hosts=hosts, bandwidth=bandwidth) as cluster:
        done, watcher = threading.Event(), None
        if link is not None:
            def watch() -> None:
                while not done.wait(LINK_SAMPLE_S):
                    link.append((time.time(), cluster.sent_bytes(0)))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        try:
            finished = cluster.run_job(nproc, script, list(args), port=port)
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
    if show_output:
        for host in finished:
            print(host.stdout, end="")
    if any(host.returncode for host in finished):
        for host in finished:
            print(host.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(result.read_text())
