"""What the stall watchdog costs when nothing stalls: training throughput with it on against
off, side by side in one run.

Two ranks train the same DataParallel model; before each timed block every rank turns the
watchdog on (stall_after 15 s: every collective numbered and remembered, the progress
thread publishing, answering and comparing twice a second) or off (stall_after 0). Blocks
run in a palindrome (on off off on), reversed every round, so drift in machine load hits
both alike; the ratio printed is the median of per-round ratios. Two models: a small MLP
whose steps take about a millisecond (the per-collective bookkeeping weighs most there),
and a deep MLP in 1 MB buckets (many collectives per step). Target: >= 0.97.

    python benchmarks/watchdog.py            # launches 2 local workers itself
    python benchmarks/watchdog.py --rounds 12 --block-s 2 --models 'small MLP (fast steps)'
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.comm import watchdog
from lockstep.launch.run import LaunchSpec, run


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def deep_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.ReLU()]
    return nn.Sequential(*layers)


# name: (model, input width, bucket_mb)
MODELS = {"small MLP (fast steps)": (small_mlp, 64, 25.0),
          "24x256 MLP, 1 MB buckets": (deep_mlp, 256, 1.0)}


def make_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return step


def timed(step: Callable[[], None], steps: int, stall_after: float, timeout_s: float) -> float:
    """Seconds for `steps` steps with the watchdog set so; the slowest rank counts."""
    watchdog.start(stall_after, timeout_s, "gloo")
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def bench_model(name: str, rounds: int, block_s: float, batch: int, timeout_s: float
                ) -> tuple[list[float], float, int, float]:
    """(per-round throughput ratios on/off, steps per second with it on, collectives per
    step, milliseconds per look). Blocks last about `block_s`: several of the watchdog's
    half-second looks each, so that every block gets its share of them."""
    build, width, bucket_mb = MODELS[name]
    torch.manual_seed(0)
    x = torch.randn(batch, width)
    model = lockstep.DataParallel(build(), bucket_mb=bucket_mb)
    step = make_step(model, x)
    for _ in range(3):  # warm up allocators and the bucket rebuild
        step()
    issued = watchdog.ledger.counts.get(watchdog.ledger.world_key, 0)
    probe = timed(step, 5, 15.0, timeout_s)
    per_step = (watchdog.ledger.counts.get(watchdog.ledger.world_key, 0) - issued) // 5
    steps = max(5, round(block_s / (probe / 5)))
    on_off: list[tuple[float, float]] = []
    for r in range(rounds):
        order = [15.0, 0.0, 0.0, 15.0] if r % 2 == 0 else [0.0, 15.0, 15.0, 0.0]
        seconds = {15.0: 0.0, 0.0: 0.0}
        for stall_after in order:
            seconds[stall_after] += timed(step, steps, stall_after, timeout_s)
        on_off.append((seconds[15.0], seconds[0.0]))
    watchdog.start(15.0, timeout_s, "gloo")
    look_ms = tick_ms(step)
    model.close()
    ratios = [off / on for on, off in on_off]  # throughput on / off
    rate = 2 * steps / statistics.median(on for on, _ in on_off)
    return ratios, rate, per_step, look_ms


def tick_ms(step: Callable[[], None], count: int = 20) -> float:
    """Milliseconds one of the watchdog's half-second looks takes (its store round trips
    included), with a training step between looks so that there is news to publish."""
    times = []
    for _ in range(count):
        step()
        started = time.perf_counter()
        watchdog.watchdog.tick()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def bookkeeping_us(count: int = 20000) -> float:
    """Microseconds the training thread spends per collective on the watchdog's ledger.
    Every rank runs it alike, so their collective numbers stay in step."""
    started = time.perf_counter()
    for _ in range(count):
        watchdog.ledger.launched(watchdog.ledger.issue("bench: bookkeeping", None), None)
    return (time.perf_counter() - started) / count * 1e6


def worker(args: argparse.Namespace) -> None:
    world = lockstep.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = {name: bench_model(name, args.rounds, args.block_s, args.batch,
                                 world.timeout.total_seconds()) for name in args.models}
    watchdog.start(15.0, world.timeout.total_seconds(), "gloo")
    cost_us = bookkeeping_us()
    for name, (ratios, rate, per_step, look_ms) in results.items():
        quartiles = statistics.quantiles(ratios, n=4)
        # The same cost from its parts, which the machine's noise does not drown: the
        # training thread's bookkeeping per step, and the looks (at most, if each one
        # stopped training for as long as it takes).
        parts = cost_us * 1e-6 * per_step * rate + look_ms * 1e-3 / 0.5
        if world.is_main:
            print(f"{name:26s} throughput ratio watchdog on/off: "
                  f"{statistics.median(ratios):.3f} measured (rounds' middle half "
                  f"{quartiles[0]:.3f}-{quartiles[2]:.3f}), {1 / (1 + parts):.4f} from its "
                  f"parts ({rate:.0f} steps/s, {per_step} collectives a step at "
                  f"{cost_us:.1f} us each, a {look_ms:.2f} ms look every 0.5 s)", flush=True)
    world.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block-s", type=float, default=1.0, help="seconds per timed block")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return 0
    print(f"stall watchdog on vs off: 2 ranks (Gloo, CPU), per-rank batch {args.batch}, "
          f"{args.rounds} ABBA rounds of {args.block_s:.0f} s blocks; medians of per-round "
          "ratios", flush=True)
    return run(LaunchSpec(nproc=2, target=os.path.abspath(__file__), args=sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
