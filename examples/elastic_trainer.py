"""The Trainer, fault tolerant: real MNIST digits, workers that may die and come back.

    lockstep run --elastic -n 3 --rdzv-endpoint 127.0.0.1:29400 examples/elastic_trainer.py
    # kill -9 any worker: the others go on within a second. Later, on any host:
    lockstep run --elastic -n 1 --rdzv-endpoint 127.0.0.1:29400 examples/elastic_trainer.py
    # kill every worker, then run the first command again: it resumes from the checkpoint

The same `fit()` as without faults: TrainConfig(elastic=ElasticConfig()) is the only change;
`--zero 2` shards the optimizer state and gradients (ZeRO-2, each shard mirrored on the
next rank so that a death loses nothing).
`--record DIR` writes, per worker, every sample the training set hands out and for which
step (benchmarks/elastic_recovery.py --trainer checks that no sample was lost or repeated).
"""

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

import lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--global-batch", type=int, default=96, help="samples per step, any world")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--run-dir", default="runs/elastic_trainer")
parser.add_argument("--algorithm", default="native", help="native, shm, hierarchical, ...")
parser.add_argument("--zero", type=int, default=0, help="ZeRO stage (1-3); 0: replicated")
parser.add_argument("--record", default=None, help="folder for per-worker JSON records")
args, _ = parser.parse_known_args()  # (elastic_recovery.py passes elastic_mnist's flags too)


class Recorded(Dataset):
    """The training set, writing down which samples each step's attempt used."""

    def __init__(self, data: Dataset, folder: Path) -> None:
        self.data, self.folder, self.trainer, self.out = data, folder, None, None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        job = self.trainer.survival
        if self.out is None:
            self.out = (self.folder / f"worker-{job.coordinator.id}.jsonl").open("a")
        world = job.world
        self.out.write(json.dumps({"attempt": job.step, "epoch": job.membership.epoch,
                                   "rank": world.rank, "world": world.world_size,
                                   "worker": job.coordinator.id, "pid": os.getpid(),
                                   "time": time.time(), "indices": [i]}) + "\n")
        self.out.flush()
        return self.data[i]


train_set, test_set = mnist()
record = Path(args.record) if args.record else None
if record is not None:
    record.mkdir(parents=True, exist_ok=True)
    train_set = Recorded(train_set, record)
config = lockstep.TrainConfig(
    global_batch_size=args.global_batch, epochs=args.epochs, run_dir=args.run_dir,
    parallel=lockstep.ShardConfig(stage=args.zero) if args.zero
    else lockstep.SyncConfig(algorithm=args.algorithm), trackers=(),
    checkpoint=lockstep.CheckpointConfig(every_steps=50),
    elastic=lockstep.ElasticConfig())
trainer = lockstep.Trainer(small_cnn, lambda p: torch.optim.Adam(p, lr=args.lr), train_set,
                           test_set, config=config)
if record is not None:
    train_set.trainer = trainer
summary = trainer.fit()
if trainer.world.is_main:
    print(f"test accuracy: {summary['test_accuracy']:.4f} after {summary['steps']} steps "
          f"({summary['world_size']} workers at the end)", flush=True)
if record is not None:
    job = trainer.survival
    with (record / f"worker-{job.coordinator.id}.jsonl").open("a") as f:
        f.write(json.dumps({"final": True, "worker": job.coordinator.id,
                            "world": summary["world_size"], "step": summary["steps"],
                            "lineage": job.lineage, "regroups": job.regroups}) + "\n")
