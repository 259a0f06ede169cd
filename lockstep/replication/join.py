"""Uneven inputs: let ranks that run out of data early stand in for the ones that have not.

Every grad-enabled forward under `join` starts with one small all-reduce: a flag per rank
saying "I still have data", plus whether this step reduces gradients. A rank whose loop has
ended keeps answering that handshake with "no data" and, while anyone still trains, has its
wrapper's `JoinHook` issue the same collectives a real step would (buffer broadcast, bucket
all-reduces of zeros, the unused-parameter bitmap). Gradients are divided by all of the
ranks, DDP's default -- or by the number that contributed -- and when every rank is out
the hook re-synchronises the model from the last rank to finish.

As in torch's Joinable pattern, `Join` knows nothing of the wrapper: only the hook's
three methods.
"""

from __future__ import annotations

from typing import Protocol

from lockstep import comm


class JoinError(RuntimeError):
    """Ranks under `join()` did something the shadow steps cannot mirror."""


class JoinHook(Protocol):
    """What a wrapper lends `Join`."""

    def set_divisor(self, ranks: int) -> None:
        """Average this step's gradients over `ranks` contributions."""

    def shadow_step(self, sync: bool, source: int) -> None:
        """Issue the collectives of one forward (and, if `sync`, its backward) with
        nothing to contribute, counting the step where the forward would (the watchdog
        compares step numbers); `source` is where buffers come from."""

    def sync_final(self, source: int) -> None:
        """Every rank is out: make every replica rank `source`'s."""


class Join:
    def __init__(self, hook: JoinHook, group: comm.Group,
                 divide_by_initial_world_size: bool = True) -> None:
        self.hook, self.group = hook, group
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.world_size, self.rank = comm.size_of(group), comm.rank_of(group)
        self.active_ranks = list(range(self.world_size))  # as of the last handshake

    def agree_on_active(self, active: bool, sync: bool = False) -> tuple[list[int], bool]:
        """The handshake before every forward: which ranks still have data, and whether
        this step's backward synchronises (every rank that still trains must agree; one
        that ran out mid-accumulation just shadows the sync)."""
        n = self.world_size
        flags = comm.control_tensor([0] * (n + 1), self.group)  # [active | syncing]
        if active:
            flags[self.rank] = 1
            flags[n] = int(sync)
        comm.all_reduce(flags, "join handshake (which ranks still have data)", self.group)
        everyone = flags.tolist()
        active_ranks = [r for r in range(n) if everyone[r]]
        syncing = everyone[n]
        if 0 < syncing < len(active_ranks):
            raise JoinError(f"rank {self.rank}: under join(), ranks disagree on whether this "
                            f"step synchronises ({syncing} of {len(active_ranks)} are inside "
                            "no_sync()); every rank must accumulate on the same steps")
        if active_ranks:
            self.active_ranks = active_ranks
            self.hook.set_divisor(n if self.divide_by_initial_world_size
                                  else len(active_ranks))
        return active_ranks, syncing > 0

    def source_rank(self) -> int:
        """Where buffers and final state come from: the highest rank still training (as
        DDP's join picks it)."""
        return self.active_ranks[-1]

    def finish(self) -> None:
        """This rank is out of data: shadow the others' steps until everyone is. What it
        accumulated in an unfinished no_sync window is not contributed (as in DDP)."""
        while True:
            active_ranks, syncs = self.agree_on_active(active=False)
            if not active_ranks:
                break
            self.hook.shadow_step(syncs, self.source_rank())  # counts the step, as a forward
        self.hook.set_divisor(self.world_size)
        self.hook.sync_final(self.source_rank())
