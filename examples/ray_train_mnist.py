"""One training loop, started by Ray Train on a Ray cluster or by `lockstep run`.

    ray start --head --port 6379                     # a Ray cluster (once per machine)
    python examples/ray_train_mnist.py --ray 127.0.0.1:6379 --workers 2
    lockstep run -n 2 examples/ray_train_mnist.py    # the same loop without Ray
    python examples/ray_train_mnist.py --ray 127.0.0.1:6379 --stage 2   # ZeRO-2 under Ray

Under Ray, TorchTrainer starts one worker per `--workers` wherever the cluster has room and
makes their process group; `lockstep.init()` in `train` adopts it, and the loop is the same
as under `lockstep run`: the same per-step losses either way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn


def train(config: dict[str, Any]) -> None:
    """The loop every worker runs: lockstep's, whoever started the worker."""
    world = lockstep.init()  # adopts Ray's process group, or reads lockstep run's environment
    train_set, _ = mnist()
    torch.manual_seed(0)
    net = small_cnn().to(world.device)
    model = lockstep.shard(net, config["stage"]) if config["stage"] else lockstep.DataParallel(net)
    optimizer = model.make_optimizer(torch.optim.Adam, lr=2e-3)
    sampler = lockstep.ShardedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=64 // world.world_size, sampler=sampler)
    losses = []
    for images, labels in loader:
        loss = F.cross_entropy(model(images.to(world.device)), labels.to(world.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if len(losses) == config["steps"]:
            break
    if world.is_main:
        print(f"{world.world_size} workers, {len(losses)} steps: loss {losses[-1]:.4f}")
        if config["out"]:
            Path(config["out"]).write_text(json.dumps({"losses": losses}))


def on_ray(config: dict[str, Any], address: str, workers: int) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=address)
    TorchTrainer(train, train_loop_config=config,
                 scaling_config=ScalingConfig(num_workers=workers,
                                              resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(storage_path=str(Path("runs/ray").resolve()),
                                      name="ray_train_mnist")).fit()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray", metavar="ADDRESS", help="train on this Ray cluster")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers")
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage (0: DataParallel)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None, help="rank 0 writes its losses here (JSON)")
    args = parser.parse_args()
    config = {"stage": args.stage, "steps": args.steps,
              "out": str(Path(args.out).resolve()) if args.out else None}
    if args.ray:
        on_ray(config, args.ray, args.workers)
    else:
        train(config)
