"""The Trainer under fault tolerance, for the tests: least squares in float64 with
`TrainConfig(elastic=ElasticConfig(...))`, launched with `lockstep run --elastic`.

Every sample the training set hands out is recorded in OUT/worker-<id>.jsonl with the step
being attempted, the membership epoch, rank and world size (the format elastic_job.py
writes, so the same audit applies); at the end each worker records its final parameters,
the job's lineage and the summary. Checkpoints, metrics and config.json go to OUT/run.
"""

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import Dataset, TensorDataset

import lockstep
from lockstep.elastic import ElasticConfig
from lockstep.elastic.heartbeat import pending_joiners
from lockstep.training.resume import CheckpointConfig
from tests import elastic_job


class RecordedSet(Dataset):
    """A dataset that writes down every sample it hands out, and for which attempt."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, out: Path) -> None:
        self.x, self.y, self.out = x, y, out
        self.trainer: Any = None
        self.log: Any = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._record(indices=[i])
        return self.x[i], self.y[i]

    def stepped(self, step: int) -> None:
        """After an optimizer step: recorded at `step` (the moment a test kills this
        worker in fail_unstepped's scenario)."""
        if self.trainer.survival.step == step:
            self._record(indices=[], stepped=True)

    def _record(self, **what: Any) -> None:
        job = self.trainer.survival
        if self.log is None:
            self.log = (self.out / f"worker-{job.coordinator.id}.jsonl").open("a")
        world = job.world
        self.log.write(json.dumps({"attempt": job.step, "epoch": job.membership.epoch,
                                   "rank": world.rank, "world": world.world_size,
                                   "worker": job.coordinator.id, "pid": os.getpid(),
                                   "time": time.time(), **what}) + "\n")
        self.log.flush()


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def fail_unstepped(job: Any, step: int) -> None:
    """Rank 2 of the first membership, about to step its optimizer at `step` (after the
    step's collectives: ZeRO-3's step has none, so the others complete it): wait until the
    test has killed rank 1, then fail on the connection to it, as a collective of the step
    would have -- the others completed the step, this rank did not."""
    if job.membership.epoch != 0 or job.world.rank != 2 or job.step != step:
        return
    deadline = time.monotonic() + 60
    while elastic_job.process_state(job.membership.pids[1]) not in ("Z", ""):
        if time.monotonic() > deadline:
            raise TimeoutError("the test did not kill rank 1 within 60 s")
        time.sleep(0.05)
    torch.distributed.recv(torch.zeros(1), src=1)


def stop_in_checkpoint(trainer: lockstep.Trainer, plan: Path) -> Callable[[], Path]:
    """The trainer's save_checkpoint, made to stop this worker first at the step the plan
    names -- inside the checkpoint's collective work, where the others will time out on
    it and go on -- once."""
    save, stopped = trainer.save_checkpoint, []

    def stop_then_save() -> Path:
        job = trainer.survival
        if plan.exists() and not stopped:
            wanted = json.loads(plan.read_text())
            if wanted == {"worker": job.coordinator.id, "step": job.step}:
                stopped.append(True)
                os.kill(os.getpid(), signal.SIGSTOP)
        return save()
    return stop_then_save


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--hold-at", type=int, default=-1, help="at this step, wait until a "
                   "worker is waiting to join (so a test's joiner always finds the job)")
    p.add_argument("--hold-for", default=None, help="with --hold-at: wait at that step "
                   "until this file exists instead (a test's joiners have been dealt with)")
    p.add_argument("--mode", default="sync", choices=["sync", "diloco", "streaming", "zero1",
                                                      "zero2", "zero3"])
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--width", type=int, default=1, help="outputs of the model (a joiner "
                   "with another width differs from the job)")
    p.add_argument("--unstepped-at", type=int, default=-1, help="rank 2 does not take this "
                   "step: its optimizer waits for rank 1's death, then fails on its "
                   "connection to it (a peer still in a step the others completed)")
    p.add_argument("--eval-every", type=int, default=10, help="0: at epochs' ends only")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--stop-plan", default=None, help="a file the test may write, "
                   '{"worker": W, "step": S}: worker W stops itself (SIGSTOP) in the '
                   "checkpoint after step S, once; the test wakes it")
    p.add_argument("--out", required=True)
    p.add_argument("--timeline", action="store_true", help="record the step timeline")
    args = p.parse_args()
    out = Path(args.out)
    x, y = elastic_job.data()
    train = RecordedSet(x, y, out)
    parallel: Any = lockstep.SyncConfig()
    if args.mode == "diloco":
        parallel = lockstep.DiLoCoConfig(sync_every=4)
    elif args.mode == "streaming":  # one layer: one fragment, its exchange a step in flight
        parallel = lockstep.StreamingDiLoCoConfig(sync_every=4, fragments=1, overlap=1)
    elif args.mode.startswith("zero"):
        parallel = lockstep.ShardConfig(stage=int(args.mode[-1]))
    config = lockstep.TrainConfig(
        global_batch_size=args.global_batch, max_steps=args.steps, epochs=100,
        run_dir=str(out / "run"), log_every_steps=args.log_every, progress=False, trackers=(),
        eval_every_steps=args.eval_every or None, parallel=parallel,
        timeline=str(out / "timeline.json") if args.timeline else None,
        checkpoint=CheckpointConfig(every_steps=args.checkpoint_every, keep=20),
        elastic=ElasticConfig(heartbeat_s=0.1, dead_after_s=1.5,
                              collective_timeout_s=args.collective_timeout,
                              join_timeout_s=60.0, check_every=0))

    def build() -> nn.Module:
        return nn.Linear(elastic_job.FEATURES, args.width).double()

    def held() -> bool:
        if args.hold_for:
            return not Path(args.hold_for).exists()
        return not pending_joiners(trainer.survival.coordinator.store)

    def pace(trainer: lockstep.Trainer) -> None:
        if trainer.state.global_step == args.hold_at:
            deadline = time.monotonic() + 120
            while held() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(args.pace)

    if args.unstepped_at >= 0:
        register_optimizer_step_pre_hook(
            lambda *_: fail_unstepped(trainer.survival, args.unstepped_at))
        register_optimizer_step_post_hook(lambda *_: train.stepped(args.unstepped_at))
    trainer = lockstep.Trainer(
        build, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), train,
        TensorDataset(x, y), loss_fn=mse, config=config, callbacks=[pace],
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5))
    train.trainer = trainer
    if args.stop_plan:
        trainer.save_checkpoint = stop_in_checkpoint(trainer, Path(args.stop_plan))  # type: ignore[method-assign]
    summary = trainer.fit()
    job = trainer.survival
    with (out / f"worker-{job.coordinator.id}.jsonl").open("a") as log:
        log.write(json.dumps({
            "final": True, "worker": job.coordinator.id, "pid": os.getpid(),
            "world": summary["world_size"], "step": summary["steps"],
            "lineage": job.lineage, "regroups": job.regroups,
            "test_loss": summary["test_loss"], "history": trainer.state.history,
            "params": [v.flatten().tolist() for v in trainer.model.module.state_dict().values()],
        }) + "\n")


if __name__ == "__main__":
    main()
