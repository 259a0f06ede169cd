"""Membership: who is in the world right now, and the process group that joins them.

A fault-tolerant job lives through *membership epochs*. Each epoch is a list of members
(one per worker process, known by an id the job's store hands out) agreed through the store
(quorum.py); its process group is torch.distributed's own default group, made afresh for
the epoch on a store prefix of its own (`pg/<epoch>`), so every collective lockstep issues
-- DataParallel's buckets, `lockstep.comm`, torch's own calls -- runs over the current
members with no group to pass around. Re-creating a Gloo group among a few ranks takes a few
milliseconds; it happens only when a worker leaves or joins.

Planning is pure: `decide` turns what the store recorded (who registered, at which step,
from which host) into the next epoch's members, in rank order, and `layout` says which
ranks share a host. Both are unit-tested without processes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.comm import watchdog
from lockstep.comm import world as world_module
from lockstep.comm.diagnostics import reporter
from lockstep.comm.ledger import ledger
from lockstep.cores import share_cores
from lockstep.logs import setup_logging

_ROOT_LOGGER = "lockstep"


@dataclass(frozen=True)
class Candidate:
    """A worker that may belong to the next epoch, as the store describes it."""

    id: int
    host: str
    pid: int = 0
    step: int | None = None
    """Steps it has committed; None for a worker that has not trained yet (a joiner)."""
    rank: int | None = None
    """Its rank in the previous epoch; None for a joiner."""
    shards: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    """ZeRO: the shards it holds at which steps (sharding/recovery.Held.shards)."""
    units: int = 0
    """Pieces of collective work between steps (Elastic.collective) it completed after
    its last step."""


@dataclass(frozen=True)
class Membership:
    """One epoch's members, in rank order, and what they agreed on. The same on every
    member (it is read from the store)."""

    epoch: int
    ids: tuple[int, ...]
    """Member ids in rank order; rank 0 holds the state the others continue from."""
    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    step: int
    """The step training continues from: the most any member had committed (under ZeRO
    possibly one less: see `decide`)."""
    behind: frozenset[int] = frozenset()
    """Members that must receive rank 0's state: joiners, and ranks not at `step` (a step
    that some ranks completed before a peer died while these did not -- or, under ZeRO,
    that these completed and the membership takes back)."""
    joined: tuple[int, ...] = ()
    lost: tuple[tuple[int, str, int], ...] = ()
    """Members of the previous epoch that are gone: (id, host, pid)."""
    units: int = 0
    """The most pieces of collective work after `step` that a member at `step` completed:
    one piece can complete on some members and fail on others (a peer died after sending
    to some of them), and those go past it, where the rest would do it again -- two
    different collectives, which Gloo aborts the process for (Elastic.collective)."""
    me: int = -1
    """This worker's id (the only field that differs between members)."""

    @property
    def rank(self) -> int:
        return self.ids.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.ids)

    @property
    def local(self) -> tuple[int, int]:
        """(local rank, local world size): see `layout`."""
        return layout(list(self.hosts), self.rank)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "ids": self.ids, "hosts": self.hosts,
                           "pids": self.pids, "step": self.step,
                           "behind": sorted(self.behind), "joined": self.joined,
                           "lost": self.lost, "units": self.units})

    @classmethod
    def from_json(cls, text: str | bytes, me: int) -> Membership:
        d = json.loads(text)
        return cls(int(d["epoch"]), tuple(d["ids"]), tuple(d["hosts"]), tuple(d["pids"]),
                   int(d["step"]), frozenset(d["behind"]), tuple(d["joined"]),
                   tuple((int(i), str(h), int(p)) for i, h, p in d["lost"]),
                   int(d.get("units", 0)), me)

    def name(self, worker: int) -> str:
        """How a user can find a member: its id, pid and host."""
        at = self.ids.index(worker)
        return f"worker {worker} (pid {self.pids[at]} on host {self.hosts[at]})"


def decide(epoch: int, present: list[Candidate], lost: list[Candidate]) -> Membership:
    """The next epoch from the workers present (registered members, and joiners admitted).

    The continuing step is the most any member committed -- under ZeRO, the step before
    when a shard at that step died with its holders (`_recoverable`); the first member
    holding it becomes rank 0, the source the others are brought level with. Ranks are
    grouped by host (rank 0's host first), so hosts hold consecutive ranks as torchrun
    numbers them; within a host, earlier members keep their order and joiners follow.
    """
    if not present:
        raise ValueError("a membership needs at least one worker")
    steps = [c.step for c in present if c.step is not None]
    step = _recoverable(present, max(steps, default=0))
    ordered = sorted(present, key=_seniority)
    source = next((c for c in ordered if c.step == step), ordered[0])
    hosts: list[str] = [source.host]
    for c in ordered:
        if c.host not in hosts:
            hosts.append(c.host)
    members = sorted(ordered, key=lambda c: (hosts.index(c.host), c is not source,
                                             _seniority(c)))
    behind = frozenset(c.id for c in members if c.step != step)
    units = max((c.units for c in members if c.step == step), default=0)
    return Membership(epoch, tuple(c.id for c in members), tuple(c.host for c in members),
                      tuple(c.pid for c in members), step, behind,
                      tuple(c.id for c in members if c.rank is None),
                      tuple((c.id, c.host, c.pid) for c in lost), units)


def _recoverable(present: list[Candidate], step: int) -> int:
    """The step to continue from: `step` if every ZeRO shard at it survived, else the one
    before when every shard survived there: a worker that had completed the step died
    holding the only copy of a shard after it (the mirror of a peer still in the step),
    so the members who completed it go back one step -- they kept the state from before
    it (recovery.hold) -- and the step is trained again. Otherwise `step` (the pool
    names what was lost)."""
    offers = [c.shards for c in present if c.shards is not None]
    if not offers:
        return step
    newest = max(o["epoch"] for o in offers)  # (a worker left out holds an older layout)
    offers = [o for o in offers if o["epoch"] == newest]
    world = range(offers[0]["world_size"])

    def whole(at: int) -> bool:
        held = {s for o in offers for s in o["steps"].get(str(at), [])}
        return all(s in held for s in world)

    behind = step - 1
    if whole(step) or not whole(behind) or all(c.step != behind for c in present):
        return step
    return behind


def describe(new: Membership, old: Membership | None, seconds: float,
             source: str = "rank 0") -> str:
    """The line a user reads when the world changes (the new rank 0 logs it); `source`:
    where a joiner's state came from."""
    if old is None and not new.joined:
        return (f"membership: {new.world_size} workers on {len(set(new.hosts))} host(s), "
                f"epoch {new.epoch}")
    parts = []
    if new.lost:
        gone = sorted({host for _, host, _ in new.lost} - set(new.hosts))
        where = f"; host(s) {', '.join(gone)} gone entirely" if gone else ""
        parts.append("lost " + ", ".join(f"worker {i} (pid {pid} on host {host})"
                                         for i, host, pid in new.lost) + where)
    if new.joined:
        parts.append(", ".join(new.name(i) for i in new.joined) + " joined, state sent "
                     f"from {source}")
    was = old.world_size if old is not None else "?"
    return (f"membership epoch {new.epoch}: {'; '.join(parts) or 'regrouped'}; "
            f"{was} -> {new.world_size} workers, continuing at step {new.step} "
            f"(regrouped in {seconds:.1f}s)")


def report(new: Membership, old: Membership | None, seconds: float) -> dict[str, Any]:
    return {"epoch": new.epoch, "step": new.step, "world_size": new.world_size,
            "was": old.world_size if old is not None else None,
            "lost": [i for i, _, _ in new.lost],
            "joined": list(new.joined), "seconds": round(seconds, 3)}


def _seniority(c: Candidate) -> tuple[int, int]:
    """Earlier members first, in their old rank order; then joiners by arrival."""
    return (0, c.rank) if c.rank is not None else (1, c.id)


def layout(hosts: list[str], rank: int) -> tuple[int, int]:
    """(local rank, local world size) of `rank` when ranks run on `hosts` (one entry per
    rank). Algorithms that split work inside hosts (shm, hierarchical) need the same number
    of ranks on every host, numbered host by host; when a lost worker leaves the hosts
    uneven, every rank is described as a host of its own -- consistent on every rank, and
    still a correct reduction (shm then refuses, hierarchical runs over the network)."""
    counts: dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    contiguous = all(hosts[i] == hosts[i - 1] or hosts[i] not in hosts[:i]
                     for i in range(1, len(hosts)))
    if len(set(counts.values())) != 1 or not contiguous:
        return 0, 1
    return hosts[:rank].count(hosts[rank]), counts[hosts[rank]]


def install(membership: Membership, store: dist.Store, backend: str,
            timeout: timedelta) -> world_module.World:
    """Make `membership`'s process group the default one, and its World the current one.

    Collective over the members: each makes its end of a fresh group on the epoch's own
    store prefix. The previous epoch's group is destroyed first; its collectives already
    failed or finished, so nothing waits on it."""
    reporter.stop()  # its store calls and watchdog checks must not span two groups
    world_module.retire_default_group()
    world_module.import_what_binds_the_default_group()  # as lockstep.init does: else the
    world_module.register_exit_once()  # last group outlives exit and may abort the process
    prefix = dist.PrefixStore(f"lockstep/elastic/pg/{membership.epoch}", store)
    local_rank, local_size = membership.local
    device = _device(backend)
    dist.init_process_group(backend, store=prefix, rank=membership.rank,
                            world_size=membership.world_size, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    share_cores(membership.hosts.count(membership.hosts[membership.rank]))  # (uneven too)
    current = world_module.World(membership.rank, membership.world_size, local_rank,
                                 local_size, device, backend, timeout)
    world_module.adopt(current)
    _log_as(membership.rank)
    _watch(membership, backend, timeout)
    return current


def _watch(membership: Membership, backend: str, timeout: timedelta) -> None:
    """The stall watchdog over the new group: its collectives numbered from 1 and its
    progress counted from the membership's step on every member (a joiner's own count
    would start at 0, and numbers or steps that differ read as a desync)."""
    ledger.reset()
    reporter.step = membership.step
    seconds = timeout.total_seconds()
    watchdog.start(watchdog.stall_after_setting(None, seconds), seconds, backend)
    reporter.start()


def _device(backend: str) -> torch.device:
    if backend == "nccl":  # the GPU follows the launcher's local rank, not the membership
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _log_as(rank: int) -> None:
    """Records carry the new rank, and only the new rank 0 speaks at INFO."""
    setup_logging(rank)
    level = os.environ.get("LOCKSTEP_LOG_LEVEL", "INFO" if rank == 0 else "WARNING")
    logging.getLogger(_ROOT_LOGGER).setLevel(level.upper())
