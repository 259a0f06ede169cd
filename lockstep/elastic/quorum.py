"""Agreeing on membership through the job's store: heartbeats, quorums, joiners.

Every worker of a fault-tolerant job talks to one TCPStore (hosted by the launcher that
started the job; `LOCKSTEP_ELASTIC=HOST:PORT` says where). Keys, under `lockstep/elastic/`:

    next_id, host/<id>       each worker's id, handed out in arrival order, and its host
    terms/<id>               what it trains (terms.py): a joiner must match the job's
    refused/<id>             why a joiner was turned away (it differs from the job)
    hb/<id>                  a counter its heartbeat thread bumps every `heartbeat_s`
    left/<id>                set when it leaves cleanly, by its launcher when its process
                             exits, or once it is judged dead
    q/<e>/in/<id>            a member's registration for epoch e: its committed step
    q/<e>/n, q/<e>/leader    arrivals; the first to arrive decides the epoch
    members/<e>              the decision (membership.Membership as JSON), or "abandoned"
    epoch                    the latest decided epoch
    joiners, joiner/<k>      workers waiting to join, in arrival order; admitted/<id>
    grow/<e>                 the step at which epoch e's members stop to let joiners in
    q/<e>/ready/<id>         a joiner saw quorum e begin: alive, as its leader asks
    done                     the job has finished

A quorum for epoch e is led by its first arrival: it waits until every member of the
previous epoch has registered or is dead -- it left, or its heartbeat stood still for
`dead_after_s` -- and writes the decision once (compare-and-set, so a leader that died
mid-way is replaced by "abandoned", and everyone moves on to e+1).
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lockstep.comm.stall_report import STACK_WAIT_S
from lockstep.elastic.heartbeat import Heartbeat, Liveness, admissible_joiners
from lockstep.elastic.membership import Candidate, Membership, decide
from lockstep.elastic.stops import JoinerStops
from lockstep.elastic.store import PREFIX, connect, store_gone
from lockstep.logs import get_logger

if TYPE_CHECKING:
    from lockstep.elastic.config import ElasticConfig

log = get_logger(__name__)

ABANDONED = "abandoned"
_POLL_S = 0.005
_QUORUM_POLL_S, _QUORUM_FAST_S = 0.001, 0.05  # see _pause
_JOINER_BUMP_S = 0.02  # a waiting joiner's counter: a write (on etcd, a Raft entry) each


def _pause(since: float) -> None:
    """One poll's sleep in a quorum's waits: 1 ms for its first 50 ms -- a quorum of live
    members is decided in a few, and every member and joiner waits on it -- then 5 ms (a
    dead member takes seconds to judge; on etcd each poll is a request). (A timed
    store.wait would wake at once, but a TCPStore logs each one that times out, and its
    connection is not to be trusted after one.)"""
    fast = time.monotonic() - since < _QUORUM_FAST_S
    time.sleep(_QUORUM_POLL_S if fast else _POLL_S)


class QuorumError(RuntimeError):
    """The workers could not agree on a membership in time."""


class Excluded(RuntimeError):
    """This worker was judged dead by the others (it stalled too long): it must join again."""


class JoinRefused(RuntimeError):
    """The job turned this worker away: it differs in what decides the training."""


class JobFinished(SystemExit):
    """The job finished before this worker was admitted: nothing is left to do (exit 0)."""

    def __init__(self) -> None:
        super().__init__(0)


class Coordinator(JoinerStops):
    """This worker's side of the membership protocol (see the module docstring); when
    the members stop to let joiners in is stops.py's."""

    def __init__(self, address: str, host: str, config: ElasticConfig,
                 initial: int, terms: dict[str, Any] | None = None) -> None:
        self.config, self.host, self.initial = config, host, initial
        self.terms, self.address = terms or {}, address
        self.latest = -1  # the newest epoch this worker has seen decided
        # (an etcd store is asked again while its members cannot be reached, for as long
        # as a worker left out may take to join again)
        self.base = connect(address, timedelta(seconds=config.collective_timeout_s),
                            timedelta(seconds=config.join_timeout_s))
        self.store = dist.PrefixStore(PREFIX, self.base)
        self.id = int(self.store.add("next_id", 1)) - 1
        self.store.set(f"host/{self.id}", json.dumps([host, os.getpid()]))
        self.store.set(f"terms/{self.id}", json.dumps(self.terms))
        self.heartbeat = Heartbeat(address, self.id, config, self.terms)
        self._asking = threading.Lock()  # left_behind is asked from any thread that waits
        self._asked: threading.Thread | None = None
        self._left = -1  # the newest epoch some member is known to have left
        self._stop_set: tuple[int, int] | None = None  # rank 0: (epoch, step) it set

    def left_behind(self, epoch: int) -> str | None:
        """Why a collective of `epoch`'s group can no longer complete -- a member left it
        for the next membership's quorum, and will not take part -- or None. Asked by a
        collective's wait each second it waits (comm/waits.py). It never blocks that wait
        (a store that does not answer would hold it past the collective's timeout): the
        store is asked on a thread of its own, and its answer read the next time."""
        with self._asking:
            if self._left >= epoch:
                return f"a member left epoch {epoch}'s group to agree on the next one"
            if self._asked is None or not self._asked.is_alive():
                self._asked = threading.Thread(target=self._ask_left, args=(epoch,),
                                               name="lockstep-left-behind", daemon=True)
                self._asked.start()
        return None

    def _ask_left(self, epoch: int) -> None:
        try:
            if self.store.check([f"q/{epoch + 1}/n"]):
                self._left = max(self._left, epoch)
        except Exception as error:  # (the store's trouble: the collective's timeout applies)
            log.debug("worker %d: asking whether epoch %d was left failed: %s", self.id,
                      epoch, error)

    # ---- entering, leaving --------------------------------------------------------------

    def enter(self) -> Membership:
        """The first membership this worker belongs to: the job's first epoch if it is
        still forming, else the next one that admits it as a joiner."""
        if not self.store.check(["epoch"]):
            first = self._quorum(0, None, 0, planned=False)
            if first is not None and self.id in first.ids:
                return first
        return self.wait_admitted()

    def wait_admitted(self) -> Membership:
        """Queue as a joiner and wait for an epoch that includes this worker (the members
        stop for it at their next agreed step boundary). A worker left out that joins again
        was admitted once before: that mark goes first, or it never counts as waiting."""
        for mark in (f"admitted/{self.id}", f"left/{self.id}"):
            if self.store.check([mark]):
                self.store.delete_key(mark)
        slot = int(self.store.add("joiners", 1)) - 1
        self.store.set(f"joiner/{slot}", str(self.id))
        epoch = int(self.store.get("epoch")) + 1 if self.store.check(["epoch"]) else 0
        deadline, next_bump = time.monotonic() + self.config.join_timeout_s, 0.0
        asked, asked_at = False, 0.0  # the quorum that may admit it has begun, and when
        while time.monotonic() < deadline:
            key = f"members/{epoch}"
            if self.store.check([key]):
                text = self.store.get(key).decode()
                self.latest = max(self.latest, epoch)
                if text != ABANDONED and self.id in json.loads(text)["ids"]:
                    return Membership.from_json(text, self.id)
                epoch, asked = epoch + 1, False
                continue
            if self.store.check([f"refused/{self.id}"]):
                reason = self.store.get(f"refused/{self.id}").decode(errors="replace")
                self.heartbeat.stop()
                raise JoinRefused(
                    f"worker {self.id} (host {self.host}): the job refused it: it differs "
                    f"from the job in what is trained ({reason}); start it with the job's "
                    "model, optimizer and settings")
            if self.store.check(["done"]):
                log.warning("worker %d: the job finished before this worker was admitted",
                            self.id)
                self.leave()
                raise JobFinished()
            if not asked and self.store.check([f"q/{epoch}/n"]):
                asked = True  # its leader asks whether this worker is alive: say so now
                asked_at = next_bump = time.monotonic()
                self.store.set(f"q/{epoch}/ready/{self.id}", "")  # (not earlier: fresh)
            # Alive as a leader judges it otherwise: a counter that moves, sooner than a
            # beat (and every 5 ms while a quorum is under way)
            if time.monotonic() >= next_bump:  # (on etcd each bump is a Raft write)
                self.store.add(f"hb/{self.id}", 1)
                next_bump = time.monotonic() + (_POLL_S if asked else _JOINER_BUMP_S)
            if asked:
                _pause(asked_at)
            else:
                time.sleep(_POLL_S)
        raise QuorumError(f"worker {self.id} (host {self.host}): not admitted to the job "
                          f"within {self.config.join_timeout_s:.0f}s; is it still training?")

    def finish(self) -> None:
        """The job is done: say so (waiting joiners exit) and leave. Training is over
        whether or not the store still answers: a store gone is only reported."""
        self.heartbeat.stop()
        if self._asked is not None:  # (a thread inside a store call at exit aborts)
            self._asked.join(timeout=self.config.collective_timeout_s)
        try:
            self.store.set("done", "1")
            self.store.set(f"left/{self.id}", "1")
        except (RuntimeError, OSError) as error:
            log.warning("worker %d finished; it could not tell the job's store: %s",
                        self.id, store_gone(self.address, error))

    def leave(self) -> None:
        self.heartbeat.stop()
        self.store.set(f"left/{self.id}", "1")

    # ---- regrouping ---------------------------------------------------------------------

    def regroup(self, current: Membership, step: int, planned: bool,
                shards: dict[str, Any] | None = None, units: int = 0) -> Membership:
        """The next membership, agreed with every live member of `current`: after a
        failure (`planned=False`), or at the step boundary set for joiners (`planned`,
        which admits them). `shards`: under ZeRO, which shards this worker holds at which
        steps; `units`: the pieces of collective work it completed after `step`. Raises
        Excluded if the others went on without this worker."""
        epoch = max(current.epoch, self.latest) + 1  # past any epoch decided since
        while True:
            decided = self._quorum(epoch, current, step, planned, shards, units)
            if decided is None:  # its leader died before deciding
                epoch += 1
                continue
            if self.id not in decided.ids:
                raise Excluded(f"worker {self.id}: epoch {epoch} was formed without it "
                               "(it was silent too long)")
            return decided

    def _quorum(self, epoch: int, current: Membership | None, step: int, planned: bool,
                shards: dict[str, Any] | None = None, units: int = 0) -> Membership | None:
        key = f"members/{epoch}"
        if not self.store.check([key]):
            rank = current.rank if current is not None else None
            self.store.set(f"q/{epoch}/in/{self.id}", json.dumps(
                {"step": step, "host": self.host, "rank": rank, "pid": os.getpid(),
                 "shards": shards, "units": units}))
            if int(self.store.add(f"q/{epoch}/n", 1)) == 1:
                self.store.set(f"q/{epoch}/leader", str(self.id))
                decision = self._lead(epoch, current, planned)
                won = self.store.compare_set(key, "", decision.to_json())
                if won.decode() != ABANDONED:
                    self.store.set("epoch", str(epoch))
                    for joiner in decision.joined:
                        self.store.set(f"admitted/{joiner}", "1")
        text = self._await(key, epoch)
        self.latest = max(self.latest, epoch)
        return None if text == ABANDONED else Membership.from_json(text, self.id)

    def _lead(self, epoch: int, current: Membership | None, planned: bool) -> Membership:
        if current is None:
            return self._lead_first(epoch)
        olds = list(current.ids)
        joiners = admissible_joiners(self.store, self.terms) if planned else []
        registered, lost = self._gather(epoch, olds, joiners, current)
        present = [registered[i] for i in olds if i in registered]
        present += [registered[j] for j in joiners if j in registered]
        return decide(epoch, present, lost)

    def _lead_first(self, epoch: int) -> Membership:
        """Epoch 0: wait for the number of workers the job was started with."""
        deadline = time.monotonic() + self.config.join_timeout_s
        while int(self.store.add(f"q/{epoch}/n", 0)) < self.initial:
            if time.monotonic() > deadline:
                raise QuorumError(f"worker {self.id}: only {self.store.add(f'q/{epoch}/n', 0)}"
                                  f" of {self.initial} workers arrived within "
                                  f"{self.config.join_timeout_s:.0f}s")
            time.sleep(_POLL_S)
        present = []
        for worker in range(int(self.store.add("next_id", 0))):
            info = self._registration(epoch, worker)
            if info is not None:
                present.append(Candidate(worker, info["host"], info["pid"], 0, worker))
        return decide(epoch, present, [])

    def _gather(self, epoch: int, olds: list[int], joiners: list[int], current: Membership
                ) -> tuple[dict[int, Candidate], list[Candidate]]:
        """Wait until each old member registered or is dead, and each joiner is seen alive
        or dead. A member alive but silent past the collective timeout is left out (it
        will find itself excluded and join again). Silent means longer than a member
        blocked in a collective with a peer that left can take to get here: its collective
        fails at its timeout (a peer that departed alive keeps its sockets open), then its
        report asks the ranks it waited for for their stacks (up to STACK_WAIT_S)."""
        liveness, started = Liveness(self.store, self.config.dead_after_s), time.monotonic()
        give_up = started + self.config.collective_timeout_s + STACK_WAIT_S + \
            self.config.dead_after_s
        registered: dict[int, Candidate] = {}
        gone: set[int] = set()
        while True:
            for worker in olds:
                if worker in registered or worker in gone:
                    continue
                info = self._registration(epoch, worker)
                if info is not None:
                    registered[worker] = Candidate(worker, info["host"], info["pid"],
                                                   info["step"], info["rank"],
                                                   info.get("shards"),
                                                   int(info.get("units", 0)))
                elif liveness.observe(worker) == "dead" or time.monotonic() > give_up:
                    gone.add(worker)
            for worker in joiners:  # (ready: it said so since this quorum began)
                if worker not in registered and worker not in gone:
                    state = liveness.observe(worker)
                    if state == "unknown" and self.store.check([f"q/{epoch}/ready/{worker}"]):
                        state = "alive"
                    if state == "alive":
                        registered[worker] = Candidate(worker, *self._where(worker))
                    elif state == "dead":
                        gone.add(worker)
                        self.store.set(f"left/{worker}", "1")  # no longer pending
            if len(registered) + len(gone) == len(olds) + len(joiners):
                break
            _pause(started)
        lost = [Candidate(w, *self._where(w)) for w in olds if w in gone]
        return registered, lost

    def _registration(self, epoch: int, worker: int) -> dict[str, Any] | None:
        key = f"q/{epoch}/in/{worker}"
        if not self.store.check([key]):
            return None
        info: dict[str, Any] = json.loads(self.store.get(key))
        return info

    def _where(self, worker: int) -> tuple[str, int]:
        """(host, pid) of a worker, as it said when it arrived."""
        host, pid = json.loads(self.store.get(f"host/{worker}"))
        return str(host), int(pid)

    def _await(self, key: str, epoch: int) -> str:
        """The decision for `epoch`; "abandoned" if its leader died before writing it."""
        liveness, started = Liveness(self.store, self.config.dead_after_s), time.monotonic()
        deadline = started + self.config.join_timeout_s
        leader: int | None = None
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise QuorumError(f"worker {self.id}: membership epoch {epoch} was not "
                                  f"decided within {self.config.join_timeout_s:.0f}s")
            if leader is None and self.store.check([f"q/{epoch}/leader"]):
                leader = int(self.store.get(f"q/{epoch}/leader"))
            if leader is not None and leader != self.id and \
                    liveness.observe(leader) == "dead":
                self.store.compare_set(key, "", ABANDONED)
            _pause(started)
        return self.store.get(key).decode()

