"""The stall watchdog: a collective that waits longer than `stall_after` is named, with the
ranks holding it up and what they are doing, long before the timeout fires.

It runs in the progress thread each rank already has (diagnostics.py), twice a second:

1. publish this rank's last few numbered collectives per group (ledger.py) to the store,
   when they changed;
2. answer requests for this rank's Python stack (stacks.py);
3. compare its own collectives with those of the next rank (a ring: every pair is covered
   through its neighbours, at one store read per rank): ranks that issued different
   collectives at the same number are a desync, and the first rank to see it warns at once;
4. if this rank's oldest unfinished collective started more than `stall_after` ago, warn:
   the collective, the ranks that have not reached it (or issued something else), their
   last progress and, for the first rank to warn about it, their stacks. Under NCCL, where
   torch's own watchdog raises the timeout, the report is logged again when it fires; under
   Gloo the error itself carries it (comm.py asks `explain`).

Nothing here is on the training thread's path but ledger.issue (no store round-trip).
Set `stall_after` with `lockstep.init(stall_after=...)` or LOCKSTEP_STALL_AFTER (seconds;
0 turns the watchdog off). By default it is min(15 s, timeout / 2).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import torch.distributed as dist

from lockstep.comm import stacks
from lockstep.comm.diagnostics import connection_lost, reporter
from lockstep.comm.ledger import HISTORY, Record, ledger, mismatches
from lockstep.comm.stall_report import (
    LEDGER_KEY,
    Diagnosis,
    diagnose,
    judge,
    read_published,
    verdict,
)
from lockstep.logs import get_logger

log = get_logger(__name__)

DEFAULT_STALL_AFTER_S = 15.0
ENV = "LOCKSTEP_STALL_AFTER"
PUBLISHED = 8  # collectives per group each rank publishes: enough to line up a desync
_CLAIMS = "lockstep/claimed/"  # the first rank to add 1 to a claim key reports that event


def stall_after_setting(value: float | None, timeout_s: float) -> float:
    """`init`'s stall_after, else LOCKSTEP_STALL_AFTER, else min(15 s, timeout / 2)."""
    if value is None:
        text = os.environ.get(ENV)
        if text is None:
            return min(DEFAULT_STALL_AFTER_S, timeout_s / 2)
        try:
            value = float(text)
        except ValueError:
            raise RuntimeError(f"lockstep.init: {ENV}={text!r} is not a number of seconds "
                               "(0 turns the stall watchdog off)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"lockstep.init: stall_after={value} must be a number of seconds >= 0 "
                         "(0 turns the stall watchdog off)")
    return float(value)


def _store() -> dist.Store | None:
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _claim(store: dist.Store, what: str) -> bool:
    """True for the first rank to claim `what`: one full report per event, not one per rank."""
    return int(store.add(f"{_CLAIMS}{what}", 1)) == 1


class Watchdog:
    def __init__(self) -> None:
        self.stall_after = 0.0
        self.timeout_s = 0.0
        self.backend = "gloo"
        self._responder = stacks.Responder()
        self._published: object = None
        self._desynced: set[str] = set()  # groups whose desync has been reported
        self._patience = 0  # ticks waited for a desync's majority to show
        self._stalled: Record | None = None  # the collective last warned about
        self._ended: Record | None = None  # ... seen complete once (told at the next look)

    def configure(self, stall_after: float, timeout_s: float, backend: str) -> None:
        """Turn the watchdog on (stall_after > 0, more than one rank) or off, on this rank.
        Every rank must agree: a rank that is off numbers no collectives."""
        self.stall_after, self.timeout_s, self.backend = stall_after, timeout_s, backend
        on = stall_after > 0 and dist.is_initialized() and dist.get_world_size() > 1
        ledger.enabled = on
        if on and self.tick not in reporter.ticks:
            reporter.ticks.append(self.tick)
            reporter.start()
        elif not on and self.tick in reporter.ticks:
            reporter.ticks.remove(self.tick)

    def tick(self) -> None:
        store = _store()
        if store is None or not ledger.enabled:
            return
        try:
            rank = dist.get_rank()
            self.publish(store, rank)
            self._responder.answer(store, rank, ledger.thread)
            for key in self._watched():
                self._check_neighbour(store, rank, key)
            self._check_stall(store, rank)
        except Exception as error:  # advisory: a store hiccup must never stop training
            log.debug("stall watchdog: a check failed", exc_info=True)
            reporter.store_lost = reporter.store_lost or connection_lost(error)

    def publish(self, store: dist.Store, rank: int) -> None:
        groups = {key: ledger.recent(key, PUBLISHED) for key in list(ledger.history)}
        latest = sorted((key, entries[-1][0]) for key, entries in groups.items() if entries)
        if latest != self._published:
            store.set(f"{LEDGER_KEY}{rank}", json.dumps({"groups": groups, "time": time.time()}))
            self._published = latest

    @staticmethod
    def _watched() -> set[str]:
        """The groups compared for a desync: the world's, and that of the newest collective
        (shm's host barriers) -- not every group the job ever made, each a store read a tick
        (a long-lived job makes and drops groups with every wrapper)."""
        last = ledger.last
        return {key for key in (ledger.world_key, last.group if last is not None else "")
                if key}

    def _check_neighbour(self, store: dist.Store, rank: int, key: str) -> None:
        """One warning per group for the first desync this rank or another finds: after it,
        every later collective of that group is out of step too."""
        members = ledger.members[key]
        if rank not in members or key in self._desynced:
            return
        peer = members[(members.index(rank) + 1) % len(members)]
        if peer == rank:
            return
        mine = ledger.recent(key, HISTORY)
        if not mismatches(mine, read_published(store, [peer], key).get(peer, [])):
            return
        published = read_published(store, [r for r in members if r != rank], key)
        judgement = judge(mine[-1][0], None, members, rank, mine, published)
        assert judgement.desync is not None  # the neighbour's mismatch is among them
        if len(judgement.desync[1]) < len(members) and self._patience < 2:
            self._patience += 1  # a tick for every rank to publish, so a majority shows
            return
        self._desynced.add(key)
        if _claim(store, f"desync/{key}"):
            log.warning("rank %d: %s. Training goes on only while the mismatched collectives "
                        "happen to fit each other: expect a hang or wrong results.",
                        rank, verdict(judgement, [], []))

    def _check_stall(self, store: dist.Store, rank: int) -> None:
        stalled = self._stalled
        if stalled is not None and stalled.complete():
            # Told at the next look: a collective that failed completes too, and its waiter
            # says so (explain: warned = 2) only once its wait has raised.
            if self._ended is not stalled:
                self._ended = stalled
            else:
                self._stalled = self._ended = None
                if stalled.warned == 1:  # not failed: its straggler came back
                    log.warning("rank %d: %s finished after all, within %.1fs.", rank,
                                stalled.name(), time.monotonic() - stalled.issued)
        record = ledger.oldest_unfinished()
        if record is None:
            return
        waited = time.monotonic() - record.issued
        if record.warned == 0 and waited >= self.stall_after:
            record.warned, self._stalled = 1, record
            first = record.seq is None or _claim(store, f"stall/{record.group}/{record.seq}")
            found = diagnose(store, record, with_stacks=first)
            note = "" if first else "\n  (another waiting rank reports their stacks)"
            log.warning("rank %d has waited %.1fs for %s: %s.\n%s%s", rank, waited,
                        found.collective, found.verdict, found.details, note)
        elif record.warned == 1 and self.backend != "gloo" and waited >= self.timeout_s:
            # Under NCCL torch's watchdog raises the timeout, without this explanation.
            record.warned = 2
            found = diagnose(store, record, with_stacks=True)
            log.error("rank %d: %s timed out after %.1fs: %s.\n%s", rank, found.collective,
                      waited, found.verdict, found.details)


watchdog = Watchdog()


def start(stall_after: float, timeout_s: float, backend: str) -> None:
    """Watch this rank's collectives (stall_after from `stall_after_setting`; 0: off)."""
    watchdog.configure(stall_after, timeout_s, backend)


def flush() -> None:
    """Publish this rank's last collectives now: at exit, for peers that still wait on it
    to compare with (the thread publishes only twice a second)."""
    store = _store()
    if store is not None and ledger.enabled:
        with contextlib.suppress(Exception):
            watchdog.publish(store, dist.get_rank())


def explain(record: Record | None) -> Diagnosis | None:
    """For the error of a failed collective: the same report the warning gives (with the
    culprits' stacks if it waited at least stall_after), or None if there is none."""
    store = _store()
    if record is None or store is None or not ledger.enabled:
        return None
    ledger.failed(record)  # the error says it; the thread need not warn as well
    waited = time.monotonic() - record.issued
    try:
        return diagnose(store, record, with_stacks=waited >= watchdog.stall_after)
    except Exception:  # the store may be gone with the rank that hosted it
        log.debug("stall watchdog: no report for the error", exc_info=True)
        return None
