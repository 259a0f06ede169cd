"""The GPU path: NCCL collectives, whose every input must live on the rank's GPU.

The core equivalence, ZeRO, compression and the Trainer, each on a 2-rank NCCL world with
one GPU per rank. Skipped, saying so, where there are fewer than two GPUs. The same checks
run on CPU/Gloo when LOCKSTEP_GPU_CHECKS_ON_CPU=1, which is how this module's own logic is
tested on machines without GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import lockstep
from lockstep.testing import World
from tests.models import batch, digits, loss_of, make_model, make_optimizer

ON_CPU = os.environ.get("LOCKSTEP_GPU_CHECKS_ON_CPU") == "1"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
PER_RANK, STEPS = 8, 6


@pytest.fixture(scope="module")
def gpu_world() -> Iterator[World]:
    if not ON_CPU and GPUS < 2:
        pytest.skip(f"needs 2 CUDA GPUs for a 2-rank NCCL world; this machine has {GPUS}")
    with World(2, backend="gloo" if ON_CPU else "nccl") as world:
        yield world


def _train(kind: str, device: torch.device, **options: object) -> tuple[float, torch.Tensor]:
    """Train DataParallel on this rank's slice and a reference on the global batch;
    return the largest parameter gap and the flat parameters."""
    world = lockstep.init()
    net, reference = make_model(kind).to(device), make_model(kind).to(device)
    stage = options.pop("stage", 0)
    model = lockstep.shard(net, stage, bucket_mb=0.01) if stage else \
        lockstep.DataParallel(net, bucket_mb=0.01, **options)  # type: ignore[arg-type]
    opt = model.make_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    ref_opt = make_optimizer("adamw", reference.parameters())
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(kind, step, PER_RANK * world.world_size))
        mine = slice(world.rank * PER_RANK, (world.rank + 1) * PER_RANK)
        loss_of(kind, model, x[mine], y[mine]).backward()
        loss_of(kind, reference, x, y).backward()
        if step % 2:  # clipping by the global norm: ZeRO sums it over the shards
            _clip(opt, net)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full = model.full_state_dict()
    gap = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    flat = torch.cat([t.reshape(-1).float().cpu() for t in full.values()])
    model.close()
    return gap, flat


def _clip(opt: object, net: torch.nn.Module) -> None:
    if hasattr(opt, "clip_grad_norm_"):
        opt.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)


def check_equivalence_zero_and_compression() -> dict[str, float]:
    device = lockstep.init().device
    gaps = {}
    for kind in ("mlp", "transformer"):
        gaps[f"{kind}"] = _train(kind, device)[0]
    for stage in (1, 2, 3):
        gaps[f"zero{stage}"] = _train("mlp", device, stage=stage)[0]
    gaps["bf16 wire"] = _train("mlp", device, compress="bf16")[0]
    gaps["PowerSGD"] = _train("mlp", device, compress=lockstep.PowerSGD(rank=4))[0]
    gaps["TopK"] = _train("mlp", device, compress=lockstep.TopK(0.5))[0]
    return gaps


def test_equivalence_zero_and_compression_on_gpus(gpu_world: World) -> None:
    for gaps in gpu_world.run(check_equivalence_zero_and_compression, deadline_s=300):
        for name in ("mlp", "transformer", "zero1", "zero2", "zero3"):
            assert gaps[name] < 5e-5, (name, gaps[name])
        assert gaps["bf16 wire"] < 5e-2 and gaps["PowerSGD"] < 0.5 and gaps["TopK"] < 0.5, gaps


def check_trainer(run_dir: str, precision: str) -> dict[str, object]:
    x, y = digits()
    train_set, test_set = TensorDataset(x[:960], y[:960]), TensorDataset(x[960:], y[960:])
    trainer = lockstep.Trainer(
        make_model("mlp"), lambda p: torch.optim.AdamW(p, lr=3e-3), train_set,
        test_set, config=lockstep.TrainConfig(global_batch_size=32, epochs=2, run_dir=run_dir,
                                              progress=False, precision=precision,
                                              grad_clip_norm=1.0, checkpoint=lockstep.
                                              CheckpointConfig(resume="never")))
    summary = trainer.fit()
    device = next(trainer.model.module.parameters()).device
    return {"accuracy": summary["test_accuracy"], "device": str(device)}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_trainer_on_gpus(gpu_world: World, tmp_path: Path, precision: str) -> None:
    results = gpu_world.run(check_trainer, str(tmp_path / precision), precision, deadline_s=300)
    for rank, result in enumerate(results):
        assert result["device"] == ("cpu" if ON_CPU else f"cuda:{rank}")
        assert result["accuracy"] > 0.8, result  # chance is 0.1  # type: ignore[operator]
