"""Catch a NaN or inf in any rank's gradients at the step it appears.

One rank's non-finite gradient becomes every rank's after the all-reduce, and from then on
every weight: left alone, a run "finishes" with NaN weights and overwrites its good
checkpoints with them. So the reducer sums this rank's gradients -- the cheapest pass over
memory there is, and NaN and inf survive it -- and the ranks exchange one flag each. Every
rank then knows the same thing at the same moment: which ranks' local gradients were not
finite. A sum of finite values can overflow, so before anyone is stopped the averaged
gradients of the flagged parameters are checked element by element. The default stops the
job with an error naming the step, those ranks and the first parameter; `nonfinite="skip"`
drops the step instead (every rank alike) and counts it.

Two ways, one result. Where the last bucket's extra elements arrive summed exactly on every
rank (an all-reduce sums every element; PowerSGD and TopK send those whole beside their
own: `Reduction.carries_flags`), each bucket is summed once as it launches, and this rank's
total, times zero -- 0 if finite, NaN if not, exact in 16 bits too -- rides in an element
of its own at the end of the last bucket (the others add zero to it): no collective of its
own, no work per gradient (a tiny model's step is mostly collective latency; a second
collective was a third of it). A rank whose element comes back NaN is flagged; the
parameters to name are those whose averaged gradient is not finite: NaN and inf reach the
average element by element (under TopK, those it selects, and it selects NaN and inf
first). Elsewhere (ZeRO's reduce-scatter keeps only shards, shm sums slices) each gradient
is summed as it arrives and the flags travel in a tiny all-reduce of their own, launched
alongside the last buckets -- or in the reduction's own way (`Reduction.share_flags`: shm
sums them in its shared memory).

While a LossScaler has scaled a loss and not yet stepped, overflow is its business (fp16's
agreed skip), so the check stands aside.

The flags carry one more element, a notice: what one rank has to tell every other at this
step (lockstep.Elastic's rank 0: stop after it, a joiner waits) travels with them, so the
others learn it from the exchange they make anyway instead of asking the job's store.
"""

from __future__ import annotations

import cmath  # (a complex model's last bucket carries its flags as complex numbers)
from collections.abc import Callable, Sequence

import torch

from lockstep import comm
from lockstep.logs import get_logger
from lockstep.replication import precision
from lockstep.replication.reduction import Handle

log = get_logger(__name__)

MODES = ("error", "skip", "off")


class NonFiniteGradientError(FloatingPointError):
    """Some rank's local gradient held a NaN or inf."""


def flags_numel(world_size: int) -> int:
    """The flags' length: one per rank, the LossScaler's count, the notices' count."""
    return world_size + 2


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"nonfinite must be one of {', '.join(MODES)}; got {mode!r}")


class FiniteCheck:
    """Watches one reducer's gradients during each synchronised backward."""

    def __init__(self, mode: str, names: Sequence[str], group: comm.Group,
                 carried: bool = False,
                 share: Callable[[torch.Tensor], Handle | None] | None = None) -> None:
        check_mode(mode)
        self.mode, self.names, self.group = mode, list(names), group
        self.share = share  # the reduction's own way to sum the flags, if it has one
        self.carried = carried and mode != "off"  # the flags ride in the last bucket
        self.per_gradient = mode != "off" and not self.carried  # `observe` each gradient
        self._rank = comm.rank_of(group)
        self.backwards = 0        # synchronised backwards seen, for the step in messages
        self.skipped_steps = 0
        self._sums: list[tuple[int, torch.Tensor]] = []  # (parameter, its gradient's sum)
        self._bucket_sums: list[torch.Tensor] = []  # carried: the launched buckets' sums
        self._flags: torch.Tensor | None = None
        self.notice: Callable[[], bool] | None = None
        """Asked as the flags leave: whether this rank gives the others notice (see
        take_notices). Runs inside backward: it must not raise."""
        self._exchanges, self._notices = 0, 0  # since take_notices last asked

    @property
    def extra(self) -> int:
        """Elements the last bucket carries for the flags: one per rank, the count of
        ranks whose LossScaler is mid-step, and the count of ranks giving notice."""
        return flags_numel(comm.size_of(self.group)) if self.carried else 0

    def take_notices(self) -> bool | None:
        """Whether any rank gave notice in the exchanges of flags since the last call --
        the same answer on every rank -- or None where there was none (the check is off,
        or no synchronised backward ran)."""
        exchanges, notices = self._exchanges, self._notices
        self._exchanges, self._notices = 0, 0
        return None if exchanges == 0 else notices > 0

    def _fill_trailer(self, flags: torch.Tensor) -> None:
        """The two elements after the ranks' own: this rank's LossScaler mid-step, and its
        notice."""
        if precision.loss_scaling_pending():
            flags[-2] = 1
        if self.notice is not None and self.notice():
            flags[-1] = 1

    def observe(self, index: int, grad: torch.Tensor) -> None:
        """Record parameter `index`'s local gradient by its sum: NaN and inf survive a sum,
        the cheapest pass over memory there is. (A sum of finite values can overflow;
        `finish` tells that apart before anyone is stopped.) Carried: the buckets are
        summed whole instead (`launching`)."""
        if self.per_gradient:
            self._sums.append((index, grad.detach().sum()))

    def launching(self, gradients: torch.Tensor, flags: torch.Tensor | None) -> None:
        """Carried: a bucket is about to launch -- sum its `gradients`. The last one (with
        its `flags` elements) carries this rank's sum of everything, times zero, in this
        rank's own element, which the others leave at zero: after the exchange, a rank
        whose element is NaN had a non-finite gradient (or a sum that overflowed)."""
        if not self.carried:
            return
        if flags is None:  # an earlier bucket
            self._bucket_sums.append(gradients.sum())
            return
        mine = flags.zero_()[self._rank]
        torch.sum(gradients, dim=0, out=mine)
        for earlier in self._bucket_sums:
            mine.add_(earlier)
        # Finite -> 0, NaN or inf -> NaN: exact on any wire (a 16-bit one turned a large
        # finite sum into inf, a false alarm each step); an overflowed sum stays flagged
        mine.mul_(0)
        self._fill_trailer(flags)
        self._bucket_sums, self._flags = [], flags

    def reset(self) -> None:
        """Forget a backward that did not finish."""
        self._sums, self._bucket_sums = [], []

    def start(self) -> Handle | None:
        """Launch the exchange of flags, once all of this backward's gradients were
        observed: flags[r] = 1 if rank r saw a non-finite gradient; the next entry counts
        the ranks whose LossScaler is mid-step (its overflow is then expected, and every
        rank leaves it to the scaler, whatever its own state), the last those giving
        notice."""
        self.backwards += 1
        if self.mode == "off" or self.carried:
            return None
        flags = comm.control_tensor([0] * flags_numel(comm.size_of(self.group)), self.group)
        if self._sums:
            local = torch.stack([total for _, total in self._sums])
            flags[self._rank] = (~torch.isfinite(local)).any().to(flags.dtype)
        self._fill_trailer(flags)
        self._flags = flags
        shared = self.share(flags) if self.share is not None else None
        if shared is not None:
            return shared
        return comm.all_reduce_async(flags, "exchange of non-finite gradient flags",
                                     self.group)

    def finish(self, exchange: Handle | None,
               averaged_finite: Callable[[list[int]], bool | None]) -> bool:
        """Wait for the exchange: True if this step's gradients are usable. Raises
        NonFiniteGradientError in "error" mode when they are not.

        A flagged sum may only have overflowed: then the averaged gradients of the flagged
        parameters -- the same on every rank -- are finite, and every rank lets the step
        be (`averaged_finite` says, or None where they are no longer held whole)."""
        flags, self._flags = self._flags, None
        sums, self._sums = self._sums, []
        if flags is None:
            return True
        if exchange is not None:
            exchange.wait()
        *per_rank, scaling, notices = flags.tolist()
        self._exchanges += 1
        self._notices += abs(notices) > 0.5  # (a complex model's flags are complex)
        bad_ranks = [r for r, v in enumerate(per_rank) if not cmath.isfinite(v)] if self.carried \
            else [r for r, flag in enumerate(per_rank) if flag]
        if not bad_ranks or abs(scaling) > 0.5:  # (complex too)
            return True
        if self.carried:  # the same averaged gradients on every rank: no collective
            everything = list(range(len(self.names)))
            if averaged_finite(everything) is True:  # (one pass: an overflowed sum is the
                return True                          # common false alarm)
            # Those not finite; else those this rank cannot tell of (a joined rank holds no
            # gradients): it must stop with the others, not go on alone.
            checks = [averaged_finite([i]) for i in everything]
            found = [i for i, c in enumerate(checks) if c is False] or \
                [i for i, c in enumerate(checks) if c is None]
            suspects = [found if r in bad_ranks else [] for r in range(len(per_rank))]
        else:
            suspects = comm.all_gather_object(_flagged(sums), "naming the non-finite "
                                              "gradients on each rank", self.group)
        if averaged_finite(sorted({i for indices in suspects for i in indices})) is True:
            return True  # finite values whose sum overflowed: nothing to stop for
        detail = "; ".join(f"rank {r}: first in '{self.names[suspects[r][0]]}'"
                           for r in bad_ranks) if not self.carried or len(bad_ranks) == 1 \
            else f"first in '{self.names[suspects[bad_ranks[0]][0]]}'"
        message = (f"rank {comm.rank_of(self.group)}: synchronised backward "
                   f"{self.backwards}: non-finite gradient (NaN or inf) in the local gradients "
                   f"of rank(s) {bad_ranks} ({detail})")
        if self.mode == "error":
            raise NonFiniteGradientError(
                f"{message}. Stopped before the optimizer step, so the weights and the last "
                "checkpoint are still finite. Look at that rank's batch; or wrap with "
                "DataParallel(..., nonfinite='skip') to drop such steps instead.")
        self.skipped_steps += 1
        log.warning("%s; this step is skipped on every rank (%d so far)", message,
                    self.skipped_steps)
        return False


def _flagged(sums: list[tuple[int, torch.Tensor]]) -> list[int]:
    """The parameters whose local gradient sum was not finite, in registration order."""
    return sorted(index for index, total in sums if not bool(torch.isfinite(total)))
