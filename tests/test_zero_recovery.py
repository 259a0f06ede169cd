"""ZeRO's state through a change of members (lockstep/sharding/recovery.py), on a real
3-rank Gloo world: mirrored shards, a step some ranks took and others did not, a rank that
holds nothing (dead, or a joiner), and a shard no one holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep import comm
from lockstep.elastic.membership import Candidate, decide
from lockstep.replication.choices import fault_tolerant
from lockstep.sharding import recovery
from lockstep.sharding.optimizer import ZeroOptimizer
from lockstep.testing import World

GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER = 12, 3, 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64), \
        torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _backward(model: nn.Module, step: int) -> None:
    x, y = _batch(step)
    rank, size = lockstep.init().rank, lockstep.init().world_size
    mine = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
    (((model(x[mine]) - y[mine]) ** 2).sum() * size / GLOBAL_BATCH).backward()  # averaged


def reference(steps: int) -> list[torch.Tensor]:
    net = _net()
    optimizer = _sgd(list(net.parameters()))
    for step in range(steps):
        x, y = _batch(step)
        (((net(x) - y) ** 2).sum() / GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _train_to_the_step_under_test(net: nn.Module, stage: int) -> tuple[Any, ZeroOptimizer]:
    """Mirrored ZeRO at `stage`: STEPS_BEFORE steps, then the backward of the next."""
    with fault_tolerant():
        model = lockstep.shard(net, stage)
    optimizer = model.make_optimizer(_sgd)
    for step in range(STEPS_BEFORE):
        optimizer.begin_step()
        _backward(model, step)
        optimizer.step()
        optimizer.zero_grad()
    optimizer.begin_step()
    _backward(model, STEPS_BEFORE)
    return model, optimizer


def _resume_from_the_pool(net: nn.Module, stage: int, optimizer: ZeroOptimizer,
                          held: recovery.Held | None, step: int) -> list[torch.Tensor]:
    """Pool what the ranks held at `step`, rebuild the wrapper from it, train to
    STEPS_BEFORE + STEPS_AFTER; the whole parameters."""
    pooled = recovery.pool(held, step)
    assert pooled is not None
    recovery.restore(net, pooled)
    with fault_tolerant():
        model = lockstep.shard(net, stage)
    optimizer.rebind(model.zero_groups, model.stage, model.group)
    recovery.load(model.zero_groups, optimizer, pooled)
    for at in range(step, STEPS_BEFORE + STEPS_AFTER):
        optimizer.begin_step()
        _backward(model, at)
        optimizer.step()
        optimizer.zero_grad()
    whole = model.full_state_dict()
    model.close()
    return [whole[name] for name, _ in net.named_parameters()]


def take_back_a_half_taken_step(stage: int) -> list[torch.Tensor]:
    """Train STEPS_BEFORE steps mirrored; in the next, rank 0 steps its shards and rank 1
    does not; then rank 2 "dies" -- it offers nothing, as a joiner would -- and the pool
    must give back the state at STEPS_BEFORE, rank 2's shard from rank 1's mirror. Rebuild
    and train STEPS_AFTER more steps; returns the whole parameters."""
    world, net = lockstep.init(), _net()
    model, optimizer = _train_to_the_step_under_test(net, stage)
    if world.rank == 0:  # its step ran; the gather after it "failed"
        optimizer._keep_previous()
        optimizer.inner.step()
        optimizer.stepped = True
    held = None if world.rank == 2 else \
        recovery.hold(model.zero_groups, optimizer, epoch=0, step=STEPS_BEFORE)
    model.abandon()
    return _resume_from_the_pool(net, stage, optimizer, held, STEPS_BEFORE)


def go_back_past_a_step_a_dead_mirror_had_not_taken(stage: int) -> list[torch.Tensor]:
    """Train STEPS_BEFORE steps mirrored, then one more that rank 0 completes (it begins
    the next) while rank 2 has not stepped; rank 1 "dies". Shard 2 after that step lived
    only on rank 1 (its mirror): the membership goes back to STEPS_BEFORE (decide), rank 0
    offering the state it kept from before its last step. Rebuild and train STEPS_AFTER
    more steps from there; returns the whole parameters."""
    world, net = lockstep.init(), _net()
    model, optimizer = _train_to_the_step_under_test(net, stage)
    if world.rank != 2:  # (the step's own collectives are not what this is about)
        optimizer._keep_previous()
        optimizer.inner.step()
    committed = STEPS_BEFORE + 1 if world.rank == 0 else STEPS_BEFORE
    optimizer.begin_step()  # (rank 0's next attempt)
    held = None if world.rank == 1 else \
        recovery.hold(model.zero_groups, optimizer, epoch=0, step=committed)
    model.abandon()
    offers = comm.all_gather_object(None if held is None else held.shards(), "test: shards")
    candidates = [Candidate(r, "h", 0, step=STEPS_BEFORE + (r == 0), rank=r, shards=o)
                  for r, o in enumerate(offers) if r != 1]
    step = decide(1, candidates, []).step
    assert step == STEPS_BEFORE
    return _resume_from_the_pool(net, stage, optimizer, held, step)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_completed_where_a_dead_mirror_had_not_taken_it_is_taken_back(
        world3: World, stage: int) -> None:
    expected = reference(STEPS_BEFORE + STEPS_AFTER)
    for got in world3.run(go_back_past_a_step_a_dead_mirror_had_not_taken, stage):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_half_taken_step_is_taken_back_and_a_lost_shard_comes_from_its_mirror(
        world3: World, stage: int) -> None:
    expected = reference(STEPS_BEFORE + STEPS_AFTER)
    for got in world3.run(take_back_a_half_taken_step, stage):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_shard_no_survivor_holds_is_refused_with_the_reason() -> None:
    """Old ranks 1 and 2 of 3 died together: shard 2 lived on rank 2 and, mirrored, on
    rank 1. Shards 0 and 1 are on rank 0 (its own and its mirror)."""
    offers = [{"epoch": 4, "world_size": 3, "versions": {7: [(0, 0), (0, 1)]}}, None]
    with pytest.raises(RuntimeError, match=r"rank 0: ZeRO shard 2 of parameter group 0 \(of 3 "
                       r"ranks\) is held at step 7 by no survivor: the ranks that held it "
                       r"\(old ranks 2 and 1, its mirror\) are both gone"):
        recovery._holders(offers, 7, 3, 0)
