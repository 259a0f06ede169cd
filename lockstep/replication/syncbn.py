"""SyncBatchNorm that works on any backend, Gloo/CPU included (torch's requires CUDA).

Batch statistics are computed over the global batch: each rank contributes its per-channel
(count, mean, M2); they are combined exactly with Chan's parallel formula, which stays
accurate where the naive sum-of-squares cancels. Backward all-reduces the two per-channel
sums the input gradient needs; the weight and bias gradients stay local, because the
data-parallel reducer averages them like any other parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from lockstep import comm


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _broadcastable(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in at least float32: half precision widened (counts and sums overflow fp16),
    float64 kept (a float64 model's statistics rounded to float32 would be approximate)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def global_moments(x: torch.Tensor, group: comm.Group) -> tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """Per-channel mean and biased variance over every rank's batch, and the total count,
    in at least float32 whatever the input's precision (see `_wide`)."""
    x = _wide(x)
    dims = _channel_dims(x)
    count = torch.full((x.shape[1],), x.numel() / x.shape[1], dtype=x.dtype, device=x.device)
    # An empty batch on this rank counts 0 with mean 0 (x.mean would be NaN, and 0 * NaN
    # in the combination below would poison every rank).
    mean = x.sum(dims) / count.clamp(min=1)
    m2 = ((x - _broadcastable(mean, x)) ** 2).sum(dims)
    local = torch.stack([count, mean, m2])  # (3, C)
    world_size = comm.size_of(group)
    everyone = torch.empty(world_size * 3, x.shape[1], dtype=x.dtype, device=x.device)
    comm.all_gather_into(everyone, local, "SyncBatchNorm statistics", group)
    counts, means, m2s = everyone.view(world_size, 3, -1).unbind(1)  # each (world, C)
    total = counts.sum(0)
    global_mean = (counts * means).sum(0) / total
    global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
    return global_mean, global_m2 / total, total


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor, eps: float,
                group: comm.Group) -> torch.Tensor:
        out_dtype = x.dtype
        x = _wide(x)  # normalise in float32, as torch's BatchNorm does for half inputs
        invstd = torch.rsqrt(var + eps)
        xhat = (x - _broadcastable(mean, x)) * _broadcastable(invstd, x)
        ctx.save_for_backward(xhat, invstd, weight)  # type: ignore[arg-type]  # None is fine
        ctx.group = group  # type: ignore[attr-defined]
        y = xhat
        if weight is not None:
            y = y * _broadcastable(weight.to(x.dtype), x)
        if bias is not None:
            y = y + _broadcastable(bias.to(x.dtype), x)
        ctx.dtypes = (out_dtype, None if weight is None else weight.dtype)  # type: ignore[attr-defined]
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        x_dtype, weight_dtype = ctx.dtypes
        dy = _wide(dy)
        dims = _channel_dims(dy)
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        grad_weight = sum_dy_xhat.to(weight_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight_dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = torch.stack([sum_dy, sum_dy_xhat, torch.full_like(sum_dy,
                                                                    dy.numel() / dy.shape[1])])
            comm.all_reduce(sums, "SyncBatchNorm backward sums", ctx.group)
            mean_dy, mean_dy_xhat = sums[0] / sums[2], sums[1] / sums[2]
            scale = invstd if weight is None else invstd * weight.to(dy.dtype)
            grad_x = ((dy - _broadcastable(mean_dy, dy)
                       - xhat * _broadcastable(mean_dy_xhat, dy)) * _broadcastable(scale, dy)
                      ).to(x_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics span every rank's batch. Any input rank >= 2."""

    def __init__(self, *args: Any, group: comm.Group = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input, got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        # Only training synchronises (as in torch): evaluation, even with batch statistics
        # (track_running_stats=False), must work on a rank that evaluates alone.
        if not self.training or comm.size_of(self.group) == 1:
            return super().forward(x)
        with torch.no_grad():  # the statistics' gradient is in _SyncBatchNormFn.backward
            mean, var, count = global_moments(x.detach(), self.group)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, count)
        return _SyncBatchNormFn.apply(x, self.weight, self.bias, mean, var,
                                      self.eps, self.group)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor,
                              count: torch.Tensor) -> None:
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                    else self.momentum)
        unbiased = var * count / (count - 1).clamp(min=1)
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)


def convert_sync_batchnorm(module: nn.Module, group: comm.Group = None) -> nn.Module:
    """Replace every BatchNorm{1,2,3}d in `module` with a lockstep SyncBatchNorm. The new
    layers take over the old ones' parameter and buffer objects (as torch's converter
    does), so a DataParallel that already wraps the model keeps reducing the same
    parameters. Returns the (possibly new) root module."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module,
                                                                              SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum,
                                  module.affine, module.track_running_stats, group=group)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, group))
    return module
