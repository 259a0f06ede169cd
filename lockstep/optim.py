"""Large-batch training: the linear scaling rule with gradual warmup, LARS and LAMB.

- Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): when the batch grows k-fold, grow
  the learning rate k-fold, but ramp up to it linearly over the first steps.
- LARS (You et al. 2017): SGD with momentum where each layer's step is scaled by a trust
  ratio ||w|| / ||g + wd*w||, so no layer moves too far relative to its own size.
- LAMB (You et al. 2019): the same layer-wise trust ratio applied to Adam's update.

Both optimizers need each parameter as a whole tensor (the trust ratio uses its norm), so
under ZeRO sharding they require stage 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a pure function of the optimizer step.

    `peak_lr` is reached after `warmup_steps`, ramping linearly from `start_lr`; after that
    it stays (decay="none") or follows a half cosine down to 0 at `total_steps`.
    """

    peak_lr: float
    warmup_steps: int = 0
    start_lr: float = 0.0
    total_steps: int | None = None
    decay: str = "none"

    def __post_init__(self) -> None:
        if self.decay not in ("none", "cosine"):
            raise ValueError(f"decay must be 'none' or 'cosine', got {self.decay!r}")
        if self.decay == "cosine" and not self.total_steps:
            raise ValueError("cosine decay needs total_steps")

    def __call__(self, step: int) -> float:
        """The learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.start_lr + (self.peak_lr - self.start_lr) * (step + 1) / \
                self.warmup_steps
        if self.decay == "cosine":
            assert self.total_steps is not None
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return 0.5 * self.peak_lr * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr


def linear_scaling(lr: float, global_batch: int, base_batch: int) -> float:
    """Goyal et al.'s rule: the learning rate that `lr` at `base_batch` becomes at
    `global_batch`."""
    return lr * global_batch / base_batch


def goyal_schedule(lr: float, global_batch: int, base_batch: int, warmup_steps: int,
                   total_steps: int | None = None, decay: str = "none") -> LRSchedule:
    """Scaled peak, reached by gradual warmup from the unscaled rate (Goyal et al. §2.2)."""
    return LRSchedule(peak_lr=linear_scaling(lr, global_batch, base_batch),
                      warmup_steps=warmup_steps, start_lr=lr, total_steps=total_steps,
                      decay=decay)


def set_lr(optimizer: Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def _trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor,
                 coefficient: float) -> torch.Tensor:
    """||w|| / ||update||, or 1 when either is zero (a fresh zero layer, or no gradient)."""
    ratio = coefficient * weight_norm / update_norm
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))


class LARS(Optimizer):
    """Layer-wise Adaptive Rate Scaling on SGD with momentum (You et al. 2017).

    For each parameter: local_lr = trust * ||w|| / (||g|| + weight_decay * ||w||);
    v = momentum * v + lr * local_lr * (g + weight_decay * w); w -= v. Parameters with one
    dimension (biases, norm scales) skip the trust ratio and weight decay, as is standard.
    """

    needs_whole_tensors = True

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 eps: float = 1e-9) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if p.ndim > 1:
                    w_norm, g_norm = p.norm(), p.grad.norm()
                    update = p.grad.add(p, alpha=group["weight_decay"])
                    local_lr = _trust_ratio(w_norm, g_norm + group["weight_decay"] * w_norm
                                            + group["eps"], group["trust_coefficient"])
                    update = update * local_lr
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                velocity = state["momentum_buffer"]
                velocity.mul_(group["momentum"]).add_(update, alpha=group["lr"])
                p.sub_(velocity)
        return loss


class LAMB(Optimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019).

    Adam's bias-corrected update r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w, scaled
    per parameter by the trust ratio ||w|| / ||r||: w -= lr * trust * r.
    """

    needs_whole_tensors = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                trust = _trust_ratio(p.norm(), update.norm(), 1.0)
                p.sub_(update * trust, alpha=group["lr"])
        return loss


def clip_and_step(optimizer: Optimizer, parameters: Iterable[torch.Tensor],
                  clip_norm: float | None, scaler: Any = None) -> None:
    """One optimizer step as the Trainer takes it: the true gradients (unscaled, with a
    loss scaler), their global norm clipped -- over every shard, for an optimizer that
    holds shards (`clip_grad_norm_`) -- then the step (a scaler skips it on every rank if
    any overflowed)."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # true gradients, before clipping
    if clip_norm is not None and hasattr(optimizer, "clip_grad_norm_"):
        optimizer.clip_grad_norm_(clip_norm)
    elif clip_norm is not None:  # every rank holds the same averaged gradients: same clip
        torch.nn.utils.clip_grad_norm_(parameters, clip_norm)
    if scaler is not None:
        scaler.step(optimizer)
    else:
        optimizer.step()
