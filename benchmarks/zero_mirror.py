"""What ZeRO under fault tolerance costs: mirrored shards against plain ones, same run.

Under lockstep.Elastic (or TrainConfig(elastic=...)) a ZeRO wrapper keeps the next rank's
shard too and the optimizer copies its shards' state before each step (sharding/
recovery.py), so that a rank's death loses nothing. This measures that price on the
8-layer 1024-wide MLP of benchmarks/zero.py (8.4M parameters, AdamW), for each stage: the
median step time over rounds that run every mode in turn, and the model state each rank
holds after a step (every live tensor storage counted once, the copy before the step
included). Prints the ratios mirrored / plain.

    python benchmarks/zero_mirror.py [--ranks 3] [--rounds 6] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import torch
from torch import nn
from zero import BATCH, WIDTH, build, live_bytes  # benchmarks/zero.py

import lockstep
from lockstep.launch.run import LaunchSpec, run
from lockstep.tools.bench import time_modes


def modes() -> dict[str, Callable[[], tuple[nn.Module, object]]]:
    def zero(stage: int, mirrored: bool) -> Callable[[], tuple[nn.Module, object]]:
        def make() -> tuple[nn.Module, object]:
            model = lockstep.shard(build(), stage, mirror=mirrored)
            return model, model.make_optimizer(torch.optim.AdamW, lr=1e-4)
        return make

    return {f"zero={stage}{' mirrored' if mirrored else ''}": zero(stage, mirrored)
            for stage in (1, 2, 3) for mirrored in (False, True)}


def worker(rounds: int, steps: int) -> None:
    world = lockstep.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    made, state_bytes = {}, {}
    for name, make in modes().items():
        before = live_bytes()
        model, opt = make()

        def step(model: nn.Module = model, opt: object = opt) -> None:
            opt.zero_grad()  # type: ignore[attr-defined]
            model(x).square().mean().backward()
            opt.step()  # type: ignore[attr-defined]

        for _ in range(2):
            step()
        state_bytes[name] = live_bytes() - before
        made[name] = step
    times = time_modes(made, rounds, steps)
    if world.is_main:
        report(times, state_bytes, world.world_size)
    world.shutdown()


def report(times: dict[str, list[float]], state: dict[str, int], ranks: int) -> None:
    params = sum(p.numel() for p in build().parameters())
    print(f"{params / 1e6:.1f}M parameters, AdamW, {ranks} ranks; per rank:")
    print(f"{'mode':18s} {'step':>9s} {'model state':>12s} {'bytes/param':>12s}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in times:
        print(f"{name:18s} {med[name] * 1e3:7.1f}ms {state[name] / 2**20:10.1f}MB "
              f"{state[name] / params:12.2f}")
    for stage in (1, 2, 3):
        plain, mirrored = f"zero={stage}", f"zero={stage} mirrored"
        print(f"stage {stage} mirrored / plain: step time {med[mirrored] / med[plain]:.2f}x, "
              f"model state {state[mirrored] / state[plain]:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:
        worker(args.rounds, args.steps)
        return 0
    return run(LaunchSpec(nproc=args.ranks, target=os.path.abspath(__file__),
                          args=["--rounds", str(args.rounds), "--steps", str(args.steps)]))


if __name__ == "__main__":
    sys.exit(main())
