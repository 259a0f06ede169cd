"""ZeRO against torch's own: FSDP2 (fully_shard) and ZeroRedundancyOptimizer, same run.

Two ranks (Gloo, CPU) train the same 8-layer 1024-wide MLP (8.4M parameters) with AdamW:

    lockstep zero=1, 2, 3           lockstep.shard(model, k).make_optimizer(AdamW); 0: DataParallel.
                                    Its default algorithm ("auto") on one host is "shm": gathers
                                    copy the shards from host-shared memory (the other ranks'
                                    shards, mapped, are their memory: not counted here)
    lockstep zero=1, 2, 3 native    the same with algorithm="native": gathers through Gloo, as
                                    across hosts
    torch ZeRO-1                    DDP + ZeroRedundancyOptimizer(AdamW)
    torch FSDP2                     fully_shard on every layer and the root
    DeepSpeed ZeRO-1, 2, 3          deepspeed.initialize(zero_optimization.stage=k), fp32,
                                    with --deepspeed (pip install deepspeed==0.19.8)

For each: the median step time over rounds that run every mode in turn (order reversed
every other round), the model state each rank holds after a step (parameters, gradients,
optimizer state: every live tensor storage counted once), and the peak memory a step adds
on top of that (the process's high-water mark, reset before the step). Prints ratios.

    python benchmarks/zero.py [--rounds 6] [--steps 5] [--deepspeed]

DeepSpeed builds nothing on a CPU-only machine: `DS_BUILD_OPS=0 pip install
deepspeed==0.19.8` into the same environment, and its engine runs on the Gloo group
lockstep.init() made, with torch's AdamW as a client optimizer.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import itertools
import os
import statistics
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import lockstep
from lockstep.comm.shm import peers_storages
from lockstep.launch.run import LaunchSpec, run
from lockstep.tools.bench import time_modes

WIDTH, LAYERS, BATCH = 1024, 8, 32
BUCKET_BYTES = 25 << 20


def build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def live_bytes() -> int:
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated module aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if hasattr(obj, "_local_tensor"):  # a DTensor: count its local shard
            obj = obj._local_tensor
        s = obj.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    peers = peers_storages()
    return sum(n for ptr, n in storages.items() if ptr not in peers)


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_extra_bytes(step: Callable[[], None]) -> int:
    """How far above the current footprint one step goes (VmHWM reset just before). The
    memory earlier modes freed goes back to the kernel first: lockstep.init() has glibc
    keep freed blocks (comm/allocator.py), which would hide a step's new pages."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size
    before = rss_kb("VmRSS:")
    step()
    return (rss_kb("VmHWM:") - before) * 1024


Step = Callable[[], None]


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Step:
    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return step


def modes(x: torch.Tensor, deepspeed: bool) -> dict[str, Callable[[], Step]]:
    """Each mode's maker: builds the model and its optimizer, returns one training step."""
    def lockstep_zero(stage: int, algorithm: str = "auto") -> Callable[[], Step]:
        def make() -> Step:
            model = lockstep.shard(build(), stage, algorithm=algorithm) if stage \
                else lockstep.DataParallel(build())
            return plain_step(model, model.make_optimizer(torch.optim.AdamW, lr=1e-4), x)
        return make

    def torch_zero1() -> Step:
        model = DDP(build())
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
        return plain_step(model, opt, x)  # type: ignore[arg-type]

    def fsdp2() -> Step:
        model = build()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), x)

    made = {"lockstep zero=0": lockstep_zero(0), "lockstep zero=1": lockstep_zero(1),
            "lockstep zero=2": lockstep_zero(2), "lockstep zero=3": lockstep_zero(3),
            "torch ZeRO-1": torch_zero1, "torch FSDP2": fsdp2,
            **{f"lockstep zero={k} native": lockstep_zero(k, "native") for k in (1, 2, 3)}}
    if deepspeed:
        made |= {f"DeepSpeed ZeRO-{k}": deepspeed_zero(k, x) for k in (1, 2, 3)}
    return made


def deepspeed_zero(stage: int, x: torch.Tensor) -> Callable[[], Step]:
    """DeepSpeed's engine in fp32 with the same AdamW: its step is forward, engine.backward
    (which reduces) and engine.step (which steps, gathers and zeroes the gradients)."""
    def make() -> Step:
        import deepspeed

        model = build()
        # Buckets of 25 MB, as lockstep's and DDP's (DeepSpeed's default, 5e8 elements,
        # makes stage 3 allocate a 2 GB reduction buffer up front).
        bucket = BUCKET_BYTES // 4
        zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                "stage3_prefetch_bucket_size": bucket}
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                  "zero_optimization": zero, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 1 << 30}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
            config=config)

        def step() -> None:
            engine.backward(engine(x).square().mean())
            engine.step()
        return step
    return make


def worker(rounds: int, steps: int, deepspeed: bool) -> None:
    world = lockstep.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    made, state_bytes, peaks = {}, {}, {}
    for name, make in modes(x, deepspeed).items():
        before = live_bytes()
        step = make()
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
    print(f"{'mode':20s} {'step':>9s} {'model state':>12s} {'bytes/param':>12s} "
          f"{'step peak':>10s}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in times:
        print(f"{name:20s} {med[name] * 1e3:7.1f}ms {state[name] / 2**20:10.1f}MB "
              f"{state[name] / params:12.2f} {peaks[name] / 2**20:8.1f}MB")
    print(f"stage 3 vs FSDP2: step time {med['lockstep zero=3'] / med['torch FSDP2']:.2f}x "
          f"(target <= 1.10x); model state "
          f"{state['lockstep zero=3'] / state['torch FSDP2']:.2f}x (target <= 1.00x)")
    print(f"stage 1 vs ZeroRedundancyOptimizer: "
          f"{med['torch ZeRO-1'] / med['lockstep zero=1']:.2f}x as fast (target >= 1.00x)")
    for k, native in itertools.product((1, 2, 3), ("", " native")):
        ours, theirs = f"lockstep zero={k}{native}", f"DeepSpeed ZeRO-{k}"
        if theirs in times:
            print(f"stage {k}{' (native)' if native else ''} vs DeepSpeed: step time "
                  f"{med[ours] / med[theirs]:.2f}x (target <= 0.60x); bytes per parameter "
                  f"{state[ours] / params:.2f} against {state[theirs] / params:.2f} "
                  f"({state[ours] / state[theirs]:.2f}x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--deepspeed", action="store_true",
                   help="add DeepSpeed's ZeRO-1/2/3 (needs deepspeed installed)")
    args = p.parse_args()
    if args.deepspeed and importlib.util.find_spec("deepspeed") is None:
        p.error("--deepspeed: DeepSpeed is not installed here "
                "(DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
    if "WORLD_SIZE" in os.environ:
        worker(args.rounds, args.steps, args.deepspeed)
        return 0
    return run(LaunchSpec(nproc=2, target=os.path.abspath(__file__), args=sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
