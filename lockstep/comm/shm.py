"""Tensors that every process on a host can read: the memory behind the "shm" reduction.

Each rank backs each of its buckets with an anonymous memory file (memfd) and the other
ranks on the host map it through /proc/<pid>/fd/<n>. Anonymous files have no name to leak:
the memory lives exactly as long as some process maps it, so it is returned on every exit
path, `kill -9` included, and nothing is ever left in /dev/shm.
"""

from __future__ import annotations

import gc
import os
import platform
import threading
import time
import weakref
from typing import Any

import torch

from lockstep import comm
from lockstep.comm import stophook, timeline, waits
from lockstep.comm.diagnostics import explain_stall
from lockstep.comm.failures import timed_out
from lockstep.comm.ledger import Record, ledger
from lockstep.comm.world import current


def shm_available() -> str | None:
    """None if shared buckets work here; otherwise why not."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return "shared-memory reduction needs Linux (memfd_create and /proc)"
    return None


def why_not_host_memory(group: comm.Group, holds: str) -> str | None:
    """Why `holds` ("shards", "buckets") cannot live in one host's shared memory for the
    ranks of `group`; None if they can. The same answer on every rank: it reads only the
    job's layout, so all of them choose shared memory or none does."""
    world = current()
    if (reason := shm_available()) is not None:
        return reason
    if comm.size_of(group) != world.world_size:
        return (f"it shares {holds} among all the job's ranks on one host, not a process "
                "group of some of them; use algorithm='native' with group=")
    if world.num_hosts > 1:
        return (f"it shares {holds} through one host's memory, and this job spans "
                f"{world.num_hosts} hosts; use algorithm='native' across hosts")
    if world.device.type != "cpu":
        return (f"it shares {holds} in host memory, and this job's parameters live on "
                f"{world.device.type}; the backend's own collectives are the fast path there")
    return None


def peers_mappable(group: comm.Group, eligible: bool = True) -> bool:
    """Whether every rank of `group` is `eligible` (its own view of the job allows host
    memory) and can map its peers' memory files (a container may forbid opening another
    process's /proc/PID/fd, and a process in another container -- or on another machine --
    may share a peer's pid and fd number: each reads back the token its peer wrote).
    Collective on every rank whatever its own answer, so all of them choose alike."""
    fd = os.memfd_create("lockstep-probe", os.MFD_CLOEXEC)
    try:
        token = int.from_bytes(os.urandom(7), "little")  # (fits an int64)
        os.write(fd, token.to_bytes(7, "little"))
        peers = comm.all_gather_ints((os.getpid(), fd, token, eligible),
                                     "shm: may peers map each other", group)
        opened = all(ok for _, _, _, ok in peers)
        for pid, peer_fd, peer_token, _ in peers if opened else []:
            try:
                with open(f"/proc/{pid}/fd/{peer_fd}", "rb") as f:
                    opened = opened and f.read(7) == peer_token.to_bytes(7, "little")
            except OSError:
                opened = False
        every = comm.all_gather_ints((opened,), "shm: did every rank map its peers", group)
        return all(ok for (ok,) in every)
    finally:
        os.close(fd)


class HostMemory:
    """Allocates host-shared tensors. Collective over `group`: the ranks on this host must
    call `allocate` together, with the same sizes, in the same order (with `deferred`, the
    collective is `exchange()`, or the first host barrier after the allocations).

    A wrapper's setup allocates a few times, and on a fault-tolerant job's join every member
    sets up again, so exchanges are few: the ranks' pids ride with their file numbers, and
    no barrier waits for the peers to map a file before its owner closes it -- the owner
    keeps it open until the peers are known to have mapped it (its next exchange or host
    barrier: each peer maps before it reaches either), then closes it, before its number
    can name another file. Dropped before that (a wrapper closed as soon as it was built,
    while a peer may still be mapping), it leaves its files open for a grace period
    (`_orphan`). With `deferred`, an allocation exchanges nothing: it returns this rank's
    own tensor at once, and the peers' entries are filled in by the next `exchange()` --
    one for everything allocated since (a wrapper's barrier flags, non-finite flags and
    every bucket: one exchange where each was one)."""

    def __init__(self, group: comm.Group, deferred: bool = False) -> None:
        reason = shm_available()
        if reason is not None:
            raise RuntimeError(f"rank {comm.rank_of()}: {reason}")
        self.group = group
        self.local_rank = comm.rank_of(group)
        self.deferred = deferred
        self.pids: list[int] = []  # the host's ranks', in local-rank order (from `exchange`)
        self.count = 0
        self.peers: list[weakref.ref[torch.Tensor]] = []  # their memory (peers_storages)
        self._unsettled: list[int] = []  # files of ours a peer may not have mapped yet
        # ours not yet exchanged: (file, its views in local-rank order, numel, dtype); a
        # HostMemory dropped before its exchange closes them (no peer knows of them)
        self.pending: list[tuple[int, list[torch.Tensor], int, torch.dtype]] = []
        weakref.finalize(self, _orphan, self._unsettled)
        weakref.finalize(self, _close_pending, self.pending)

    def allocate(self, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """A zeroed tensor of `numel` elements per rank on the host, in local-rank order;
        entry `local_rank` is this rank's own (the others are its peers', mapped -- with
        `deferred`, once `exchange()` has run: until then they are empty, so a view taken
        of a peer's entry before then keeps the empty one)."""
        nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()
        fd = os.memfd_create(f"lockstep-bucket-{self.count}", os.MFD_CLOEXEC)
        self.count += 1
        views = [torch.empty(0, dtype=dtype)] * comm.size_of(self.group)
        try:
            os.ftruncate(fd, nbytes)  # fresh pages read as zeros
            views[self.local_rank] = torch.from_file(f"/proc/self/fd/{fd}", shared=True,
                                                     size=numel, dtype=dtype)
        except BaseException:
            os.close(fd)  # (no peer knows of it yet)
            raise
        self.pending.append((fd, views, numel, dtype))
        if not self.deferred:
            self.exchange()
        return views

    def exchange(self) -> None:
        """Map the peers' files for everything allocated since the last exchange: one
        all-gather of every rank's pid and file numbers. Collective over the host's ranks."""
        if not self.pending:
            return
        pending = self.pending[:]
        self.pending.clear()
        fds = [fd for fd, _, _, _ in pending]
        try:
            peers = comm.all_gather_ints((os.getpid(), *fds), "shm: exchange bucket files",
                                         self.group)
        except BaseException:
            # The exchange may have completed on a peer, now mapping them: closed at once,
            # their numbers could name this rank's next files (a regroup's) under it
            _orphan(fds)
            raise
        self.settled()  # every peer is past its last exchange: it mapped our files
        self._unsettled.extend(fds)  # the mappings keep the memory; no name to clean up
        self.pids = [pid for pid, *_ in peers]
        for k, (_, views, numel, dtype) in enumerate(pending):
            for r, (pid, *theirs) in enumerate(peers):
                if r != self.local_rank:
                    views[r] = self._map(pid, theirs[k], numel, dtype)
                    self.peers.append(weakref.ref(views[r]))

    def settled(self) -> None:
        """Every peer has mapped what this rank exchanged before now (they reached a host
        barrier or an exchange after it): close those files (and any orphans' that are due).
        Files allocated and not exchanged yet stay open (`pending`)."""
        _close_all(self._unsettled)
        if _ORPHANS:
            _close_orphans()

    def _map(self, pid: int, fd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A peer's memory file, mapped. A peer that died (or failed) between the exchange
        and now has closed it: said as a collective's failure, so that lockstep.Elastic
        regroups rather than ends the job."""
        try:
            return torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=numel,
                                   dtype=dtype)
        except (OSError, RuntimeError) as error:
            local = self.pids.index(pid)
            raise comm.CollectiveError(
                f"rank {comm.rank_of()}: shm: mapping local rank {local}'s memory (pid {pid}) "
                f"failed -- it exited or failed while the host's ranks set up: "
                f"{str(error).splitlines()[0]}") from None


def _close_pending(pending: list[tuple[int, list[torch.Tensor], int, torch.dtype]]) -> None:
    _close_all([fd for fd, *_ in pending])
    pending.clear()


def _close_all(fds: list[int]) -> None:
    """Close and forget `fds` (each once, even if another thread closes the same list)."""
    while True:
        try:
            fd = fds.pop()  # (atomic: no fd is taken twice)
        except IndexError:
            return
        os.close(fd)


ORPHAN_GRACE_S = 60.0
"""How long the files of a HostMemory dropped before its peers were known to have mapped
them stay open: far longer than a live peer takes to map a file once the exchange that
named it completed (a peer that has not by then failed its setup)."""
_ORPHANS: list[tuple[float, list[int]]] = []  # (when they may close, the files)
_ORPHANS_LOCK = threading.Lock()  # (a finalizer may run on any thread)


def _orphan(fds: list[int]) -> None:
    """A HostMemory's finalizer: its files not yet known mapped close after the grace, at
    a later HostMemory's settling (at the process's exit otherwise)."""
    if fds:
        with _ORPHANS_LOCK:
            _ORPHANS.append((time.monotonic() + ORPHAN_GRACE_S, fds[:]))
        fds.clear()


def _close_orphans() -> None:
    with _ORPHANS_LOCK:
        now = time.monotonic()
        due = [fds for when, fds in _ORPHANS if when <= now]
        _ORPHANS[:] = [(when, fds) for when, fds in _ORPHANS if when > now]
    for fds in due:
        _close_all(fds)


def peers_storages() -> set[int]:
    """Where the other ranks' memory that this process maps begins (their storages' data
    pointers), while it is mapped: theirs, counted by its owner -- not by a count of this
    process's live tensors (memory_report never counts it)."""
    views = [ref() for obj in gc.get_objects() if isinstance(obj, HostMemory) for ref in obj.peers]
    return {view.untyped_storage().data_ptr() for view in views if view is not None}


LOOK_EVERY_S = 0.02  # how often a waiting barrier checks that its late peers still live


class HostBarrier:
    """A barrier among the ranks of one host, through flags in shared memory.

    Each rank bumps its own counter and waits until every peer's counter has caught up:
    a few microseconds when ranks arrive together, against ~0.2 ms for a barrier over
    loopback sockets. Spinning gives way (sched_yield, then short sleeps) while it waits,
    and gives up after `timeout_s` naming the ranks that never arrived. The flag store
    follows the data stores in program order, which x86's memory model keeps in order for
    the reader; elsewhere this falls back to the group's socket barrier.
    """

    def __init__(self, memory: HostMemory, timeout_s: float) -> None:
        self.memory, self.timeout_s = memory, timeout_s
        self.spin = platform.machine() in ("x86_64", "AMD64", "i686")
        # (with a deferred HostMemory, the peers' flags are mapped at its exchange)
        self._flags = memory.allocate(1, torch.int64) if self.spin else []
        self._read: list[Any] | None = None
        self.generation = 0

    def wait(self, what: str, in_backward: bool = False) -> None:
        """Until every rank on the host has reached this barrier. Waited `in_backward`, it
        is what backward's end waits for over sockets, and the step timeline counts it so
        (attribution.py: a rank's compute in backward excludes it, or the ranks waiting for
        a straggler would look slow)."""
        if not in_backward:
            self._wait(what)
            return
        with timeline.span("wait for communication"):
            self._wait(what)

    def _wait(self, what: str) -> None:
        if stophook.armed is not None and self.memory.group is None:  # the job's ranks,
            stophook.run_armed()  # all on this host: no step passes it without each
        # Memory allocated deferred and not exchanged yet (its owner did not connect()):
        # here, where every rank of the host arrives at the same point
        self.memory.exchange()
        if not self.spin:
            comm.barrier(what, self.memory.group)
            self.memory.settled()
            return
        self.generation += 1
        flags = self.flags  # (a property: read once, not at every spin)
        flags[self.memory.local_rank][0] = self.generation
        started, spins = time.monotonic(), 0
        # The stall watchdog sees this wait as it sees any collective's (ledger.py).
        record = ledger.issue(what, self.memory.group)
        look_at, ask_at = started + LOOK_EVERY_S, started + waits.SLICE.total_seconds()
        while any(flag[0] < self.generation for flag in flags):
            spins += 1
            if spins < 2000:
                os.sched_yield()
                continue
            now = time.monotonic()
            if now >= look_at:
                if not self._still_late(what, now - started, record):
                    break  # (those that left had reached it first)
                look_at = now + LOOK_EVERY_S
            if now >= ask_at:  # as a backend's collective is given up (comm/waits.py)
                try:
                    waits.give_up_if_told(what, started, record)
                except waits.Abandoned as error:  # (it says why, as Pending.wait's)
                    raise comm.CollectiveError(str(error)) from None
                ask_at = now + waits.SLICE.total_seconds()
            time.sleep(min(1e-3, 1e-5 * (spins - 2000)))
        ledger.launched(record, None)
        self.memory.settled()

    @property
    def flags(self) -> list[Any]:
        """Every rank's flag, as numpy (cheap scalar reads), once the peers' are mapped."""
        if self._read is None:
            if self.memory.pending:
                raise RuntimeError(f"rank {comm.rank_of()}: a host barrier was used before "
                                   "its HostMemory exchanged its files (exchange())")
            self._read = [flag.numpy() for flag in self._flags]
        return self._read

    def leave(self) -> None:
        """Say this rank will reach no more of these barriers (its wrapper closed, or its
        process is exiting): a peer waiting in one fails at its next look, not at its
        timeout -- and before a launcher that saw this process end stops it."""
        if self.spin:  # negative: left, having reached generation -flag - 1
            self._flags[self.memory.local_rank][0] = -self.generation - 1  # (own: mapped)

    def _still_late(self, what: str, waited: float, record: Record | None) -> bool:
        """Whether some peer has not reached this barrier yet. Fail once the timeout has
        passed -- or at once if a late peer has left or exited: a barrier in memory has no
        connection whose closing would tell (a socket does)."""
        # Liveness first, then one read of the flags: a peer dead before its flag was read
        # and not there in it never reached this barrier (read the other way round, one
        # that arrived, passed and exited in between would be blamed).
        running = [_running(pid) for pid in self.memory.pids]
        values = [int(flag[0]) for flag in self.flags]
        late = [r for r, v in enumerate(values) if v < self.generation and -v - 1 < self.generation]
        gone = [r for r in late if values[r] < 0 or not running[r]]
        if gone:  # as a socket's peer_closed: said at once, in the same words
            ledger.launched(record, None)
            raise comm.CollectiveError(
                f"rank {comm.rank_of()}: {what} failed after {waited:.1f}s: local rank(s) "
                f"{gone} on this host (pid {', '.join(str(self.memory.pids[r]) for r in gone)}) "
                "left (closed its wrapper or exited) before reaching it\n"
                f"{explain_stall(comm.rank_of(), comm.size_of())}")
        if waited > self.timeout_s:  # culprits named as for a backend's timed-out collective
            raise timed_out(what, waited, record, f"local rank(s) {late} on this host did not "
                            f"reach it within the {self.timeout_s:.0f}s timeout")
        return bool(late)


class HostFlags:
    """A few per-rank numbers summed through host memory (the non-finite check's flags):
    each rank writes its own slot, and the handle's `wait` adds up everyone's -- µs, where a
    Gloo all-reduce of a few bytes took 1.4 ms on a 2-core machine, most of a tiny model's
    step. The caller's barriers order the uses: one between every rank's write and the sum,
    and one between the sum and any rank's next write."""

    def __init__(self, memory: HostMemory, numel: int, dtype: torch.dtype) -> None:
        self.slots = memory.allocate(numel, dtype)  # (see HostMemory: collective)
        self.me = memory.local_rank

    def share(self, flags: torch.Tensor) -> _SumOfSlots | None:
        """Write this rank's `flags`; None for a tensor these slots were not made for."""
        slots, mine = self.slots, self.slots[self.me]  # (mine: mapped even before exchange)
        if mine.shape != flags.shape or mine.dtype != flags.dtype or mine.device != flags.device:
            return None
        mine.copy_(flags)
        return _SumOfSlots(slots, flags)


class _SumOfSlots:
    """The handle of `HostFlags.share`: `wait` sums every rank's slot into `into`."""

    def __init__(self, slots: list[torch.Tensor], into: torch.Tensor) -> None:
        self.slots, self.into = slots, into

    def wait(self) -> None:
        torch.sum(torch.stack(self.slots), dim=0, out=self.into)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie -- killed, not yet reaped -- is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False
