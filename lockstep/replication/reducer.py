"""The reducer: averages gradients across ranks while backward is still running.

One step, as seen from here:

1. Each trainable parameter's `.grad` is a view into a flat bucket buffer, so autograd
   accumulates straight into the buffer that goes on the wire (no copy in or out).
2. A post-accumulate-grad hook marks the parameter ready. When every parameter of a bucket
   is ready the bucket may launch -- but buckets launch strictly in plan order, so all ranks
   issue the same collectives in the same sequence even if readiness differs.
3. Each gradient is scaled once by 1/N as it enters its bucket (fused with the copy, so
   no extra pass); the all-reduce's sum is then the average. A callback queued on the
   autograd engine runs once backward ends: it launches whatever is left and waits for
   every bucket.

Only a backward that follows a forward through the wrapper synchronises (as in torch's
DDP): the forward arms the reducer for one backward, and hooks that fire unarmed -- a
backward through `model.module` alone, before or after a synchronised one, or one inside
`no_sync()` -- accumulate locally. The end-of-backward
callback is queued from the outputs' own autograd nodes, so it runs at the end of the
*outermost* backward even when reentrant activation checkpointing runs nested backwards
inside it. The hooks hold the reducer weakly: a dropped wrapper is freed, and its hooks go
with it.

After the first synchronised backward the plan is rebuilt in the order gradients actually
arrived (rank 0's order, broadcast), so buckets fill contiguously and launch earlier -- unless
the reduction's plan is fixed (ZeRO's buckets are its shards' layout: `fixed_plan`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import Variable

from lockstep import comm
from lockstep.comm import timeline
from lockstep.logs import get_logger
from lockstep.replication.buckets import MB, ParamSlot, arrival_order, reverse_registration_order
from lockstep.replication.nonfinite import FiniteCheck, NonFiniteGradientError
from lockstep.replication.outputs import find_tensors
from lockstep.replication.reduction import Bucket, Done, Reduction, adopt_gradient
from lockstep.replication.unused import drop_globally_unused, unused_error

log = get_logger(__name__)


def _slots(params: Sequence[torch.nn.Parameter]) -> list[ParamSlot]:
    return [ParamSlot(i, p.numel(), str(p.dtype), p.element_size()) for i, p in
            enumerate(params)]


class Reducer:
    """Bucketed, overlapped gradient averaging for one replica's trainable parameters,
    each bucket travelling the way its `Reduction` says (reduction.py)."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]],
                 reduction: Reduction, bucket_cap_bytes: int, first_bucket_bytes: int,
                 find_unused: bool = False, group: comm.Group = None,
                 nonfinite: str = "error") -> None:
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.reduction = reduction
        self.cap_bytes, self.first_cap_bytes = bucket_cap_bytes, first_bucket_bytes
        self.find_unused = find_unused
        self.group = group
        self.finite = FiniteCheck(nonfinite, self.names, group, reduction.carries_flags,
                                  reduction.share_flags)
        self.stats = {"bytes_sent": 0, "bytes_uncompressed": 0}  # of the last synced step
        self.world_size = comm.size_of(group)
        self.divisor = self.world_size  # ranks contributing this step (fewer under join)
        self.buckets: list[Bucket] = []
        # Whether the reduction overrides the per-gradient steps (ZeRO materializes buckets
        # it freed, shm moves gradients into shared memory): if not, they are skipped.
        self._materializes = type(reduction).materialize is not Reduction.materialize
        self._absorbs = type(reduction).absorb is not Reduction.absorb
        self._build(reverse_registration_order(len(self.params)))
        self._armed = False        # the next backward synchronises (one backward only)
        self._in_backward = False  # a synchronised backward is under way
        self._graph_task = -1      # ...run by this autograd graph task
        self._next_launch = 0
        self._ready = bytearray(len(self.params))
        self._used = bytearray(len(self.params))  # got a gradient since the last sync
        # Recorded during the first synced backward, to rebuild the plan in arrival order.
        self._arrivals: list[int] | None = None if reduction.fixed_plan else []
        self._learned_order: list[int] | None = None
        self._warned_create_graph = False
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self, i))
                       for i, p in enumerate(self.params)]

    # ---- plan -------------------------------------------------------------------------

    def _build(self, order: list[int]) -> None:
        """(Re)allocate buckets for `order`, carrying over any gradient already held. A
        plan that comes out as it was (ZeRO's is fixed) is kept as it is."""
        slots = _slots(self.params)
        specs = self.reduction.plan([slots[i] for i in order], self.cap_bytes,
                                    self.first_cap_bytes)
        if specs == [b.spec for b in self.buckets]:
            return
        self._free_buckets()
        self.buckets = [Bucket(k, spec, self.params, f"gradient bucket {k + 1}/{len(specs)} "
                               f"({spec.numel} x {spec.dtype})", self.reduction,
                               self.finite.extra if k == len(specs) - 1 else 0)
                        for k, spec in enumerate(specs)]
        self.reduction.connect()
        self._comm_ns = [(0, 0)] * len(self.buckets)  # launched, done (if done at once)
        self._where: list[tuple[Bucket, torch.Tensor]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for index, view in zip(bucket.spec.param_indices, bucket.views, strict=True):
                self._where[index] = (bucket, view)
                param = self.params[index]
                if param.grad is not None:
                    self.reduction.materialize(bucket)
                    adopt_gradient(param, view, 1.0)

    def bucket_sizes_mb(self) -> list[float]:
        return [(b.flat.numel() - b.extra) * b.flat.element_size() / MB for b in self.buckets]

    def prepare_forward(self, sync: bool) -> None:
        """Called before each grad-enabled forward through the wrapper: clean up after a
        backward that raised, rebuild the plan once in arrival order, and arm (or disarm)
        the next backward's synchronisation. Like DDP, the forward decides: a backward
        inside `no_sync()` whose forward ran outside it still synchronises."""
        if self._in_backward:
            self._abandon_backward()
        self._armed = sync
        if sync and comm.size_of(self.group) != self.world_size:  # it would divide wrongly
            raise RuntimeError(f"rank {comm.rank_of(self.group)}: the process group changed "
                               f"size ({self.world_size} -> {comm.size_of(self.group)} ranks) "
                               "under this wrapper; wrap the module again")
        if not sync or self._learned_order is None:
            return
        order = comm.broadcast_object(self._learned_order, 0, "broadcast of rank 0's "
                                      "gradient arrival order", self.group)
        self._learned_order = None
        self._build(order)

    def watch_outputs(self, output: Any) -> None:
        """Queue the end of the synchronised backward from the outputs' autograd nodes.
        They run in the outermost backward, before any parameter's gradient, so the
        callback lands on that backward even when reentrant checkpointing runs the
        parameters' backward in nested ones (their callbacks would run too early)."""
        if not self._armed:
            return
        weak_self = weakref.ref(self)

        def begin(grad_outputs: Any) -> None:
            reducer = weak_self()
            if reducer is not None and reducer._armed:
                reducer._begin_backward()

        for tensor in find_tensors(output):
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(begin)

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._graph_task = torch._C._current_graph_task_id()
            Variable._execution_engine.queue_callback(self._finish_backward)

    def recomputing(self) -> bool:
        """Whether a forward through the wrapper, now, is non-reentrant activation
        checkpointing recomputing the forward of the synchronised backward under way (the
        whole wrapped model checkpointed): it runs inside that backward's own graph task.
        Such a forward replays the step's forward; it starts no step of its own."""
        return self._in_backward and torch._C._current_graph_task_id() == self._graph_task

    def _abandon_backward(self) -> None:
        """A synchronised backward raised before its end-of-backward callback ran (autograd
        skips queued callbacks on error). Finish the all-reduces it launched -- its peers
        launched the same ones if they failed the same way -- and start clean."""
        log.warning("rank %d: the previous backward did not finish (it raised); discarding "
                    "its partial gradient reduction", comm.rank_of(self.group))
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
        if self._arrivals is not None:
            self._arrivals = []
        self.finite.reset()
        self._reset_for_next_backward()

    # ---- backward -----------------------------------------------------------------------

    def _on_grad_ready(self, index: int) -> None:
        # Runs once per gradient per backward -- 96 times a step for a 24-layer MLP with
        # LayerNorm, where DDP does this work in C++ -- so the common case (plain memory,
        # the finite check riding in the buckets) calls nothing that would do nothing.
        bucket, view = self._where[index]
        param = self.params[index]
        if self._materializes:
            self.reduction.materialize(bucket)
        self._used[index] = 1
        if not self._armed:  # accumulate in the bucket slot, unscaled, until the sync
            adopt_gradient(param, view, 1.0)
            return
        if not self._in_backward:  # the outputs' nodes usually queued the end already
            self._begin_backward()
        if self._ready[index]:
            raise RuntimeError(
                f"rank {comm.rank_of(self.group)}: parameter '{self.names[index]}' received a "
                "gradient twice in one backward (used both inside and outside a reentrant "
                "checkpoint, or a second backward through the same graph?); lockstep reduces "
                "each gradient once. Use torch.utils.checkpoint(..., use_reentrant=False)")
        self._ready[index] = 1
        grad = param.grad
        assert grad is not None  # (the hook runs after accumulation)
        if grad.requires_grad:
            self._warn_create_graph()
        if self.finite.per_gradient:
            self.finite.observe(index, grad)
        if self._absorbs:  # the reduction decides where a fresh gradient goes
            adopt_gradient(param, view, self._scale(), self.reduction, bucket)
        else:
            adopt_gradient(param, view, self._scale())
        if self._arrivals is not None:
            self._arrivals.append(index)
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._launch_in_order()

    def _scale(self) -> float:
        """What a gradient is multiplied by as it enters its bucket."""
        return 1.0 / self.divisor if self.reduction.prescale else 1.0

    def _warn_create_graph(self) -> None:
        if self._warned_create_graph:
            return
        self._warned_create_graph = True
        log.warning("rank %d: backward(create_graph=True): .grad holds the average over ranks "
                    "as values; the graph of higher-order gradients through it is not averaged "
                    "(as with torch's DDP). For a gradient penalty, torch.autograd.grad(..., "
                    "create_graph=True) composes exactly.", comm.rank_of(self.group))

    def _launch_in_order(self) -> None:
        buckets = self.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].waiting == 0:
            bucket = buckets[self._next_launch]
            self.finite.launching(bucket.flat[:bucket.spec.numel],
                                  bucket.carried() if bucket.extra else None)
            launched = time.time_ns()  # (for the timeline)
            bucket.pending = self.reduction.start(bucket)
            self._comm_ns[self._next_launch] = \
                (launched, time.time_ns() if isinstance(bucket.pending, Done) else 0)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        """End of a synchronised backward: complete every bucket, agree whether every
        gradient was finite, then check for unused parameters."""
        try:
            unready = [i for i in range(len(self.params)) if not self._ready[i]]
            emptied = self._fill_unready(unready)
            self._launch_in_order()
            flags = self.finite.start()
            self._wait_all()
            try:
                finite = self.finite.finish(flags, self._averaged_finite)  # every rank alike
            except NonFiniteGradientError:  # a caller that catches it and goes on steps
                self._drop_step()            # nothing of this backward, nor does a
                raise                        # compressor carry it on
            if self.find_unused:
                drop_globally_unused(self.params, self._used, emptied, self.group)
            elif unready:
                raise unused_error(self.names, unready, self.group)
            if self._arrivals is not None:
                self._learned_order = arrival_order(self._arrivals, len(self.params))
                self._arrivals = None
            if not finite:
                self._drop_step()
        finally:
            self._reset_for_next_backward()

    def _averaged_finite(self, indices: list[int]) -> bool | None:
        """Whether these parameters' averaged gradients are all finite (None when they are
        no longer held whole: ZeRO's reduce-scatter keeps only shards)."""
        grads = [self.params[i].grad for i in indices]
        if any(g is None for g in grads):
            return None
        return all(bool(torch.isfinite(g).all()) for g in grads)  # type: ignore[arg-type]

    def _drop_step(self) -> None:
        """nonfinite="skip": no gradient, so the optimizer leaves every parameter (and its
        state) as it was -- on every rank, since all agreed."""
        for param in self.params:
            param.grad = None
        self.reduction.drop_step(self.buckets)

    def _fill_unready(self, unready: list[int]) -> list[int]:
        """Give parameters that got no gradient this backward a defined slot value: zero if
        they hold no gradient (other ranks' gradients will land there), their own if they
        accumulated one earlier. Returns the ones that had no gradient at all."""
        emptied = []
        for index in unready:
            bucket, view = self._where[index]
            param = self.params[index]
            self.reduction.materialize(bucket)
            if param.grad is None:
                view.zero_()
                param.grad = view
                emptied.append(index)
            else:
                self.finite.observe(index, param.grad)
                adopt_gradient(param, view, self._scale())
            bucket.waiting -= 1
        return emptied

    def _wait_all(self) -> None:
        recording, started = timeline.active(), time.time_ns()
        for index, bucket in enumerate(self.buckets):
            handle, bucket.pending = bucket.pending, None
            assert handle is not None, f"{bucket.label} was never launched"
            handle.wait()
            if recording is not None:  # launched -> done: when it landed, if it says (it
                launched, done = self._comm_ns[index]  # may have, during backward), else now
                done = done or getattr(handle, "landed_ns", 0) or time.time_ns()
                recording.add(bucket.label, launched, done, "comm", via=self.reduction.name,
                              bytes=bucket.nbytes)
        if recording is not None:  # what backward's end waited for communication
            recording.add("wait for communication", started, time.time_ns())
        self.reduction.finish(self.buckets)
        if self.world_size == 1:  # a world of one has no one to send to
            self.stats = {"bytes_sent": 0, "bytes_uncompressed": 0}
            return
        raw = sum(b.nbytes for b in self.buckets)  # all launched
        self.stats = {"bytes_sent": self.reduction.sent_bytes(self.buckets),
                      "bytes_uncompressed": raw}

    def _reset_for_next_backward(self) -> None:
        # A forward through the wrapper arms exactly one backward (DDP's reducer expects
        # hooks only from its forward to the end of that backward): a later backward
        # through `model.module` alone accumulates locally and launches nothing.
        self._armed = False
        self._in_backward = False
        self._next_launch = 0
        self.finite.reset()  # (a backward that failed mid-launch left its buckets' sums)
        self._ready = bytearray(len(self.params))
        self._used = bytearray(len(self.params))
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)
            bucket.pending = None
        self.reduction.reset()

    # ---- join: stand in for a backward this rank has no data for ------------------------

    def shadow_backward(self) -> None:
        """Issue exactly the collectives a real synchronised backward issues, contributing
        zeros, so ranks that still have data are not left waiting."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.waiting = 0
        self._launch_in_order()
        try:
            flags = self.finite.start()
            self._wait_all()
            self.finite.finish(flags, self._averaged_finite)
            if self.find_unused:  # (its bitmap of used parameters: none here)
                drop_globally_unused(self.params, bytearray(len(self.params)), [], self.group)
            if self._arrivals is not None:
                self._learned_order = arrival_order([], len(self.params))
                self._arrivals = None
        finally:
            self._reset_for_next_backward()

    def has_unsynced_gradients(self) -> bool:
        """Whether no_sync micro-steps accumulated gradients that no synced backward has
        reduced yet."""
        return any(self._used)

    def _free_buckets(self) -> None:
        for bucket in self.buckets:
            self.reduction.free(bucket.flat)
        self.buckets = []

    def detach(self) -> None:
        """Stop reducing: remove the hooks. Gradients keep their current values (the
        bucket memory stays alive as long as a `.grad` view of it does). Idempotent."""
        self._armed = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._free_buckets()


def _weak_hook(reducer: Reducer, index: int) -> Callable[[torch.Tensor], None]:
    """A parameter's readiness hook that does not keep its reducer alive: a wrapper that
    is no longer referenced is collected, and its finalizer removes this hook."""
    weak = weakref.ref(reducer)

    def hook(param: torch.Tensor) -> None:
        live = weak()
        if live is not None:
            live._on_grad_ready(index)
    return hook
