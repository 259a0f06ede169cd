"""DataParallel: one replica of the model per rank, kept identical by averaging gradients.

Initialisation, in order:
  1. check that every rank built the same model (names, shapes, dtypes): a fingerprint
     exchange, so a mismatch is an error naming the parameter and the ranks, not a hang;
  2. broadcast parameters and buffers from rank 0, so every replica starts identical;
  3. plan gradient buckets and register one readiness hook per trainable parameter.

Each grad-enabled forward then: (under `join`, agrees which ranks still have data),
rebuilds the bucket plan once in arrival order, broadcasts buffers from rank 0, and runs
the module. Backward does the rest (see reducer.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep import zero as zero_mod
from lockstep.algorithms import make_algorithm
from lockstep.buckets import DEFAULT_FIRST_BUCKET_BYTES, MB, default_bucket_mb
from lockstep.compress import make_compression
from lockstep.diagnostics import reporter
from lockstep.reducer import Reducer, trainable
from lockstep.world import current


class ModelMismatchError(RuntimeError):
    """Ranks wrapped models with different parameters or buffers."""


def _describe(module: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    entries = [(f"parameter {n}", tuple(p.shape), str(p.dtype), p.requires_grad)
               for n, p in module.named_parameters()]
    entries += [(f"buffer {n}", tuple(b.shape), str(b.dtype), False)
                for n, b in module.named_buffers()]
    return entries


def verify_replicas_match(module: nn.Module, group: comm.Group = None) -> None:
    """Raise ModelMismatchError on every rank if any rank's model differs from rank 0's."""
    described = _describe(module)
    digest = hashlib.sha256(repr(described).encode()).hexdigest()
    digests = comm.all_gather_object(digest, "model fingerprint exchange", group)
    if len(set(digests)) == 1:
        return
    everyone = comm.all_gather_object(described, "model description exchange", group)
    raise ModelMismatchError(_first_difference(everyone, comm.rank_of(group)))


def _first_difference(described: list[list[tuple[Any, ...]]], me: int) -> str:
    reference = described[0]
    for rank, entries in enumerate(described[1:], start=1):
        for position in range(max(len(reference), len(entries))):
            ours = reference[position] if position < len(reference) else None
            theirs = entries[position] if position < len(entries) else None
            if ours != theirs:
                return (f"rank {me}: DataParallel found different models across ranks: entry "
                        f"{position} is {_fmt(ours)} on rank 0 but {_fmt(theirs)} on rank "
                        f"{rank}. Every rank must build the same model before wrapping it.")
    return f"rank {me}: model fingerprints differ across ranks"


def _fmt(entry: tuple[Any, ...] | None) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad or name.startswith("buffer") else ", frozen"
    return f"{name} (shape {list(shape)}, {dtype.removeprefix('torch.')}{frozen})"


class DataParallel(nn.Module):
    """Wrap `module` for synchronous data-parallel training.

    After `loss.backward()` returns, every trainable parameter's `.grad` holds the average
    over ranks (except inside `no_sync()`), exactly as with torch's
    DistributedDataParallel.

    Args:
        module: the model, already on `lockstep.init().device`.
        bucket_mb: cap on the size of one gradient bucket, in MiB; by default 25, or 4
            for algorithm="shm" (see buckets.default_bucket_mb).
        find_unused: allow parameters that get no gradient on some steps (costs one small
            extra all-reduce per step). Without it such a parameter is an error.
        broadcast_buffers: overwrite buffers (BatchNorm statistics) with rank 0's before
            every grad-enabled forward.
        first_bucket_mb: cap on the first bucket, small so communication starts early.
        group: the process group to average over (default: everyone).
        algorithm: how buckets are summed: "native" (the backend's all-reduce), "ring",
            "tree", "shm" (shared memory, one host) or "hierarchical" (shm inside hosts,
            the network between them). See algorithms.py.
        compress: what goes on the wire: None, "bf16", "fp16", lockstep.PowerSGD(rank=4)
            (`wire_dtype="bf16"` halves its bytes) or lockstep.TopK(ratio). See
            compress.py; `comm_stats()` reports the bytes.
        zero: 0 (plain), 1 (shard optimizer state), 2 (and gradients) or 3 (and
            parameters), with `make_optimizer`. See zero.py. From stage 2 on, gradients
            live in the optimizer's shards, not in `.grad`.
        zero_unit: for stage 3, which modules are gathered as one unit (default: every
            module that owns parameters, i.e. each layer).
    """

    def __init__(self, module: nn.Module, bucket_mb: float | None = None, *,
                 find_unused: bool = False, broadcast_buffers: bool = True,
                 first_bucket_mb: float = DEFAULT_FIRST_BUCKET_BYTES / MB,
                 group: comm.Group = None, algorithm: str = "native",
                 compress: Any = None, zero: int = 0,
                 zero_unit: Callable[[nn.Module], bool] | None = None) -> None:
        super().__init__()
        bucket_mb = default_bucket_mb(algorithm) if bucket_mb is None else bucket_mb
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.world = current()
        self.module = module
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        verify_replicas_match(module, group)
        comm.broadcast_tensors([*module.parameters(), *module.buffers()], 0,
                               "broadcast of rank 0's parameters and buffers", group)
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3; got {zero!r}")
        if zero and (compress is not None or algorithm != "native"):
            raise ValueError("ZeRO stages use their own reduce-scatter and all-gather; they "
                             "take neither compress= nor an algorithm other than 'native'")
        self.zero = zero
        self.algorithm = make_algorithm(algorithm, group, self.world.local_world_size)
        self.compression = make_compression(compress)
        if self.compression is not None:
            if algorithm != "native":
                raise ValueError(f"compress={compress!r} sends its own messages; it works "
                                 f"with algorithm='native', not {algorithm!r}")
            self.compression.bind(group)
        self._bucket_bytes = (int(bucket_mb * MB), int(first_bucket_mb * MB))
        self._find_unused = find_unused
        if zero:
            self._shard(zero_unit)
        self.reducer = self._new_reducer()
        if zero >= 2:  # gradient buffers exist only while a bucket is being reduced
            for bucket in self.reducer.buckets:
                self.sharding.release(bucket)
        self._join: Any = None  # the active Join, when inside `join()`

    def _shard(self, unit: Callable[[nn.Module], bool] | None) -> None:
        """Lay the parameters out in flat groups (ZeRO) and, at stage 3, shard them."""
        self.zero_groups = zero_mod.build_groups(self.module, self.zero, self.group,
                                                 *self._bucket_bytes, unit)
        self.sharding = zero_mod.Sharding(self.zero_groups, self.zero, self.group)
        if self.zero == 3:
            gatherer = zero_mod.Gatherer(self.module, self.zero_groups, self.group)
            self.sharding.on_reduced = gatherer.reduced
            self.sharding.on_step_end = gatherer.end_of_step
            for g in self.zero_groups:
                g.release()  # sharded at rest

    def _new_reducer(self) -> Reducer:
        self._trainable_mask = _requires_grad_mask(self.module)
        if self.zero:
            return Reducer(zero_mod.reducer_params(self.zero_groups), *self._bucket_bytes,
                           self._find_unused, self.group, self.algorithm,
                           sharding=self.sharding)
        return Reducer(trainable(self.module), *self._bucket_bytes, self._find_unused,
                       self.group, self.algorithm, self.compression)

    def make_optimizer(self, optimizer: Any, **kwargs: Any) -> Any:
        """An optimizer for this model's ZeRO stage: `optimizer` is a torch.optim class
        (with its keyword arguments) or a function of the parameters. Plain at stage 0; its
        sharded form otherwise, with the same step/zero_grad/param_groups/state_dict."""
        def make(params: Any) -> torch.optim.Optimizer:
            return optimizer(params, **kwargs)

        if not self.zero:
            return make(self.parameters())
        return zero_mod.ZeroOptimizer(self.zero_groups, self.zero, self.group, make)

    def _follow_requires_grad(self) -> None:
        """Parameters frozen or unfrozen since the reducer was built (a backbone unfrozen
        after warmup, say) need new hooks and buckets. Every rank must make the same change
        at the same step; the rebuild checks that they did."""
        if _requires_grad_mask(self.module) == self._trainable_mask:
            return
        if self.zero:
            raise ValueError(f"rank {comm.rank_of(self.group)}: requires_grad changed after "
                             "wrapping with zero>0; the sharded layout is fixed: wrap again")
        masks = comm.all_gather_object(_requires_grad_mask(self.module), "agreeing on which "
                                       "parameters are trainable after requires_grad changed",
                                       self.group)
        if any(mask != masks[0] for mask in masks):
            names = [n for n, p in self.module.named_parameters()]
            first = next(i for i in range(len(names)) if len({m[i] for m in masks}) > 1)
            raise ModelMismatchError(
                f"rank {comm.rank_of(self.group)}: requires_grad of '{names[first]}' changed "
                "on some ranks but not others; freeze and unfreeze on every rank alike")
        self.reducer.detach()
        self.reducer = self._new_reducer()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._before_training_forward()
        return self.module(*args, **kwargs)

    def _before_training_forward(self) -> None:
        """The collectives every grad-enabled forward issues, in this fixed order. A joined
        rank's shadow step (join.py) issues the same ones."""
        if self._join is not None:
            self._join.agree_on_active(active=True)
        self._follow_requires_grad()
        self.reducer.prepare_forward()
        self.sync_buffers()
        reporter.advance()

    def sync_buffers(self) -> None:
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                src = self._join.source_rank() if self._join is not None else 0
                comm.broadcast_tensors(buffers, src, "broadcast of buffers", self.group)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces all of them."""
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    @contextmanager
    def join(self, optimizers: Sequence[torch.optim.Optimizer] = (),
             sync_final_model: bool = True) -> Iterator[None]:
        """Train on uneven inputs: a rank that runs out of batches early keeps matching the
        others' collectives (contributing nothing) until every rank is done. Gradients are
        averaged over the ranks that still had data.

        Pass the optimizers: ranks that stopped early skipped steps, so at the end their
        state (momentum, Adam moments) is replaced by that of a rank that trained to the
        end, along with the parameters and buffers -- otherwise replicas drift apart on the
        next step. Each grad-enabled forward inside must be followed by one backward.
        """
        from lockstep.join import Join  # join builds on this class

        self._join = Join(self, list(optimizers), sync_final_model)
        try:
            yield
            self._join.finish()
        finally:
            self._join = None

    def bucket_sizes_mb(self) -> list[float]:
        return self.reducer.bucket_sizes_mb()

    def comm_stats(self) -> dict[str, float]:
        """Bytes this rank sent in the last synchronised step, what an uncompressed
        reduction would have sent, and their ratio."""
        stats = dict(self.reducer.stats)
        sent = stats["bytes_sent"]
        return {**stats, "compression_ratio": stats["bytes_uncompressed"] / sent if sent else 1.0}

    def close(self) -> None:
        """Stop reducing gradients and release the algorithm's thread and shared memory.
        The module keeps working on its own afterwards."""
        self.reducer.detach()
        self.algorithm.close()
        if self.compression is not None:
            self.compression.close()


def _requires_grad_mask(module: nn.Module) -> tuple[bool, ...]:
    return tuple(p.requires_grad for p in module.parameters())
