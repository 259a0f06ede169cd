"""ZeRO's gradients: how each flat group's gradient is reduced (zero.py lays the groups out).

The buckets are the flat groups -- a fixed plan, padded to split evenly among the ranks. At
stage 1 each is all-reduced and the shard's averaged gradient is a view of it; from stage 2
each is reduce-scattered into this rank's shard as it fills, and its full buffer exists only
while it is being reduced. Over the backend a reduce-scatter is left in flight while backward
computes the next bucket's layers; with every rank on one host it is summed through host
memory instead (staging.py). Mirrored shards (recovery.py) take a second, rotated
reduce-scatter; a compressed wire its own encoded one (compressed.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lockstep import comm
from lockstep.comm import timeline
from lockstep.replication.buckets import BucketSpec, ParamSlot
from lockstep.replication.compress import PER_RANK
from lockstep.replication.reduction import Bucket, Done, Handle, Reduction
from lockstep.sharding import compressed
from lockstep.sharding.zero import FlatGroup, padded


class ShardedReduction(Reduction):
    """ZeRO's way for a bucket to travel: the buckets are the flat groups (a fixed plan,
    padded to split evenly), reduced by all-reduce (stage 1) or reduce-scatter into this
    rank's shard (2, 3), whose full buffers exist only while being reduced (2, 3)."""

    fixed_plan = True

    def __init__(self, groups: list[FlatGroup], stage: int, group: comm.Group,
                 error_feedback: bool = False) -> None:
        self.groups, self.stage, self.group = groups, stage, group
        self.wire = groups[0].wire if groups else "full"
        self.name = f"ZeRO-{stage} " + ("all-reduce" if stage == 1 else "reduce-scatter") + \
            ("" if self.wire == "full" else f" in {self.wire}")  # (the timeline's "via")
        self.world_size = comm.size_of(group)
        # what each group's last compressed reduce-scatter rounded off (compressed.py)
        self.feedback = [torch.zeros(g.padded_numel, dtype=g.flat.dtype, device=g.flat.device)
                         for g in groups] if error_feedback and self.wire != "full" else None
        self.specs = [BucketSpec(str(g.flat.dtype), tuple(range(_first(groups, g),
                                                               _first(groups, g) + len(g.params))),
                                 tuple(g.offsets), g.numel) for g in groups]
        self.on_reduced: Callable[[int], None] | None = None  # stage 3: free the unit
        self.on_step_end: Callable[[], None] | None = None    # stage 3: free them all
        self._in_flight: _Scattering | None = None
        host = groups[0].host if groups else None  # every rank on one host: its memory
        self.staging = host.staging if host is not None else None  # (staging.py)
        # Stage 1 over sockets all-reduces whole buckets: the non-finite flags ride in the
        # last (an exchange of their own cost the MNIST CNN 1 ms of a 22 ms step on 2
        # emulated hosts); a reduce-scatter sums only shards, host memory has its own way
        self.carries_flags = stage == 1 and self.staging is None
        if self.staging is not None:
            self.name += " in host memory"

    def plan(self, slots: Sequence[ParamSlot], cap_bytes: int,
             first_cap_bytes: int) -> list[BucketSpec]:
        return list(self.specs)  # the layout of the sharded parameters: never rebuilt

    def buffer_numel(self, spec: BucketSpec) -> int:
        return padded(spec.numel, self.world_size)

    def materialize(self, bucket: Bucket) -> None:
        """Give a freed gradient bucket its memory back before a gradient lands in it. The
        padding past its parameters must be zero: it is summed into the shards, where the
        gradient norm (and the optimizer) would otherwise see whatever memory held."""
        storage = bucket.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(bucket.nbytes)
            bucket.flat[bucket.spec.numel:].zero_()

    def release(self, bucket: Bucket) -> None:
        if self.stage >= 2:  # no rank keeps a full gradient bucket between reductions
            bucket.flat.untyped_storage().resize_(0)

    def start(self, bucket: Bucket) -> Handle:
        if self.staging is not None:  # one host: through its memory, on backward's thread
            if self.stage == 1:
                self.staging.all_reduce(bucket.flat, bucket.label)
            else:
                self._reduced(bucket, self.staging.reduce_scatter(bucket.flat, bucket.label))
            return Done()
        if self.stage == 1:
            return comm.all_reduce_async(bucket.flat, bucket.label, self.group)
        if self._in_flight is not None:  # one reduce-scatter in flight at a time: its full
            with timeline.span("wait for communication"):  # bucket goes back before the
                self._in_flight.wait()                       # next is let go
        what = f"reduce-scatter of {bucket.label}"
        if self.wire != "full":
            self._reduced(bucket, compressed.reduce_scatter(
                bucket.flat, self.wire, what, self.group,
                None if self.feedback is None else self.feedback[bucket.index]))
            return Done()
        # Launched and left to run while backward computes the next bucket's layers (on
        # Gloo an all-to-all, summed when waited for): the next launch, or backward's end,
        # waits for it.
        incoming = torch.empty_like(self.groups[bucket.index].shard_grad)
        pending = comm.reduce_scatter_async(incoming, bucket.flat, what, self.group)
        self._in_flight = _Scattering(self, bucket, pending, incoming)
        return self._in_flight

    def reset(self) -> None:
        self._in_flight = None  # a backward that raised: its buckets are not landed

    def _reduced(self, bucket: Bucket, incoming: torch.Tensor) -> None:
        """A bucket's shard of the sum arrived: add it to the shard's gradient, free the
        full bucket (and, at stage 3, the unit's gathered parameters)."""
        target = self.groups[bucket.index]
        target.shard_grad.add_(incoming)  # accumulates across backwards until zero_grad
        if target.mirror_grad is not None:  # rotated by one shard: this rank gets the next's
            rotated = torch.roll(bucket.flat, -incoming.numel())
            comm.reduce_scatter(incoming, rotated, f"mirror reduce-scatter of {bucket.label}",
                                self.group)
            target.mirror_grad.add_(incoming)
        for param in bucket.params:
            param.grad = None
        self.release(bucket)
        if self.on_reduced is not None:
            self.on_reduced(bucket.index)

    def finish(self, buckets: Sequence[Bucket]) -> None:
        """What the optimizer steps is each shard's averaged gradient: at stage 1 a view of
        the averaged bucket; from stage 2 on, the accumulated reduce-scatters."""
        for group, bucket in zip(self.groups, buckets, strict=True):
            if self.stage == 1:
                group.shard_grad = bucket.flat[group.shard]
                if group.mirror is not None:
                    group.mirror_grad = bucket.flat[group.mirror]
            group.shard_param.grad = group.shard_grad
            if group.mirror_param is not None:
                group.mirror_param.grad = group.mirror_grad
        if self.staging is not None:
            self.staging.end_of_backward()  # (the flags, share_flags, are summed after it)
        if self.on_step_end is not None:
            self.on_step_end()

    def share_flags(self, flags: torch.Tensor) -> Handle | None:  # (on one host: there)
        return self.staging.flags.share(flags) if self.staging is not None else None

    def sent_bytes(self, buckets: Sequence[Bucket]) -> int:
        if self.wire == "full":
            return super().sent_bytes(buckets)
        return sum(compressed.encoded_bytes(self.wire, b.flat.numel(), self.world_size)
                   for b in buckets)

    def checkpoint_tensors(self, params: Sequence[nn.Parameter]) -> dict[str, torch.Tensor]:
        """Each rank's error feedback, kept per rank in checkpoints."""
        return {f"{PER_RANK}zero.feedback.{i}": kept
                for i, kept in enumerate(self.feedback or [])}

    def drop_step(self, buckets: Sequence[Bucket]) -> None:
        """A step dropped for a non-finite gradient: the optimizer skips shards without a
        gradient (`finish` gives them back next time). What the dropped gradients' encoding
        rounded off goes with them."""
        for kept in self.feedback or []:
            kept.zero_()
        for group in self.groups:
            group.shard_param.grad = None
            if group.mirror_param is not None:
                group.mirror_param.grad = None


class _Scattering:
    """A bucket's reduce-scatter in flight; waiting (again is a no-op) lands its shard."""

    def __init__(self, reduction: ShardedReduction, bucket: Bucket, pending: Handle,
                 incoming: torch.Tensor) -> None:
        self._in_flight: tuple[ShardedReduction, Bucket, Handle, torch.Tensor] | None = \
            (reduction, bucket, pending, incoming)
        self.landed_ns = 0  # when it landed (the timeline's end of its span)

    def wait(self) -> None:
        if self._in_flight is None:
            return  # landed already
        # Let go of everything first: the backend's handle holds the full bucket and the
        # received chunks, which must not outlive the landing (a handle is kept until
        # backward's end).
        (reduction, bucket, pending, incoming), self._in_flight = self._in_flight, None
        if reduction._in_flight is self:
            reduction._in_flight = None
        pending.wait()
        reduction._reduced(bucket, incoming)
        self.landed_ns = time.time_ns()


def _first(groups: list[FlatGroup], group: FlatGroup) -> int:
    """Index of `group`'s first parameter in the reducer's parameter list."""
    return sum(len(g.params) for g in groups[: group.index])
