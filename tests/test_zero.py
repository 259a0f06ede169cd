"""ZeRO stages 1-3: the same training as one process, the promised memory, clear refusals."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import lockstep
from lockstep.testing import World
from lockstep.zero import padded, plan_units, shard_range
from tests.models import batch, digest, loss_of, make_model

STEPS, PER_RANK = 15, 8
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}


def train_stage(kind: str, stage: int, optimizer: str, accumulate: int) -> tuple[float, str]:
    world = lockstep.init()
    rank, n = world.rank, world.world_size
    net, reference = make_model(kind), make_model(kind)
    model = lockstep.DataParallel(net, bucket_mb=0.004, first_bucket_mb=0.004, zero=stage)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt, ref_opt = model.make_optimizer(cls, **kwargs), cls(reference.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = batch(kind, step, PER_RANK * n)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        for i, (mx, my) in enumerate(zip(x[mine].chunk(accumulate), y[mine].chunk(accumulate))):
            with nullcontext() if i == accumulate - 1 else model.no_sync():
                (loss_of(kind, model, mx, my) / accumulate).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(kind, reference, x, y).backward()
        ref_opt.step()
    gaps = []
    for g in getattr(model, "zero_groups", []):  # stage 3: gather to compare the parameters
        g.materialize()
        lockstep.comm.all_gather_into(g.flat, g.shard_param.detach().clone(), "test gather")
    for p, q in zip(net.parameters(), reference.parameters()):
        gaps.append((p - q).abs().max().item())
    return max(gaps), digest(net, parameters_only=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_like_one_process(world: World, stage: int) -> None:
    for optimizer in OPTIMIZERS:
        for accumulate in (1, 2):
            results = world.run(train_stage, "transformer", stage, optimizer, accumulate)
            worst = max(r[0] for r in results)
            assert worst < 5e-5, f"stage {stage} {optimizer} x{accumulate}: {worst:.2e}"
            assert len({r[1] for r in results}) == 1


def test_shard_arithmetic_pads_for_any_world_size() -> None:
    for numel in (1, 7, 10, 12):
        for n in (1, 2, 3, 4):
            full = padded(numel, n)
            assert full % n == 0 and 0 <= full - numel < n
            covered = [i for r in range(n) for i in range(full)[shard_range(full, r, n)]]
            assert covered == list(range(full))


def test_units_are_layers_and_tied_weights_have_one_owner() -> None:
    units = plan_units(make_model("transformer"))
    names = [n for unit in units for n in unit]
    assert len(names) == len(set(names))  # each parameter once
    assert ["embed.weight"] in units      # tied to head.weight: owned by the embedding
    assert not any("head" in n or "position" in n for n in names)  # tied, and frozen


def check_needs_whole_tensors() -> str:
    lockstep.init()
    model = lockstep.DataParallel(make_model("mlp"), zero=1)
    try:
        model.make_optimizer(lockstep.LAMB, lr=1e-3)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_lamb_and_lars_are_refused_under_zero(world2: World) -> None:
    for rank, message in enumerate(world2.run(check_needs_whole_tensors)):
        assert f"rank {rank}: LAMB needs each parameter whole" in message
