"""`lockstep demo`: launch 2 local workers that train a small CNN on real MNIST digits.

The launcher half parses options and starts the workers through `lockstep run`; the worker
half (`--worker`) is an ordinary lockstep training script.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lockstep
from lockstep import data
from lockstep.launch import LaunchSpec, run


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # (16, 14, 14)
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (32, 7, 7)
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep demo", description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dataset", default="mnist", choices=["mnist", "fashion-mnist"])
    p.add_argument("--data-path", default=None, help="folder of the Fashion-MNIST IDX files")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


@torch.no_grad()
def accuracy(model: nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    model.eval()
    images, labels = dataset.tensors
    correct = sum((model(x).argmax(1) == y).sum().item()
                  for x, y in zip(images.split(500), labels.split(500), strict=True))
    model.train()
    return correct / len(labels)


def worker(args: argparse.Namespace) -> None:
    world = lockstep.init()
    if args.dataset == "mnist":
        train_set, test_set = data.mnist()
    else:
        train_set, test_set = data.fashion_mnist(args.data_path or data.FASHION_MNIST_DIR)
    torch.manual_seed(0)
    model = lockstep.DataParallel(small_cnn().to(world.device))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = lockstep.ShardedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size // world.world_size,
                        sampler=sampler)
    started, seen = time.perf_counter(), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(world.device)), labels.to(world.device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(images) * world.world_size
        if world.is_main:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.3f}", flush=True)
    elapsed = time.perf_counter() - started
    if world.is_main:
        print(f"{seen / elapsed:.0f} samples/s on {world.world_size} workers")
        print(f"test accuracy: {accuracy(model.module, test_set):.2f}")
    world.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = [a for a in (argv or []) if a != "--worker"]
    return run(LaunchSpec(nproc=args.workers, target="lockstep.demo", module=True,
                          args=["--worker", *forwarded]))


if __name__ == "__main__":
    main()
