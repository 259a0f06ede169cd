"""Which collectives this rank has issued: numbered, labelled, and whether they finished.

comm.py tells the ledger about every collective it starts. Collectives on a process group
are numbered per group (1, 2, 3, ...): every rank of a group issues the same collectives in
the same order, so the n-th one must be the same on all of them. Each is remembered with
the training step it was issued in and its label ("gradient bucket 3/7 (...)"); (step,
label) at the same number is what ranks compare to find a desync. Point-to-point messages
are tracked for stalls but not numbered: ranks legitimately send different numbers of them
(a tree's leaves and its root).

The hot path is a counter, a tuple and two deque appends under an uncontended lock; no
store round-trip. The watchdog thread (watchdog.py) reads the ledger twice a second.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any

import torch.distributed as dist

from lockstep.comm.diagnostics import reporter

HISTORY = 256  # collectives remembered per group, to compare with what peers published
_PRUNE_AT = 4096  # in-flight records kept before the issuing thread prunes them itself

Entry = tuple[int, int, str]  # (number within its group, step issued in, label)


class Record:
    """One collective (or point-to-point message) this rank started."""

    __slots__ = ("done", "group", "issued", "label", "partner", "seq", "step", "warned",
                 "work")

    def __init__(self, group: str, seq: int | None, label: str, step: int,
                 partner: int | None) -> None:
        self.group, self.seq, self.label, self.step = group, seq, label, step
        self.partner = partner  # the global rank at the other end of a send/recv
        self.issued = time.monotonic()
        # A weak reference to the backend's handle of an async collective: a handle holds
        # its tensors, and ZeRO-3's gathered parameters must be freed when their user lets go.
        self.work: Any = None
        self.done = False
        self.warned = 0  # how many warnings the watchdog gave about it (0, 1: stall, 2: timeout)

    def complete(self) -> bool:
        if not self.done and self.work is not None:
            work = self.work()
            try:  # a handle nobody holds any more cannot be waited on: nothing to report
                self.done = work is None or bool(work.is_completed())
            except Exception:  # a failed work: its waiter reports it
                self.done = True
        return self.done

    def name(self) -> str:
        number = f"collective #{self.seq}" if self.seq is not None else "message"
        return f'{number} "{self.label}"'


def group_key(group: dist.ProcessGroup | None) -> str:
    """A name for the group that is the same on every member rank."""
    return str((group or dist.distributed_c10d._get_default_group()).group_name)


def _default_group() -> Any:
    return dist.distributed_c10d._world.default_pg


class Ledger:
    """Per-rank bookkeeping of collectives. Off (records nothing) until the watchdog starts."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.history: dict[str, deque[Entry]] = {}
        self.members: dict[str, list[int]] = {}  # global ranks of each group seen
        self.in_flight: deque[Record] = deque()
        self.world_key = ""
        self.thread: int | None = None  # the thread that issues collectives (the training loop)
        self.last: Record | None = None  # the newest record, for comm.Pending to keep
        # The default process group, weakly (a group held here would outlive
        # destroy_process_group, its connections open: elastic/job.py closes them to wake
        # peers still blocked in it), and its key.
        self._default: weakref.ref[Any] | None = None
        self._default_key = ""

    def issue(self, label: str, group: dist.ProcessGroup | None,
              partner: int | None = None) -> Record | None:
        """Note a collective that is about to start (None when the watchdog is off)."""
        if not self.enabled:
            return None
        if group is None:  # the default group's name, looked up once per default group
            default = _default_group()
            if self._default is None or default is not self._default():
                self._default, self._default_key = weakref.ref(default), group_key(default)
            key = self._default_key
        else:
            key = group_key(group)
        step = reporter.step
        record = Record(key, None, label, step, partner)
        with self._lock:
            if key not in self.members:
                self._meet(key, group)
            if partner is None:
                record.seq = seq = self.counts.get(key, 0) + 1
                self.counts[key] = seq
                self.history[key].append((seq, step, label))
            self.in_flight.append(record)
            if len(self.in_flight) > _PRUNE_AT:  # the watchdog thread is not keeping up
                self._prune()
        self.last, self.thread = record, threading.get_ident()
        return record

    def _meet(self, key: str, group: dist.ProcessGroup | None) -> None:
        self.members[key] = dist.get_process_group_ranks(
            group or dist.distributed_c10d._get_default_group())
        self.history[key] = deque(maxlen=HISTORY)
        if group is None or group == dist.distributed_c10d._get_default_group():
            self.world_key = key

    @staticmethod
    def launched(record: Record | None, result: Any) -> None:
        """The call returned: an async handle is in flight until it completes; anything
        else (a blocking call's result) means it is done."""
        if record is None:
            return
        if isinstance(result, dist.Work):
            try:
                record.work = weakref.ref(result)
            except TypeError:  # not weakly referable: not tracked
                record.done = True
        else:
            record.done = True

    def _prune(self) -> None:
        while self.in_flight and self.in_flight[0].complete():
            self.in_flight.popleft()

    def failed(self, record: Record) -> None:
        """`record`'s collective failed: it and whatever its group still has in flight
        (issued after it: doomed with it) are explained by that error, not by warnings."""
        with self._lock:
            for other in self.in_flight:
                if other.group == record.group:
                    other.warned = 2
        record.warned = 2

    def oldest_unfinished(self) -> Record | None:
        with self._lock:
            self._prune()
            return self.in_flight[0] if self.in_flight else None

    def recent(self, key: str, count: int) -> list[Entry]:
        with self._lock:
            entries = self.history.get(key)
            return list(entries)[-count:] if entries else []

    def reset(self) -> None:
        """Forget everything: a new process group numbers its collectives from 1."""
        with self._lock:
            self.counts.clear()
            self.history.clear()
            self.members.clear()
            self.in_flight.clear()


ledger = Ledger()


def mismatches(mine: list[Entry], theirs: list[Entry]) -> list[int]:
    """The collective numbers at which two ranks issued different collectives (a different
    label, or the same label in a different step), among the numbers both know."""
    known = {seq: (step, label) for seq, step, label in theirs}
    return [seq for seq, step, label in mine
            if (other := known.get(seq)) is not None and other != (step, label)]
