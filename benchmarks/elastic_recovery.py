"""Fault tolerance end to end, on real MNIST (examples/elastic_mnist.py), against an
uninterrupted run of the same job.

    python benchmarks/elastic_recovery.py             # 3 workers on this host
    python benchmarks/elastic_recovery.py --trainer   # the same, through the Trainer
    python benchmarks/elastic_recovery.py --trainer --zero 3   # ... sharded, ZeRO-3
    sudo .venv/bin/python benchmarks/elastic_recovery.py --cluster   # 2 hosts x 2 workers

One host: 3 workers under `lockstep run --elastic`; at step 40 (mid-epoch) one is killed
with SIGKILL; once the others go on, a second `lockstep run --elastic -n 1` adds a worker.
Cluster: 2 emulated hosts (lockstep.tools.cluster) of 2 workers each, hierarchical all-reduce;
at step 40 every process of host 1 is killed; then the same launcher is started there again.
With `--cut 25`, host 1's link goes down for 25 s instead (a host lost without a word: no
connection closes), and its workers come back by themselves.

Prints what the user sees, then the audit from the workers' records: the survivors' pids
(no restart), how long until they trained again, the world sizes, the steps redone, whether
every global batch was trained exactly once, and test accuracy against the uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "elastic_mnist.py")
sys.path.insert(0, str(ROOT))


def launcher(nproc: int, endpoint: str, record: Path, extra: list[str],
             run: Path | None = None) -> list[str]:
    # (every launcher of one job: the same run folder, for the Trainer's checkpoints)
    run_dir = ["--run-dir", str(run or record / "run")] if SCRIPT.endswith("trainer.py") else []
    return [sys.executable, "-m", "lockstep.launch.cli", "run", "--elastic", "-n", str(nproc),
            "--rdzv-endpoint", endpoint, SCRIPT, "--record", str(record), *run_dir, *extra]


_READ: dict[Path, tuple[int, list[dict[str, Any]]]] = {}  # file -> (bytes read, records)


def records(folder: Path) -> list[dict[str, Any]]:
    """Every worker's records so far. Each file is read on from where the last call left
    it: polled 20 times a second, rereading the whole of files that grow by a line per
    sample took 40% of a core by the adversary's fifth cycle -- CPU the job lacked, so its
    recoveries looked slower each cycle."""
    found = []
    for path in sorted(folder.glob("worker-*.jsonl")):
        done, parsed = _READ.get(path, (0, []))
        with path.open("rb") as f:
            f.seek(done)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # (a line being written: next time)
        for line in complete.decode().splitlines():
            with contextlib.suppress(ValueError):
                parsed.append(json.loads(line))
        _READ[path] = (done + len(complete), parsed)
        found += parsed
    return found


def wait_for(folder: Path, test: Any, job: subprocess.Popen[str],
             deadline_s: float = 300) -> list[dict[str, Any]]:
    deadline = time.monotonic() + deadline_s
    looked: dict[Path, int] = {}  # file -> records already tested (each is tested once)
    while time.monotonic() < deadline and job.poll() is None:
        records(folder)
        hits = []
        for path, (_, parsed) in list(_READ.items()):
            if path.parent == folder:
                hits += [r for r in parsed[looked.get(path, 0):] if "attempt" in r and test(r)]
                looked[path] = len(parsed)
        if hits:
            return hits
        time.sleep(0.05)
    raise RuntimeError(f"the job did not get there:\n{job.communicate()[0]}")


def shown(output: str) -> list[str]:
    """The launcher's output, without torch's warning that a namespace has no reverse DNS
    ("The hostname of the client socket cannot be retrieved"), which says nothing here."""
    return [line for line in output.splitlines() if "socket.cpp" not in line]


def accuracy(output: str) -> float:
    line = next(x for x in output.splitlines() if "test accuracy:" in x)
    return float(line.split("test accuracy:")[1].split()[0])


def audit(folder: Path, global_batch: int, dataset: int) -> dict[str, Any]:
    """Along the final lineage (which membership committed which step), was every global
    batch trained exactly once? How many steps were computed and thrown away?"""
    rs = records(folder)
    finals = [r for r in rs if r.get("final")]
    lineage = finals[0]["lineage"]
    attempts = [r for r in rs if "attempt" in r]
    steps = finals[0]["step"]
    committed = {s: max(e for f, e in lineage if f <= s) for s in range(lineage[0][0], steps)}
    bad = wrong_samples(attempts, committed, global_batch, dataset)
    redone = sorted({s for s, e in {(r["attempt"], r["epoch"]) for r in attempts}
                     - set(committed.items())})
    return {"steps": steps, "bad_steps": bad, "redone": redone, "lineage": lineage,
            "worlds": [g["world_size"] for g in max((f["regroups"] for f in finals), key=len)],
            "finals": len(finals), "attempts": attempts,
            "samples": steps * global_batch}


def wrong_samples(attempts: list[dict[str, Any]], committed: dict[int, int], global_batch: int,
                  dataset: int) -> list[int]:
    """The steps whose committed attempt (step -> membership epoch) did not train exactly
    that step's global batch of the sampler's order."""
    from lockstep.training.sampler import global_order

    used: dict[int, list[int]] = {s: [] for s in committed}
    for r in attempts:
        if committed.get(r["attempt"]) == r["epoch"]:
            used[r["attempt"]] += r["indices"]
    per_epoch = dataset // global_batch
    bad = []
    for step, indices in used.items():
        data_epoch, within = divmod(step, per_epoch)
        order = global_order(dataset, 0, data_epoch, True)
        if sorted(indices) != sorted(order[within * global_batch:][:global_batch].tolist()):
            bad.append(step)
    return bad


def report(name: str, baseline: float, result: dict[str, Any], killed_at: float,
           victims: list[int]) -> None:
    a = result["audit"]
    attempts = a["attempts"]
    survivors = {r["worker"]: r["pid"] for r in attempts if r["epoch"] == 0
                 and r["pid"] not in victims}
    restarted = [r["worker"] for r in attempts if r["worker"] in survivors
                 and r["pid"] != survivors[r["worker"]]]
    resumed = min(r["time"] for r in attempts if r["time"] > killed_at and r["epoch"] > 0)
    print(f"\n== {name}: audit ==")
    print(f"survivors restarted: {len(restarted)} (their pids never changed: "
          f"{sorted(set(survivors.values()))})")
    print(f"trained again {resumed - killed_at:.1f}s after the kill")
    print(f"world sizes, epoch by epoch: {' -> '.join(map(str, a['worlds']))}")
    print(f"steps computed and redone: {a['redone']} (at most one step's work lost)")
    print(f"global batches trained exactly once: {a['steps'] - len(a['bad_steps'])} of "
          f"{a['steps']} ({a['samples']} samples; none lost or repeated)"
          if not a["bad_steps"] else f"STEPS WITH LOST OR REPEATED SAMPLES: {a['bad_steps']}")
    diff = result["accuracy"] - baseline
    print(f"test accuracy: {result['accuracy']:.4f} against {baseline:.4f} uninterrupted "
          f"({diff * 100:+.2f} points)")


class Drained(subprocess.Popen[str]):
    """A launcher whose output is read as it comes. A pipe left unread until the end fills
    (64 KB: a minute of rank 0's progress bar), and the worker writing to it blocks -- its
    peers then wait on it in their next collective. The adversary's runs stalled so, and
    read as slow recoveries (up to 20 s: the collective timeout) that were this script's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.stdout is not None
        for line in self.stdout:
            self.lines.append(line)

    def communicate(self, input: Any = None, timeout: float | None = None
                    ) -> tuple[str, str]:
        self.wait(timeout)
        self._reader.join()
        return "".join(self.lines), ""


def run_job(commands: list[list[str]], env: list[dict[str, str]] | None = None
            ) -> list[subprocess.Popen[str]]:
    envs: list[dict[str, str] | None] = list(env) if env else [None] * len(commands)
    return [Drained(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    env=e, cwd=ROOT) for c, e in zip(commands, envs, strict=True)]


def one_host(args: argparse.Namespace, tmp: Path) -> None:
    extra = ["--epochs", str(args.epochs), "--algorithm", args.algorithm or "native"]
    extra += ["--compress", args.compress] if args.compress else []
    extra += ["--zero", str(args.zero)] if args.zero else []
    base = tmp / "base"
    print(f"== uninterrupted: lockstep run --elastic -n 3 examples/elastic_mnist.py "
          f"{' '.join(extra)} ==")
    out = run_job([launcher(3, "127.0.0.1:29471", base, extra)])[0].communicate()[0]
    print(out.rstrip())
    folder = tmp / "ft"
    first = run_job([launcher(3, "127.0.0.1:29472", folder, extra)])[0]
    victim = wait_for(folder, lambda r: r["attempt"] >= 40 and r["rank"] == 1, first)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.time()
    wait_for(folder, lambda r: r["world"] == 2, first)
    second = run_job([launcher(1, "127.0.0.1:29472", folder, extra)])[0]
    out1, out2 = first.communicate()[0], second.communicate()[0]
    print(f"\n== kill -9 of pid {victim['pid']} (rank 1) at step {victim['attempt']}; "
          "then a second command adds a worker ==")
    print(out1.rstrip())
    print("-- the second command (lockstep run --elastic -n 1 ...) --")
    print(out2.rstrip())
    result = {"accuracy": accuracy(out1 + out2), "audit": audit(folder, 96, 4000)}
    report("one host, kill -9 and rejoin", accuracy(out), result, killed, [victim["pid"]])


def cluster(args: argparse.Namespace, tmp: Path) -> None:
    from lockstep.tools.cluster import Cluster

    extra = ["--epochs", str(args.epochs), "--algorithm", args.algorithm or "hierarchical"]
    extra += ["--compress", args.compress] if args.compress else []
    extra += ["--zero", str(args.zero)] if args.zero else []
    with Cluster(hosts=2, bandwidth=args.bandwidth) as c:
        def on_host(host: int, record: Path, port: int) -> list[str]:
            command = launcher(2, f"{c.address(0)}:{port}", record, extra)
            at = command.index("--elastic") + 1
            command[at:at] = ["--nnodes", "2"]  # the first membership waits for both hosts
            return ["ip", "netns", "exec", c.netns(host), *command]

        base = tmp / "base"
        print(f"== uninterrupted: 2 hosts x 2 workers ({args.bandwidth} links) ==")
        jobs = run_job([on_host(h, base, 29481) for h in (0, 1)], [c.env(0), c.env(1)])
        outs = [j.communicate()[0] for j in jobs]
        print("\n".join(f"[host {h}] {line}" for h, o in enumerate(outs) for line in shown(o)))
        folder = tmp / "ft"
        jobs = run_job([on_host(h, folder, 29482) for h in (0, 1)], [c.env(0), c.env(1)])
        wait_for(folder, lambda r: r["attempt"] >= 40, jobs[0])
        if args.cut:
            what, victims, host1 = f"host 1's link cut for {args.cut:.0f}s", [], jobs[1]
            lost = cut_link(c, folder, jobs[0], args.cut)
        else:
            victims = [int(p) for p in subprocess.run(["ip", "netns", "pids", c.netns(1)],
                                                      capture_output=True, text=True
                                                      ).stdout.split()]
            for pid in victims:  # the whole host: its launcher and both workers
                os.kill(pid, signal.SIGKILL)
            lost, what = time.time(), f"host 1 killed (pids {victims})"
            wait_for(folder, lambda r: r["world"] == 2, jobs[0])
            host1 = run_job([on_host(1, folder, 29482)], [c.env(1)])[0]
        out0, out1 = jobs[0].communicate()[0], host1.communicate()[0]
        print(f"\n== {what} at step ~40; then it is back ==")
        print("\n".join(f"[host 0] {line}" for line in shown(out0)))
        print("\n".join(f"[host 1] {line}" for line in shown(out1)))
        result = {"accuracy": accuracy(out0 + out1), "audit": audit(folder, 96, 4000)}
        report(f"2 hosts x 2, {what}", accuracy(outs[0] + outs[1]), result, lost, victims)


def cut_link(c: Any, folder: Path, job: subprocess.Popen[str], seconds: float) -> float:
    """Take host 1 off the network without a word (no connection is closed: the others
    notice by their collective timeout), then bring it back: its workers, excluded
    meanwhile, join again by themselves."""
    link = ["ip", "-n", c.netns(1), "link", "set", "dev", c.interface(1)]
    subprocess.run([*link, "down"], check=True)
    cut = time.time()
    wait_for(folder, lambda r: r["world"] == 2, job)
    time.sleep(max(0.0, seconds - (time.time() - cut)))
    subprocess.run([*link, "up"], check=True)
    return cut


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--cluster", action="store_true", help="2 emulated hosts (needs root)")
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--algorithm", default=None,
                   help="DataParallel's (default: native; hierarchical on the cluster)")
    p.add_argument("--compress", default=None, help="bf16 or fp16 on the wire")
    p.add_argument("--cut", type=float, default=0.0, help="with --cluster: cut host 1's "
                   "link for this many seconds instead of killing its processes")
    p.add_argument("--zero", type=int, default=0, help="with --trainer: ZeRO at this stage "
                   "(its shards mirrored: a death loses nothing)")
    p.add_argument("--trainer", action="store_true", help="the job through lockstep.Trainer "
                   "(examples/elastic_trainer.py) rather than Elastic.run_step")
    args = p.parse_args()
    if args.trainer:
        global SCRIPT
        SCRIPT = str(ROOT / "examples" / "elastic_trainer.py")
    with tempfile.TemporaryDirectory(prefix="lockstep-elastic-") as tmp:
        (cluster if args.cluster else one_host)(args, Path(tmp))


if __name__ == "__main__":
    main()
