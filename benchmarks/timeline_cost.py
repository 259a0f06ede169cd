"""What the step timeline and its per-window attribution cost when left on: the same
Trainer fit() with `timeline=PATH` and without, in ABBA order (off, on, on, off) each round
so the machine's drift falls on both alike.

    python benchmarks/timeline_cost.py            # 2 workers, MNIST CNN, 3 rounds

Prints each job's training throughput (the Trainer's own samples/s: the per-window
attribution's all-gather is inside it; evaluation, checkpoints and the trace's one write
at the end are not) and the ratio on / off per round, and the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from elastic_trainer_cost import JOB_TEMPLATE, trainer_speed  # noqa: E402  (the same job)

JOB = JOB_TEMPLATE.format(log_every=10, setting='timeline=sys.argv[2] + "/timeline.json" '
                          'if on else None')


def run(mode: str, nproc: int, epochs: int, tmp: Path, tag: str) -> float:
    script = tmp / "job.py"
    script.write_text(JOB)
    return trainer_speed([sys.executable, "-m", "lockstep.launch.cli", "run", "-n", str(nproc),
                          str(script), mode, str(tmp / f"run-{tag}"), str(epochs)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="lockstep-timeline-cost-") as folder:
        tmp = Path(folder)
        for r in range(args.rounds):
            speeds: dict[str, list[float]] = {"off": [], "on": []}
            for i, mode in enumerate(("off", "on", "on", "off")):
                speeds[mode].append(run(mode, args.nproc, args.epochs, tmp, f"{r}-{i}"))
            off, on = (statistics.mean(speeds[m]) for m in ("off", "on"))
            ratios.append(on / off)
            print(f"round {r + 1}: off {off:8.0f} samples/s, on {on:8.0f} samples/s, "
                  f"on / off {on / off:.3f}", flush=True)
    print(f"Trainer throughput with timeline and attribution / without: "
          f"{statistics.median(ratios):.3f} (median of {args.rounds} ABBA rounds; "
          f"{args.nproc} workers, MNIST CNN, {args.epochs} epochs each)")


if __name__ == "__main__":
    main()
