"""The seam: how one gradient bucket travels from this rank's backward to the average.

A `Reduction` answers four questions for the Reducer, which asks nothing else and never
which kind it holds:

    allocate  where a bucket's flat buffer lives (plain memory, memory the host's ranks
              share, a buffer padded to split into equal shards)
    absorb    how a fresh gradient enters its slot of the buffer (scaled by 1/N on the way)
    start     how the bucket is summed across ranks (an all-reduce, a ring, shared memory,
              a compressed exchange, a reduce-scatter into a shard); returns a handle
    finish    what follows once every bucket of a backward is done (a barrier, error
              feedback's step count, handing shards to the optimizer)

and, around them: which buckets to make (`plan`, fixed for ZeRO), memory that comes and
goes (`materialize`), the bytes a step sent, dropping a step, and closing. The algorithms
(algorithms.py), the compressors that wrap one (compress.py) and ZeRO's sharded reduction
(zero.py) implement it; so can a user: subclass `Reduction`, or `AllReduce` for a new way
to sum a flat tensor, and pass an instance as `DataParallel(..., reduction=...)`.

Torch's DDP exposes the same seam as comm hooks (a function from a bucket to a future);
here it is a type, so the buffer's placement and the end of the step belong to it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from lockstep.replication.buckets import BucketSpec, ParamSlot, plan_buckets


class Handle(Protocol):
    def wait(self) -> None: ...


class Done:
    """The handle of a reduction that finished before it was returned."""

    def wait(self) -> None:
        """Already complete."""


def scaled_copy(grad: torch.Tensor, view: torch.Tensor, scale: float) -> None:
    if scale != 1.0:
        torch.mul(grad, scale, out=view)
    else:
        view.copy_(grad)


def adopt_gradient(param: torch.Tensor, view: torch.Tensor, scale: float,
           reduction: Reduction | None = None, bucket: Bucket | None = None) -> None:
    """Bring `param`'s gradient into its bucket slot, scaled, in one pass over memory, and
    point `.grad` at the slot.

    Scaling by 1/N here, as the gradient enters the bucket, replaces a separate division
    pass over every bucket after the all-reduce (and the sum of pre-scaled values cannot
    overflow in low precision). A fresh tensor from autograd (after
    zero_grad(set_to_none=True)) is handed to the reduction, which may move only what its
    peers will read (see HostSlices.absorb); one already in the slot is scaled in place.
    """
    grad = param.grad
    assert grad is not None
    if grad is view:
        if scale != 1.0:
            view.mul_(scale)
        return
    if torch.is_grad_enabled():  # create_graph: the gradient has a graph; take its values
        with torch.no_grad():
            _move(grad, view, scale, reduction, bucket)
    elif reduction is None:  # backward without create_graph runs its hooks so (no_grad's
        scaled_copy(grad, view, scale)  # cost, and _move's call, per gradient)
    else:
        _move(grad, view, scale, reduction, bucket)
    param.grad = view


def _move(grad: torch.Tensor, view: torch.Tensor, scale: float, reduction: Reduction | None,
          bucket: Bucket | None) -> None:
    if reduction is None or bucket is None:
        scaled_copy(grad, view, scale)
    else:
        reduction.absorb(grad, view, scale, bucket)


class Bucket:
    """One flat gradient buffer and the parameters whose `.grad` are views into it."""

    def __init__(self, index: int, spec: BucketSpec, params: Sequence[torch.nn.Parameter],
                 label: str, reduction: Reduction, extra: int = 0) -> None:
        self.index, self.spec = index, spec  # index: its place in the plan (launch order)
        self.params = [params[i] for i in spec.param_indices]
        first = self.params[0]
        self.extra = extra  # elements past the buffer that travel with it (the finite flags)
        self.flat = reduction.allocate(reduction.buffer_numel(spec) + extra, first.dtype,
                                       first.device)
        self.views = [self.flat[offset:offset + p.numel()].view_as(p)
                      for offset, p in zip(spec.offsets, self.params, strict=True)]
        self.waiting = len(self.params)  # parameters not yet ready in this backward
        self.pending: Handle | None = None
        self.label = label
        reduction.release(self)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def carried(self) -> torch.Tensor:
        """The `extra` elements at the end of the buffer."""
        return self.flat[self.flat.numel() - self.extra:]


class Reduction:
    """How a bucket travels. The defaults describe plain memory and a plan of ~25 MB
    buckets in arrival order; `start` is what every reduction must say."""

    name = "?"
    # The reducer scales each gradient by 1/N as it enters its bucket, so `start` sums.
    # False: buckets hold this rank's gradients as they are, and `start` averages
    # (DDP's communication hooks expect that; commhook.py).
    prescale = True
    # Whether the last bucket's `extra` elements (Bucket.carried) arrive summed exactly on
    # every rank -- an all-reduce sums every element; a compressor may send them whole
    # beside its own -- so the ranks' non-finite flags ride there instead of in a
    # collective of their own (nonfinite.py).
    carries_flags = False
    # Whether `plan` ignores the order it is given (ZeRO's buckets are its shards' layout):
    # then the order gradients arrive in is not learned, nor shared after the first step.
    fixed_plan = False

    def plan(self, slots: Sequence[ParamSlot], cap_bytes: int,
             first_cap_bytes: int) -> list[BucketSpec]:
        """The buckets for parameters taken in the order of `slots`."""
        return plan_buckets(slots, cap_bytes, first_cap_bytes)

    def buffer_numel(self, spec: BucketSpec) -> int:
        """Elements of a bucket's buffer (more than its parameters' when padded)."""
        return spec.numel

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def connect(self) -> None:
        """The buckets are made (all of them, in `Reducer._build`): finish what they need
        among the ranks (on a host, one exchange maps every peer's memory)."""

    def materialize(self, bucket: Bucket) -> None:
        """Make the bucket's memory present before a gradient is written into it."""

    def release(self, bucket: Bucket) -> None:
        """The bucket may give its memory up until the next `materialize` (called once it
        is made; a reduction that frees buckets after summing calls it itself)."""

    def absorb(self, grad: torch.Tensor, view: torch.Tensor, scale: float,
               bucket: Bucket) -> None:
        """Move a fresh gradient, times `scale`, into its slot `view` of the bucket."""
        scaled_copy(grad, view, scale)

    def start(self, bucket: Bucket) -> Handle:
        """Begin summing the bucket (its gradients already scaled by 1/N) across ranks."""
        raise NotImplementedError

    def finish(self, buckets: Sequence[Bucket]) -> None:
        """Every bucket of a synchronised backward has been waited for."""

    def share_flags(self, flags: torch.Tensor) -> Handle | None:
        """Begin summing a small tensor of per-rank flags in place (the non-finite check's,
        where they do not ride in a bucket) in a way of this reduction's own, waited on
        after `finish`; None: by an all-reduce over the group, as any small tensor."""
        return None

    def sent_bytes(self, buckets: Sequence[Bucket]) -> int:
        """What this rank put on the wire in the step that just finished."""
        return sum(b.nbytes for b in buckets)

    def drop_step(self, buckets: Sequence[Bucket]) -> None:
        """The step's gradients are not to be used (a non-finite one somewhere)."""

    def free(self, flat: torch.Tensor) -> None:
        """A buffer from `allocate` is no longer used (the plan was rebuilt)."""

    def reset(self) -> None:
        """A backward ended without waiting for its buckets (it raised): forget them."""

    def close(self) -> None:
        """Release threads, process groups and memory."""
