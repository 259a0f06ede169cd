"""ZeRO against torch's own: FSDP2 (fully_shard) and ZeroRedundancyOptimizer, same run.

Two ranks (Gloo, CPU) train the same 8-layer 1024-wide MLP (8.4M parameters) with AdamW:

    lockstep zero=1, 2, 3           lockstep.shard(model, k).make_optimizer(AdamW); 0: DataParallel
    torch ZeRO-1                    DDP + ZeroRedundancyOptimizer(AdamW)
    torch FSDP2                     fully_shard on every layer and the root

For each: the median step time over rounds that run every mode in turn (order reversed
every other round), the model state each rank holds after a step (parameters, gradients,
optimizer state: every live tensor storage counted once), and the peak memory a step adds
on top of that (the process's high-water mark, reset before the step). Prints ratios.

    python benchmarks/zero.py [--rounds 6] [--steps 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import lockstep
from lockstep.launch.run import LaunchSpec, run
from lockstep.tools.bench import time_modes

WIDTH, LAYERS, BATCH = 1024, 8, 32


def build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def live_bytes() -> int:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            if hasattr(obj, "_local_tensor"):  # a DTensor: count its local shard
                obj = obj._local_tensor
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_extra_bytes(step: Callable[[], None]) -> int:
    """How far above the current footprint one step goes (VmHWM reset just before)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size
    before = rss_kb("VmRSS:")
    step()
    return (rss_kb("VmHWM:") - before) * 1024


def modes() -> dict[str, Callable[[], tuple[nn.Module, object]]]:
    def lockstep_zero(stage: int) -> Callable[[], tuple[nn.Module, object]]:
        def make() -> tuple[nn.Module, object]:
            model = lockstep.shard(build(), stage) if stage else lockstep.DataParallel(build())
            return model, model.make_optimizer(torch.optim.AdamW, lr=1e-4)
        return make

    def torch_zero1() -> tuple[nn.Module, object]:
        model = DDP(build())
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)

    def fsdp2() -> tuple[nn.Module, object]:
        model = build()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    return {"lockstep zero=0": lockstep_zero(0), "lockstep zero=1": lockstep_zero(1),
            "lockstep zero=2": lockstep_zero(2), "lockstep zero=3": lockstep_zero(3),
            "torch ZeRO-1": torch_zero1, "torch FSDP2": fsdp2}


def worker(rounds: int, steps: int) -> None:
    world = lockstep.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    made, state_bytes, peaks = {}, {}, {}
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
        peaks[name] = peak_extra_bytes(step)
        made[name] = step
    times = time_modes(made, rounds, steps)
    if world.is_main:
        report(times, state_bytes, peaks)
    del made  # FSDP2's and ZeroRedundancyOptimizer's state before the group goes
    world.shutdown()


def report(times: dict[str, list[float]], state: dict[str, int], peaks: dict[str, int]) -> None:
    params = sum(p.numel() for p in build().parameters())
    print(f"{params / 1e6:.1f}M parameters, AdamW, 2 ranks; per rank:")
    print(f"{'mode':18s} {'step':>9s} {'model state':>12s} {'bytes/param':>12s} "
          f"{'step peak':>10s}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in times:
        print(f"{name:18s} {med[name] * 1e3:7.1f}ms {state[name] / 2**20:10.1f}MB "
              f"{state[name] / params:12.2f} {peaks[name] / 2**20:8.1f}MB")
    print(f"stage 3 vs FSDP2: step time {med['lockstep zero=3'] / med['torch FSDP2']:.2f}x "
          f"(target <= 1.10x); model state "
          f"{state['lockstep zero=3'] / state['torch FSDP2']:.2f}x (target <= 1.00x)")
    print(f"stage 1 vs ZeroRedundancyOptimizer: "
          f"{med['torch ZeRO-1'] / med['lockstep zero=1']:.2f}x as fast (target >= 1.00x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:
        worker(args.rounds, args.steps)
        return 0
    return run(LaunchSpec(nproc=2, target=os.path.abspath(__file__), args=sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
