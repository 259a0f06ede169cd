"""Uneven inputs: let ranks that run out of data early stand in for the ones that have not.

Every grad-enabled forward under `join` starts with one small all-reduce: a flag per rank
saying "I still have data", plus whether this step reduces gradients. A rank whose loop has
ended keeps answering that handshake with "no data" and, while anyone still trains, has its
wrapper's `JoinHook` issue the same collectives a real step would (buffer broadcast, bucket
all-reduces of zeros, the unused-parameter bitmap). Gradients are divided by all of the
ranks, DDP's default -- or by the number that contributed -- and when every rank is out
the hook re-synchronises the model from the last rank to finish.

The training loop's own agreement goes through the same handshake: a LossScaler's overflow
vote (one per optimizer step) is a turn of it that says "vote", so a rank out of data
answers it in its loop without knowing what comes when, and its scaler follows the verdict
(`Voter`): every rank keeps the same scale, which the gradients' average relies on. (torch's
GradScaler needs no vote: each rank decides from its own averaged gradients, and a rank
that joined keeps its stale scale.)

As in torch's Joinable pattern, `Join` knows nothing of the wrapper: only the hook's
three methods.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from lockstep import comm
from lockstep.comm.ledger import group_key

# The join in force on each process group (by the ledger's group name), for the loop's
# own votes (a LossScaler knows its group, not the wrapper).
_IN_FORCE: dict[str, Join] = {}


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


class Voter(Protocol):
    """One who asks every rank a yes/no question once per step (a LossScaler: did anyone
    overflow?), given to `join()` so that a rank out of data can answer it."""

    def follow(self, verdict: bool) -> None:
        """Take the verdict of a vote this rank sat out (it had no data)."""


@dataclass(frozen=True)
class Turn:
    """One handshake's outcome."""

    active_ranks: list[int]
    sync: bool
    vote: tuple[int, bool] | None  # (which voter, the verdict) when this turn was a vote


def joined(group: comm.Group) -> Join | None:
    """The join in force on `group`, if any."""
    return _IN_FORCE.get(group_key(group)) if _IN_FORCE else None


class Join:
    def __init__(self, hook: JoinHook, group: comm.Group,
                 divide_by_initial_world_size: bool = True, voters: Sequence[Voter] = ()
                 ) -> None:
        self.hook, self.group = hook, group
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.voters = list(voters)
        self.world_size, self.rank = comm.size_of(group), comm.rank_of(group)
        self.active_ranks = list(range(self.world_size))  # as of the last handshake

    @contextmanager
    def in_force(self) -> Iterator[None]:
        """While inside, the loop's votes on this group go through this join."""
        key = group_key(self.group)
        outer = _IN_FORCE.get(key)
        _IN_FORCE[key] = self
        try:
            yield
        finally:
            if outer is None:
                del _IN_FORCE[key]
            else:
                _IN_FORCE[key] = outer

    def everyone_active(self) -> bool:
        """Whether every rank still had data at the last handshake (the replicas are the
        same then; a rank out of data stops stepping until the join ends)."""
        return len(self.active_ranks) == self.world_size

    def agree_on_active(self, active: bool, sync: bool = False) -> tuple[list[int], bool]:
        """The handshake before every forward: which ranks still have data, and whether
        this step's backward synchronises (every rank that still trains must agree; one
        that ran out mid-accumulation just shadows the sync)."""
        turn = self._handshake(active, sync)
        return turn.active_ranks, turn.sync

    def vote(self, voter: Voter, yes: bool) -> bool:
        """Whether any rank still training says yes -- a turn of the handshake, which
        ranks out of data answer too (and pass the verdict to their `voter`)."""
        # A voter join() was not given is refused on every rank, those out of data too
        # (they learn of it from this very turn): an error everywhere, not a hang.
        index = next((i for i, v in enumerate(self.voters) if v is voter), -1)
        turn = self._handshake(True, vote=(index, yes))
        assert turn.vote is not None
        return turn.vote[1]

    def _handshake(self, active: bool, sync: bool = False,
                   vote: tuple[int, bool] | None = None) -> Turn:
        n = self.world_size
        # [active per rank | syncing | voting | voted yes | voter index, summed | strangers]
        flags = comm.control_tensor([0] * (n + 5), self.group)
        if active:
            flags[self.rank], flags[n] = 1, int(sync)
            if vote is not None:
                index, yes = vote
                flags[n + 1], flags[n + 2] = 1, int(yes)
                if index >= 0:
                    flags[n + 3] = index
                else:
                    flags[n + 4] = 1
        comm.all_reduce(flags, "join handshake (which ranks still have data; a forward or "
                        "a vote)", self.group)
        everyone = flags.tolist()
        active_ranks = [r for r in range(n) if everyone[r]]
        syncing, voting, yes, index, strangers = everyone[n:]
        self._check_agreement(len(active_ranks), syncing, voting, strangers)
        if active_ranks:
            self.active_ranks = active_ranks
            self.hook.set_divisor(n if self.divide_by_initial_world_size
                                  else len(active_ranks))
        verdict = (index // voting, yes > 0) if voting else None
        return Turn(active_ranks, syncing > 0, verdict)

    def _check_agreement(self, active: int, syncing: int, voting: int, strangers: int
                         ) -> None:
        if strangers:
            raise JoinError(
                f"rank {self.rank}: a LossScaler not given to join() voted on overflow under "
                "it: a rank that ran out of data must answer that vote at every step, so "
                "join() has to know the scaler -- pass it with the optimizers, e.g. "
                "model.join([optimizer, scaler])")
        if 0 < voting < active:
            raise JoinError(f"rank {self.rank}: under join(), {voting} of {active} ranks "
                            "voted (a LossScaler's step) while the others began a forward; "
                            "every rank must step its scaler on the same steps")
        if not voting and 0 < syncing < active:
            raise JoinError(f"rank {self.rank}: under join(), ranks disagree on whether this "
                            f"step synchronises ({syncing} of {active} are inside "
                            "no_sync()); every rank must accumulate on the same steps")

    def source_rank(self) -> int:
        """Where buffers and final state come from: the highest rank still training (as
        DDP's join picks it)."""
        return self.active_ranks[-1]

    def finish(self) -> None:
        """This rank is out of data: shadow the others' steps, and answer their votes,
        until everyone is. What it accumulated in an unfinished no_sync window is not
        contributed (as in DDP)."""
        while True:
            turn = self._handshake(active=False)
            if not turn.active_ranks:
                break
            if turn.vote is not None:
                index, verdict = turn.vote
                self.voters[index].follow(verdict)
                continue
            self.hook.shadow_step(turn.sync, self.source_rank())  # counts the step
        self.hook.set_divisor(self.world_size)
        self.hook.sync_final(self.source_rank())
