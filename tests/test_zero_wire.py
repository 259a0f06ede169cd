"""ZeRO's reduce-scatters and gathers in bf16 and int8 (sharding/compressed.py).

The collectives themselves against exact ones, within their formats' precision; training
with them learns the digits as plain ZeRO does, with at least 3.5x fewer gradient bytes in
int8; the replicas compute with the same (decoded) weights, while the optimizer, state
dicts and checkpoints keep the exact masters. (Exact resume with error feedback is in
test_resume_state.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep import comm
from lockstep.sharding import compressed
from lockstep.testing import World
from tests.models import make_model
from tests.test_trainer import digit_sets


def collectives(wire: str) -> tuple[float, float, float]:
    """The worst error of a compressed reduce-scatter and gather against exact ones, each
    relative to the largest magnitude, and the error feedback's effect over 20 rounds."""
    rank, size = comm.rank_of(), comm.size_of()
    torch.manual_seed(rank)
    bucket = torch.randn(size * 640)
    exact = torch.empty(640)
    comm.reduce_scatter(exact, bucket.clone(), "exact reduce-scatter")
    approx = compressed.reduce_scatter(bucket, wire, "compressed reduce-scatter", None)
    scatter_error = ((approx - exact).abs().max() / exact.abs().max()).item()
    shard, flat = torch.randn(640), torch.zeros(size * 640)
    compressed.start_gather(flat, shard, wire, "compressed gather", None).wait()
    mine = flat[rank * 640:(rank + 1) * 640]
    gather_error = ((mine - shard).abs().max() / shard.abs().max()).item()
    # the same gradient 20 times: with feedback the sum of what arrived tracks 20x exact
    feedback, total = torch.zeros_like(bucket), torch.zeros(640)
    for _ in range(20):
        total += compressed.reduce_scatter(bucket, wire, "with feedback", None, feedback)
    drift = ((total - 20 * exact).abs().max() / (20 * exact.abs().max())).item()
    return scatter_error, gather_error, drift


@pytest.mark.parametrize("wire,bound", [("bf16", 2 ** -7), ("int8", 2 / 127)])
def test_compressed_collectives_are_exact_within_their_format(world2: World, wire: str,
                                                              bound: float) -> None:
    for scatter_error, gather_error, drift in world2.run(collectives, wire):
        assert 0 < scatter_error < bound and 0 < gather_error < bound
        assert drift < scatter_error / 5  # rounding carried over, not repeated 20 times


def learn(run_dir: str, stage: int, wire: str) -> dict[str, Any]:
    """Two epochs of the digits under ZeRO: accuracy, gradient bytes per step, whether the
    state dict holds the masters (this rank's shard of it) and whether the copies the
    forward computes with differ from them (stage 2, whose full buffers stay)."""
    lockstep.init()
    train_set, test_set = digit_sets()
    trainer = lockstep.Trainer(
        make_model("mlp"), lambda p: torch.optim.AdamW(p, lr=3e-3), train_set, test_set,
        config=lockstep.TrainConfig(
            global_batch_size=32, epochs=2, run_dir=run_dir, progress=False,
            parallel=lockstep.ShardConfig(stage=stage, wire=wire, error_feedback=wire != "full"),
            checkpoint=lockstep.CheckpointConfig(resume="never")))
    summary = trainer.fit()
    model = trainer.model
    state = model.full_state_dict()
    masters_kept = decoded_differ = False
    for g in model.zero_groups:
        whole = torch.cat([state[name].reshape(-1) for name in g.names])
        whole = torch.nn.functional.pad(whole, (0, g.padded_numel - whole.numel()))
        valid = max(0, min(g.shard.stop, g.numel) - g.shard.start)  # (padding aside)
        masters_kept = torch.equal(whole[g.shard][:valid], g.shard_param.detach()[:valid])
        if not masters_kept:
            break
        if stage == 2:  # the full buffer holds what the forward uses
            decoded_differ |= not torch.equal(g.flat[g.shard], g.shard_param.detach())
    return {"accuracy": summary["test_accuracy"], "bytes": model.comm_stats()["bytes_sent"],
            "masters_kept": masters_kept, "decoded_differ": decoded_differ,
            "fingerprint": summary["fingerprint"]}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_in_int8_learns_as_plain_zero_with_a_quarter_of_the_bytes(
        world2: World, tmp_path: Path, stage: int) -> None:
    plain = world2.run(learn, str(tmp_path / "plain"), stage, "full")
    int8 = world2.run(learn, str(tmp_path / "int8"), stage, "int8")
    assert int8[0]["accuracy"] >= plain[0]["accuracy"] - 0.02, (int8[0], plain[0])
    assert int8[0]["bytes"] * 3.5 < plain[0]["bytes"], (int8[0]["bytes"], plain[0]["bytes"])
    assert len({r["fingerprint"] for r in int8}) == 1  # every rank's state dict agrees
    # the state dict is the masters, each rank's own shard bit for bit ...
    assert all(r["masters_kept"] for r in int8 + plain)
    if stage == 2:  # ... while the wire did round the copies the forward computes with
        assert all(r["decoded_differ"] for r in int8)
        assert not any(r["decoded_differ"] for r in plain)


def test_what_cannot_compose_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="stage 1 all-reduces whole gradients"):
        lockstep.ShardConfig(stage=1, wire="int8").validate()
    with pytest.raises(ValueError, match="wire must be one of full, bf16, int8"):
        lockstep.ShardConfig(stage=2, wire="int4").validate()
    with pytest.raises(ValueError, match="full precision rounds nothing"):
        lockstep.ShardConfig(stage=2, error_feedback=True).validate()


def mirrored_refused() -> str:
    lockstep.init()
    try:
        lockstep.shard(make_model("mlp"), 2, mirror=True, wire="bf16")
    except ValueError as error:
        return str(error)
    return "accepted"


def test_compressed_wire_under_fault_tolerance_is_refused(world2: World) -> None:
    for said in world2.run(mirrored_refused):
        assert "under fault tolerance" in said and "wire='full' with elastic=" in said


class OutOfOrder(torch.nn.Module):
    """Layers used in another order than registered: stage 3's prefetch order is then not
    the reverse of its groups' (a state dict's exact gathers once took a prefetched,
    decoded unit for the master)."""

    def __init__(self) -> None:
        super().__init__()
        self.b, self.a, self.c = (torch.nn.Linear(64, 64), torch.nn.Linear(64, 64),
                                  torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def skipped_then_trained(stage: int, wire: str) -> dict[str, bool]:
    """One step with an inf loss (skipped on every rank), two good ones after: everything
    must stay finite, and the state dict must be the masters."""
    lockstep.init()
    torch.manual_seed(0)
    model = lockstep.shard(OutOfOrder(), stage, wire=wire, error_feedback=True,
                           nonfinite="skip")
    optimizer = model.make_optimizer(torch.optim.SGD, lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 64)).sum()
        (loss * float("inf") if step == 0 else loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.full_state_dict()
    masters = all(torch.equal(
        torch.nn.functional.pad(torch.cat([state[n].reshape(-1) for n in g.names]),
                                (0, g.padded_numel - g.numel))[g.shard], g.shard_param.detach())
        for g in model.zero_groups)
    return {"finite": all(bool(torch.isfinite(t).all()) for t in state.values()) and all(
        bool(torch.isfinite(k).all()) for k in model.reduction.feedback),  # type: ignore
        "masters": masters}


@pytest.mark.parametrize("stage,wire", [(2, "bf16"), (2, "int8"), (3, "int8")])
def test_a_skipped_step_leaves_no_trace_and_state_dicts_hold_the_masters(
        world2: World, stage: int, wire: str) -> None:
    """Before: a skipped step's inf stayed in the error feedback and made every later
    step's parameters NaN (bf16) or silently wrong (int8, which cast NaN to a number); and
    stage 3's exact gathers for a state dict prefetched the next unit decoded."""
    for result in world2.run(skipped_then_trained, stage, wire):
        assert result == {"finite": True, "masters": True}
