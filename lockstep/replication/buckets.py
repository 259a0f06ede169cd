"""Bucket planning: which gradients travel together, and where each sits in its flat buffer.

Pure functions of integers -- no tensors, no processes -- so the plan is unit-tested alone
and is identical on every rank by construction (each rank computes it from the same sizes).

Why buckets: one all-reduce per parameter pays the network latency hundreds of times per
step; one all-reduce for everything cannot start until backward ends. Buckets of ~25 MB,
filled in the order gradients become ready (reverse registration order: the last layer's
gradients arrive first), overlap communication with the rest of backward. The first bucket
is small so communication starts as early as possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MB  # as torch DDP: get the wire busy early
DEFAULT_BUCKET_MB = 25.0  # as torch DDP


def default_bucket_mb(algorithm: str) -> float:
    """The bucket cap when the user gives none. Over a network, torch DDP's 25 MB amortises
    each message's latency. Summing through shared memory has no latency to amortise but
    runs at half speed once a bucket's copies outgrow the caches (probe_host on this
    machine: 16-23 GB/s at 2-8 MB, 7-12 at 32 MB), so "shm" takes 4 MB buckets, summed
    while backward's writes to them are still in cache."""
    return 4.0 if algorithm == "shm" else DEFAULT_BUCKET_MB


@dataclass(frozen=True)
class ParamSlot:
    """What planning needs to know about one parameter."""

    index: int          # position in the model's list of trainable parameters
    numel: int
    dtype: str          # e.g. "torch.float32"; buckets never mix dtypes
    element_size: int   # bytes per element

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class BucketSpec:
    """One flat buffer: its parameters in fill order and each one's offset in elements."""

    dtype: str
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int


def plan_buckets(slots: Sequence[ParamSlot], cap_bytes: int,
                 first_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES) -> list[BucketSpec]:
    """Group parameters, taken in the given order, into buckets.

    Each dtype fills its own open bucket; a bucket closes when the next parameter would push
    it past its cap (the first bucket of each dtype has the smaller `first_cap_bytes`). A
    parameter larger than the cap gets a bucket of its own. Buckets come back in the order of
    their first parameter, which is the order they become ready during backward.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    open_buckets: dict[str, list[ParamSlot]] = {}
    open_bytes: dict[str, int] = {}
    closed_per_dtype: dict[str, int] = {}
    finished: list[list[ParamSlot]] = []

    for slot in slots:
        dtype = slot.dtype
        cap = cap_bytes if closed_per_dtype.get(dtype, 0) else min(first_cap_bytes, cap_bytes)
        current = open_buckets.setdefault(dtype, [])
        if current and open_bytes[dtype] + slot.nbytes > cap:
            finished.append(current)
            closed_per_dtype[dtype] = closed_per_dtype.get(dtype, 0) + 1
            current = open_buckets[dtype] = []
            open_bytes[dtype] = 0
        current.append(slot)
        open_bytes[dtype] = open_bytes.get(dtype, 0) + slot.nbytes
    finished.extend(b for b in open_buckets.values() if b)

    position = {slot.index: i for i, slot in enumerate(slots)}
    finished.sort(key=lambda bucket: position[bucket[0].index])
    return [_layout(bucket) for bucket in finished]


def _layout(bucket: list[ParamSlot]) -> BucketSpec:
    offsets, total = [], 0
    for slot in bucket:
        offsets.append(total)
        total += slot.numel
    return BucketSpec(bucket[0].dtype, tuple(s.index for s in bucket), tuple(offsets), total)


def reverse_registration_order(num_params: int) -> list[int]:
    """The default fill order before any backward has been seen."""
    return list(range(num_params - 1, -1, -1))


def plan_before_backward(slots: Sequence[ParamSlot], cap_bytes: int,
                         first_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES) -> list[BucketSpec]:
    """The buckets of `slots` (in registration order) before any backward has been seen:
    filled in reverse registration order, the order gradients usually arrive in."""
    order = reverse_registration_order(len(slots))
    return plan_buckets([slots[i] for i in order], cap_bytes, first_cap_bytes)


def arrival_order(arrived: Sequence[int], num_params: int) -> list[int]:
    """The order gradients actually arrived, completed by the ones that never did (unused
    parameters) in reverse registration order, so every parameter has a place."""
    seen = set(arrived)
    if len(seen) != len(arrived) or not seen <= set(range(num_params)):
        raise ValueError("arrival order must list distinct parameter indices")
    return list(arrived) + [i for i in reverse_registration_order(num_params) if i not in seen]
