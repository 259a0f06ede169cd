"""A small fault-tolerant job for the tests: least squares in float64 under lockstep.Elastic.

Launched with `lockstep run --elastic`. Every worker appends to OUT/worker-<id>.jsonl one
line per attempted step (the membership epoch, its rank and world size, the sample indices
it trained on, its pid) and, at the end, its final parameters and lineage -- so a test can
check that no sample was lost or repeated, and compare the weights with one process
training on the same global batches.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lockstep
from lockstep import comm
from lockstep.elastic import Elastic, ElasticConfig, batch_slice, regroup
from lockstep.elastic.heartbeat import pending_joiners
from lockstep.lowcomm.rounds import DiLoCo, LocalSGD
from lockstep.lowcomm.streaming import StreamingDiLoCo

SAMPLES, FEATURES = 240, 8


def process_state(pid: int) -> str:
    """Process `pid`'s state letter in /proc (T: stopped, Z: killed, not yet reaped), or ""
    once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return ""


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)
    return x, x @ w + 0.1 * torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)


def order(step: int, global_batch: int) -> tuple[torch.Tensor, int]:
    """The epoch's sample order for global step `step`, and the step within the epoch."""
    per_epoch = SAMPLES // global_batch
    epoch, within = divmod(step, per_epoch)
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)), within


def wrapper(mode: str, every: int, algorithm: str):  # type: ignore[no-untyped-def]
    if mode == "localsgd":
        return lambda m: LocalSGD(m, every)
    if mode == "diloco":
        return lambda m: DiLoCo(m, every, outer_lr=1.0, outer_momentum=0.5)
    if mode == "streaming":  # one layer: one fragment, its exchange a step in flight
        return lambda m: StreamingDiLoCo(m, every, fragments=1, overlap=1, outer_lr=1.0,
                                         outer_momentum=0.5)
    if mode == "zero":
        return lambda m: lockstep.shard(m, 2)
    return lambda m: lockstep.DataParallel(m, algorithm=algorithm)


def evaluate(job: Elastic, x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean squared error over all samples, each rank summing its share."""
    world = job.world
    mine = batch_slice(0, SAMPLES, world.rank, world.world_size)
    with torch.no_grad():
        total = ((job.module(x[mine.start:mine.stop]) - y[mine.start:mine.stop]) ** 2).sum()
    return float(comm.all_reduce(total.reshape(1), "evaluation").item()) / SAMPLES


def hold(job: Elastic) -> None:
    deadline = time.monotonic() + 120
    while not pending_joiners(job.coordinator.store) and time.monotonic() < deadline:
        time.sleep(0.05)


def die_handing_over(job: Elastic) -> None:
    """The member that is rank 0 when a joiner is let in is killed as it begins to hand the
    joiner its state -- after ZeRO's pool gave the joiner its shards: a second failure in
    the middle of an admission."""
    real = regroup.hand_over

    def hand_over(*args: Any, **kwargs: Any) -> Any:
        if job.world.rank == 0 and job.membership is not None and job.membership.joined:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    regroup.hand_over = hand_over


def pieces_one_peer_completes(job: Elastic, log: Any) -> None:
    """Two pieces of collective work between steps. In the first, worker 1 sends to rank 0
    alone and dies: rank 0 completes it and goes on to the second, the others fail in the
    first. Done again without worker 1, the first is an all-reduce of 5 numbers, the second
    one of 3: if a member did the first again while another did the second, Gloo would
    abort the process (the sizes differ)."""
    def first() -> str:
        m = job.membership
        if 1 not in m.ids:
            comm.all_reduce(torch.ones(5, dtype=torch.float64), "the first piece, again")
            return "again"
        token = torch.zeros(1, dtype=torch.float64)
        if m.me == 1:
            comm.send(token, 0, "the first piece: to rank 0 alone")
            time.sleep(0.3)  # (delivered before the connection goes)
            os.kill(os.getpid(), signal.SIGKILL)
        comm.recv(token, m.ids.index(1), "the first piece: from worker 1")
        return "done"

    def second() -> str:
        comm.all_reduce(torch.ones(3, dtype=torch.float64), "the second piece")
        return "done"

    for name, piece in (("first", first), ("second", second)):
        got = job.collective(piece, skipped="skipped")
        log.write(json.dumps({"piece": name, "got": got, "worker": job.coordinator.id}) + "\n")
        log.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--mode", default="dp", choices=["dp", "localsgd", "diloco", "streaming",
                                                     "zero"])
    p.add_argument("--algorithm", default="native")
    p.add_argument("--every", type=int, default=4, help="local SGD / DiLoCo round length")
    p.add_argument("--check-every", type=int, default=0)
    p.add_argument("--perturb", type=int, default=-1, help="worker 1 perturbs its weight "
                   "in this step, after its gradient (a replica drifting)")
    p.add_argument("--hold-at", type=int, default=-1, help="at this step, wait until a "
                   "worker is waiting to join (so a test's joiner always finds the job)")
    p.add_argument("--ballast-mb", type=int, default=0, help="a frozen parameter this "
                   "large, so that handing state to a joiner takes a while")
    p.add_argument("--plain-optimizer", action="store_true", help="ZeRO with a torch "
                   "optimizer (refused: it cannot be rebuilt over the shards)")
    p.add_argument("--die-handing-over", action="store_true", help="rank 0 is killed as it "
                   "begins to hand its state to a joiner (die_handing_over)")
    p.add_argument("--pieces-at", type=int, default=-1, help="after this step, two pieces "
                   "of collective work that only rank 0 completes the first of "
                   "(pieces_one_peer_completes)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    x, y = data()
    model, optimizer = build()
    if args.mode == "zero" and not args.plain_optimizer:  # rebuilt over each membership's
        # shards, the schedule following it
        optimizer = lockstep.ZeroOptimizer.unbound(
            model.parameters(), lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    if args.ballast_mb:
        model.ballast = nn.Parameter(torch.zeros(args.ballast_mb << 17, dtype=torch.float64),
                                     requires_grad=False)
    config = ElasticConfig(heartbeat_s=0.1, dead_after_s=1.5, collective_timeout_s=10.0,
                           check_every=args.check_every, join_timeout_s=60.0)
    lr = schedule(optimizer)

    def update() -> None:
        optimizer.step()
        lr.step()
        optimizer.zero_grad(set_to_none=True)

    job = Elastic(model, optimizer, wrapper(args.mode, args.every, args.algorithm),
                  state={"schedule": lr}, config=config, update=update)
    me = job.coordinator.id
    if args.die_handing_over:
        die_handing_over(job)
    log = (Path(args.out) / f"worker-{me}.jsonl").open("a")

    def train_step(replica: nn.Module, step: int) -> None:
        if step == args.hold_at:
            hold(job)
        world = job.world
        permutation, within = order(step, args.global_batch)
        indices = permutation[list(batch_slice(within, args.global_batch, world.rank,
                                               world.world_size))]
        log.write(json.dumps({"attempt": step, "epoch": job.membership.epoch,
                              "rank": world.rank, "world": world.world_size, "worker": me,
                              "pid": os.getpid(), "indices": indices.tolist(),
                              "time": time.time(), "threads": torch.get_num_threads()}) + "\n")
        log.flush()
        loss = ((replica(x[indices]) - y[indices]) ** 2).sum()
        (loss * world.world_size / args.global_batch).backward()
        if step == args.perturb and me == 1:
            with torch.no_grad():
                model.weight[0, 0] += 0.5
        time.sleep(args.pace)

    while job.step < args.steps:
        job.run_step(train_step)
        if job.step == args.pieces_at:
            pieces_one_peer_completes(job, log)
    if hasattr(job.model, "finish"):
        job.model.finish()
    mse = job.collective(lambda: evaluate(job, x, y))
    log.write(json.dumps({"final": True, "worker": me, "pid": os.getpid(),
                          "rank": job.world.rank, "world": job.world.world_size,
                          "step": job.step, "lineage": job.lineage, "regroups": job.regroups,
                          "mse": mse,
                          "params": [v.flatten().tolist() for v in model.state_dict().values()],
                          "drift_checks": job.drift.checks if job.drift else 0}) + "\n")
    log.close()
    job.finish()


if __name__ == "__main__":
    main()
