"""Telling a peer's failure from this worker's own: which errors mean the membership must be
agreed again, and dropping what a failed collective keeps alive."""

from __future__ import annotations

import re

import torch.distributed as dist

from lockstep import comm
from lockstep.comm.diagnostics import peer_closed
from lockstep.elastic.store import StoreGone


def membership_failure(error: BaseException) -> bool:
    """Whether `error` says a peer is gone or unreachable (and the membership must be
    agreed again), rather than a fault in this rank's own work."""
    if isinstance(error, StoreGone):  # nobody left to agree through: not survivable
        return False
    if isinstance(error, (comm.CollectiveError, dist.DistError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        peer_closed(error) or "Timed out waiting" in text or "gloo" in text)


def forget_frames(error: BaseException) -> None:
    """Drop the frames an error (and the errors it came from) keeps: they hold the failed
    collective's work, which holds the group's connections open."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending += [e.__cause__, e.__context__]


def first_line(error: BaseException) -> str:
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return re.sub(r"^rank \d+: ", "", line)[:200]  # the log record names the rank already
