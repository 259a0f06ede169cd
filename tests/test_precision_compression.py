"""Mixed precision and compression: the skip decision is shared, and what is approximate
stays close -- each checked on real ranks and real data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lockstep
from lockstep.demo.models import CharGPT
from lockstep.testing import World
from tests.models import batch, digest, loss_of, make_model
from tests.test_trainer import digit_sets, sgd


def check_overflow_on_one_rank() -> tuple[list[bool], list[float], str]:
    """After the (averaged) backward, one rank alone finds an inf: every rank must skip."""
    world = lockstep.init()
    net = make_model("mlp")
    model = lockstep.DataParallel(net)
    opt = sgd(model.parameters())
    scaler = lockstep.LossScaler(init_scale=1024.0)
    stepped, scales = [], []
    for step in range(4):
        opt.zero_grad()
        with lockstep.replication.precision.autocast("fp16", world.device):
            loss = loss_of("mlp", model, *batch("mlp", step * 2 + world.rank, 8))
        scaler.scale(loss).backward()
        if step == 2 and world.rank == world.world_size - 1:
            net[0].weight.grad[0, 0] = float("inf")  # this rank only
        stepped.append(scaler.step(opt))
        scales.append(scaler.scale_value)
    return stepped, scales, digest(net)


def test_an_overflow_on_one_rank_makes_every_rank_skip(world: World) -> None:
    results = world.run(check_overflow_on_one_rank)
    for stepped, scales, _ in results:
        assert stepped == [True, True, False, True]
        assert scales == [1024.0, 1024.0, 512.0, 512.0]
    assert len({r[2] for r in results}) == 1  # replicas identical


OVERFLOW_AT = 3  # a step only rank 0 still has data for


def check_join_with_loss_scaler(counts: list[int], sync_final_model: bool
                                ) -> tuple[float, str, dict[str, float]]:
    """Uneven inputs under join() with a LossScaler given to it. fp32 math: scaling by a
    power of 2 is exact, so the weights must be a single process's, DDP's way (divided by
    the initial world size), without the step that overflowed on rank 0 alone while the
    others were out of data."""
    world = lockstep.init()
    rank, n = world.rank, world.world_size
    net, reference = make_model("mlp"), make_model("mlp")
    model = lockstep.DataParallel(net)
    opt, ref_opt = sgd(model.parameters()), sgd(reference.parameters())
    scaler = lockstep.LossScaler(init_scale=1024.0, growth_interval=2)
    with model.join([opt, scaler], sync_final_model=sync_final_model):
        for step in range(counts[rank]):
            opt.zero_grad()
            scaler.scale(loss_of("mlp", model, *batch("mlp", step * n + rank, 8))).backward()
            if step == OVERFLOW_AT:
                net[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
    for step in range(max(counts)):
        active = [r for r in range(n) if step < counts[r]]
        ref_opt.zero_grad()
        sum(loss_of("mlp", reference, *batch("mlp", step * n + r, 8))  # type: ignore[union-attr]
            for r in active).div(n).backward()
        if step != OVERFLOW_AT:
            ref_opt.step()
    gap = max((p - q).abs().max().item()
              for p, q in zip(net.parameters(), reference.parameters(), strict=True))
    return gap, digest(net), scaler.state_dict()


def test_join_with_a_loss_scaler_is_exact_and_keeps_one_scale(world: World) -> None:
    """Before, the scaler's overflow all-reduce met a rank out of data still waiting in
    join's handshake: a desync, then the collective timeout (issue 28's sweep)."""
    counts = [5, 2] if world.world_size == 2 else [5, 2, 0]
    results = world.run(check_join_with_loss_scaler, counts, True)
    assert max(r[0] for r in results) < 5e-5
    assert len({r[1] for r in results}) == 1
    # Without the final sync, the ranks out of data followed every vote themselves:
    # 1024 -> 2048 (two good steps) -> 1024 (the overflow) -> one good step.
    for _, _, scaler in world.run(check_join_with_loss_scaler, counts, False):
        assert scaler == {"scale": 1024.0, "good_steps": 1, "skipped_steps": 1}


def check_scaler_not_given_to_join(counts: list[int]) -> str:
    world = lockstep.init()
    model = lockstep.DataParallel(make_model("mlp"))
    opt, scaler = sgd(model.parameters()), lockstep.LossScaler()
    try:
        with model.join([opt]):
            for step in range(counts[world.rank]):
                scaler.scale(loss_of("mlp", model, *batch("mlp", step, 8))).backward()
                scaler.step(opt)
    except lockstep.JoinError as error:
        return str(error)
    return "no error"


def test_a_scaler_not_given_to_join_is_refused_on_every_rank(world: World) -> None:
    """Every rank -- the one out of data from the start too -- gets the reason, at once."""
    counts = [2, 0] if world.world_size == 2 else [2, 1, 0]
    for rank, said in enumerate(world.run(check_scaler_not_given_to_join, counts,
                                          deadline_s=60)):
        assert said.startswith(f"rank {rank}: a LossScaler not given to join()"), said
        assert "model.join([optimizer, scaler])" in said


def check_precision_training(precision: str, run_dir: str) -> float:
    lockstep.init()
    train_set, test_set = digit_sets()
    config = lockstep.TrainConfig(global_batch_size=48, epochs=3, run_dir=run_dir,
                                  checkpoint=lockstep.CheckpointConfig(resume="never"),
                                  progress=False, precision=precision)
    trainer = lockstep.Trainer(make_model("mlp"), lambda p: torch.optim.Adam(p, lr=3e-3),
                               train_set, test_set, config=config)
    return float(trainer.fit()["test_accuracy"])


def test_bf16_and_fp16_train_as_well_as_fp32(world2: World, tmp_path: Path) -> None:
    accuracy = {p: world2.run(check_precision_training, p, str(tmp_path / p))[0]
                for p in ("fp32", "bf16", "fp16")}
    assert accuracy["fp32"] > 0.8  # it learned (chance is 0.1)
    for precision in ("bf16", "fp16"):
        assert abs(accuracy[precision] - accuracy["fp32"]) <= 0.01, accuracy


def check_compression(compress: object, algorithm: str = "native") -> tuple[float, float, float]:
    """Relative gap between compressed and exact averages, over a few steps, and the
    bytes ratio; gradients accumulated under no_sync first, to check they compose."""
    world = lockstep.init()
    net, ref = make_model("mlp"), make_model("mlp")
    model = lockstep.DataParallel(net, compress=compress, algorithm=algorithm)
    exact = lockstep.DataParallel(ref)
    gaps = []
    for step in range(4):
        x, y = batch("mlp", step * world.world_size + world.rank, 16)
        for m in (model, exact):
            m.zero_grad()
            with m.no_sync():
                loss_of("mlp", m, x[:8], y[:8]).backward()
            loss_of("mlp", m, x[8:], y[8:]).backward()
        gaps.append(max(((p.grad - q.grad).norm() / q.grad.norm()).item()
                        for p, q in zip(net.parameters(), ref.parameters())))
    stats = model.comm_stats()
    model.close()
    exact.close()
    return max(gaps), min(gaps), stats["compression_ratio"]


def test_bf16_and_fp16_compression_match_fp32_to_their_precision(world: World) -> None:
    for worst, _, ratio in world.run(check_compression, "bf16"):
        assert worst < 2 ** -7 and ratio == 2.0  # bf16 keeps 8 bits of mantissa
    for worst, _, ratio in world.run(check_compression, "fp16"):
        assert worst < 2 ** -10 and ratio == 2.0


def test_powersgd_and_topk_send_less_and_approximate(world2: World) -> None:
    worst, best, ratio = world2.run(check_compression,
                                    lockstep.PowerSGD(rank=2, warmup_steps=1))[0]
    assert best < 1e-6 < worst  # exact while warming up, approximate after
    assert ratio > 5
    worst, _, ratio = world2.run(check_compression, lockstep.TopK(0.05))[0]
    assert 0 < worst < 1.5 and 9.5 < ratio < 10.5  # 5% of the entries, values + int32 indices
    worst, best, _ = world2.run(check_compression, lockstep.TopK(0.05, warmup_steps=1))[0]
    assert best < 1e-6 < worst


def check_powersgd_error_feedback_is_lossless_in_sum(wire_dtype: str | None) -> float:
    """Error feedback loses nothing: the approximation plus every rank's kept error equals
    the exact sum of the gradients -- the rounding of 16-bit factors included."""
    world = lockstep.init()
    net, ref = make_model("mlp"), make_model("mlp")
    compressor = lockstep.PowerSGD(rank=1, warmup_steps=0, min_compression=1.0,
                                   wire_dtype=wire_dtype)
    model, exact = lockstep.DataParallel(net, compress=compressor), lockstep.DataParallel(ref)
    x, y = batch("mlp", world.rank, 16)
    loss_of("mlp", model, x, y).backward()
    loss_of("mlp", exact, x, y).backward()
    weight = net[0].weight
    index = next(i for i, p in enumerate(model.reducer.params) if p is weight)
    error = compressor._errors[index].clone()  # kept per parameter, by its index
    lockstep.comm.all_reduce(error, "test: sum of kept errors")
    gap = (weight.grad + error - ref[0].weight.grad).abs().max().item()
    model.close()
    exact.close()
    return gap


def test_powersgd_error_feedback_keeps_what_it_did_not_send(world: World) -> None:
    for wire_dtype in (None, "bf16", "fp16"):
        assert max(world.run(check_powersgd_error_feedback_is_lossless_in_sum, wire_dtype)) < 1e-6


def check_powersgd_on_char_gpt(wire_dtype: str | None) -> tuple[float, list[torch.Tensor]]:
    """One compressed step of the char-GPT: the bytes ratio and the reduced gradients."""
    lockstep.init()
    torch.manual_seed(0)
    net = CharGPT(vocab=63)
    model = lockstep.DataParallel(net, compress=lockstep.PowerSGD(
        rank=4, warmup_steps=0, wire_dtype=wire_dtype))
    torch.manual_seed(lockstep.comm.rank_of())  # each rank its own batch
    model(torch.randint(0, 63, (4, 64))).sum().backward()
    ratio = model.comm_stats()["compression_ratio"]
    model.close()
    return ratio, [p.grad for p in net.parameters()]


def test_powersgd_rank4_sends_20x_less_on_the_char_gpt(world2: World) -> None:
    (ratio, grads), _ = world2.run(check_powersgd_on_char_gpt, None)
    assert ratio >= 20
    (ratio_bf16, grads_bf16), (_, other_rank) = world2.run(check_powersgd_on_char_gpt, "bf16")
    assert ratio_bf16 == pytest.approx(2 * ratio, rel=1e-12)  # every number in 16 bits
    for exact, narrow, twin in zip(grads, grads_bf16, other_rank, strict=True):
        assert torch.equal(narrow, twin)  # replicas still agree bit for bit
        assert (narrow - exact).norm() <= 2 ** -6 * exact.norm()  # close to the fp32 factors


def test_powersgd_refuses_an_unknown_wire_dtype() -> None:
    with pytest.raises(ValueError, match="wire_dtype is None, 'bf16' or 'fp16'"):
        lockstep.PowerSGD(rank=4, wire_dtype="int8")
