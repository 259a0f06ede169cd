"""lockstep's Trainer under Ray Train's own fault tolerance: a worker is killed, Ray restarts
the worker group, the Trainer resumes from its newest checkpoint -- and ends with the same
model as a run nothing happened to.

Starts a real 2-node Ray cluster on this machine (lockstep.tools.raycluster), fits the
Trainer (MNIST CNN, 60 steps, a checkpoint every 10) through Ray Train with
FailureConfig(max_failures=1) while rank 1 kills itself (SIGKILL) at step 25, then fits it
again under `lockstep run -n 2` untouched, and compares the two models' fingerprints.

    python benchmarks/ray_restart.py                 # about 3 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

KILL_AT, STEPS, EVERY = 25, 60, 10


def train(config: dict[str, Any]) -> None:
    """Every worker's loop, under Ray or `lockstep run`."""
    import lockstep
    from lockstep.demo.data import mnist
    from lockstep.demo.models import small_cnn

    world = lockstep.init()
    run_dir = Path(config["run_dir"])
    killed = run_dir / "killed-once"

    first_step: list[int] = []

    def kill_once(trainer: Any) -> None:
        if not first_step and world.is_main:  # where this attempt began: 1, or after a resume
            first_step.append(trainer.state.global_step)
            with open(run_dir / "attempts.txt", "a") as f:
                f.write(f"{first_step[0]}\n")
        if config["kill"] and world.rank == 1 and trainer.state.global_step == KILL_AT \
                and not killed.exists():
            killed.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    train_set, test_set = mnist()
    trainer = lockstep.Trainer(
        small_cnn, lambda p: torch.optim.Adam(p, lr=2e-3), train_set, test_set,
        config=lockstep.TrainConfig(global_batch_size=64, max_steps=STEPS, run_dir=str(run_dir),
                                    checkpoint=lockstep.CheckpointConfig(every_steps=EVERY),
                                    progress=False, trackers=()),
        callbacks=[kill_once])
    summary = trainer.fit()
    if world.is_main:
        (run_dir / "summary.json").write_text(json.dumps(
            {"fingerprint": summary["fingerprint"], "steps": summary["steps"]}))


def on_ray(address: str, run_dir: Path) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=address, log_to_driver=False)
    TorchTrainer(train, train_loop_config={"run_dir": str(run_dir), "kill": True},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(storage_path=str(run_dir / "ray"), name="restart",
                                      failure_config=FailureConfig(max_failures=1))).fit()


def attempts(run_dir: Path) -> list[int]:
    """The first step each attempt took (rank 0): 1, then one past the resumed checkpoint."""
    return [int(line) for line in (run_dir / "attempts.txt").read_text().split()]


def main() -> None:
    from lockstep.tools.raycluster import local_ray_cluster

    work = Path(tempfile.mkdtemp(prefix="lockstep-ray-restart-"))
    ray_dir, reference = work / "under_ray", work / "lockstep_run"
    started = time.perf_counter()
    with local_ray_cluster(2) as address:
        subprocess.run([sys.executable, __file__, "--ray", address, str(ray_dir)], check=True)
    ray_seconds = time.perf_counter() - started
    subprocess.run([str(Path(sys.executable).parent / "lockstep"), "run", "-n", "2", __file__,
                    "--worker", str(reference)], check=True, capture_output=True)
    got, want = (json.loads((d / "summary.json").read_text()) for d in (ray_dir, reference))
    print(f"== the Trainer under Ray Train, rank 1 killed (SIGKILL) at step {KILL_AT} ==")
    print(f"killed pid {(ray_dir / 'killed-once').read_text()}; Ray restarted the worker group "
          f"and the Trainer went on; each attempt's first step: {attempts(ray_dir)} "
          f"(checkpoints every {EVERY}); {got['steps']} steps in {ray_seconds:.0f}s "
          "(cluster start and stop included)")
    print(f"model fingerprint under Ray {got['fingerprint']}, untouched under lockstep run "
          f"{want['fingerprint']}: {'the same' if got == want else 'DIFFERENT'}")
    print(f"(runs in {work})")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ray":
        on_ray(sys.argv[2], Path(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker":
        train({"run_dir": sys.argv[2], "kill": False})
    else:
        main()
