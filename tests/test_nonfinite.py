"""A NaN or inf on one rank is caught at the step it appears, never spread silently.

One rank's bad batch at step 4: by default every rank stops there with an error naming the
step, that rank and the first parameter, with finite weights and the last checkpoint
intact; with nonfinite="skip" every rank drops that step alike and training goes on.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lockstep
from lockstep.replication.nonfinite import FiniteCheck, NonFiniteGradientError, flags_numel
from lockstep.testing import World
from lockstep.training import checkpoint
from tests.models import batch, digest, make_model
from tests.test_trainer import config, digit_sets, sgd

BAD_STEP, BAD_RANK = 4, 1


def _poisoned(x: torch.Tensor, step: int, rank: int, value: float) -> torch.Tensor:
    if step == BAD_STEP and rank == BAD_RANK:
        x = x.clone()
        x[0, 0] = value
    return x


def compressor(name: str) -> object:
    return {"none": None, "topk": lockstep.TopK(0.1),
            "powersgd": lockstep.PowerSGD(2, warmup_steps=2),  # step 4: compressed
            "powersgd-warm": lockstep.PowerSGD(2, warmup_steps=10)}[name]


def check_loop(mode: str, precision: str, value: float, algorithm: str = "native",
               compress: str = "none") -> dict[str, object]:
    """A plain training loop; rank 1's input holds `value` at step 4."""
    world = lockstep.init()
    net = make_model("mlp")
    model = lockstep.DataParallel(net, bucket_mb=0.004, nonfinite=mode, algorithm=algorithm,
                                  compress=compressor(compress))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    error, steps_done = "", 0
    for step in range(1, 7):
        x, y = batch("mlp", step * world.world_size + world.rank, 8)
        x = _poisoned(x, step, world.rank, value)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        try:
            with torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        except NonFiniteGradientError as caught:
            error = str(caught)
            break
        opt.step()
        opt.zero_grad()
        steps_done = step
    finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    return {"error": error, "steps": steps_done, "finite": finite, "digest": digest(net),
            "skipped": model.comm_stats()["skipped_steps"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("algorithm", ["native", "shm"])  # the flags in the last bucket, or
def test_a_nan_on_one_rank_stops_every_rank_at_that_step(  # in a collective of their own
        world2: World, precision: str, algorithm: str) -> None:
    for rank, result in enumerate(world2.run(check_loop, "error", precision, float("nan"),
                                             algorithm)):
        assert result["steps"] == BAD_STEP - 1 and result["finite"], result
        message = result["error"]
        assert f"rank {rank}: synchronised backward {BAD_STEP}:" in message  # type: ignore[operator]
        assert f"rank(s) [{BAD_RANK}]" in message and "first in '0.weight'" in message  # type: ignore[operator]


@pytest.mark.parametrize("compress", ["topk", "powersgd", "powersgd-warm"])
def test_a_nan_under_a_compressor_stops_every_rank_at_that_step(
        world2: World, compress: str) -> None:
    """TopK's values and PowerSGD's uncompressed part carry the flags, summed exactly
    (a compressor would drop or approximate them as gradients)."""
    for rank, result in enumerate(world2.run(check_loop, "error", "fp32", float("nan"),
                                             "native", compress)):
        assert result["steps"] == BAD_STEP - 1 and result["finite"], result
        message = result["error"]
        assert f"rank {rank}: synchronised backward {BAD_STEP}:" in message  # type: ignore[operator]
        assert f"rank(s) [{BAD_RANK}]" in message and "first in '0.weight'" in message  # type: ignore[operator]


@pytest.mark.parametrize("compress", ["none", "topk", "powersgd"])
def test_skip_drops_the_step_on_every_rank_and_goes_on(world2: World, compress: str) -> None:
    """A compressor's state from the dropped step (error feedback, PowerSGD's Q) held the
    NaN too and brought it into the weights a step later, where no flag saw it: dropped
    with the step."""
    results = world2.run(check_loop, "skip", "fp32", float("nan"), "native", compress)
    assert len({r["digest"] for r in results}) == 1  # replicas stayed identical
    for result in results:
        assert result["steps"] == 6 and result["finite"] and result["skipped"] == 1, result


def check_flag_values(value: float) -> list[float]:
    """This rank's flag after a gradient bucket of `value`s, as a 16-bit wire carries it."""
    world = lockstep.init()
    check = FiniteCheck("error", ["w"], None, carried=True)
    flags = torch.zeros(flags_numel(world.world_size))
    check.launching(torch.full((8,), value), flags)
    return flags.to(torch.float16).tolist()


def test_a_flag_is_zero_or_nan_so_a_16_bit_wire_carries_it_exactly(world2: World) -> None:
    """A large finite sum (8e5, past fp16's 65504) must not arrive as inf: a false alarm."""
    for flags in world2.run(check_flag_values, 1e5):
        assert flags == [0.0] * len(flags)
    for rank, flags in enumerate(world2.run(check_flag_values, float("inf"))):
        assert math.isnan(flags[rank]) and flags[1 - rank] == 0.0


def check_trainer(run_dir: str, mode: str) -> dict[str, object]:
    """The Trainer with checkpoints every 2 steps and a NaN loss on rank 1 at step 5."""
    world = lockstep.init()
    train_set, test_set = digit_sets()
    seen = {"step": 0}

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, y)
        return loss * float("nan") if world.rank == 1 and seen["step"] == 4 else loss

    trainer = lockstep.Trainer(make_model("mlp"), sgd, train_set, test_set, loss_fn=loss_fn,
                               config=config(run_dir, max_steps=8, checkpoint_every_steps=2,
                                             parallel=lockstep.SyncConfig(nonfinite=mode)),
                               callbacks=[lambda t: seen.update(step=t.state.global_step)])
    try:
        summary = trainer.fit()
    except NonFiniteGradientError as error:
        summary = {"error": str(error)}
    saved = [int(p.name.split("-")[-1])
             for p in checkpoint.list_checkpoints(Path(run_dir) / "checkpoints")]
    return {"summary": summary, "saved": sorted(saved),
            "finite": all(bool(torch.isfinite(p).all())
                          for p in trainer.model.module.parameters())}


def test_the_trainer_stops_before_a_checkpoint_takes_the_bad_weights(world2: World,
                                                                      tmp_path: Path) -> None:
    for rank, result in enumerate(world2.run(check_trainer, str(tmp_path / "error"), "error")):
        assert f"training step 5 (epoch 0): rank {rank}:" in result["summary"]["error"]  # type: ignore[index]
        assert result["saved"] == [2, 4] and result["finite"], result
    for result in world2.run(check_trainer, str(tmp_path / "skip"), "skip"):
        assert result["summary"]["steps"] == 8 and result["finite"], result  # type: ignore[index]
        assert result["saved"][-1] == 8
    logged = (tmp_path / "skip" / "metrics.jsonl").read_text()
    assert '"skipped_steps": 1' in logged


def check_large_but_finite() -> tuple[str, bool]:
    """Gradients of 8e36 per element: finite, though their sum overflows float32."""
    lockstep.init()
    net = torch.nn.Linear(64, 4)
    model = lockstep.DataParallel(net)
    try:
        model(torch.full((8, 64), 1e36)).sum().backward()  # weight grads 8e36, sum inf
    except NonFiniteGradientError as error:
        return str(error), False
    return "", bool(torch.isfinite(net.weight.grad).all())


def test_large_finite_gradients_are_not_mistaken_for_nan(world2: World) -> None:
    for error, finite in world2.run(check_large_but_finite):
        assert error == "" and finite


def collectives_per_step(algorithm: str, compress: str = "none") -> list[str]:
    """The collectives three synchronised steps of a small model issued, by label (the
    watchdog's ledger records each; it is on by default)."""
    from lockstep.comm.ledger import ledger

    lockstep.init()
    model = lockstep.DataParallel(make_model("mlp"), algorithm=algorithm,
                                  compress=compressor(compress))
    for step in range(1, 6):
        if step == 3:  # (the plan is rebuilt in arrival order at the second forward)
            seen = {key: max((n for n, _, _ in ledger.recent(key, 1)), default=0)
                    for key in ledger.history}  # each group's last collective so far
        x, y = batch("mlp", step, 8)
        F.cross_entropy(model(x), y).backward()
    return [label for key in ledger.history for n, _, label in ledger.recent(key, 100)
            if n > seen.get(key, 0)]


def test_the_flags_ride_in_the_last_bucket_where_every_element_is_summed(
        world2: World) -> None:
    """An all-reduce sums every element of a bucket on every rank, so the ranks' flags go at
    its end: one collective per step for a one-bucket model, as DDP issues -- not two (a
    tiny model's step is mostly collective latency). shm sums slices of shared memory, and
    the flags there too: its steps wait only at the host's barriers in memory (two a step
    for one bucket), never on a socket."""
    native = world2.run(collectives_per_step, "native")[0]
    assert len(native) == 3 and all(label.startswith("gradient bucket 1/1") for label in native)
    # A compressor's own collectives carry them too: no exchange of their own (it cost
    # the MNIST CNN 2-3 ms of a 16 ms step on 2 emulated hosts)
    topk = world2.run(collectives_per_step, "native", "topk")[0]
    assert len(topk) == 6 and all("TopK" in label for label in topk), topk
    powersgd = world2.run(collectives_per_step, "native", "powersgd")[0]  # (compressed)
    assert len(powersgd) == 9 and all("PowerSGD" in label for label in powersgd), powersgd
    shm = world2.run(collectives_per_step, "shm")[0]
    assert len(shm) == 6 and all(  # a bucket's barrier names it, as its all-reduce would
        bucket.startswith("gradient bucket 1/1") and end.startswith("every rank on the host has")
        for bucket, end in zip(shm[::2], shm[1::2], strict=True)), shm


def check_join_sees_a_nan_it_has_no_gradients_for() -> str:
    """Uneven inputs under join(): rank 1 runs out after 2 batches and stands in for the
    rest (zero_grad left it no gradients); rank 0's 4th batch holds a NaN."""
    world = lockstep.init()
    net = make_model("mlp")
    model = lockstep.DataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        with model.join():
            for step in range(1, (4 if world.rank == 0 else 2) + 1):
                x, y = batch("mlp", step * 2 + world.rank, 8)
                if world.rank == 0 and step == 4:
                    x[0, 0] = float("nan")
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    except NonFiniteGradientError as caught:
        return str(caught)
    return ""


def test_a_joined_rank_stops_with_the_others_on_a_nan(world2: World) -> None:
    """The joined rank cannot look at the averaged gradients (it holds none): it must stop
    with the rank that can, not go on alone into the next handshake and wait out the
    timeout (it did, once the flags rode in the last bucket)."""
    for message in world2.run(check_join_sees_a_nan_it_has_no_gradients_for, deadline_s=120):
        assert "non-finite gradient (NaN or inf) in the local gradients of rank(s) [0]" \
            in message, message
