"""LARS, LAMB, warmup and the linear scaling rule against updates computed by hand."""

import math

import pytest
import torch

from lockstep.optim import LAMB, LARS, LRSchedule, goyal_schedule, linear_scaling, set_lr
from lockstep.training.trainer import plan_batches


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def test_lars_matches_hand_computed_updates():
    weight = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
    bias = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LARS([weight, bias], lr=0.1, momentum=0.9, weight_decay=0.1, trust_coefficient=0.001,
               eps=0.0)
    g, gb = [0.6, 0.8], 0.5
    w, b, v, vb = [3.0, 4.0], 1.0, [0.0, 0.0], 0.0
    for _ in range(2):
        weight.grad = torch.tensor([g])
        bias.grad = torch.tensor([gb])
        opt.step()
        local_lr = 0.001 * norm(w) / (norm(g) + 0.1 * norm(w))
        v = [0.9 * vi + 0.1 * local_lr * (gi + 0.1 * wi) for vi, gi, wi in zip(v, g, w)]
        w = [wi - vi for wi, vi in zip(w, v)]
        vb = 0.9 * vb + 0.1 * gb  # 1-D parameters: plain momentum SGD, no trust, no decay
        b -= vb
        assert weight.flatten().tolist() == pytest.approx(w, rel=1e-6)  # float32
        assert bias.item() == pytest.approx(b, abs=1e-7)


def test_lamb_matches_hand_computed_updates():
    weight = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = LAMB([weight], lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    w, m, v = [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]
    for t, g in enumerate([[0.6, 0.8], [-0.2, 0.4]], start=1):
        weight.grad = torch.tensor(g)
        opt.step()
        m = [0.9 * mi + 0.1 * gi for mi, gi in zip(m, g)]
        v = [0.999 * vi + 0.001 * gi * gi for vi, gi in zip(v, g)]
        m_hat = [mi / (1 - 0.9 ** t) for mi in m]
        v_hat = [vi / (1 - 0.999 ** t) for vi in v]
        r = [mh / (math.sqrt(vh) + 1e-6) + 0.01 * wi for mh, vh, wi in zip(m_hat, v_hat, w)]
        trust = norm(w) / norm(r)
        w = [wi - 0.01 * trust * ri for wi, ri in zip(w, r)]
        assert weight.tolist() == pytest.approx(w, abs=1e-6)


def test_trust_ratio_is_one_for_a_zero_layer():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    weight.grad = torch.ones(2, 2)
    LAMB([weight], lr=0.1, weight_decay=0.0).step()
    # ||w|| = 0: trust falls back to 1, so the step is lr * Adam's first update (~1 each).
    assert weight.detach() == pytest.approx(torch.full((2, 2), -0.1), abs=1e-5)


def test_goyal_linear_scaling_and_gradual_warmup():
    assert linear_scaling(0.1, 1024, 256) == pytest.approx(0.4)
    schedule = goyal_schedule(0.1, global_batch=1024, base_batch=256, warmup_steps=5)
    # Linear from the unscaled 0.1 up to the scaled 0.4, reached at the last warmup step.
    assert [round(schedule(s), 6) for s in range(7)] == [0.16, 0.22, 0.28, 0.34, 0.4, 0.4, 0.4]


def test_cosine_decay_after_warmup():
    schedule = LRSchedule(peak_lr=1.0, warmup_steps=2, start_lr=0.0, total_steps=12,
                          decay="cosine")
    assert schedule(0) == pytest.approx(0.5) and schedule(1) == pytest.approx(1.0)
    assert schedule(2) == pytest.approx(1.0)
    assert schedule(7) == pytest.approx(0.5)  # half way through the decay
    assert schedule(12) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="total_steps"):
        LRSchedule(peak_lr=1.0, decay="cosine")


def test_set_lr_honours_per_group_scale():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr_scale": 0.1}], lr=1.0)
    set_lr(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.05])


@pytest.mark.parametrize(("global_batch", "world", "cap", "expected"), [
    (64, 2, None, (32, 32, 1)),
    (64, 2, 8, (32, 8, 4)),
    (48, 3, 10, (16, 8, 2)),     # 16 per rank, cap 10: two micro-batches of 8
    (48, 1, 7, (48, 6, 8)),      # 48 = 8 x 6: the fewest equal micro-batches under 7
    (30, 3, 4, (10, 2, 5)),      # 10 does not split into 3 equal parts: 5 x 2
])
def test_batch_plan_splits_over_ranks_then_micro_steps(global_batch, world, cap, expected):
    plan = plan_batches(global_batch, world, cap)
    assert (plan.per_rank, plan.micro_batch, plan.accumulation) == expected
    assert plan.micro_batch * plan.accumulation * world == global_batch


def test_batch_plan_rejects_uneven_split():
    with pytest.raises(ValueError, match="multiple of 3"):
        plan_batches(64, 3)
