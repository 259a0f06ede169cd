"""A host's cores shared among the job's workers on it, for their threads.

The launcher gives each worker cores / (workers it starts on this host) intra-op threads
(OMP_NUM_THREADS), as torchrun's users set by hand. A fault-tolerant job's workers on a
host change while it runs: a worker restarted on its own (`lockstep run --elastic -n 1`)
would take every core beside the survivors there, and each joiner after it too -- after a
few kill/rejoin cycles every worker ran with all of the host's threads, six threads on two
cores, and steps took five times as long. So where the launcher chose the number (the user
set none), each worker shares the cores again whenever its membership changes
(`share_cores`, called as the membership's group is made).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

HOST_CORES = "LOCKSTEP_HOST_CORES"
"""The cores a host's workers divide among their threads, in place of the machine's: set
by `lockstep cluster`, whose emulated hosts share this machine's cores (tools/cluster.py)."""

AUTO_THREADS = "LOCKSTEP_AUTO_THREADS"
"""Set by the elastic launcher to the threads it chose for OMP_NUM_THREADS (the user set
none): the worker may choose again as its host's share of the job changes. A user's
OMP_NUM_THREADS, or a script's own torch.set_num_threads, is left alone."""

_ours: int | None = None  # the threads share_cores last set in this process


def machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def threads_per_worker(nproc: int) -> int:
    """This host's cores shared among its `nproc` workers."""
    cores = int(os.environ.get(HOST_CORES) or machine_cores())
    return max(1, cores // max(1, nproc))


def share_cores(local_workers: int) -> None:
    """Give this worker its share of the host's cores among `local_workers` of the job,
    where the launcher chose its threads (AUTO_THREADS) and the script has not set its own
    since (torch reads the launcher's number capped at the machine's cores)."""
    global _ours
    launched = os.environ.get(AUTO_THREADS, "")
    if not launched.isdigit():
        return
    import torch  # (here: the launcher reads this module, and starts workers, without it)

    ours = {_ours} if _ours is not None else {int(launched), min(int(launched), machine_cores())}
    if torch.get_num_threads() not in ours:  # the script's own choice: it stays
        return
    threads = threads_per_worker(local_workers)
    if torch.get_num_threads() != threads:
        log.info("%d worker(s) of the job on this host: %d intra-op thread(s) each, where "
                 "this worker had %d", local_workers, threads, torch.get_num_threads())
        torch.set_num_threads(threads)
    _ours = threads
