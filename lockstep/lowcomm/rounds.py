"""Training that talks rarely: local SGD and DiLoCo.

Synchronous data parallelism averages gradients every step, so every step waits for the
slowest link. These modes let each rank take H optimizer steps on its own and only then
agree:

- LocalSGD(H): after every H local steps, average the parameters (and buffers) across
  ranks. With H=1 and plain SGD this is synchronous SGD exactly (averaging the results of
  one linear step is the step of the averaged gradient).
- DiLoCo(H) (Douillard et al. 2023): each rank runs an inner optimizer (AdamW in the paper)
  for H steps from the shared parameters theta; the pseudo-gradient theta - theta_rank is
  averaged across ranks (optionally sent in bf16) and applied to theta by an outer
  optimizer, Nesterov SGD with lr 0.7 and momentum 0.9 by default. Every rank then
  continues from the new theta. With H=1, outer lr 1 and no momentum it is synchronous
  training whenever the inner step is linear in the gradient (SGD).

Both wrap the model like DataParallel (`.module`, `no_sync()`, `comm_stats()`) and are
driven by `after_step()`, which the caller (the Trainer) calls after every optimizer step.
They report bytes on the wire per step, averaged over the H-step round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lockstep import comm
from lockstep.comm import timeline
from lockstep.comm.world import current
from lockstep.replication.choices import refusing
from lockstep.replication.consistency import verify_replicas_match
from lockstep.replication.drift import replicated
from lockstep.replication.join import JoinError


class _Replica(nn.Module):
    """A model replica that synchronises only in `after_step`."""

    def __init__(self, module: nn.Module, every: int, group: comm.Group = None) -> None:
        super().__init__()
        if every < 1:
            raise ValueError(f"sync every must be >= 1 step, got {every}")
        self.world = current()
        self.module, self.every, self.group = module, every, group
        verify_replicas_match(module, group)
        comm.broadcast_tensors(list(module.state_dict().values()), 0,
                               "broadcast of rank 0's model", group)
        self.local_steps = 0
        self._round_bytes = 0
        self.stats = {"bytes_sent": 0.0, "bytes_uncompressed": 0.0}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # gradients are never reduced per step here

    def join(self, optimizers: Any = (), sync_final_model: bool = True, *,
             divide_by_initial_world_size: bool = False,
             enable: bool = True) -> contextlib.AbstractContextManager[None]:
        """Refused (a no-op with enable=False, as DDP's): a rank that ran out of data
        would have to stand in for the parameter averages of rounds it never trained."""
        if not enable:
            return contextlib.nullcontext()
        raise JoinError(f"rank {comm.rank_of(self.group)}: join() is for gradients averaged "
                        f"every step (DataParallel); {type(self).__name__} averages parameters "
                        "every few steps, and a rank out of data cannot stand in for a round "
                        "it never trained. Give every rank the same number of batches "
                        "(lockstep.ShardedSampler with drop_last=True, as the Trainer does)")

    def after_step(self) -> None:
        self.local_steps += 1
        if self.local_steps % self.every == 0:
            with timeline.span(f"{type(self).__name__} round's sync", "comm"):
                self.synchronise()
            self._close_round_stats()

    def _close_round_stats(self) -> None:
        """The bytes sent over the round just ended, per step (comm_stats)."""
        alone = comm.size_of(self.group) == 1  # a world of one sends nothing
        per_step = 0.0 if alone else self._round_bytes / self.every
        full = sum(p.numel() * p.element_size() for p in self.module.parameters())
        self.stats = {"bytes_sent": per_step, "bytes_uncompressed": float(full)}
        self._round_bytes = 0

    def synchronise(self) -> None:
        raise NotImplementedError

    def in_sync(self) -> bool:
        """Whether every replica holds the same model now (at the end of a round)."""
        return self.local_steps % self.every == 0

    def finish(self) -> None:
        """End of training: close a partial round so every replica ends identical."""
        if not self.in_sync():
            self.synchronise()
            self.local_steps = 0

    def _average(self, tensors: list[torch.Tensor], what: str) -> None:
        """Average float tensors across ranks in place: one all-reduce per dtype."""
        self._round_bytes += average_in_place(tensors, what, self.group)

    def comm_stats(self) -> dict[str, float]:
        sent = self.stats["bytes_sent"]
        ratio = self.stats["bytes_uncompressed"] / sent if sent else 1.0
        return {**self.stats, "compression_ratio": ratio}

    def make_optimizer(self, optimizer: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """`optimizer` (a torch.optim class, or a function of the parameters) over the
        replica's parameters: each rank steps its own copy."""
        return optimizer(self.module.parameters(), **kwargs)

    def checkpoint_model(self) -> nn.Module:
        """What a checkpoint saves of the model: the plain module (checkpoints are written
        at the end of a round, when every replica holds the same)."""
        return self.module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict, as copies (every rank holds it whole)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def close(self) -> None:
        """Nothing to release (no hooks, no threads)."""


    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Extra state to checkpoint besides model and optimizer (none for local SGD)."""
        return {}

    replicated_optimizer = False  # each rank steps its own optimizer between rounds

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """What every replica holds identically at a round's end (DriftCheck compares it
        only then, `in_sync()`): the module's state and the wrapper's shared state."""
        outer = {f"outer state '{k}'": t for k, t in self.checkpoint_tensors().items()}
        return {**replicated(self.module), **outer}


def average_in_place(tensors: list[torch.Tensor], what: str, group: comm.Group) -> int:
    """Average the float tensors over `group` in place (one all-reduce per dtype); the
    bytes this rank sent."""
    size, sent = comm.size_of(group), 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point():
            by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        comm.all_reduce(flat, what, group)
        sent += flat.numel() * flat.element_size()
        flat.div_(size)
        with torch.no_grad():
            for t, piece in zip(group_tensors, flat.split([t.numel() for t in group_tensors]),
                                strict=True):
                t.copy_(piece.view_as(t))
    return sent


class LocalSGD(_Replica):
    """Average parameters and buffers every `every` local optimizer steps."""

    def synchronise(self) -> None:
        self._average(list(self.module.state_dict().values()), "local SGD parameter average")


class DiLoCo(_Replica):
    """DiLoCo: H inner steps per rank, then one outer step on the averaged pseudo-gradient.

    Args:
        module: the model, identical on every rank (rank 0's is broadcast).
        every: inner steps per round (H).
        outer_lr, outer_momentum, nesterov: the outer SGD (the paper: 0.7, 0.9, True).
        bf16: send pseudo-gradients in bf16 (half the bytes).
    """

    def __init__(self, module: nn.Module, every: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, bf16: bool = False,
                 group: comm.Group = None) -> None:
        super().__init__(module, every, group)
        self.bf16 = bf16
        # theta: the shared starting point of the round, held by the outer optimizer in at
        # least fp32 (a float64 model keeps its precision: fp32 would round its weights).
        self.theta = [p.detach().clone().to(torch.promote_types(p.dtype, torch.float32))
                      .requires_grad_(True) for p in module.parameters()]
        self.outer = torch.optim.SGD(self.theta, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)

    def synchronise(self) -> None:
        everything = range(len(self.theta))
        flat = self._pseudo_gradient(everything)
        wire = flat.to(torch.bfloat16) if self.bf16 else flat
        comm.all_reduce(wire, "DiLoCo pseudo-gradient all-reduce", self.group)
        self._round_bytes += wire.numel() * wire.element_size()
        self._outer_step(everything, wire.to(flat.dtype).div_(comm.size_of(self.group)))
        # Buffers (BatchNorm statistics) have no gradient: average them as local SGD does.
        self._average(list(self.module.buffers()), "DiLoCo buffer average")

    def _pseudo_gradient(self, indices: Sequence[int]) -> torch.Tensor:
        """theta minus this rank's parameters, for the parameters at `indices`, flat."""
        params = list(self.module.parameters())
        with torch.no_grad():
            return torch.cat([(self.theta[i].detach() - params[i].detach().to(
                self.theta[i].dtype)).reshape(-1) for i in indices])

    def _outer_step(self, indices: Sequence[int], averaged: torch.Tensor,
                    mixing: float = 0.0) -> None:
        """The outer step on the averaged pseudo-gradient (flat) of the parameters at
        `indices`, taken into them; `mixing` of their own values is kept (streaming)."""
        mine = [self.theta[i] for i in indices]
        for t, piece in zip(mine, averaged.split([t.numel() for t in mine]), strict=True):
            t.grad = piece.view_as(t).to(t.dtype)
        self.outer.step()  # (a parameter without a gradient is left as it is)
        self.outer.zero_grad(set_to_none=True)
        params = list(self.module.parameters())
        with torch.no_grad():
            for i in indices:
                if mixing == 0:
                    params[i].copy_(self.theta[i])
                else:
                    params[i].lerp_(self.theta[i].to(params[i].dtype), 1 - mixing)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The outer state, for checkpoints (loaded in place): theta and the outer
        optimizer's momentum buffers (created as zeros before the first outer step)."""
        tensors = {}
        for i, t in enumerate(self.theta):
            tensors[f"diloco.theta.{i}"] = t
            state = self.outer.state[t]
            if "momentum_buffer" not in state or state["momentum_buffer"] is None:
                state["momentum_buffer"] = torch.zeros_like(t)
            tensors[f"diloco.momentum.{i}"] = state["momentum_buffer"]
        return tensors


@refusing(compress="local SGD averages the parameters themselves every sync_every steps, and "
                   "16-bit parameters would round the weights; send fewer bytes by a larger "
                   "sync_every, or use DiLoCoConfig(pseudo_grad_bf16=True), which sends its "
                   "pseudo-gradients in bf16")
@dataclass
class LocalSGDConfig:
    """Local SGD as a training mode: parameters averaged every `sync_every` steps."""

    mode: ClassVar[str] = "local_sgd"
    sync_every: int = 50
    """Local optimizer steps per round."""

    def validate(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 step, got {self.sync_every}")

    def build(self, module: nn.Module) -> LocalSGD:
        return LocalSGD(module, self.sync_every)


@refusing(compress="DiLoCo sends one pseudo-gradient per round: pseudo_grad_bf16=True sends "
                   "it in bf16 (half the bytes); PowerSGD and TopK compress SyncConfig's "
                   "per-step gradients")
@dataclass
class DiLoCoConfig:
    """DiLoCo as a training mode: an outer Nesterov step every `sync_every` inner steps."""

    mode: ClassVar[str] = "diloco"
    sync_every: int = 50
    """Inner steps per round (H)."""
    outer_lr: float = 0.7
    """The outer learning rate."""
    outer_momentum: float = 0.9
    """The outer Nesterov momentum (0: plain SGD)."""
    pseudo_grad_bf16: bool = False
    """Send pseudo-gradients in bf16 (half the bytes)."""

    def validate(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 step, got {self.sync_every}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCo needs outer_lr > 0 and 0 <= outer_momentum < 1; got "
                             f"{self.outer_lr} and {self.outer_momentum}")

    def build(self, module: nn.Module) -> DiLoCo:
        return DiLoCo(module, self.sync_every, self.outer_lr, self.outer_momentum,
                      bf16=self.pseudo_grad_bf16)
