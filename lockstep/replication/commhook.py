"""DDP's communication hooks, taken through the Reduction seam.

`model.register_comm_hook(state, hook)` makes a hook written for torch's DDP --
`hook(state, bucket) -> torch.futures.Future[torch.Tensor]` -- the way this wrapper's
buckets travel, so torch's own hooks (`default_hooks.allreduce_hook`,
`fp16_compress_hook`, `bf16_compress_hook`, `powerSGD_hook`) and users' run unchanged:

- the bucket a hook gets offers what DDP's GradBucket does (`buffer`, `index`, `is_last`,
  `gradients`, `parameters`, `set_buffer`), its buffer holding this rank's gradients *not*
  divided by the world size: the hook averages, as in DDP (so under `join` the hook, not
  `divide_by_initial_world_size`, decides what they are divided by, as in DDP);
- the tensor its future holds becomes the bucket's values (copied in unless it is the
  buffer itself), and so every parameter's `.grad`.

Hooks may issue collectives from their futures' callbacks (PowerSGD does), on a thread of
the backend's. So that every rank issues them in the same order, a bucket's hook is called
once the previous bucket's future is done, and the last bucket's future is waited for
before the reducer's own end-of-backward collectives. Communication still overlaps with
the backward of the layers before each bucket.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep import comm
from lockstep.replication.algorithms import Native
from lockstep.replication.buckets import DEFAULT_BUCKET_MB, MB, BucketSpec, ParamSlot
from lockstep.replication.reduction import Bucket, Done, Handle, Reduction

Hook = Callable[[Any, Any], Any]


class GradBucket:
    """What a hook sees of one bucket: the methods of torch's dist.GradBucket."""

    def __init__(self, bucket: Bucket, last: bool) -> None:
        self._bucket, self._last = bucket, last
        self._buffer = bucket.flat

    def index(self) -> int:
        """The bucket's place in this step's plan (plans are rebuilt after the first
        step, as DDP's are: keep per-bucket state from the second step on)."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradients, this rank's own, not divided by the world size."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace what `buffer()` returns (torch's compress wrappers use it)."""
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: views into the bucket's buffer."""
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the step's last bucket to be reduced."""
        return self._last


def check_comm_hook(hook: Any, rank: int) -> None:
    """DDP's checks on a hook, with DDP's error types (annotations given as strings, under
    `from __future__ import annotations`, are read by name)."""
    if not callable(hook):
        raise TypeError(f"rank {rank}: Communication hook must be callable.")
    signature = inspect.signature(hook)
    params = list(signature.parameters.values())
    bucket = signature.parameters.get("bucket", params[1] if len(params) > 1 else None)
    if bucket is not None and not _annotated(bucket.annotation, dist.GradBucket, "GradBucket"):
        raise ValueError(f"rank {rank}: Communication hook: bucket annotation should be "
                         "dist.GradBucket.")
    if not _annotated(signature.return_annotation, torch.futures.Future[torch.Tensor],
                      "Future"):
        raise ValueError(f"rank {rank}: Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")


def _annotated(annotation: Any, expected: Any, name: str) -> bool:
    if annotation is inspect.Parameter.empty or annotation == expected:
        return True
    if annotation is GradBucket:
        return True
    return isinstance(annotation, str) and name in annotation


class CommHook(Reduction):
    """A DDP communication hook as this wrapper's Reduction. Buckets live in plain memory;
    gradients enter them undivided (`prescale = False`): the hook averages."""

    name = "comm hook"
    prescale = False

    def __init__(self, state: object, hook: Hook, group: comm.Group) -> None:
        self.state, self.hook, self.group = state, hook, group
        self.label = getattr(hook, "__qualname__", repr(hook))
        self._buckets = 0
        self._previous: _HookHandle | None = None

    def plan(self, slots: Sequence[ParamSlot], cap_bytes: int,
             first_cap_bytes: int) -> list[BucketSpec]:
        specs = super().plan(slots, cap_bytes, first_cap_bytes)
        self._buckets = len(specs)
        return specs

    def start(self, bucket: Bucket) -> Handle:
        if self._previous is not None:  # its callbacks' collectives come first everywhere
            self._previous.wait()
        last = bucket.index == self._buckets - 1
        future = self.hook(self.state, GradBucket(bucket, last))
        if not callable(getattr(future, "wait", None)):
            raise TypeError(f"rank {comm.rank_of(self.group)}: communication hook "
                            f"{self.label} returned {type(future).__name__} for "
                            f"{bucket.label}; a hook returns a torch.futures.Future holding "
                            "the bucket's new values (DDP's contract)")
        handle = self._previous = _HookHandle(future, bucket, self)
        if last:  # before the reducer's own collectives at the end of backward
            handle.wait()
            return Done()
        return handle

    def finish(self, buckets: Sequence[Bucket]) -> None:
        self._previous = None

    def close(self) -> None:
        self._previous = None  # holds a bucket: let it go with the wrapper


class _HookHandle:
    """A hook's future; waiting puts its value into the bucket (once)."""

    def __init__(self, future: Any, bucket: Bucket, owner: CommHook) -> None:
        self.future, self.bucket, self.owner = future, bucket, owner
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        value = self.future.wait()
        if isinstance(value, list | tuple) and len(value) == 1:
            value = value[0]  # a c10d Work's future holds a list of one tensor
        flat = self.bucket.flat
        if not isinstance(value, torch.Tensor) or value.numel() != flat.numel():
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise RuntimeError(f"rank {comm.rank_of(self.owner.group)}: communication hook "
                               f"{self.owner.label} gave {got} for {self.bucket.label}; its "
                               f"future must hold one tensor of {flat.numel()} elements")
        if value.data_ptr() != flat.data_ptr():
            flat.copy_(value.reshape(-1))


def install(wrapper: Any, state: object, hook: Callable[..., Any]) -> CommHook:
    """DataParallel.register_comm_hook's checks, as DDP makes them; then the wrapper's
    reducer is detached and its reduction closed, and the hook to put in its place is
    returned (the caller builds a new reducer over it)."""
    rank = comm.rank_of(wrapper.group)
    check_comm_hook(hook, rank)
    if isinstance(wrapper.reduction, CommHook):
        raise RuntimeError(f"rank {rank}: register_comm_hook or register_builtin_comm_hook "
                           "can only be called once.")
    if wrapper.reducer.finite.backwards or wrapper.reducer.has_unsynced_gradients():
        raise RuntimeError(f"rank {rank}: register_comm_hook must be called before the "
                           "first backward (as DDP requires): gradients were already "
                           "reduced another way")
    # algorithm="auto"'s pick is lockstep's, not the user's: a hook may replace it
    if type(wrapper.reduction) is not Native and not wrapper._replaceable:
        raise ValueError(f"rank {rank}: a communication hook says how buckets travel, "
                         f"and this wrapper already has a way ({wrapper.reduction.name}, "
                         "from algorithm=, compress= or reduction=); wrap without them")
    wrapper.reducer.detach()  # gradients held so far stay, and move to the new buckets
    wrapper.reduction.close()
    if not wrapper._cap_given:  # DDP's bucket cap, as a hook written for DDP expects
        wrapper._bucket_bytes = (int(DEFAULT_BUCKET_MB * MB), wrapper._bucket_bytes[1])
    return CommHook(state, hook, wrapper.group)
