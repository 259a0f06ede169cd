"""SyncBatchNorm on Gloo/CPU: the global batch's statistics, whatever each rank holds."""

from __future__ import annotations

import torch
from torch import nn

import lockstep
from lockstep.testing import World


def per_rank_sizes(world_size: int) -> list[int]:
    return [3 + 4 * r for r in range(world_size)]  # unequal: a count-weighting bug shows


def check_unequal_batches() -> dict[str, float]:
    """Forward, backward and running stats against BatchNorm on the concatenated batch."""
    world = lockstep.init()
    sizes = per_rank_sizes(world.world_size)
    x = torch.randn(sum(sizes), 4, 5, generator=torch.Generator().manual_seed(0)) * 3 + 1
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    mine = slice(sum(sizes[:world.rank]), sum(sizes[:world.rank + 1]))
    sync, plain = lockstep.SyncBatchNorm(4), nn.BatchNorm1d(4)
    xs, xp = x[mine].clone().requires_grad_(), x.clone().requires_grad_()
    # Each rank's loss is its share of the global sum, so summed gradients are comparable.
    ((sync(xs) - target[mine]) ** 2).sum().backward()
    ((plain(xp) - target) ** 2).sum().backward()
    weight_grad = sync.weight.grad.clone()
    lockstep.comm.all_reduce(weight_grad, "test: sum weight grads")
    return {"dx": (xs.grad - xp.grad[mine]).abs().max().item(),
            "dweight": (weight_grad - plain.weight.grad).abs().max().item(),
            "running_var": (sync.running_var - plain.running_var).abs().max().item(),
            "running_mean": (sync.running_mean - plain.running_mean).abs().max().item()}


def test_matches_batchnorm_on_the_global_batch_with_unequal_shares(world: World) -> None:
    for errors in world.run(check_unequal_batches):
        assert max(errors.values()) < 1e-4, errors


def check_eval_alone_and_half_precision() -> tuple[bool, float, float]:
    world = lockstep.init()
    bn = lockstep.SyncBatchNorm(3, track_running_stats=False).eval()
    if world.rank == 0:  # only rank 0 evaluates: no collective may be issued
        bn(torch.randn(4, 3))
    x = torch.randn(64 * 1100, 3, generator=torch.Generator().manual_seed(world.rank))
    # more than 65,504 elements per channel: a half-precision count would overflow
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        layer = lockstep.SyncBatchNorm(3).to(dtype).train()
        y = layer(x.to(dtype))
        out[dtype] = float(y.float().mean().abs().item() + (y.float().std() - 1).abs().item())
    return True, out[torch.float16], out[torch.bfloat16]


def test_eval_never_communicates_and_half_precision_works(world2: World) -> None:
    for _, fp16_error, bf16_error in world2.run(check_eval_alone_and_half_precision):
        assert fp16_error < 0.05 and bf16_error < 0.05  # normalised: mean 0, std 1


def check_join_refuses_syncbn() -> str:
    lockstep.init()
    model = lockstep.DataParallel(lockstep.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))))
    try:
        with model.join():
            pass
    except lockstep.JoinError as error:
        return str(error)
    return "accepted"


def test_join_says_it_cannot_shadow_syncbn(world2: World) -> None:
    for rank, message in enumerate(world2.run(check_join_refuses_syncbn)):
        assert f"rank {rank}: join() cannot stand in for SyncBatchNorm" in message
