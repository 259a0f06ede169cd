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

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.comm.diagnostics import reporter
from lockstep.comm.world import current
from lockstep.eager import eager
from lockstep.logs import get_logger
from lockstep.replication import memory
from lockstep.replication.buckets import DEFAULT_FIRST_BUCKET_BYTES, MB, default_bucket_mb
from lockstep.replication.choices import check_combination, make_reduction, resolve_algorithm
from lockstep.replication.commhook import install
from lockstep.replication.consistency import (
    LEVELLED_ELSEWHERE,
    ModelMismatchError,
    verify_replicas_match,
)
from lockstep.replication.ddp_args import (
    check_trainable,
    pick,
    read_ddp_arguments,
    requires_grad_mask,
    trainable,
)
from lockstep.replication.drift import replicated
from lockstep.replication.join import Join, JoinHook
from lockstep.replication.join_hook import ReplicaJoinHook
from lockstep.replication.nonfinite import check_mode
from lockstep.replication.ownership import Owned, claim, owner_of
from lockstep.replication.precision import LossScaler
from lockstep.replication.reducer import Reducer
from lockstep.replication.reduction import Reduction

log = get_logger(__name__)


class DataParallel(nn.Module):
    """Wrap `module` for synchronous data-parallel training.

    After `loss.backward()` returns, every trainable parameter's `.grad` holds the average
    over ranks (except inside `no_sync()`), exactly as with torch's
    DistributedDataParallel -- which it replaces by its name: DDP's keyword arguments
    (device_ids, process_group, bucket_cap_mb, find_unused_parameters, ...) and attributes
    (`.module`, `require_backward_grad_sync`) mean the same here (see ddp_args.py).

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
        algorithm: how buckets are summed: "auto" (the default: "shm" where every rank is
            on one host's CPU and nothing is compressed, "native" elsewhere; see
            choices.resolve_algorithm), "native" (the backend's all-reduce), "ring",
            "tree", "shm" (shared memory, one host) or "hierarchical" (shm inside hosts,
            the network between them). See algorithms.py. `.algorithm` says which.
        compress: what goes on the wire: None, "bf16", "fp16", lockstep.PowerSGD(rank=4)
            (`wire_dtype="bf16"` halves its bytes) or lockstep.TopK(ratio), over the
            algorithm ("hierarchical": "bf16"/"fp16" on its cross-host leg only; "shm":
            none). See compress.py; `comm_stats()` reports the bytes.
        reduction: your own way for a bucket to travel, a lockstep.Reduction (or an
            AllReduce: say how to sum a flat tensor), instead of algorithm and compress.
            See reduction.py. (DDP's `register_comm_hook(state, hook)` works too, and
            runs torch's hooks unchanged: commhook.py.)
        nonfinite: what a NaN or inf in some rank's local gradient does: "error" (stop,
            naming the step, the ranks and the first parameter), "skip" (drop the step on
            every rank, counted in `comm_stats()`), or "off". See nonfinite.py.

    The wrapper owns its hooks, buckets, threads and shared memory, and gives them back on
    `close()` or when it is no longer referenced. Wrapping a module again takes it over
    from a wrapper that is still alive (which is closed, with a warning). Sharding (ZeRO)
    is applied from outside by `lockstep.shard`, a subclass; this class only replicates.
    """

    def __init__(self, module: nn.Module, bucket_mb: float | None = None, *,
                 find_unused: bool = False, broadcast_buffers: bool = True,
                 first_bucket_mb: float = DEFAULT_FIRST_BUCKET_BYTES / MB,
                 group: comm.Group = None, algorithm: str = "auto",
                 compress: Any = None, reduction: Reduction | None = None,
                 nonfinite: str = "error", **ddp_kwargs: Any) -> None:
        super().__init__()
        ddp = read_ddp_arguments(module, ddp_kwargs)
        self.group = ddp.group if group is None else group
        # "auto" picked shm: a comm hook registered later may replace it (it is ours, not
        # the user's choice), with the network's bucket cap unless the user set one
        self._replaceable = algorithm == "auto" and compress is None and reduction is None
        self._cap_given = bucket_mb is not None or ddp.bucket_mb is not None
        algorithm = self._pick_algorithm(algorithm, compress, reduction, module)
        bucket_mb = pick("bucket_mb", bucket_mb, "bucket_cap_mb", ddp.bucket_mb,
                          default_bucket_mb(algorithm))
        if not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r} "
                             "(DDP's device_ids goes by keyword: device_ids=[...])")
        check_mode(nonfinite)
        check_trainable(module)
        self.world = current()
        self.module = module
        self.broadcast_buffers = broadcast_buffers if ddp.broadcast_buffers is None \
            else ddp.broadcast_buffers
        self.require_backward_grad_sync = True  # DDP's flag; no_sync() clears it
        self._take_over(module)
        if ddp.init_sync and not LEVELLED_ELSEWHERE.get():
            verify_replicas_match(module, self.group)
            comm.broadcast_tensors([*module.parameters(), *module.buffers()], 0,
                                   "broadcast of rank 0's parameters and buffers", self.group)
        self._bucket_bytes = (int(bucket_mb * MB), int(first_bucket_mb * MB))
        self._find_unused = bool(pick("find_unused", find_unused or None,
                                       "find_unused_parameters", ddp.find_unused, False))
        self._nonfinite = nonfinite
        self._owned = Owned()
        self.reduction = self._owned.reduction = self._make_reduction(algorithm, compress,
                                                                      reduction)
        self.reducer = self._new_reducer()
        self._join: Any = None  # the active Join, when inside `join()`
        self._buffers_due = True  # broadcast buffers before the next grad-enabled forward
        self._release = weakref.finalize(self, self._owned.release)

    def _take_over(self, module: nn.Module) -> None:
        """Become the one wrapper reducing these parameters' gradients. Two live wrappers
        would each scale a gradient by 1/N in the same bucket slot."""
        for previous in {id(w): w for p in module.parameters()
                         if (w := owner_of(p)) is not None}.values():
            log.warning("rank %d: this module is already wrapped by a live DataParallel; the "
                        "new wrapper takes over and the old one is closed",
                        comm.rank_of(self.group))
            previous.close()
        for p in module.parameters():
            if p.numel() > 0 and p.untyped_storage().nbytes() == 0:
                raise RuntimeError(f"rank {comm.rank_of(self.group)}: a parameter of this "
                                   "module has no values (a ZeRO stage-3 wrapper released it and "
                                   "was dropped without close()); build the model again")
            claim(p, self)

    def _pick_algorithm(self, requested: str, compress: Any, reduction: Reduction | None,
                        module: nn.Module) -> str:
        """The algorithm's name, "auto" resolved (a collective, on every rank alike); a
        reduction of the user's own goes by its name."""
        check_combination(requested, compress)
        device = next((p.device for p in module.parameters()), None)
        self.algorithm = reduction.name if reduction is not None else \
            resolve_algorithm(requested, compress, self.group, device)
        return requested if reduction is not None else self.algorithm

    def _make_reduction(self, algorithm: str, compress: Any,
                        reduction: Reduction | None) -> Reduction:
        """How this wrapper's buckets travel (a sharded wrapper lays its own out)."""
        if reduction is None:
            return make_reduction(algorithm, compress, self.group,
                                  self.world.local_world_size)
        if algorithm not in ("auto", "native") or compress is not None:
            raise ValueError("reduction= is the whole answer to how buckets travel; it "
                             "takes no algorithm= or compress= beside it")
        return reduction

    def _reduced_params(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the reducer averages, in the order the reduction's plan uses."""
        return trainable(self.module)

    def _new_reducer(self) -> Reducer:
        # (kept as a list: walking the module tree at every forward cost a deep model tens
        # of microseconds a step)
        self._watched_params = list(self.module.parameters())
        self._trainable_mask = requires_grad_mask(self.module)
        reducer = Reducer(self._reduced_params(), self.reduction, *self._bucket_bytes,
                          self._find_unused, self.group, self._nonfinite)
        replaced = getattr(self, "reducer", None)
        if replaced is not None:  # (who gives notice in the flags: lockstep.Elastic's rank 0)
            reducer.finite.notice = replaced.finite.notice
        self._owned.reducer = reducer
        return reducer

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's communication hook: `hook(state, bucket) -> torch.futures.Future[Tensor]`
        becomes how buckets travel (torch's ddp_comm_hooks, or your own; see commhook.py).
        The bucket holds this rank's gradients undivided: the hook averages. As in DDP:
        once, before the first backward."""
        self.reduction = self._owned.reduction = install(self, state, hook)
        self.algorithm = self.reduction.name
        self.reducer = self._new_reducer()

    def make_optimizer(self, optimizer: Any, **kwargs: Any) -> Any:
        """`optimizer` (a torch.optim class, with its keyword arguments, or a function of
        the parameters) over this model's parameters; a sharded model's own form of it."""
        return optimizer(self.parameters(), **kwargs)

    def _requires_grad_changed(self) -> bool:
        return any(p.requires_grad != trains for p, trains in zip(self._watched_params,
                                                                  self._trainable_mask,
                                                                  strict=True))

    def _follow_requires_grad(self) -> None:
        """Parameters frozen or unfrozen since the reducer was built (a backbone unfrozen
        after warmup, say) need new hooks and buckets. Every rank must make the same change
        at the same step; the rebuild checks that they did."""
        if not self._requires_grad_changed():
            return
        masks = comm.all_gather_object(requires_grad_mask(self.module), "agreeing on which "
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
        training = self._before_forward()
        output = self.module(*args, **kwargs)
        if training:
            self._after_forward(output)
        return output

    @eager  # collectives and bookkeeping stay out of a compiled graph (torch.compiler.disable)
    def _before_forward(self) -> bool:
        """Start a training forward (grad-enabled) and say whether this is one. A forward
        that activation checkpointing recomputes inside the backward it armed is not: it
        replays the step, so it issues no collective and arms nothing (the backward under
        way reduces each gradient once)."""
        if not self._release.alive:
            raise RuntimeError(f"rank {comm.rank_of(self.group)}: this DataParallel was "
                               "closed (or superseded by a newer wrapper of the same module); "
                               "call .module directly or wrap the module again")
        if not torch.is_grad_enabled() or self.reducer.recomputing():
            return False
        self._before_training_forward()
        return True

    @eager
    def _after_forward(self, output: Any) -> None:
        self.reducer.watch_outputs(output)

    def _before_training_forward(self) -> None:
        """The collectives every grad-enabled forward issues, in this fixed order. A joined
        rank's shadow step (join.py) issues the same ones."""
        sync = self.require_backward_grad_sync
        if self._join is not None:
            sync = self._join.agree_on_active(active=True, sync=sync)[1]
        self._follow_requires_grad()
        self.reducer.prepare_forward(sync)
        self.sync_buffers(sync)
        reporter.advance()

    def prepare_for_backward(self, output: Any) -> None:
        """Arm one more synchronised backward, from `output`, without a forward through the
        wrapper -- DDP's `reducer.prepare_for_backward`, which Lightning's manual
        optimization calls before each `manual_backward` (a GAN backs up twice from one
        training_step: the second backward must be averaged too)."""
        self.reducer.prepare_forward(self.require_backward_grad_sync)
        self.reducer.watch_outputs(output)

    def sync_buffers(self, sync: bool) -> None:
        """Broadcast buffers before a forward that follows a synchronised one (DDP's rule:
        inside a no_sync window each rank keeps its own statistics until the window's
        synchronised step has passed). `sync`: whether this forward's backward syncs."""
        due, self._buffers_due = self._buffers_due, sync
        if self.broadcast_buffers and due:
            buffers = list(self.module.buffers())
            if buffers:
                src = self._join.source_rank() if self._join is not None else 0
                comm.broadcast_tensors(buffers, src, "broadcast of buffers", self.group)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backwards of forwards run inside do not reduce;
        the next backward of a forward outside reduces all of them (as DDP)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @contextmanager
    def join(self, optimizers: Sequence[torch.optim.Optimizer | LossScaler] = (),
             sync_final_model: bool = True, *, divide_by_initial_world_size: bool = True,
             enable: bool = True) -> Iterator[None]:
        """Train on uneven inputs: a rank that runs out of batches early keeps matching the
        others' collectives (contributing nothing) until every rank is done. As in DDP,
        gradients are divided by the initial world size, the finished ranks counting as
        zeros; with `divide_by_initial_world_size=False`, averaged over the ranks that
        still had data.

        Pass the optimizers: ranks that stopped early skipped steps, so at the end their
        state (momentum, Adam moments) is replaced by that of a rank that trained to the
        end, along with the parameters and (if broadcast_buffers) the buffers -- otherwise
        replicas drift apart on the next step. Pass a LossScaler with them
        (`model.join([optimizer, scaler])`): its overflow vote at each step is then
        answered by the ranks out of data, whose scale follows. Each grad-enabled forward
        inside must be followed by one backward.
        """
        if not enable:
            yield
            return
        hook = self._join_hook(list(optimizers), sync_final_model)
        voters = [o for o in optimizers if isinstance(o, LossScaler)]
        self._join = Join(hook, self.group, divide_by_initial_world_size, voters)
        try:
            with self._join.in_force():
                yield
                self._join.finish()
        finally:
            self._join = None

    def _join_hook(self, optimizers: list[Any], sync_final_model: bool) -> JoinHook:
        return ReplicaJoinHook(self, optimizers, sync_final_model)

    # ---- what the training loop asks of every parallel model (trainer.Replica) ----------

    def after_step(self) -> None:
        """Nothing to do after an optimizer step: gradients were averaged in backward."""

    def in_sync(self) -> bool:
        """Every replica took the same step -- but under join() once a rank ran out of
        data: it stops stepping until the join ends and re-synchronises the replicas."""
        return self._join is None or self._join.everyone_active()

    def finish(self) -> None:
        """Nothing to close at the end of training."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Besides the model and optimizer: what the reduction keeps (error feedback)."""
        state = getattr(self.reduction, "checkpoint_tensors", None)
        return state(self.reducer.params) if state is not None else {}

    replicated_optimizer = True  # every rank's optimizer state is the same (DriftCheck)

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """What every replica holds identically, named for DriftCheck: the parameters
        (buffers differ after a forward by design: each rank's batch statistics)."""
        return replicated(self.module, buffers=False)

    def checkpoint_model(self) -> nn.Module:
        """What a checkpoint saves: this wrapper, in a layout any ZeRO stage and world size
        can load (reshard.py)."""
        return self

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with every tensor whole, as copies -- what
        `model.module.state_dict()` gives. (A sharded model gathers them: a collective.)"""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def memory_report(self, optimizer: Any) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        return memory.held(self.module.parameters(), optimizer)

    def bucket_sizes_mb(self) -> list[float]:
        return self.reducer.bucket_sizes_mb()

    def comm_stats(self) -> dict[str, float]:
        """Bytes this rank sent in the last synchronised step, what an uncompressed
        reduction would have sent, and their ratio; and the steps dropped for a
        non-finite gradient (nonfinite="skip")."""
        stats = dict(self.reducer.stats)
        sent = stats["bytes_sent"]
        return {**stats, "compression_ratio": stats["bytes_uncompressed"] / sent if sent else 1.0,
                "skipped_steps": self.reducer.finite.skipped_steps}

    def close(self) -> None:
        """Stop reducing gradients and release the hooks, threads and shared memory. The
        module keeps working on its own afterwards (a stage-3 sharded model first gets its
        full parameters back: a collective, so every rank must call close()). Idempotent."""
        if self._release.alive:
            self._release()
