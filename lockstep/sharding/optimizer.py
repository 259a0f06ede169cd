"""ZeRO's optimizer: any element-wise torch.optim class over this rank's shards (zero.py).

Optimizers that need whole tensors (LARS, LAMB: their trust ratio is a per-tensor norm) are
refused. Gradient clipping by the global norm sums squares over shards, then across ranks.
Under fault tolerance the shards are mirrored (zero.py) and it keeps the state from before
its last step, so that a step some ranks took and others did not can be taken back
(recovery.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.comm import timeline
from lockstep.sharding.gather import gather_all
from lockstep.sharding.hostshards import shared_by, writing_shards
from lockstep.sharding.pieces import PiecewiseStep, elementwise
from lockstep.sharding.zero import FlatGroup


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer over this rank's shards, and what to do around its step.

    A torch.optim.Optimizer to whoever asks (a learning-rate scheduler refuses anything
    else), built without Optimizer.__init__: what it has, it takes from the one it steps.

    Behaves like the optimizer it wraps: step(), zero_grad(), param_groups (so learning-rate
    schedulers work), state_dict()/load_state_dict() (of this rank's shards; see
    zero.sharded_state_dict for checkpoints that reshard). Mirrored groups (fault
    tolerance) are stepped with the own ones, and the state before each step is kept until
    the next, so that a step some ranks finished and others did not can be taken back."""

    per_rank_state = True  # its state is this rank's shard: never another rank's to load

    def __init__(self, groups: list[FlatGroup], stage: int, group: comm.Group,
                 make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.stage, self.make = stage, make
        self.stepped = False  # since begin_step(): stepped (or skipped: nothing changed)
        self.previous: dict[nn.Parameter, tuple[torch.Tensor, dict[str, Any]]] | None = None
        self.copied = False  # since begin_step(): `previous` taken (a step began)
        self._bind(groups, group, settings={})

    @classmethod
    def unbound(cls, params: Any, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                ) -> ZeroOptimizer:
        """An optimizer for shards not laid out yet -- fault tolerance builds the wrapper
        once a membership forms, and again for each one:

            optimizer = ZeroOptimizer.unbound(net.parameters(),
                                              lambda params: torch.optim.AdamW(params, lr=1e-3))
            job = lockstep.Elastic(net, optimizer, wrap=lambda m: lockstep.shard(m, 2))

        Over `params` until `rebind`, so that a learning-rate scheduler made over it now
        keeps working after."""
        optimizer = cls.__new__(cls)
        optimizer.stage, optimizer.make, optimizer.groups, optimizer.group = 0, make, [], None
        optimizer.stepped, optimizer.previous, optimizer.copied = False, None, False
        optimizer.inner = make(list(params))
        optimizer.stepping = PiecewiseStep(optimizer.inner, make)
        return optimizer

    def rebind(self, groups: list[FlatGroup], stage: int, group: comm.Group) -> None:
        """Step a new layout's shards (a new membership's), keeping the settings a scheduler
        set (lr, initial_lr, ...); the state starts empty (recovery.py fills it)."""
        self.stage = stage
        self._bind(groups, group, numeric_settings(self.inner.param_groups[0]))

    def _bind(self, groups: list[FlatGroup], group: comm.Group, settings: dict[str, Any]
              ) -> None:
        self.groups, self.group = groups, group
        self.inner = self.make(self.stepped_params())
        self.inner.param_groups[0].update(settings)
        self.stepping = PiecewiseStep(self.inner, self.make)
        self.stepped, self.previous, self.copied = False, None, False
        if getattr(self.inner, "needs_whole_tensors", False):
            raise ValueError(f"rank {comm.rank_of(group)}: {type(self.inner).__name__} needs "
                             "each parameter whole (its trust ratio is a per-tensor norm); "
                             "use it without sharding (lockstep.DataParallel)")
        for g in groups:  # what the optimizer (and a loss scaler) sees as the gradient
            g.shard_param.grad = g.shard_grad
            if g.mirror_param is not None:
                g.mirror_param.grad = g.mirror_grad

    def stepped_params(self) -> list[nn.Parameter]:
        """The own shards, then the mirrored ones."""
        return [g.shard_param for g in self.groups] + \
            [g.mirror_param for g in self.groups if g.mirror_param is not None]

    @property
    def mirrored(self) -> bool:
        return any(g.mirror_param is not None for g in self.groups)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            if self.stage > 1:  # reduce-scatters accumulate into the shard
                g.shard_grad.zero_()
                if g.mirror_grad is not None:
                    g.mirror_grad.zero_()
            for p in g.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the norm over every rank's shards: the global gradient norm."""
        squares = comm.control_tensor([0.0], self.group, torch.float64)
        for g in self.groups:
            squares += g.shard_grad.double().square().sum()
        comm.all_reduce(squares, "ZeRO: sum of squared gradient shards", self.group)
        norm = squares.sqrt().item()
        if norm > max_norm:
            for g in self.groups:
                g.shard_grad.mul_(max_norm / (norm + 1e-6))
                if g.mirror_grad is not None:
                    g.mirror_grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def begin_step(self) -> None:
        """A new attempt at a step starts: nothing stepped in it yet."""
        self.stepped = self.copied = False

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None  # type: ignore[override]
             ) -> None:
        if self.mirrored:
            self._keep_previous()
        with writing_shards(self.groups, "the optimizer's step"):
            self.stepping.step(closure)
        self.stepped = True
        if self.stage < 3:  # parameters are whole on every rank: refresh them from shards
            self.gather_params("all-gather of the stepped parameters")
        if self.stage == 1:
            self._release_full_gradients()

    def _release_full_gradients(self) -> None:
        """Stage 1 keeps the whole averaged gradient from backward through the step (`.grad`
        is DDP's, for clipping or inspection); once the step has taken its shard, the
        gradient buckets give their memory back until the next backward refills them. So
        between steps a rank holds the parameters and its shard of the optimizer state, as
        DeepSpeed's stage 1 does -- not a full gradient besides."""
        for g in self.groups:
            g.shard_grad.untyped_storage().resize_(0)  # a view of its gradient bucket
            # No view of the freed memory may stay reachable (reading one crashes the
            # process): until the next backward, the shards' gradients are empty, as after
            # zero_grad -- a clip_grad_norm_ now finds nothing to clip.
            g.shard_grad = g.shard_grad.new_zeros(0)
            g.shard_param.grad = None
            if g.mirror_param is not None:
                g.mirror_grad = g.shard_grad
                g.mirror_param.grad = None
            for p in g.params:
                p.grad = None

    def skipped(self) -> None:
        """A loss scaler skipped the step on every rank: the state is the step's result."""
        self.stepped, self.previous = True, None

    def _keep_previous(self) -> None:
        """Copy what the step is about to change, into the buffers of the last copy."""
        kept = self.previous or {}
        for p in self.stepped_params():
            state = {k: v for k, v in self.inner.state.get(p, {}).items()
                     if isinstance(v, torch.Tensor)}
            old = kept.get(p)
            if old is None or old[1].keys() != state.keys():
                kept[p] = (p.detach().clone(), {k: v.clone() for k, v in state.items()})
            else:
                old[0].copy_(p.detach())
                for k, v in state.items():
                    old[1][k].copy_(v)
        self.previous, self.copied = kept, True

    @torch.no_grad()
    def refresh_mirrors(self) -> None:
        """After the own shards were loaded (a checkpoint): the mirrors from the next rank,
        parameters and optimizer state, gathered whole one tensor at a time."""
        for g in self.groups:
            if g.mirror_param is None or g.mirror is None:
                continue
            g.mirror_param.copy_(self._next_ranks(g, g.shard_param.detach()))
            own = self.inner.state.get(g.shard_param, {})
            mirror = self.inner.state.setdefault(g.mirror_param, {})
            for key, value in own.items():
                if elementwise(value, g.shard_param):
                    mirror[key] = self._next_ranks(g, value)
                else:
                    mirror[key] = value.clone() if isinstance(value, torch.Tensor) else value
        self.previous = None

    def _next_ranks(self, group: FlatGroup, own: torch.Tensor) -> torch.Tensor:
        whole = torch.zeros(group.padded_numel, dtype=own.dtype, device=own.device)
        whole[group.shard].copy_(own)
        comm.gather_shards_async(whole, f"mirror refresh of parameter group {group.index}",
                                 self.group).wait()
        return whole[group.mirror].clone()

    def gather_params(self, what: str) -> None:
        """Stages 1-2: make every rank's whole parameters from the shards."""
        with timeline.span(f"{what} (ZeRO-{self.stage})", "comm"):
            gather_all(self.groups, what, self.group)
        if (host := shared_by(self.groups)) is not None:  # the parameters may be written
            host.done_reading()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def numeric_settings(param_group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer group's numeric settings (lr, momentum, betas, weight decay), as values
    a checkpoint keeps and a new layout takes over. Not the flags (foreach, fused,
    maximize): how to compute is this run's choice."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def plain(value: Any) -> bool:
        if isinstance(value, (tuple, list)):
            return bool(value) and all(number(v) for v in value)
        return number(value)

    return {k: v for k, v in param_group.items() if k != "params" and plain(v)}
