"""lockstep where users already train: Lightning's loop over lockstep's wrapper gives what
Lightning's own DDPStrategy gives (tests/lightning_job.py runs both in one 2-process job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.dropin import worker_error

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


@pytest.fixture(scope="module")
def lightning_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("lightning", reason="Lightning is the [lightning] extra")
    out = tmp_path_factory.mktemp("lightning") / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "lightning_job.py"), str(out)],
                            cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, worker_error(result.stderr)
    report: dict = json.loads(out.read_text())
    return report


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", ["sync", "zero2", "zero3", "accumulate", "pytorch_lightning",
                                 "zero1_warmup", "manual"])
def test_lightning_strategy_takes_ddps_steps(lightning_report: dict, run: str) -> None:
    """Per-step losses and final weights as DDPStrategy's, in float64 (Adam with a step
    schedule, chained after a warm-up at ZeRO-1; SGD with momentum for the accumulation),
    with lockstep's wrapper training -- also from the older `pytorch_lightning` package (at
    ZeRO-2), and under manual optimization with two backwards per step (a GAN's pattern)."""
    got = lightning_report[run]
    assert got["steps"] == 32
    sharded = run.startswith("zero") or run == "pytorch_lightning"
    assert got["wrapper"] == ("ShardedDataParallel" if sharded else "DataParallel")
    assert got["optimizer"] == ("ZeroOptimizer" if sharded else
                                "SGD" if run in ("accumulate", "manual") else "AdamW")
    assert got["loss_gap"] <= 1e-12 and got["weights_gap"] <= 1e-12, got


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", ["sync", "zero2", "zero3"])
def test_lightning_checkpoint_is_ddps_checkpoint(lightning_report: dict, run: str) -> None:
    """The optimizer state in the checkpoint is whole, as DDP's (ZeRO's shards assembled)."""
    assert lightning_report[run]["optimizer_gap"] <= 1e-12


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", ["zero3_from_ddp", "sync_from_zero3"])
def test_lightning_resumes_across_stages(lightning_report: dict, run: str) -> None:
    """DDP's checkpoint resumed under ZeRO-3, and ZeRO-3's under plain sync, continue as DDP
    resumed from its own does."""
    got = lightning_report[run]
    assert got["steps"] == 32 and got["loss_gap"] <= 1e-12 and got["weights_gap"] <= 1e-12, got


@pytest.mark.timeout(360)
def test_lightning_refuses_clipping_a_shard(lightning_report: dict) -> None:
    assert "configure_gradient_clipping" in lightning_report["clip_refused"]
    assert lightning_report["watchdog_world"] == 2  # lockstep.init() adopted Lightning's group


def run_example(args: list[str], cwd: Path, **env_vars: str
                ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS} | env_vars
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, worker_error(result.stderr)
    return result


# ---- Hugging Face Accelerate -----------------------------------------------------------------


@pytest.mark.extra
@pytest.mark.timeout(300)
def test_accelerate_with_locksteps_wrapper_takes_ddps_steps(tmp_path: Path) -> None:
    """examples/accelerate_mnist.py under torchrun, 2 processes: Accelerate's own DDP and
    lockstep's wrapper (the model prepared with evaluation_mode=True) take the same steps,
    with gradient accumulation and clipping."""
    pytest.importorskip("accelerate", reason="Accelerate is the [accelerate] extra")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    records = {}
    for wrapper in ("ddp", "lockstep"):
        out = tmp_path / f"{wrapper}.json"
        run_example([torchrun, "--standalone", "--nproc-per-node", "2",
                     f"--log-dir={tmp_path / 'torchrun-logs'}",  # (not a folder in /tmp)
                     str(ROOT / "examples" / "accelerate_mnist.py"), "--wrapper", wrapper,
                     "--steps", "30", "--out", str(out)], tmp_path,
                    ACCELERATE_USE_CPU="1")
        records[wrapper] = json.loads(out.read_text())
    assert records["ddp"]["processes"] == records["lockstep"]["processes"] == 2
    assert records["lockstep"]["wrapper"] == "DataParallel"
    assert records["ddp"]["wrapper"] == "DistributedDataParallel"
    assert len(records["ddp"]["losses"]) == 30
    assert records["lockstep"]["losses"] == records["ddp"]["losses"]


# ---- Ray Train ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A real local Ray cluster: a head node and a worker node, one CPU each (so Ray Train
    must place one worker on each)."""
    pytest.importorskip("ray.train", reason="Ray Train is the [ray] extra")
    from lockstep.tools.raycluster import local_ray_cluster

    with local_ray_cluster(2) as address:
        yield address


@pytest.mark.extra
@pytest.mark.timeout(420)
def test_ray_train_takes_the_steps_lockstep_run_takes(ray_cluster: str, tmp_path: Path) -> None:
    """The same loop (examples/ray_train_mnist.py) under Ray Train on a 2-node cluster and
    under `lockstep run -n 2`: the same per-step losses."""
    example = str(ROOT / "examples" / "ray_train_mnist.py")
    lockstep_run = str(Path(sys.executable).parent / "lockstep")
    losses = {}
    for name, command in [
            ("ray", [sys.executable, example, "--ray", ray_cluster, "--steps", "25"]),
            ("lockstep run", [lockstep_run, "run", "-n", "2", example, "--steps", "25"])]:
        out = tmp_path / f"{name}.json"
        run_example([*command, "--out", str(out)], tmp_path)
        losses[name] = json.loads(out.read_text())["losses"]
    assert len(losses["lockstep run"]) == 25
    assert losses["ray"] == losses["lockstep run"]
