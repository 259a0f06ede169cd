"""Fault-tolerant training on real MNIST digits: workers may die and come back, and the
others neither stop nor restart.

    lockstep run --elastic -n 3 --rdzv-endpoint 127.0.0.1:29400 examples/elastic_mnist.py
    # kill -9 any worker: the others go on at 2 workers within seconds. Later, on any host:
    lockstep run --elastic -n 1 --rdzv-endpoint 127.0.0.1:29400 examples/elastic_mnist.py

Each step trains on one global batch (96 samples: positions [96*i, 96*(i+1)) of the epoch's
order), split over however many workers there are now, so a world of 2 or 4 trains on
exactly the samples a world of 3 would have. `--record DIR` writes what each worker trained
on (benchmarks/elastic_recovery.py checks that no sample was lost or repeated).
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn
from lockstep.elastic import ElasticConfig, batch_slice
from lockstep.training.sampler import global_order

parser = argparse.ArgumentParser()
# 12 epochs (492 steps, about a minute on 2 cores): time to kill a worker and to start
# the second command while the job still runs (3 epochs were over in 6 s).
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--global-batch", type=int, default=96, help="samples per step, any world")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--algorithm", default="native", help="native, shm, hierarchical, ...")
parser.add_argument("--compress", default=None, help="bf16 or fp16 on the wire")
parser.add_argument("--check-every", type=int, default=100, help="drift check (0: off)")
parser.add_argument("--record", default=None, help="folder for per-worker JSON records")
parser.add_argument("--collective-timeout", type=float, default=15.0, help="seconds until a "
                    "peer that went silent (its host cut off) is given up on")
args = parser.parse_args()

train_set, test_set = mnist()
images, labels = train_set.tensors
torch.manual_seed(0)                                   # the same model on every worker
net = small_cnn()
optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
job = lockstep.Elastic(net, optimizer, wrap=lambda m: lockstep.DataParallel(
    m, algorithm=args.algorithm, compress=args.compress),
    config=ElasticConfig(check_every=args.check_every,
                         collective_timeout_s=args.collective_timeout),
    agree={"global_batch": args.global_batch, "epochs": args.epochs})  # a joiner must match
steps_per_epoch = len(train_set) // args.global_batch  # the tail of each epoch is dropped
record = Path(args.record) / f"worker-{job.coordinator.id}.jsonl" if args.record else None
if record is not None:
    record.parent.mkdir(parents=True, exist_ok=True)


def note(entry: dict) -> None:
    """One line of this worker's record (what it trained on, for an audit)."""
    if record is not None:
        with record.open("a") as f:
            f.write(json.dumps(entry) + "\n")


def train_step(model: torch.nn.Module, step: int) -> float:
    """Forward and backward for this worker's share of global batch `step`."""
    world = job.world                                  # who we are *now*
    epoch, within = divmod(step, steps_per_epoch)
    order = global_order(len(train_set), seed=0, epoch=epoch, shuffle=True)
    mine = order[list(batch_slice(within, args.global_batch, world.rank, world.world_size))]
    note({"attempt": step, "epoch": job.membership.epoch, "rank": world.rank,
          "world": world.world_size, "worker": job.coordinator.id, "pid": os.getpid(),
          "time": time.time(), "indices": mine.tolist()})
    loss = F.cross_entropy(model(images[mine]), labels[mine], reduction="sum")
    # summed over this share, weighted so the average over workers is the batch's mean
    (loss * world.world_size / args.global_batch).backward()
    return loss.item() / len(mine)


started = time.monotonic()
while job.step < args.epochs * steps_per_epoch:
    loss = job.run_step(train_step)                    # None: completed by peers instead
    if job.step % steps_per_epoch == 0 and job.world.is_main and loss is not None:
        print(f"epoch {job.step // steps_per_epoch - 1}: loss {loss:.3f}, "
              f"{job.world.world_size} workers", flush=True)
seconds = time.monotonic() - started
if job.world.is_main:                                  # replicas are identical: ask one
    with torch.no_grad():
        accuracy = (net.eval()(test_set.tensors[0]).argmax(1) == test_set.tensors[1]).float()
    print(f"test accuracy: {accuracy.mean().item():.4f} after {job.step} steps "
          f"({seconds:.1f}s, {job.step * args.global_batch / seconds:.0f} samples/s)",
          flush=True)
note({"final": True, "worker": job.coordinator.id, "world": job.world.world_size,
      "step": job.step, "lineage": job.lineage, "regroups": job.regroups})
job.finish()
