"""A hook run just before the next collective a step waits for (comm.collectives calls
`run_armed` as it issues each one, and shm's host barrier where every rank of the job is on
the host: the step's only wait on its peers there): where lockstep.Elastic's rank 0 sets
the step at which its members stop for a joiner -- the step under way, which no member can
finish without that collective -- when its steps exchange no non-finite flags to give
notice in (local SGD, DiLoCo, the check off: Coordinator.grow_due; else
Coordinator.announce_stop)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

armed: tuple[int, Callable[[], None]] | None = None
_awaited_later = threading.local()


def before_next_world_collective(thread: int, hook: Callable[[], None]) -> None:
    """Run `hook` once, in thread `thread`, just before that thread next issues a
    collective over the whole default group that its step waits for -- one no rank can
    finish the step without (lockstep.Elastic's rank 0 may set the step at which its
    members stop for a joiner there: the step under way, not the one after). Point-to-point
    messages, subgroups and collectives issued inside `awaited_later()` do not run it.
    May be called from any thread."""
    global armed
    armed = (thread, hook)


@contextlib.contextmanager
def awaited_later() -> Iterator[None]:
    """Collectives issued inside are waited for after the step under way (streaming
    DiLoCo's exchange, overlapped with the next inner steps): a peer may finish the step
    before this rank joins them, so they run no before_next_world_collective hook."""
    _awaited_later.on = True
    try:
        yield
    finally:
        _awaited_later.on = False


def run_armed() -> None:
    """Run the armed hook if this is its thread and not inside awaited_later()."""
    global armed
    found = armed
    if found is not None and found[0] == threading.get_ident() and \
            not getattr(_awaited_later, "on", False):
        armed = None
        found[1]()
