"""lockstep.DataParallel against torch's DistributedDataParallel, side by side in one run.

Two ranks on this machine train the same models (few large tensors, many small ones, and
a tiny one) on the same data four ways: lockstep with its defaults (algorithm="auto":
shm here, every rank on one CPU host), torch DDP, lockstep with algorithm="native" (the
backend's all-reduce, as DDP's), and no communication at all (each rank alone: the ceiling
that sync efficiency is measured against). Every round runs the modes in a palindrome,
ABBA-style, reversed every other round, so drift in machine load hits all alike; the
printed numbers are medians of per-round ratios, since absolute times on a shared machine
mean little.

    python benchmarks/vs_ddp.py            # launches 2 local workers itself
    python benchmarks/vs_ddp.py --rounds 12 --steps 20 --block-s 0.5
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lockstep
from lockstep.launch.run import LaunchSpec, run


def wide_mlp() -> nn.Module:
    """(a) few large tensors: 6 layers of 1024x1024."""
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers)


def deep_mlp() -> nn.Module:
    """(b) many small tensors: 24 layers of 256 wide, each with LayerNorm."""
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.ReLU()]
    return nn.Sequential(*layers)


def tiny() -> nn.Module:
    """(c) almost nothing to compute: one Linear 20 -> 1. A step is the fixed cost of the
    wrapper and one collective's latency."""
    return nn.Linear(20, 1)


MODELS = {"6x1024 MLP": (wide_mlp, 1024), "24x256 MLP+LayerNorm": (deep_mlp, 256),
          "Linear 20->1 (tiny)": (tiny, 20)}


def make_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return step


def timed(step: Callable[[], None], steps: int, synchronised: bool) -> float:
    """Seconds for `steps` steps; every rank starts together and the slowest one counts."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - started])
    if synchronised:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def steps_per_block(step: Callable[[], None], at_least: int, block_s: float) -> int:
    """Enough steps for a timed block to last about `block_s` (the same on every rank): a
    tiny model's step is ~3 ms, and 20 of them -- 60 ms -- measure the machine's scheduling
    more than the step."""
    seconds = timed(step, 5, True) / 5
    return max(at_least, math.ceil(block_s / seconds))


def bench_model(name: str, rounds: int, steps: int, batch: int,
                block_s: float = 0.0) -> dict[str, Any]:
    build, width = MODELS[name]
    torch.manual_seed(0)
    x = torch.randn(batch, width)
    base = build()
    default = lockstep.DataParallel(copy.deepcopy(base))
    steps_by_mode = {
        "lockstep": make_step(default, x),
        "ddp": make_step(DDP(copy.deepcopy(base)), x),
        "lockstep-native": make_step(lockstep.DataParallel(copy.deepcopy(base),
                                                           algorithm="native"), x),
        "local": make_step(copy.deepcopy(base), x),
    }
    for step in steps_by_mode.values():  # warm up allocators, bucket rebuilds, caches
        for _ in range(3):
            step()
    steps = steps_per_block(steps_by_mode["ddp"], steps, block_s)
    # A palindrome (A B C D D C B A), reversed every round: drift in machine load over a
    # round hits every mode alike.
    palindrome = list(steps_by_mode) + list(reversed(steps_by_mode))
    per_round: dict[str, list[float]] = {mode: [] for mode in steps_by_mode}
    for r in range(rounds):
        seconds = dict.fromkeys(steps_by_mode, 0.0)
        for mode in palindrome if r % 2 == 0 else list(reversed(palindrome)):
            seconds[mode] += timed(steps_by_mode[mode], steps, True)
        for mode in steps_by_mode:
            per_round[mode].append(seconds[mode])

    def ratio(slower: str, faster: str) -> float:
        """Median over rounds of time(slower) / time(faster) = throughput(faster/slower)."""
        return statistics.median(a / b for a, b in zip(per_round[slower], per_round[faster],
                                                       strict=True))

    return {"ratio": ratio("ddp", "lockstep"), "ratio_native": ratio("ddp", "lockstep-native"),
            "eff_lockstep": ratio("local", "lockstep"), "eff_ddp": ratio("local", "ddp"),
            "eff_native": ratio("local", "lockstep-native"),
            "samples_per_s": 2 * batch * 2 * steps / statistics.median(per_round["lockstep"]),
            "steps": steps, "algorithm": default.algorithm}


def worker(args: argparse.Namespace) -> None:
    world = lockstep.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for name in args.models:
        result = bench_model(name, args.rounds, args.steps, args.batch, args.block_s)
        if world.is_main:
            print(f"{name:22s} throughput ratio lockstep/DDP: {result['ratio']:.3f}   "
                  f"sync efficiency lockstep {result['eff_lockstep']:.3f}, "
                  f"DDP {result['eff_ddp']:.3f}   ({result['samples_per_s']:.0f} samples/s, "
                  f"{result['steps']:.0f}-step blocks; default algorithm: "
                  f"{result['algorithm']})\n"
                  f"{'':22s} with algorithm='native': ratio lockstep/DDP "
                  f"{result['ratio_native']:.3f}   sync efficiency {result['eff_native']:.3f}",
                  flush=True)
    world.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per timed block, at least")
    p.add_argument("--block-s", type=float, default=0.5,
                   help="seconds a timed block lasts, at least (more steps for fast models)")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return 0
    print(f"lockstep vs torch DDP: 2 ranks (Gloo, CPU), per-rank batch {args.batch}, "
          f"{args.rounds} ABBA rounds of blocks of at least {args.steps} steps and "
          f"{args.block_s} s; medians of per-round ratios",
          flush=True)
    return run(LaunchSpec(nproc=2, target=os.path.abspath(__file__), args=sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
