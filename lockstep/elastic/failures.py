"""Telling a peer's failure from this worker's own: which errors mean the membership must be
agreed again, and dropping what a failed collective keeps alive."""

from __future__ import annotations

import gc
import re
import types
from typing import Any

import torch.distributed as dist

from lockstep import comm
from lockstep.comm.diagnostics import peer_closed
from lockstep.elastic.store import StoreGone
from lockstep.logs import get_logger

log = get_logger(__name__)


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


def still_held(wrapper: Any, rank: int) -> None:
    """Say who keeps a dropped wrapper alive: its reducer's finished and failed works keep
    the old group's connections open, so a peer blocked on this rank in a collective is
    not released and waits out its timeout (the quorum with it)."""
    holders = sorted({_holder(r) for r in gc.get_referrers(wrapper)
                      if not isinstance(r, types.FrameType)})
    log.warning("rank %d: the dropped %s is still referenced (by %s): its group's "
                "connections stay open until it goes", rank, type(wrapper).__name__,
                ", ".join(holders) or "a frame")


def _holder(referrer: Any) -> str:
    """A referrer in words; a bound method by its name, and what holds the method."""
    if isinstance(referrer, types.MethodType):
        held = sorted({type(r).__name__ for r in gc.get_referrers(referrer)
                       if not isinstance(r, types.FrameType)})
        return f"its method {referrer.__func__.__qualname__}, held by {'/'.join(held)}"
    return type(referrer).__name__
