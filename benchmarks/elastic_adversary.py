"""The Trainer under fault tolerance, tried from outside the way the issue's adversary did:
kill -9 of two workers at once, SIGSTOP of one for 40 s, then kill/rejoin cycles -- all in
one job (examples/elastic_trainer.py, MNIST, 3 workers), audited from the workers' records.

    python benchmarks/elastic_adversary.py            # ~3 minutes

Prints each event and then the audit: no survivor restarted, every global batch trained
exactly once along the final lineage, the worlds it went through, the seconds from each kill
to training again, and test accuracy.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import elastic_recovery as er  # noqa: E402  (its launcher, records and audit)

er.SCRIPT = str(ROOT / "examples" / "elastic_trainer.py")


def members(folder: Path, size: int, after: float, job: subprocess.Popen[str]) -> list[int]:
    """The pids of a membership of `size` workers, each seen training in it after `after`
    (a moment past the last change: a worker killed before it is no candidate)."""
    found: dict[int, int] = {}

    def seen(r: dict[str, Any]) -> bool:
        if r["world"] == size and r["time"] > after:
            found[r["worker"]] = r["pid"]
        return len(found) == size
    er.wait_for(folder, seen, job)
    return [pid for _, pid in sorted(found.items())]


def wait_world(folder: Path, size: int, after: float, job: subprocess.Popen[str]) -> float:
    """When the job first trained at `size` workers after `after`."""
    hit = er.wait_for(folder, lambda r: r["world"] == size and r["time"] > after, job)
    return min(r["time"] for r in hit)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--cycles", type=int, default=8)
    p.add_argument("--stop-s", type=float, default=40.0)
    args = p.parse_args()
    extra = ["--epochs", str(args.epochs)]
    endpoint = "127.0.0.1:29491"
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="lockstep-adversary-") as tmp:
        folder = Path(tmp) / "ft"
        first = er.run_job([er.launcher(3, endpoint, folder, extra)])[0]
        added: list[subprocess.Popen[str]] = []
        recoveries = []
        er.wait_for(folder, lambda r: r["attempt"] >= 40, first)
        now = time.time()
        victims = members(folder, 3, now - 1, first)[1:]
        for pid in victims:  # two of three, at once
            os.kill(pid, signal.SIGKILL)
        back = wait_world(folder, 1, now, first)
        recoveries.append(("kill -9 of two at once", back - now))
        print(f"kill -9 of two workers at once: training again {back - now:.1f}s later",
              flush=True)
        added.append(er.run_job([er.launcher(2, endpoint, folder, extra)])[0])
        # (from `back`, not `now`: a step the three trained just before the kill landed
        # after `now`, and its killed workers were once picked here)
        grown = wait_world(folder, 3, back, first)
        now = time.time()
        stopped = members(folder, 3, grown, first)[1]
        os.kill(stopped, signal.SIGSTOP)
        back = wait_world(folder, 2, now, first)
        recoveries.append((f"SIGSTOP for {args.stop_s:.0f}s", back - now))
        print(f"SIGSTOP of pid {stopped}: the others train again {back - now:.1f}s later "
              "(the collective timeout)", flush=True)
        time.sleep(max(0.0, args.stop_s - (time.time() - now)))
        os.kill(stopped, signal.SIGCONT)
        try:
            grown = wait_world(folder, 3, time.time(), first)
        except RuntimeError:
            for a in added:
                a.kill()
                print("-- the added launcher said --\n" + a.communicate()[0][-4000:])
            raise
        print(f"SIGCONT after {args.stop_s:.0f}s: it joined again by itself", flush=True)
        for cycle in range(args.cycles):
            now = time.time()
            pid = rng.choice(members(folder, 3, grown, first))
            os.kill(pid, signal.SIGKILL)
            back = wait_world(folder, 2, now, first)
            recoveries.append((f"cycle {cycle + 1}", back - now))
            added.append(er.run_job([er.launcher(1, endpoint, folder, extra)])[0])
            joined = grown = wait_world(folder, 3, back, first)
            print(f"cycle {cycle + 1}: kill -9 of pid {pid}, training again after "
                  f"{back - now:.1f}s; a new worker training {joined - back:.1f}s after that",
                  flush=True)
        outs = [first.communicate()[0]] + [a.communicate()[0] for a in added]
        audit = er.audit(folder, 96, 4000)
        finals = [r for r in er.records(folder) if r.get("final")]
        print("\n== audit ==")
        print(f"global batches trained exactly once: {audit['steps'] - len(audit['bad_steps'])}"
              f" of {audit['steps']}" if not audit["bad_steps"] else
              f"STEPS WITH LOST OR REPEATED SAMPLES: {audit['bad_steps']}")
        print(f"steps computed and redone: {audit['redone']}")
        print(f"world sizes: {' -> '.join(map(str, audit['worlds']))}")
        print(f"workers that finished: {len(finals)}")
        print("seconds to train again: " + ", ".join(f"{w} {s:.1f}" for w, s in recoveries))
        print(f"test accuracy: {er.accuracy(''.join(outs)):.4f}")


if __name__ == "__main__":
    main()
