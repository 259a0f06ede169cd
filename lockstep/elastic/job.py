"""Per-step fault tolerance: training that goes on when workers die, and grows back when
they return -- without restarting anyone.

    job = lockstep.Elastic(net, optimizer, wrap=lambda m: lockstep.DataParallel(m))
    while job.step < total_steps:
        job.run_step(train_step)    # train_step(model, step): forward and backward only
    job.finish()

What one step does (`run_step`):
  1. at the step boundary, if joiners wait and this is the step the members agreed to stop
     at (rank 0's notice came with the step before's non-finite flags, or the store says
     so), regroup: the new membership's group, a fresh wrapper, state to the newcomers;
  2. `train_step(model, step)` computes gradients (the caller slices global batch `step`
     by `job.world.rank` / `world_size`: see `batch_slice`);
  3. the optimizer steps (and a local-SGD / DiLoCo wrapper synchronises at round ends);
  4. the step is committed: `job.step` advances; every `check_every` steps the replicas
     are compared (drift.py).
When a collective fails (a peer died: its sockets closed; or a timeout: a host vanished),
the survivors discard the step's partial gradients, agree on the new membership through
the store (quorum.py), form a new group (membership.py), bring any rank that missed the
last step level from a peer (handover.py) -- regroup.py -- and redo the step at the
smaller world size.
At most the interrupted step is lost; a global batch is the same samples at any size.

Under ZeRO (`wrap=lambda m: lockstep.shard(m, stage)`) each rank also keeps the next rank's
shard, so one death loses nothing; at a regroup the new membership takes its shards from
what the survivors held (sharding/recovery.py). The optimizer is a ZeroOptimizer.unbound,
rebound to each membership's shards.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lockstep.comm import timeline, waits
from lockstep.comm.stophook import before_next_world_collective
from lockstep.comm.topology import this_host
from lockstep.comm.world import World, current
from lockstep.elastic import rounds
from lockstep.elastic.config import ENV_INITIAL, ElasticConfig
from lockstep.elastic.failures import first_line, forget_frames, membership_failure
from lockstep.elastic.membership import Membership
from lockstep.elastic.quorum import Coordinator
from lockstep.elastic.regroup import Regrouping
from lockstep.elastic.store import job_address
from lockstep.elastic.terms import terms_of
from lockstep.logs import get_logger
from lockstep.replication.drift import DriftCheck
from lockstep.sharding import recovery

log = get_logger(__name__)

T = TypeVar("T")

def batch_slice(step: int, global_batch: int, rank: int, world_size: int) -> range:
    """Positions of global batch `step` that `rank` of `world_size` trains on: its share of
    [step*G, (step+1)*G), contiguous, sizes differing by at most one. Weight each rank's
    summed loss by world_size / global_batch so the average over ranks is the batch mean
    whatever the split."""
    start = step * global_batch
    lo = start + rank * global_batch // world_size
    hi = start + (rank + 1) * global_batch // world_size
    return range(lo, hi)


class Elastic(Regrouping):
    """Drives a training loop through failures and joins (see the module docstring).

    Args:
        module: the model, built the same way on every worker.
        optimizer: over `module`'s parameters; stepped by `run_step`.
        wrap: makes the data-parallel wrapper for a membership (DataParallel by default;
            also a lockstep.lowcomm LocalSGD or DiLoCo, or a ZeRO lockstep.shard, whose
            shards are then mirrored: give it a ZeroOptimizer.unbound as `optimizer`).
            Called again whenever the world changes (a new group).
        state: objects with state_dict()/load_state_dict() that a joining worker must
            receive (an LR scheduler, a loss scaler); the step and RNG go anyway.
        update: how a step's gradients are applied, once every rank has them (default:
            `optimizer.step()` and `zero_grad`); a loss scaler's step, an LR scheduler's
            step belong here, so they count exactly once per committed step.
        config: timing and the drift check (ElasticConfig).
        address: the job's store, HOST:PORT (default: the LOCKSTEP_ELASTIC variable).
        agree: what else decides the training besides the model and optimizer (the
            global batch, the data's size and seed: JSON values). A worker that asks to
            join a running job with other terms is refused with the reason (terms.py).

    Attributes: `model` (the current wrapper: use it, not a variable kept from before),
    `world` (rank and size now), `step` (steps committed by the job), `completed_here`
    (False when the last step was completed by peers and this rank brought level from
    them), `lineage` (which membership epoch committed which steps: [first step, epoch]),
    `membership` (the current members: its `epoch`, `ids`, `hosts`, `rank`),
    `coordinator.id` (this worker's id in the job, which its records and the logs use),
    `joined_running` (this worker joined a job already training: it received its state).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 wrap: Callable[[nn.Module], nn.Module] | None = None, *,
                 state: Mapping[str, Any] | None = None, config: ElasticConfig | None = None,
                 update: Callable[[], None] | None = None, address: str | None = None,
                 agree: Mapping[str, Any] | None = None) -> None:
        from lockstep.replication.replica import DataParallel

        self.module = module
        self.optimizer: Any = optimizer  # (under ZeRO, a ZeroOptimizer over the shards)
        self.wrap = wrap or DataParallel
        self.state = dict(state or {})
        self.update = update or self._step_optimizer
        self.config = config or ElasticConfig()
        self.backend = current().backend if dist.is_initialized() else "gloo"
        self.step = 0
        self.reached = 0  # the most steps this worker has committed (see `collective`)
        self.lineage: list[list[int]] = []
        self.model: Any = None  # DataParallel, or a lowcomm LocalSGD / DiLoCo
        self.membership: Membership | None = None
        self.regroups: list[dict[str, Any]] = []  # what happened, for reports and tests
        self._phase, self._sync_retry, self._failures = 0, False, 0
        self.completed_here = False  # see the class docstring
        self._in_rounds = False  # local SGD / DiLoCo: its wrapper outlives a failure
        self.coordinator = Coordinator(job_address(address), this_host(), self.config,
                                       int(os.environ.get(ENV_INITIAL, "1")),
                                       terms_of(module, optimizer, agree))
        self.drift: DriftCheck | None = None
        self._target = 0  # the step the current run_step commits
        self._units = 0  # pieces of `collective` work completed since the last commit
        self._rejoined_at = -1  # left out, it was let in again at this step, not yet trained
        self._received = False  # this worker was brought level from a peer
        self._held: recovery.Held | None = None  # ZeRO: shards kept through a regroup
        self._shards_at: int | None = None  # ZeRO: pooled, not yet handed over (regroup.py)
        self._training_thread = threading.get_ident()  # the one that calls run_step
        self._listens = False  # rank 0's notice to stop rides in each step's flags
        self._heard: tuple[int, bool | None] | None = None  # (epoch, in the last step)
        self.coordinator.heartbeat.on_joiners = self._stop_for_joiners_soon
        started = time.monotonic()
        first = self.coordinator.enter()
        self._entering = True  # (a failure now interrupts this worker's entry, not a step)
        try:
            self._admit(first, rewrap=True, started=started)
        except Exception as error:  # a member died while this worker was let in (or sent
            self._handle(error)     # its state): agree again, as any member would
        self._entering = False
        self.joined_running = self._received

    @property
    def world(self) -> World:
        return current()

    # ---- the step ------------------------------------------------------------------------

    def run_step(self, train_step: Callable[[Any, int], T]) -> T | None:
        """Run global step `self.step` to its commit: `train_step(model, step)` computes
        gradients, the optimizer steps. Returns what `train_step` returned in the attempt
        that counted -- None if the step was completed by peers while this rank's attempt
        failed (it was then brought level from them). A worker the others went on without
        (it stalled) joins again and trains the step they are at: `step` then advances by
        more than one. Under ZeRO it may go back by one instead (None is returned): a step
        this worker had completed is taken back (membership.decide), to be trained again."""
        self._target, value = self.step, None
        self._training_thread = threading.get_ident()
        while self.step == self._target:
            failure: Exception | None = None
            try:
                value = self._advance(train_step, value)
            except Exception as error:
                failure = error
            if failure is not None:  # handled outside `except`, which would pin its frames
                self._handle(failure)
        self._failures = 0
        if not self.completed_here:  # brought level from a peer: the peers that completed
            return None               # the step already tried the check, in the old group
        self._check_drift()
        return value

    def _advance(self, train_step: Callable[[Any, int], T], value: T | None) -> T | None:
        self.completed_here = False
        if self._phase == 0:
            self._begin_attempt()
            if self.coordinator.grow_due(self._current(), self.step, self._heard_here()):
                with timeline.span("regroup (admitting joiners)"):
                    self._regroup(planned=True)
            self._heard = None
            self._take_notices()  # (any from exchanges between steps)
            value = train_step(self.model, self.step)
            self.update()
            heard = self._take_notices()
            self._heard = None if heard is None else (self._current().epoch, heard)
            self._phase = 1
        self._sync_round()
        self._commit()
        self.completed_here = True
        return value

    def _take_notices(self) -> bool | None:
        """Whether rank 0 gave notice in the exchanges of flags since the last call (None:
        there were none, or the wrapper makes none)."""
        return self.model.reducer.finite.take_notices() if self._listens else None

    def _heard_here(self) -> bool | None:
        """Whether rank 0 gave notice to stop here in the last step's exchange of flags
        (None: that step exchanged none, or it was another membership's)."""
        heard = self._heard
        return heard[1] if heard is not None and heard[0] == self._current().epoch else None

    def _stop_for_joiners_soon(self) -> None:
        """(Rank 0's heartbeat thread: admissible joiners wait.) The stopping step is set
        by the training thread -- at its next step boundary (Coordinator.grow_due), or
        sooner: just before it next issues a collective over the whole group that the step
        waits for, as no member can finish the step under way without it. Set there, the
        members stop at the end of that step (under local SGD / DiLoCo, of its round), not a
        step later (most of what a joiner waited). Where the notice rides in the flags,
        rank 0 sets the step as they leave instead (Coordinator.announce_stop): a stop
        set before a later collective of the step would reach no member."""
        if not self._listens:
            before_next_world_collective(self._training_thread, self._set_stopping_step)

    def _set_stopping_step(self) -> None:
        try:
            self.coordinator.grow_due(self._current(), self.step)
        except (RuntimeError, OSError) as error:  # the boundary asks again, and says why
            log.debug("worker %d: setting the step to stop for joiners failed: %s",
                      self.coordinator.id, first_line(error))

    def _step_optimizer(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def collective(self, fn: Callable[[], T], skipped: T | None = None) -> T | None:
        """Run `fn` -- collective work outside a training step that changes no training
        state (an evaluation's all-reduce, a checkpoint) -- again on the new membership
        if a peer fails during it. Returns `skipped` without running it when this worker
        was left out meanwhile and joined again at a later step: the others did this work
        without it, and are training the step it is now at -- or when ZeRO took back a
        step this worker had completed (membership.decide): the work after that step waits
        until it is trained again. A worker let in again skips every such piece of work
        until it has trained the step it was let in at: the others, admitting it at their
        next step's start, had done the work of the steps before it (the rest of the
        step it was left out in: its checkpoint, the epoch's evaluation). And it returns
        `skipped` when a peer that died during it had completed it with some members: those
        went on to the next piece, and the members agree (Membership.units) that it is done
        rather than have some do it again while the others do the next -- two different
        collectives, which Gloo aborts the process for."""
        at = self.step
        if at == self._rejoined_at:  # let in again at this step after the others had done
            return skipped           # all the work before it -- an epoch's end too
        while self.step >= self.reached:
            failure: Exception | None = None
            try:
                value = fn()
                self._units += 1
                return value
            except Exception as error:
                failure = error
            self._handle(failure)
            if self.step == self._rejoined_at:  # left out during it, and let in again
                return skipped
            if self.step == self._current().step and self._units < self._current().units:
                self._units += 1  # completed by the members that went past it
                log.warning("rank %d: collective work after step %d was completed by "
                            "members that went on to the next; not done again here",
                            self.world.rank, self.step)
                return skipped
        return skipped

    def _sync_round(self) -> None:
        """Local SGD / DiLoCo: count the inner step, and synchronise at the round's end. A
        failed synchronisation is retried among the survivors, not the step."""
        if not self._in_rounds:  # (known since the wrapper was made: a step asks it)
            return
        retry, self._sync_retry = self._sync_retry, True
        rounds.sync_round(self.model, retry)
        self._sync_retry = False

    def _commit(self) -> None:
        epoch = self._current().epoch
        if not self.lineage or self.lineage[-1][1] != epoch:
            self.lineage.append([self.step, epoch])
        self.step += 1
        self.reached = max(self.reached, self.step)
        self._rejoined_at = -1
        self._units = 0
        self._phase = 0
        # Between steps (an evaluation, a checkpoint) nothing is stepped yet either: a
        # regroup there must not read the step just committed as one in progress
        self._begin_attempt()

    def _begin_attempt(self) -> None:
        begin = getattr(self.optimizer, "begin_step", None)
        if begin is not None:  # ZeRO: whether this attempt stepped the shards
            begin()

    def _check_drift(self) -> None:
        if self.drift is None or not self.drift.due(self.step):
            return
        try:
            self.drift.check_and_repair(self.step, [self.optimizer], self.config.repair)
        except Exception as error:  # a peer died during the check: the next step regroups
            if not membership_failure(error):
                raise
            log.warning("rank %d: the drift check at step %d was interrupted: %s",
                        self.world.rank, self.step, first_line(error))

    # ---- failures ------------------------------------------------------------------------

    def _handle(self, error: Exception) -> None:
        """Regroup after a membership failure -- again if a peer fails during the regroup
        itself -- or raise: any other error, or too many failures in a row."""
        while True:
            if not membership_failure(error):
                waits.watch(None)  # (no membership to watch past this error)
                raise error
            self._failures += 1
            if self._failures > self.config.max_retries:
                log.error("rank %d: step %d failed %d times in a row; giving up",
                          self.world.rank, self.step, self._failures)
                waits.watch(None)
                raise error
            what = "entering the job" if self._entering else f"step {self.step}"
            log.warning("rank %d: %s was interrupted (%s); regrouping", self.world.rank, what,
                        first_line(error))
            forget_frames(error)
            if self._phase == 0:  # the step's partial gradients are not to be used
                self.optimizer.zero_grad(set_to_none=True)
            try:
                with timeline.span("regroup (a peer was lost)"):
                    self._regroup(planned=False)
                return
            except Exception as again:
                error = again

    def finish(self) -> None:
        """Training is over on this worker: tell the job (waiting joiners exit) and leave."""
        waits.watch(None)
        self.coordinator.finish()
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
