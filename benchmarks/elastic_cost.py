"""What fault tolerance and the stall watchdog cost when nothing fails: throughput of steps
driven by lockstep.Elastic (step bookkeeping, the drift check every 100 steps) with the
watchdog on (collectives numbered, published and checked twice a second) against the same
DataParallel steps in a plain loop with the watchdog off, on real MNIST with 3 workers, in
one run. `--against ddp`: against torch's DistributedDataParallel instead (a copy of the
same model, its own Adam, over the same process group) -- lockstep's fault-tolerant step
beside the one DDP's users take.

    python benchmarks/elastic_cost.py [--blocks 40] [--block-steps 10] [--against ddp]

One `lockstep run --elastic -n 3` job; its workers alternate blocks of plain steps
(forward, backward, optimizer step) and blocks of the same steps through `run_step`, so
load from elsewhere on the machine falls on both alike -- separate launches on these
shared cores differ by more than the cost being measured. What both blocks share, and so
is not in the ratio: the heartbeat thread (one store increment every 0.25 s, tens of
microseconds) and the group itself (Gloo, as under torchrun).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH, WARMUP = 96, 10



def worker(blocks: int, block_steps: int, check_every: int, against: str) -> None:
    """Alternate plain (or DDP) and Elastic blocks; rank 0 prints each kind's block times."""
    import copy

    import torch
    import torch.nn.functional as F

    import lockstep
    from lockstep.comm import watchdog
    from lockstep.demo.data import mnist
    from lockstep.demo.models import small_cnn
    from lockstep.elastic import ElasticConfig, batch_slice
    from lockstep.training.sampler import global_order

    train_set, _ = mnist()
    images, labels = train_set.tensors
    order = global_order(len(train_set), 0, 0, True)
    per_epoch = len(train_set) // GLOBAL_BATCH
    torch.manual_seed(0)
    net = small_cnn()
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    twin = copy.deepcopy(net)  # the same initial weights, for DDP
    job = lockstep.Elastic(net, optimizer, config=ElasticConfig(check_every=check_every))
    if against == "ddp":  # over the default group Elastic has just formed
        ddp = torch.nn.parallel.DistributedDataParallel(twin)
        ddp_optimizer = torch.optim.Adam(ddp.parameters(), lr=2e-3)

    def train_step(replica: torch.nn.Module, step: int) -> None:
        world = job.world
        mine = order[list(batch_slice(step % per_epoch, GLOBAL_BATCH, world.rank,
                                      world.world_size))]
        loss = F.cross_entropy(replica(images[mine]), labels[mine], reduction="sum")
        (loss * world.world_size / GLOBAL_BATCH).backward()

    def plain(step: int) -> None:
        replica, stepper = (ddp, ddp_optimizer) if against == "ddp" else (job.model, optimizer)
        train_step(replica, step)
        stepper.step()
        stepper.zero_grad(set_to_none=True)

    for step in range(WARMUP):  # both kinds, so neither pays a first step in the blocks
        plain(step)
        job.run_step(train_step)
    timeout_s = job.world.timeout.total_seconds()
    stall_after = watchdog.stall_after_setting(None, timeout_s)
    seconds: dict[str, list[float]] = {"off": [], "on": []}  # per block
    for block in range(2 * blocks):
        kind = "off" if block % 2 == 0 else "on"
        # Every rank switches at the same block boundary: the watchdog on with Elastic.
        watchdog.start(stall_after if kind == "on" else 0.0, timeout_s, job.world.backend)
        started = time.perf_counter()
        for step in range(block_steps):
            if kind == "on":
                job.run_step(train_step)
            else:
                plain(step)
        seconds[kind].append(time.perf_counter() - started)
    if job.world.is_main:
        for kind, values in seconds.items():
            print(kind, *values, flush=True)
        print(f"drift checks {job.drift.checks if job.drift else 0}", flush=True)
    job.finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=40, help="blocks of each kind")
    p.add_argument("--block-steps", type=int, default=10)
    p.add_argument("--check-every", type=int, default=100)
    p.add_argument("--against", choices=("plain", "ddp"), default="plain",
                   help="the other blocks: lockstep's DataParallel with the watchdog off, "
                        "or torch's DistributedDataParallel")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.blocks, args.block_steps, args.check_every, args.against)
        return
    command = [sys.executable, "-m", "lockstep.launch.cli", "run", "--elastic", "-n", "3",
               __file__,
               "--worker", "--blocks", str(args.blocks), "--block-steps",
               str(args.block_steps), "--check-every", str(args.check_every),
               "--against", args.against]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    found = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()
             if line.split()[:1] in (["off"], ["on"], ["drift"])}
    if "on" not in found:
        raise SystemExit(f"the run failed:\n{out.stdout}\n{out.stderr}")
    off, on = ([float(x) for x in found[k]] for k in ("off", "on"))
    steps = args.blocks * args.block_steps
    print(f"3 workers, MNIST CNN, global batch {GLOBAL_BATCH}, {steps} steps of each kind in "
          f"alternating blocks of {args.block_steps}; {found['drift'][1]} drift checks")
    other = "torch DDP" if args.against == "ddp" else "plain loop, watchdog off"
    for name, blocks in ((other, off), ("Elastic + watchdog on", on)):
        print(f"  {name:24} {sum(blocks) / steps * 1e3:.2f} ms/step")
    # Neighbouring blocks see the same load from elsewhere: their ratios are the fair ones.
    pairs = [a / b for a, b in zip(off, on, strict=True)]
    versus = "torch DDP's" if args.against == "ddp" else "without"
    print(f"throughput with fault tolerance and watchdog / {versus}: "
          f"{statistics.median(pairs):.3f} "
          f"(median of {len(pairs)} neighbouring block pairs; "
          f"{sum(off) / sum(on):.3f} over the whole run)")


if __name__ == "__main__":
    main()
