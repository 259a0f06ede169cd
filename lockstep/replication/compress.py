"""What goes on the wire: gradient compression for slow networks.

A compressor takes over a bucket's reduction at its launch: the bucket holds this rank's
gradients, already scaled by 1/N, and must end holding (an approximation of) their sum.
It runs on a thread of its own, taking buckets in launch order, over a process group of
its own; gradient accumulation (no_sync) happens in the bucket before it, so the two
compose.

- Cast("bf16" | "fp16"): send the bucket in 16 bits and widen it back. Gradients are
  divided by N before the sum, so fp16 cannot overflow where fp32 would not.
- PowerSGD(rank): each matrix-shaped gradient M (rows x cols) is replaced by a rank-r
  approximation P Q^T found by one step of power iteration from last step's Q (warm start):
  P = M Q, all-reduced and orthonormalised; Q = M^T P, all-reduced. What the approximation
  missed is kept and added to the next step's gradient (error feedback), so nothing is lost
  for good (Vogels et al. 2019). Vectors and small matrices travel uncompressed, and the
  first `warmup_steps` steps are sent whole while the warm-started Q settles. With
  `wire_dtype="bf16"` the factors and the uncompressed part travel in 16 bits, half the
  bytes; error feedback takes up the rounding too.
- TopK(ratio): each rank sends only its largest `ratio` of entries (values and indices,
  all-gathered) and keeps the rest as error feedback; it too takes `warmup_steps`.

Each compressor counts the bytes it sends per step; DataParallel.comm_stats() reports them
next to what an uncompressed reduction would have sent. What decides its next steps -- the
step count, PowerSGD's Q, and each rank's own error feedback -- it offers a checkpoint
(`checkpoint_tensors`), keyed by parameter index so that a resumed run finds it again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch._utils import _unflatten_dense_tensors

from lockstep import comm
from lockstep.replication.algorithms import AllReduce, Worker
from lockstep.replication.reduction import Bucket, Handle, Reduction


class Compression(Reduction):
    """A reduction that changes what goes on the wire, summing through the algorithm it
    wraps (`wrap`). It reduces one bucket at a time on its own thread, so the wrapped
    algorithm runs over a process group of its own (a cast, cheap enough for the backward
    thread, overrides `start` and never needs the thread)."""

    name = "?"
    warmup_steps = 0  # synchronised steps sent uncompressed before compression starts
    _steps: torch.Tensor | None = None  # synchronised steps so far (a checkpoint fills it)

    @property
    def step(self) -> int:
        return int(self._counter()[0])

    def _counter(self) -> torch.Tensor:
        if self._steps is None:
            self._steps = torch.zeros(1, dtype=torch.int64)
        return self._steps

    def checkpoint_tensors(self, params: Sequence[torch.nn.Parameter]
                           ) -> dict[str, torch.Tensor]:
        """What decides the next steps, as tensors a checkpoint saves and a resume fills in
        place; names starting with PER_RANK are each rank's own. `params`: the reducer's."""
        return {}

    def wrap(self, algorithm: AllReduce, world_size: int) -> None:
        """Take over reducing buckets, summing through `algorithm`. Collective: it may
        create a process group on every rank; refused for algorithms that sum only their
        own buffers."""
        self.inner = algorithm.for_compressor()
        self.group = self.inner.group  # type: ignore[attr-defined]
        self.world_size = world_size
        self._worker: Worker | None = None  # started with the first bucket it reduces
        self._sent = 0

    def start(self, bucket: Bucket) -> Handle:
        if self._worker is None:
            self._worker = Worker(f"compress-{self.name}")
        return self._worker.submit(self.reduce_bucket, bucket)

    def reduce_bucket(self, bucket: Bucket) -> None:
        if self.step < self.warmup_steps:
            self._all_reduce(bucket.flat, f"{self.name} warm-up all-reduce of {bucket.label}")
        else:
            self.compress_bucket(bucket)

    def compress_bucket(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def finish(self, buckets: Any) -> None:
        self._counter().add_(1)

    def sent_bytes(self, buckets: Any) -> int:
        sent, self._sent = self._sent, 0
        return sent

    def _all_reduce_async(self, tensor: torch.Tensor, what: str) -> Handle:
        self._sent += tensor.numel() * tensor.element_size()
        return self.inner.all_reduce(tensor, what)

    def _all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        self._all_reduce_async(tensor, what).wait()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self.inner.close()


PER_RANK = "per-rank."
"""Starts the name of a checkpoint tensor that is each rank's own (error feedback): saved by
every rank and restored on the rank of the same number."""

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Cast(Compression):
    carries_flags = True  # (0, NaN and small whole numbers are exact in bf16 and fp16)

    def __init__(self, dtype: str) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"cast compression is 'bf16' or 'fp16', not {dtype!r}")
        self.name, self.dtype = dtype, HALF_DTYPES[dtype]

    def start(self, bucket: Bucket) -> Handle:
        """No thread: the cast is cheap, so the narrow all-reduce starts at once on the
        backward thread, and several buckets can be on the wire together (in order)."""
        narrow = bucket.flat.to(self.dtype)
        pending = self._all_reduce_async(narrow, f"{self.name} all-reduce of {bucket.label}")
        return _WidenWhenDone(pending, narrow, bucket.flat)


class _WidenWhenDone:
    def __init__(self, pending: Handle, narrow: torch.Tensor, flat: torch.Tensor) -> None:
        self.pending, self.narrow, self.flat = pending, narrow, flat

    def wait(self) -> None:
        self.pending.wait()
        self.flat.copy_(self.narrow)


class PowerSGD(Compression):
    """Rank-`rank` PowerSGD with error feedback and warm start.

    Args:
        rank: the approximation's rank r; a (n x m) matrix sends r(n + m) numbers.
        warmup_steps: steps sent uncompressed first.
        min_compression: compress a matrix only if it shrinks at least this many times.
        seed: seeds the initial Q, identically on every rank.
        wire_dtype: None to send fp32, or "bf16" / "fp16" to send the factors and the
            uncompressed part in half the bytes (warm-up steps still go in fp32).
    """

    name = "powersgd"
    carries_flags = True  # (they travel with the part sent whole)

    def __init__(self, rank: int = 4, warmup_steps: int = 10, min_compression: float = 2.0,
                 seed: int = 0, wire_dtype: str | None = None) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        if wire_dtype is not None and wire_dtype not in HALF_DTYPES:
            raise ValueError(f"PowerSGD wire_dtype is None, 'bf16' or 'fp16', not {wire_dtype!r}")
        self.rank, self.warmup_steps = rank, warmup_steps
        self.min_compression, self.seed = min_compression, seed
        self.wire_dtype = HALF_DTYPES[wire_dtype] if wire_dtype else torch.float32
        # Per parameter, by its index in the reducer's list (the same in a resumed run):
        self._errors: dict[int, torch.Tensor] = {}  # what was not sent yet (this rank's)
        self._qs: dict[int, torch.Tensor] = {}      # last step's Q (the same everywhere)

    def _compressible(self, view: torch.Tensor) -> bool:
        return powersgd_compresses(tuple(view.shape), self.rank, self.min_compression)

    def compress_bucket(self, bucket: Bucket) -> None:
        label = bucket.label
        matrices: list[tuple[int, torch.Tensor]] = []
        vectors: list[torch.Tensor] = []
        for index, v in zip(bucket.spec.param_indices, bucket.views, strict=True):
            if self._compressible(v):
                matrices.append((index, v.view(v.shape[0], -1)))
            else:
                vectors.append(v)
        if bucket.extra:  # the non-finite flags (0 or NaN each: exact in 16 bits too)
            vectors.append(bucket.carried())
        in_flight = None
        if vectors:  # one all-reduce for everything sent whole, overlapping the P products
            whole = self._packed(vectors)
            in_flight = self._all_reduce_async(whole, f"PowerSGD uncompressed part of {label}")
        if matrices:
            self._compress(matrices, label)
        if in_flight is not None:
            in_flight.wait()
            _copy_back(whole, vectors)

    def _compress(self, matrices: list[tuple[int, torch.Tensor]], label: str) -> None:
        locals_ = []
        for key, m in matrices:  # error feedback: add what earlier steps did not send
            if key in self._errors:
                m.add_(self._errors[key])
            locals_.append(m.clone())
        qs = [self._q(key, m) for key, m in matrices]
        ps = [m @ q for (_, m), q in zip(matrices, qs, strict=True)]  # (rows, r) each
        self._all_reduce_list(ps, f"PowerSGD P of {label}")
        ps = [torch.linalg.qr(p, mode="reduced").Q for p in ps]  # identical on every rank
        qs = [m.T @ p for (_, m), p in zip(matrices, ps, strict=True)]  # (cols, r) each
        self._all_reduce_list(qs, f"PowerSGD Q of {label}")
        for (key, m), p, q, mine in zip(matrices, ps, qs, locals_, strict=True):
            torch.mm(p, q.T, out=m)  # the approximated sum, in the bucket
            # This rank's share of what the approximation missed: its own (scaled)
            # gradient minus 1/N of the sum's approximation; shares add up to the miss.
            self._errors[key] = mine.sub_(m, alpha=1.0 / self.world_size)
            self._qs[key] = q

    def drop_step(self, buckets: Any) -> None:
        """A step dropped for a non-finite gradient: its error feedback and its Q hold the
        NaN too, and would bring it into the next step's gradients after the flags were
        summed (they sum each rank's gradients before the feedback is added): start again
        as at the first compressed step, on every rank alike."""
        self._errors.clear()
        self._qs.clear()

    def _q(self, key: int, m: torch.Tensor) -> torch.Tensor:
        if key not in self._qs:  # the same random start on every rank, whenever it is made
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
            self._qs[key] = torch.randn(m.shape[1], self.rank, generator=generator,
                                        dtype=m.dtype).to(m.device)
        return self._qs[key]

    def checkpoint_tensors(self, params: Sequence[torch.nn.Parameter]
                           ) -> dict[str, torch.Tensor]:
        """The step count, each matrix's Q, and this rank's error feedback. State not made
        yet (in warm-up) is made now, as it would be: zero error, Q from its seed."""
        out = {"powersgd.steps": self._counter()}
        for i, p in enumerate(params):
            if not self._compressible(p):
                continue
            if i not in self._errors:
                self._errors[i] = torch.zeros(p.shape[0], p.numel() // p.shape[0],
                                              dtype=p.dtype, device=p.device)
            out[f"powersgd.q.{i}"] = self._q(i, self._errors[i])
            out[f"{PER_RANK}powersgd.error.{i}"] = self._errors[i]
        return out

    def _all_reduce_list(self, tensors: list[torch.Tensor], what: str) -> None:
        flat = self._packed(tensors)
        self._all_reduce(flat, what)
        _copy_back(flat, tensors)

    def _packed(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """`tensors` flattened into one, in the wire's dtype: what one all-reduce sends
        (`_copy_back` unpacks it)."""
        return torch.cat([t.reshape(-1) for t in tensors]).to(self.wire_dtype)


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy `flat`, laid out as torch.cat of the flattened `tensors`, back into them
    (widening it to their dtype if it travelled narrower)."""
    torch._foreach_copy_(tensors, list(_unflatten_dense_tensors(flat, tensors)))


def powersgd_compresses(shape: tuple[int, ...], rank: int, min_compression: float) -> bool:
    """Whether PowerSGD sends a gradient of `shape` as rank-`rank` factors: a matrix (rows x
    the rest) that they shrink at least `min_compression` times."""
    if len(shape) < 2 or shape[0] == 0:
        return False
    rows, cols = shape[0], math.prod(shape) // shape[0]
    return rows * cols >= min_compression * rank * (rows + cols)


class TopK(Compression):
    """Send the largest `ratio` of each bucket's entries; keep the rest as error feedback.

    Args:
        ratio: the fraction of entries each rank sends.
        warmup_steps: steps sent uncompressed first (the early, fast-changing gradients).
    """

    name = "topk"
    carries_flags = True  # (they travel with the values, each rank's whole)

    def __init__(self, ratio: float = 0.01, warmup_steps: int = 0) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"TopK ratio must be in (0, 1], got {ratio}")
        self.ratio, self.warmup_steps = ratio, warmup_steps
        # Per parameter, by its index in the reducer's list: a plan rebuilt in arrival
        # order, or a resumed run, finds each residual again.
        self._errors: dict[int, torch.Tensor] = {}

    def compress_bucket(self, bucket: Bucket) -> None:
        spec, extra = bucket.spec, bucket.extra
        flat = bucket.flat[:bucket.flat.numel() - extra]
        for index, view in zip(spec.param_indices, bucket.views, strict=True):
            if index in self._errors:
                view.add_(self._errors[index].view_as(view))
        k = max(1, int(self.ratio * flat.numel()))
        indices = flat.abs().topk(k, sorted=False).indices
        values = flat[indices]
        residual = flat.clone()
        residual[indices] = 0
        for index, offset, p in zip(spec.param_indices, spec.offsets, bucket.params,
                                    strict=True):
            self._errors[index] = residual[offset:offset + p.numel()]
        # int32 indices: half the bytes of int64, enough for any bucket under 8 GB.
        everyone_i = torch.empty(self.world_size * k, dtype=torch.int32, device=flat.device)
        everyone_v = torch.empty(self.world_size, k + extra, dtype=flat.dtype,
                                 device=flat.device)
        comm.all_gather_into(everyone_i, indices.to(torch.int32),
                             f"TopK indices of {bucket.label}", self.group)
        # The non-finite flags (the last bucket's `extra` elements) ride with the values
        sent = torch.cat([values, bucket.carried()]) if extra else values
        comm.all_gather_into(everyone_v.view(-1), sent, f"TopK values of {bucket.label}",
                             self.group)
        self._sent += k * 4 + (k + extra) * values.element_size()
        flat.zero_()
        flat.index_add_(0, everyone_i.long(), everyone_v[:, :k].reshape(-1))
        if extra:
            torch.sum(everyone_v[:, k:], dim=0, out=bucket.carried())

    def drop_step(self, buckets: Any) -> None:
        """A step dropped for a non-finite gradient: its error feedback holds the NaN too
        (see PowerSGD.drop_step): none is carried on."""
        self._errors.clear()

    def checkpoint_tensors(self, params: Sequence[torch.nn.Parameter]
                           ) -> dict[str, torch.Tensor]:
        """The step count and this rank's error feedback (zero where none is kept yet)."""
        out = {"topk.steps": self._counter()}
        for i, p in enumerate(params):
            if i not in self._errors:
                self._errors[i] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            out[f"{PER_RANK}topk.error.{i}"] = self._errors[i]
        return out


def make_compression(spec: Any) -> Compression | None:
    """None, "bf16", "fp16", or a Compression instance (PowerSGD(...), TopK(...))."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, Compression):
        return spec
    if isinstance(spec, str):
        return Cast(spec)
    raise ValueError(f"compress must be None, 'bf16', 'fp16', lockstep.PowerSGD(...) or "
                     f"lockstep.TopK(...); got {spec!r}")
