"""Each compression's own work per step, measured on lockstep's compressor itself.

The compressors (replication/compress.py) are run on this rank's real gradients, laid out
in the buckets DataParallel would make, through an all-reduce that sends nothing over a
group of this rank alone: everything they do -- casts, PowerSGD's products and
orthonormalisation, TopK's selection and scatter, their threads and bookkeeping -- but the
wire, which wire.py times apart. (The arithmetic alone had said 1.3 ms for TopK on the
MNIST CNN, where the compressor in a training step cost 4.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from lockstep import comm
from lockstep.replication.algorithms import AllReduce
from lockstep.replication.buckets import (
    DEFAULT_BUCKET_MB,
    MB,
    ParamSlot,
    plan_before_backward,
)
from lockstep.replication.compress import (
    Cast,
    Compression,
    PowerSGD,
    TopK,
    powersgd_compresses,
)
from lockstep.replication.reduction import Bucket, Done, Handle

POWERSGD_RANK, TOPK_RATIO = 4, 0.01  # the compressions the advisor weighs (their defaults)

COMPRESSORS: dict[str, Callable[[], Compression]] = {
    "bf16": lambda: Cast("bf16"),
    "powersgd": lambda: PowerSGD(POWERSGD_RANK, warmup_steps=0),
    "topk": lambda: TopK(TOPK_RATIO),
}


class _NoWire(AllReduce):
    """An all-reduce that sends nothing, over a group of this rank alone."""

    name = "none"

    def __init__(self, alone: comm.Group) -> None:
        self.group = alone

    def all_reduce(self, flat: torch.Tensor, label: str) -> Handle:
        return Done()

    def for_compressor(self) -> AllReduce:
        return self


def group_of_one() -> comm.Group:
    """A process group of this rank alone. Collective: every rank makes every rank's."""
    return [comm.new_group([r]) for r in range(comm.size_of())][comm.rank_of()]


def compressor_work(params: Sequence[nn.Parameter], alone: comm.Group, repeats: int = 5
                    ) -> dict[str, float]:
    """Median seconds of one step of each compressor over `params`' gradients (set), its
    collectives over `alone` (group_of_one)."""
    slots = [ParamSlot(i, p.numel(), str(p.dtype), p.element_size())
             for i, p in enumerate(params)]
    specs = plan_before_backward(slots, int(DEFAULT_BUCKET_MB * MB))
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    seconds = {}
    for name, make in COMPRESSORS.items():
        compressor = make()
        compressor.wrap(_NoWire(alone), world_size=1)
        buckets = [Bucket(i, spec, params, f"bucket {i}", compressor)
                   for i, spec in enumerate(specs)]
        seconds[name] = statistics.median(
            _one_step(compressor, buckets, grads) for _ in range(repeats))
        compressor.close()
    return seconds


def _one_step(compressor: Compression, buckets: list[Bucket],
              grads: list[torch.Tensor]) -> float:
    for bucket in buckets:  # (filling the buckets is DataParallel's work in every mode)
        for view, index in zip(bucket.views, bucket.spec.param_indices, strict=True):
            view.copy_(grads[index])
    started = time.perf_counter()
    for handle in [compressor.start(bucket) for bucket in buckets]:
        handle.wait()
    compressor.finish(buckets)
    return time.perf_counter() - started


def powersgd_numels(shapes: Iterable[tuple[int, ...]]) -> tuple[int, int, int]:
    """Floats PowerSGD sends per step: (the P factors, the Q factors, what travels whole)."""
    p = q = whole = 0
    least = PowerSGD(POWERSGD_RANK).min_compression
    for shape in shapes:
        numel = int(torch.Size(shape).numel())
        if powersgd_compresses(shape, POWERSGD_RANK, least):
            p += shape[0] * POWERSGD_RANK
            q += numel // shape[0] * POWERSGD_RANK
        else:
            whole += numel
    return p, q, whole
