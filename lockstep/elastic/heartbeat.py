"""Who is alive, and who waits to join: heartbeats through the job's store.

Each worker's heartbeat thread bumps its counter (`hb/<id>`); `Liveness` judges workers by
whether their counters move. The heartbeat of the membership's rank 0 also vets joiners
against the job's terms (terms.py) and sets the step at which the members stop to let the
admissible ones in.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lockstep.comm.diagnostics import connection_lost
from lockstep.elastic.etcd import EtcdUnavailable
from lockstep.elastic.membership import Membership
from lockstep.elastic.store import PREFIX, connect, store_gone
from lockstep.elastic.terms import differences
from lockstep.logs import get_logger

if TYPE_CHECKING:
    from lockstep.elastic.config import ElasticConfig

log = get_logger(__name__)


class Liveness:
    """Judges workers by their heartbeat counters: alive once a counter moves, dead once it
    stands still for `dead_after_s` (or the worker left). Only moves count, so hosts'
    clocks never need to agree."""

    def __init__(self, store: dist.Store, dead_after_s: float) -> None:
        self.store, self.dead_after_s = store, dead_after_s
        self._seen: dict[int, tuple[int, float, bool]] = {}  # id -> beats, since, moved

    def observe(self, worker: int) -> str:
        """"alive", "dead", or "unknown" (not watched long enough to say)."""
        if self.store.check([f"left/{worker}"]):
            return "dead"
        beats, now = int(self.store.add(f"hb/{worker}", 0)), time.monotonic()
        seen = self._seen.get(worker)
        if seen is None or beats != seen[0]:
            self._seen[worker] = (beats, now, seen is not None)
            return "alive" if seen is not None else "unknown"
        if now - seen[1] >= self.dead_after_s:
            return "dead"
        return "alive" if seen[2] else "unknown"

    def silent_for(self, worker: int) -> float:
        seen = self._seen.get(worker)
        return 0.0 if seen is None else time.monotonic() - seen[1]


def pending_joiners(store: dist.Store) -> list[int]:
    """Workers waiting to join, in arrival order (not yet admitted, not gone)."""
    count = int(store.add("joiners", 0))
    keys = [f"joiner/{k}" for k in range(count)]
    ids = [int(store.get(key)) for key in keys if store.check([key])]
    # (once each: a worker left out and let in again queues again, in a slot of its own)
    return [i for i in dict.fromkeys(ids) if not store.check([f"admitted/{i}"])
            and not store.check([f"left/{i}"])]


def admissible_joiners(store: dist.Store, terms: dict[str, Any]) -> list[int]:
    """Pending joiners whose terms match the job's (`terms`, the asking member's own).
    Any other is refused here, once: told why (refused/<id>), and no longer pending --
    the members never stop for it."""
    admissible = []
    for joiner in pending_joiners(store):
        theirs = json.loads(store.get(f"terms/{joiner}")) \
            if store.check([f"terms/{joiner}"]) else {}
        differ = differences(terms, theirs)
        if not differ:
            admissible.append(joiner)
            continue
        host, pid = json.loads(store.get(f"host/{joiner}"))
        reason = "; ".join(differ)
        log.warning("refused worker %d (pid %d on host %s): it differs from the job in "
                    "what is trained: %s", joiner, pid, host, reason)
        store.set(f"refused/{joiner}", reason)
        store.set(f"left/{joiner}", "1")
    return admissible


JOINER_POLL_S = 0.01  # how often the epoch's rank 0 looks for a new joiner (one store call)


class Heartbeat:
    """A daemon thread with its own store connection: bumps this worker's counter, learns
    when its epoch will stop to admit joiners, and -- on the epoch's rank 0 -- vets the
    joiners as soon as their count moves (read every JOINER_POLL_S, not at the next beat)
    and says when admissible ones wait (`joiners_for`, and `on_joiners`). Rank 0 then sets
    the stopping step from inside its step (autograd's thread on a GPU): as the step's
    non-finite flags leave, with a notice in them (Coordinator.announce_stop); where steps
    exchange none, before it next issues a collective over the group that its step waits
    for, or at its next step boundary, one step ahead (Coordinator.grow_due) -- safe, since
    no member can finish a step without rank 0. (Set from this thread, it had to be a
    fifth of a second of steps ahead: a starved thread reads a step that training has left
    behind. That and a beat's quarter second were most of a joiner's wait.)"""

    def __init__(self, address: str, worker: int, config: ElasticConfig,
                 terms: dict[str, Any]) -> None:
        self._store_timeout_s = config.collective_timeout_s
        self.terms, self.address = terms, address
        self.store = dist.PrefixStore(PREFIX, connect(address, timedelta(
            seconds=self._store_timeout_s)))
        self.worker, self.interval = worker, config.heartbeat_s
        self.membership: Membership | None = None
        self.align = 1
        self._grow: tuple[int, int] | None = None  # (epoch, step)
        self._joiners = -1  # the joiners' count rank 0 last vetted
        self.joiners_for: int | None = None  # the epoch for which admissible joiners wait
        self.on_joiners: Callable[[], None] | None = None  # called when joiners_for is set
        self._stop = threading.Event()
        self._wake = threading.Event()  # a new membership (or stop): look again at once
        self._complained = False
        self.lost = False  # the store's server is gone
        self._thread = threading.Thread(target=self._run, name="lockstep-heartbeat",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # a job that ends without finish() or leave() too

    def follow(self, membership: Membership, align: int) -> None:
        self.membership, self.align = membership, max(1, align)
        self._wake.set()

    def grow_at(self, epoch: int) -> int | None:
        grow = self._grow
        return grow[1] if grow is not None and grow[0] == epoch else None

    def stop(self) -> None:
        """Stop beating, and wait for the thread until it has stopped: one still inside a
        store call while the interpreter exits aborts the process ("terminate called without
        an active exception"). Its store calls end within the store's timeout."""
        atexit.unregister(self.stop)
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._store_timeout_s)

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            pause = JOINER_POLL_S if self._leading() else self.interval
            try:
                now = time.monotonic()
                beat = now >= next_beat
                if beat:
                    self.store.add(f"hb/{self.worker}", 1)
                    next_beat = now + self.interval
                self._watch_growth(vet=beat or self._joiner_arrived())
            except EtcdUnavailable as error:  # replicated: reachable again later, maybe
                log.warning("worker %d: %s; asking again", self.worker,
                            store_gone(self.address, error))
                pause = self.interval  # not every JOINER_POLL_S while it is away
            except Exception as error:  # the store's host is gone: quorums will say so
                if not self._complained:
                    self._complained = True
                    log.warning("worker %d: %s; training goes on, but a worker's failure "
                                "can no longer be survived", self.worker,
                                store_gone(self.address, error))
                if connection_lost(error):  # for good: no more calls (each logs a C++
                    self.lost = True        # stack trace)
                    return
            self._wake.wait(pause)
            self._wake.clear()

    def _leading(self) -> bool:
        m = self.membership
        return m is not None and m.me == m.ids[0] and self.grow_at(m.epoch) is None

    def _joiner_arrived(self) -> bool:
        """Rank 0: whether the joiners' count moved since it last looked. A joiner takes
        its slot, then names itself in it: a count whose last slot is still unnamed is
        looked at again next time, not taken as seen."""
        if not self._leading():
            return False
        count = int(self.store.add("joiners", 0))
        if count == self._joiners or (count and not self.store.check([f"joiner/{count - 1}"])):
            return False
        self._joiners = count
        return True

    def _watch_growth(self, vet: bool) -> None:
        m = self.membership
        if m is None or self.grow_at(m.epoch) is not None or (self._leading() and not vet):
            return
        key = f"grow/{m.epoch}"
        if self.store.check([key]):
            self._grow = (m.epoch, int(self.store.get(key)))
        elif m.me == m.ids[0] and admissible_joiners(self.store, self.terms):
            self.joiners_for = m.epoch
            if self.on_joiners is not None:
                self.on_joiners()
