"""Issue 23's acceptance for the Trainer: 2 emulated hosts x 2 workers, one of host 1's
workers killed (kill -9), then the rest of host 1, then host 1's command started again;
later every process of the job is killed and the same commands are run again.

    sudo .venv/bin/python benchmarks/elastic_trainer_cluster.py [--zero 2] [--epochs 12]

Prints what each host's launcher said, then the audit from the workers' records (through
examples/elastic_trainer.py --record): how long after each event the job trained again,
whether any survivor restarted, the checkpoints published and the step the rerun resumed
at, the gaps in metrics.jsonl, whether every global batch was trained exactly once (the
first run's committed steps up to the resume, the rerun's after), and test accuracy
against an uninterrupted run on the same cluster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import elastic_recovery as er
from elastic_recovery import accuracy, audit, records, run_job, shown, wait_for, wrong_samples

er.SCRIPT = str(er.ROOT / "examples" / "elastic_trainer.py")
EVERY = 50  # its checkpoints: CheckpointConfig(every_steps=50)


def trained_again(attempts: list[dict[str, Any]], at: float) -> float:
    """Seconds from `at` until a step was trained by a membership newer than the one
    training at that moment."""
    before = max(r["epoch"] for r in attempts if r["time"] <= at)
    return min(r["time"] for r in attempts if r["time"] > at and r["epoch"] > before) - at


class Checkpoints(threading.Thread):
    """Every checkpoint the job publishes, as it appears (the Trainer keeps only the
    newest three on disk)."""

    def __init__(self, run: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.steps, self.stop = run, set[int](), threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.steps |= {int(f.name[5:]) for f in self.folder.glob("checkpoints/step-*")}


def cluster_trainer(args: argparse.Namespace, tmp: Path) -> None:
    """Issue 23's acceptance: the Trainer on 2 hosts x 2 loses a worker, then the rest of
    its host, gets them back, and is then killed whole -- the same command resumes it."""
    from lockstep.tools.cluster import Cluster

    extra = ["--epochs", str(args.epochs), "--algorithm", args.algorithm or "hierarchical"]
    extra += ["--zero", str(args.zero)] if args.zero else []
    with Cluster(hosts=2, bandwidth=args.bandwidth) as c:
        def on_host(host: int, record: Path, run: Path, port: int) -> list[str]:
            command = er.launcher(2, f"{c.address(0)}:{port}", record, extra, run)
            at = command.index("--elastic") + 1
            command[at:at] = ["--nnodes", "2"]
            return ["ip", "netns", "exec", c.netns(host), *command]

        def start(hosts: tuple[int, ...], record: Path, run: Path, port: int
                  ) -> list[subprocess.Popen[str]]:
            return run_job([on_host(h, record, run, port) for h in hosts],
                           [c.env(h) for h in hosts])

        print(f"== uninterrupted: the Trainer on 2 hosts x 2 workers ({args.bandwidth}) ==")
        outs = [j.communicate()[0] for j in start((0, 1), tmp / "base", tmp / "base-run", 29483)]
        print("\n".join(f"[host {h}] {line}" for h, o in enumerate(outs) for line in shown(o)))
        run, first, second = tmp / "run", tmp / "ft", tmp / "ft-rerun"
        published = Checkpoints(run)
        jobs = start((0, 1), first, run, 29484)
        events: list[tuple[str, float]] = []

        def when(test: Any) -> int:
            return max(r["attempt"] for r in wait_for(first, test, jobs[0]))

        when(lambda r: r["attempt"] >= 40)
        host1 = {int(p) for p in subprocess.run(["ip", "netns", "pids", c.netns(1)],
                                                capture_output=True, text=True).stdout.split()}
        victim = next(r["pid"] for r in records(first) if r.get("pid") in host1)
        os.kill(victim, signal.SIGKILL)
        events.append((f"kill -9 of worker pid {victim} on host 1", time.time()))
        when(lambda r: r["world"] == 3 and r["attempt"] >= 80)
        c.kill_host(1)
        events.append(("host 1 killed (its launcher and last worker)", time.time()))
        when(lambda r: r["world"] == 2 and r["attempt"] >= 120)
        back = start((1,), first, run, 29484)[0]
        events.append(("host 1's command started again", time.time()))
        alone = max(r["epoch"] for r in records(first) if "epoch" in r)  # 2 workers
        back_at = when(lambda r: r["world"] == 4 and r["epoch"] > alone)
        checkpointed = (back_at // EVERY + 1) * EVERY  # the first one the 4 ranks write
        when(lambda r: r["attempt"] >= checkpointed + 15)
        c.kill_host(0)
        c.kill_host(1)
        stopped = max(r["attempt"] for r in records(first) if "attempt" in r)
        out_first = [j.communicate()[0] for j in (*jobs, back)]
        print(f"\n== {'; '.join(e for e, _ in events)}; then every process of the job "
              f"killed at step {stopped} ==")
        for name, o in zip(("host 0", "host 1", "host 1, again"), out_first, strict=True):
            print("\n".join(f"[{name}] {line}" for line in shown(o)))
        print("\n== the same command again on both hosts ==")
        outs2 = [j.communicate()[0] for j in start((0, 1), second, run, 29485)]
        print("\n".join(f"[host {h}] {line}" for h, o in enumerate(outs2) for line in shown(o)))
        published.stop.set()
        report_trainer(args, run, first, second, events, outs, outs2, published.steps)


def report_trainer(args: argparse.Namespace, run: Path, first: Path, second: Path,
                   events: list[tuple[str, float]], base: list[str], rerun: list[str],
                   checkpoints: set[int]) -> None:
    after = audit(second, 96, 4000)  # the rerun: from the checkpoint it resumed to the end
    resumed_at = after["lineage"][0][0]
    before = [r for r in records(first) if "attempt" in r]
    committed: dict[int, int] = {}  # a committed step is never attempted again: its last
    for r in before:                # attempt is the one that counted
        if r["attempt"] < resumed_at:
            committed[r["attempt"]] = max(committed.get(r["attempt"], 0), r["epoch"])
    bad = wrong_samples(before, committed, 96, 4000) + after["bad_steps"]
    pids: dict[int, set[int]] = {}
    for r in before:
        pids.setdefault(r["worker"], set()).add(r["pid"])
    print("\n== the Trainer on 2 hosts x 2: audit ==")
    for name, at in events[:2]:
        print(f"{name}: trained again {trained_again(before, at):.1f}s later")
    print(f"{events[2][0]}: its workers trained "
          f"{trained_again(before, events[2][1]):.1f}s after the command started")
    print(f"survivors restarted: {sum(len(p) > 1 for p in pids.values())} of {len(pids)} "
          "workers ever had a second pid")
    print(f"checkpoints published: steps {sorted(checkpoints)}; the rerun resumed at step "
          f"{resumed_at}")
    steps = sorted({json.loads(line)["step"] for line in (run / "metrics.jsonl").open()
                    if '"kind": "train"' in line})
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    print(f"metrics.jsonl: train lines at steps {steps[0]}..{steps[-1]}, widest gap "
          f"{max(gaps)} steps (logged every 10)")
    print(f"global batches trained exactly once: {after['steps'] - len(bad)} of "
          f"{after['steps']}" if not bad else f"STEPS WITH LOST OR REPEATED SAMPLES: {bad}")
    ours, theirs = accuracy("".join(rerun)), accuracy("".join(base))
    print(f"test accuracy: {ours:.4f} against {theirs:.4f} uninterrupted "
          f"({(ours - theirs) * 100:+.2f} points)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--algorithm", default=None, help="DataParallel's (default: hierarchical)")
    p.add_argument("--zero", type=int, default=0, help="ZeRO at this stage (mirrored shards)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lockstep-elastic-") as tmp:
        cluster_trainer(args, Path(tmp))


if __name__ == "__main__":
    main()
