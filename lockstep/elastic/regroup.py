"""Moving a fault-tolerant job from one membership to the next: the other half of
lockstep.Elastic (job.py holds the step and its failures).

A regroup leaves the old process group (its wrapper dropped, ZeRO's shards held), agrees
on the new membership through the store (quorum.py), makes its group current
(membership.py), builds the wrapper for it, and brings whoever needs it level: ZeRO's
shards pooled from what the survivors held (sharding/recovery.py), everything else from
rank 0 (handover.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch import nn

from lockstep.comm import waits
from lockstep.comm.diagnostics import reporter
from lockstep.comm.world import current, retire_default_group
from lockstep.elastic import rounds
from lockstep.elastic.config import ElasticConfig
from lockstep.elastic.failures import still_held
from lockstep.elastic.handover import hand_over
from lockstep.elastic.membership import Membership, describe, install, report
from lockstep.elastic.quorum import Coordinator, Excluded, QuorumError
from lockstep.elastic.store import store_gone
from lockstep.logs import get_logger
from lockstep.replication.choices import fault_tolerant
from lockstep.replication.consistency import levelled_elsewhere
from lockstep.replication.drift import DriftCheck
from lockstep.sharding import recovery
from lockstep.sharding.optimizer import ZeroOptimizer
from lockstep.sharding.sharded import ShardedDataParallel

log = get_logger(__name__)


class Regrouping:
    """lockstep.Elastic's membership changes, over the state its constructor sets."""

    module: nn.Module
    optimizer: Any  # (under ZeRO, a ZeroOptimizer over the shards)
    wrap: Callable[[nn.Module], nn.Module]
    state: dict[str, Any]
    config: ElasticConfig
    backend: str
    coordinator: Coordinator
    model: Any
    membership: Membership | None
    drift: DriftCheck | None
    step: int
    reached: int
    lineage: list[list[int]]
    regroups: list[dict[str, Any]]
    _phase: int
    _sync_retry: bool
    _target: int
    _rejoined_at: int
    _received: bool
    _in_rounds: bool
    _listens: bool
    _held: recovery.Held | None
    _shards_at: int | None

    def _regroup(self, planned: bool) -> None:
        started = time.monotonic()
        previous = self._current()
        # A DataParallel is built for its world size: rebuilt. Local SGD / DiLoCo keep
        # their round's progress through a failure; joiners need a fresh one everywhere.
        rewrap = planned or not self._in_rounds
        if planned:
            rounds.before_planned_regroup(self.model)
        self._leave_group(drop_wrapper=rewrap, failed=not planned)
        try:
            membership = self.coordinator.regroup(
                previous, self.step, planned,
                None if self._held is None else self._held.shards(), self._units)
        except Excluded as error:
            log.warning("%s; joining again", error)  # (it names the worker)
            self._admit(self.coordinator.wait_admitted(), rewrap=True, started=started)
            # train the step the others are at, and none of the work before it
            self._target = self._rejoined_at = self.step
            return
        except QuorumError:
            raise
        except (RuntimeError, OSError) as error:  # the store's, not a peer's: not retried
            raise store_gone(self.coordinator.address, error) from None
        self._admit(membership, rewrap=rewrap or bool(membership.joined), started=started,
                    previous=previous)

    def _leave_group(self, drop_wrapper: bool, failed: bool) -> None:
        """Close the old group's connections before the quorum, so a peer still blocked in
        a collective with this rank fails at once rather than at its timeout. Nothing may
        keep the group alive: the wrapper's own groups go with it, and the failed work
        with the error's frames (failures.forget_frames). A garbage collection takes a
        tenth of a second or more with torch loaded, most of a joiner's wait: a planned
        regroup (nothing failed) collects only if the wrapper outlived its last
        reference."""
        if drop_wrapper and isinstance(self.model, ShardedDataParallel):
            assert isinstance(self.optimizer, ZeroOptimizer)
            # (a failure in the last admission, after the pool: its step, not this rank's)
            at = self.step if self._shards_at is None else self._shards_at
            self._held = recovery.hold(self.model.zero_groups, self.optimizer,
                                       self._current().epoch, at)
            self.model.abandon()  # (close() would gather stage 3's shards: a collective)
            self.optimizer.group = None  # it would keep the old group's sockets open
        elif drop_wrapper and hasattr(self.model, "close"):  # (no local may keep it)
            self.model.close()
        rounds.leaving_group(self.model)  # a kept wrapper's works on the old group
        dropped = None
        if drop_wrapper and self.model is not None:
            dropped, self.model = weakref.ref(self.model), None
            self.drift = None  # it watches that wrapper (_rewrap makes the next one's)
        if failed or (dropped is not None and dropped() is not None):
            gc.collect()  # frames and works in reference cycles
        if dropped is not None and dropped() is not None:
            still_held(dropped(), current().rank)
        reporter.stop()  # no progress or watchdog store call while the group goes
        retire_default_group()

    def _admit(self, membership: Membership, rewrap: bool, started: float,
               previous: Membership | None = None) -> None:
        """Make `membership` current: its group, the wrapper, state for whoever needs it.
        It is current from the start: if a member fails mid-way, the next regroup starts
        from these members (and this rank's step still says what it has committed)."""
        self.membership = membership
        install(membership, self.coordinator.base, self.backend,
                timedelta(seconds=self.config.collective_timeout_s))
        # A member that leaves this group alive keeps its connections open: a collective
        # waiting on it is given up once it is seen gone to the next quorum, not at timeout.
        # (Gloo's: a wait with a timeout would block NCCL's host thread on the GPU's work.)
        if self.backend == "gloo":
            waits.watch(functools.partial(self.coordinator.left_behind, membership.epoch))
        # ZeRO's shards (a collective: every worker of a ZeRO job has a ZeroOptimizer, the
        # terms agreed on it); a replicated job has nothing to pool
        pooled = recovery.pool(self._held, membership.step) \
            if isinstance(self.optimizer, ZeroOptimizer) else None
        if pooled is not None:
            recovery.restore(self.module, pooled)
        if rewrap or self.model is None or pooled is not None:
            self._rewrap()
        if pooled is not None:
            recovery.load(self.model.zero_groups, self.optimizer, pooled)
            # The shards are at the membership's step from here; this rank's step and the
            # rest of its state (a joiner's, or one a step ahead) only after the hand-over,
            # which a second failure may interrupt: it then holds them at their own step.
            self._shards_at = membership.step
        self._held = None
        behind = self.coordinator.id in membership.behind
        if membership.behind:  # (ZeRO: the pool brought parameters and optimizer level)
            sharded = isinstance(self.model, ShardedDataParallel)
            ranks = sorted(membership.ids.index(i) for i in membership.behind)
            objects = hand_over(self.module, None if sharded else self.optimizer, self.model,
                                self._objects(), behind=ranks, receive_wrapper=rewrap)
            if behind:
                self._load_objects(objects)
                self._received = True
        if self.step > membership.step:
            log.warning("worker %d: step %d, which it had completed, is taken back: a member "
                        "that had not completed it lost the only other copy of its ZeRO shard "
                        "with the worker that died; training again from step %d",
                        self.coordinator.id, self.step - 1, membership.step)
        if self.step != membership.step:  # brought level, or a step taken back: no work
            self._units = 0                # after the step it is at yet
        self.step = membership.step
        self._shards_at = None
        self.reached = max(self.reached, self.step)
        if behind:
            self._phase, self._sync_retry = 0, False
        self.coordinator.heartbeat.follow(membership, int(getattr(self.model, "every", 1)))
        self.regroups.append(report(membership, previous, time.monotonic() - started))
        source = "rank 0" if pooled is None else "rank 0, ZeRO shards from every member"
        if membership.rank == 0:
            log.warning(describe(membership, previous, time.monotonic() - started, source))
        elif self.coordinator.id in membership.joined:  # the newcomer's own launcher says so
            log.warning("worker %d joined the job at step %d as rank %d of %d (state received "
                        "from %s; %.1fs after it asked)", self.coordinator.id,
                        membership.step, membership.rank, membership.world_size, source,
                        time.monotonic() - started)

    def _rewrap(self) -> None:
        if self.model is not None:
            close = getattr(self.model, "close", None)
            if close is not None:
                close()
        # Past step 0 every member is level or receives rank 0's state (hand_over), and a
        # joiner's model was vetted (terms.py): the wrapper need not check and broadcast.
        # (ZeRO's shards come from the pool, not from rank 0: its own sync stays.)
        levelled = self._current().step > 0 and not isinstance(self.optimizer, ZeroOptimizer)
        with fault_tolerant(), levelled_elsewhere() if levelled else contextlib.nullcontext():
            self.model = self.wrap(self.module)
        self._in_rounds = rounds.trains_in_rounds(self.model)
        self._listen_for_notices()
        self.drift = None
        if isinstance(self.model, ShardedDataParallel):
            self.optimizer = recovery.over_shards(self.optimizer, self.model)
            if self.model.stage == 3:  # nothing is held alike by two ranks: nothing to check
                return
        if self.config.check_every:
            # The wrapper says what its replicas share, and when (local rounds: at ends)
            self.drift = DriftCheck(self.model, self.config.check_every)

    def _listen_for_notices(self) -> None:
        """Where every step exchanges non-finite flags over the whole group (a DataParallel
        with the check on, training step by step: ZeRO too), rank 0's notice to stop for
        joiners rides in them (nonfinite.py): no member asks the store at each boundary.
        (A reducer the wrapper builds anew -- a comm hook, requires_grad changed -- takes
        the notice over.)"""
        finite = getattr(getattr(self.model, "reducer", None), "finite", None)
        self._listens = finite is not None and finite.mode != "off" and not self._in_rounds
        if finite is not None and self._listens:
            finite.notice = self._announce

    def _announce(self) -> bool:
        m = self._current()
        return m.me == m.ids[0] and self.coordinator.announce_stop(m, self.step)

    def _objects(self) -> dict[str, Any]:
        return {"step": self.step, "lineage": self.lineage,
                "state": {k: v.state_dict() for k, v in self.state.items()}}

    def _load_objects(self, objects: dict[str, Any]) -> None:
        self.lineage = [list(run) for run in objects["lineage"]]
        for key, value in objects["state"].items():
            self.state[key].load_state_dict(value)

    def _current(self) -> Membership:
        assert self.membership is not None, "Elastic has not joined a membership"
        return self.membership
