"""Lightning's Trainer with LockstepStrategy against its own DDPStrategy, side by side.

Two processes (Lightning's own launcher) fit the same LightningModule on real MNIST with
each strategy in turn, in ABBA rounds (reversed every other round) so that drift in the
machine's load hits both alike. A round times `--steps` optimizer steps after a warm-up;
the printed ratio is the median over rounds of DDP's time over lockstep's (above 1: lockstep
is faster), for each model.

    python benchmarks/lightning_vs_ddp.py               # 2 processes, ~4 minutes
    python benchmarks/lightning_vs_ddp.py --rounds 8 --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn
from lockstep.integrations.lightning import LockstepStrategy


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10))


MODELS = {"MNIST CNN": small_cnn, "MLP 784-512-512-10": mlp}


class Classifier(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepClock(L.Callback):
    """Wall time of the steps after the first `warmup`."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.started = warmup, 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.started = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.started


def seconds(strategy: Any, build: Any, steps: int, warmup: int, train: Any) -> float:
    L.seed_everything(0, verbose=False)
    clock = StepClock(warmup)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                        max_steps=warmup + steps, callbacks=[clock], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(build()), DataLoader(train, batch_size=64, shuffle=True,
                                                drop_last=True))
    measured = torch.tensor([clock.seconds])
    torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
    return float(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    train, _ = mnist()
    strategies = {"ddp": lambda: "ddp", "lockstep": lambda: LockstepStrategy()}
    for name, build in MODELS.items():
        ratios = []
        for r in range(args.rounds):
            order = ["ddp", "lockstep", "lockstep", "ddp"]
            times: dict[str, float] = {"ddp": 0.0, "lockstep": 0.0}
            for which in (order if r % 2 == 0 else order[::-1]):
                times[which] += seconds(strategies[which](), build, args.steps, args.warmup,
                                        train)
            ratios.append(times["ddp"] / times["lockstep"])
        if lockstep.init().rank == 0:
            print(f"{name}: lockstep / DDPStrategy throughput {statistics.median(ratios):.3f}x "
                  f"(median of {args.rounds} ABBA rounds; per round "
                  f"{', '.join(f'{x:.2f}' for x in ratios)})", flush=True)


if __name__ == "__main__":
    main()
