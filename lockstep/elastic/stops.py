"""When a fault-tolerant job's members stop to let joiners in: the step boundary rank 0
sets once a joiner is vetted, and how every member learns it -- from a notice in the
step's own exchange of non-finite flags where steps make one, else from the job's store
(key `grow/<epoch>`; quorum.py lists the others). The quorum that then admits the joiners
is quorum.py's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch.distributed as dist

from lockstep.comm.diagnostics import connection_lost
from lockstep.elastic.etcd import EtcdUnavailable
from lockstep.logs import get_logger

if TYPE_CHECKING:
    from lockstep.elastic.heartbeat import Heartbeat
    from lockstep.elastic.membership import Membership

log = get_logger(__name__)


class JoinerStops:
    """The Coordinator's part that sets and reads the step at which the members stop for
    joiners (its store, heartbeat and id are the Coordinator's)."""

    store: dist.Store
    heartbeat: Heartbeat
    id: int
    _stop_set: tuple[int, int] | None  # rank 0: (epoch, step) it set

    def grow_due(self, membership: Membership, step: int, heard: bool | None = None) -> bool:
        """Whether the epoch stops at this step boundary to admit joiners.

        `heard`: whether rank 0 gave notice to stop here in the step before's exchange of
        non-finite flags (announce_stop), which every rank of a DataParallel training step
        by step with the check on makes -- the answer, with no store to ask -- or None
        where that step exchanged none (local SGD and DiLoCo, `nonfinite="off"`).

        Else, until the heartbeat has learnt the step, the store is asked: a heartbeat
        thread starved on a loaded machine once learnt it too late, and that member went
        into the step the others stopped before (its attempt interrupted, the step redone).

        Rank 0 sets the step here (where no flags carry notices), at the next boundary (and
        round end) after `step`: at its step boundary, or sooner, just before it issues a
        collective over the group that step `step` waits for
        (Elastic._stop_for_joiners_soon). No member can be past
        that boundary, because every step -- under local SGD, DiLoCo and streaming DiLoCo
        every round's end -- waits on a collective rank 0 has not joined yet. A mode whose
        round ends without one would need more steps ahead."""
        if heard is not None:
            return heard
        at = self.heartbeat.grow_at(membership.epoch)
        key = f"grow/{membership.epoch}"
        if at is None and not self.heartbeat.lost:
            try:
                if self.heartbeat.joiners_for == membership.epoch:  # rank 0: stop after
                    align = self.heartbeat.align                    # the next step
                    at = self._set_stop(membership.epoch,
                                        math.ceil((step + 1) / align) * align)
                elif self.store.check([key]):
                    at = int(self.store.get(key))
            except EtcdUnavailable:  # unreachable for now: no joiner is let in meanwhile
                return False
            except (RuntimeError, OSError) as error:  # nobody can join without the store:
                if not connection_lost(error):        # train on; a failure will say so
                    raise
                self.heartbeat.lost = True
        return at is not None and step >= at

    def announce_stop(self, membership: Membership, step: int) -> bool:
        """Rank 0, as step `step`'s non-finite flags leave: whether to give the members
        notice to stop after this step -- joiners wait, or the stop was set for it at the
        boundary before. Sets it in the store too (the joiners, and members of a step that
        exchanges no flags, read it there). Runs inside backward: never raises."""
        epoch = membership.epoch
        if self._stop_set is None or self._stop_set[0] != epoch:
            if self.heartbeat.joiners_for != epoch or self.heartbeat.lost:
                return False
            try:
                self._set_stop(epoch, step + 1)
            except (RuntimeError, OSError) as error:  # (EtcdUnavailable too): nobody can
                log.debug("worker %d: setting the step to stop for joiners failed: %s",
                          self.id, error)             # join now; the next step asks again
                if connection_lost(error):  # for good: no more calls (each logs a C++
                    self.heartbeat.lost = True  # stack trace)
                return False
        return self._stop_set == (epoch, step + 1)

    def _set_stop(self, epoch: int, step: int) -> int:
        """Rank 0: `epoch` stops at `step` for joiners -- or at the step set already."""
        at = int(self.store.compare_set(f"grow/{epoch}", "", str(step)))
        self._stop_set = (epoch, at)
        return at
