"""What each compression costs per step, measured on lockstep's compressor itself.

The compressors (replication/compress.py) are run on this rank's real gradients, laid out
in the buckets DataParallel would make. The cast runs through an all-reduce that sends
nothing, over a group of this rank alone: everything it does but the wire, which wire.py
times apart (one all-reduce of the cast bucket). PowerSGD and TopK run through the job's
own group, every rank at once, and their seconds include their wire: each makes several
small collectives with work between them (products and orthonormalisation, selection and
scatter), and at each one every rank waits for the last to arrive -- ranks sharing cores
drift apart within a step -- which the sum of their parts, each collective timed with the
ranks already together, left out: on 2 and 4 emulated hosts that sum put TopK 7-31% under
its measured step in every cell (the MNIST CNN and the char-GPT, 1 Gbit/s and 100 Mbit/s)
and PowerSGD 12-23% under in seven of eight. (The arithmetic alone had said 1.3 ms for TopK
on the CNN, where the compressor in a training step cost 4.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from lockstep import comm
from lockstep.replication.algorithms import AllReduce, Native
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


WITH_WIRE = ("powersgd", "topk")
"""The compressors whose seconds include their collectives on the job's own group."""


def compressor_seconds(params: Sequence[nn.Parameter], alone: comm.Group, repeats: int = 12
                       ) -> dict[str, float]:
    """Mean seconds of one step of each compressor over `params`' gradients (set): the
    cast's collective over `alone` (group_of_one), sending nothing; PowerSGD's and TopK's
    over the job's group (WITH_WIRE). Collective: every rank measures at once."""
    slots = [ParamSlot(i, p.numel(), str(p.dtype), p.element_size())
             for i, p in enumerate(params)]
    specs = plan_before_backward(slots, int(DEFAULT_BUCKET_MB * MB))
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    seconds = {}
    for name, make in COMPRESSORS.items():
        compressor = make()
        try:
            if name in WITH_WIRE:
                compressor.wrap(Native(None), world_size=comm.size_of())
            else:
                compressor.wrap(_NoWire(alone), world_size=1)
            buckets = [Bucket(i, spec, params, f"bucket {i}", compressor)
                       for i, spec in enumerate(specs)]
            _one_step(compressor, buckets, grads)  # (its thread and buffers started)
            comm.barrier(f"advisor: time the {name} compressor")
            # The mean, as a training step's time is: a compressor's waits have a long tail
            seconds[name] = statistics.fmean(
                _one_step(compressor, buckets, grads) for _ in range(repeats))
        finally:
            compressor.close()
    return seconds


def _one_step(compressor: Compression, buckets: list[Bucket],
              grads: list[torch.Tensor]) -> float:
    for bucket in buckets:  # (filling the buckets is DataParallel's work in every mode)
        for view, index in zip(bucket.views, bucket.spec.param_indices, strict=True):
            view.copy_(grads[index])
    _synchronize(grads[0].device)
    started = time.perf_counter()
    for handle in [compressor.start(bucket) for bucket in buckets]:
        handle.wait()
    compressor.finish(buckets)
    _synchronize(grads[0].device)  # (on a GPU, the kernels and NCCL's work are queued)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
