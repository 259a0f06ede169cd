"""Waiting on a collective that may never complete: a peer that left its group alive.

A peer that dies closes its connections, and a collective waiting on it fails at once. A
peer that leaves the group alive -- a fault-tolerant job's member that failed elsewhere and
went to agree on the next membership -- keeps them open (Gloo's abort and shutdown close
no socket), so a rank waiting on it would wait out the collective's whole timeout. While a
`check` is set (lockstep.Elastic sets one per membership), a wait is cut into slices of a
second, and after each the check says whether waiting is still of use; once it names a
reason, the wait fails with it. The collective itself is left to the backend's thread (a
new group is formed anyway). Nothing changes while no check is set.

Collectives only: a Gloo send or receive waited on with a timeout fails for good when it
expires (and closes the group's connections), so those are waited on whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from lockstep.comm.ledger import Record

SLICE = timedelta(seconds=1.0)
_SLICE_ENDED = "Operation timed out"  # Work.wait(timeout)'s words; the backend's own differ

_check: Callable[[], str | None] | None = None


class Abandoned(RuntimeError):
    """A wait given up: what it waited for can no longer complete (the check's reason)."""


def watch(check: Callable[[], str | None] | None) -> None:
    """Set (or, with None, clear) what every collective's wait asks after each slice:
    None to go on waiting, or why the collective can no longer complete."""
    global _check
    _check = check


def give_up_if_told(what: str, started: float, record: Record | None) -> None:
    """Raise Abandoned -- naming `what` and the check's reason -- if the check says waiting
    is of no use; else return. Asked each slice by `wait`, and by waits that are no
    backend's work (a barrier in host memory, comm/shm.py)."""
    check = _check
    reason = None if check is None else check()
    if reason is not None:
        if record is not None:
            record.done = True
        raise Abandoned(f"rank {dist.get_rank()}: {what} given up after "
                        f"{time.monotonic() - started:.1f}s: {reason}")


def wait(work: dist.Work, what: str, started: float, record: Record | None) -> None:
    """`work.wait()`, given up -- Abandoned, naming `what` and the reason -- once the check
    says waiting is of no use."""
    check = _check
    if check is None:
        work.wait()
        return
    while True:
        try:
            work.wait(SLICE)
            return
        except RuntimeError as error:
            if _SLICE_ENDED not in str(error):
                raise  # the collective's own failure
        if work.is_completed():  # meanwhile: its own outcome (a failure raises here)
            work.wait()
            return
        give_up_if_told(what, started, record)
