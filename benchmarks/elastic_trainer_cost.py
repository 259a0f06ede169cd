"""What fault tolerance costs the Trainer when nothing fails: the same fit() with
`elastic=ElasticConfig()` (under `lockstep run --elastic`) and without (under `lockstep
run`), alternated in one run so the machine's noise falls on both alike.

    python benchmarks/elastic_trainer_cost.py            # 3 workers, MNIST CNN, 3 rounds

Prints each job's training throughput (the Trainer's own samples/s: evaluation and
checkpoints excluded) and the ratio elastic / plain, per round and as a median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB_TEMPLATE = """
import json, sys, torch, lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn
on = sys.argv[1] == "on"
train, test = mnist()
config = lockstep.TrainConfig(global_batch_size=96, epochs=int(sys.argv[3]), run_dir=sys.argv[2],
                              progress=False, trackers=(), log_every_steps={log_every},
                              checkpoint=lockstep.CheckpointConfig(resume="never"),
                              {setting})
summary = lockstep.Trainer(small_cnn, lambda p: torch.optim.Adam(p, lr=2e-3), train, test,
                           config=config).fit()
if lockstep.comm.world.current().is_main:
    print("SUMMARY", json.dumps({{"samples_per_s": summary["samples_per_s"]}}), flush=True)
"""
"""The MNIST CNN Trainer job the cost benchmarks time (argv: on|off RUN_DIR EPOCHS);
`setting` is the TrainConfig keyword that "on" turns on."""
JOB = JOB_TEMPLATE.format(log_every=20,
                          setting="elastic=lockstep.ElasticConfig() if on else None")


def trainer_speed(command: list[str]) -> float:
    """Run a launch of the job; its training throughput (the Trainer's own samples/s)."""
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("SUMMARY"))
    return float(json.loads(line.split(" ", 1)[1])["samples_per_s"])


def run(mode: str, nproc: int, epochs: int, tmp: Path, port: int) -> float:
    script = tmp / "job.py"
    script.write_text(JOB)
    launch = ["--elastic", "--rdzv-endpoint", f"127.0.0.1:{port}"] if mode == "on" else []
    command = [sys.executable, "-m", "lockstep.launch.cli", "run", *launch, "-n", str(nproc),
               str(script), mode, str(tmp / f"run-{mode}-{port}"), str(epochs)]
    return trainer_speed(command)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="lockstep-ft-cost-") as folder:
        tmp = Path(folder)
        for r in range(args.rounds):
            plain = run("off", args.nproc, args.epochs, tmp, 29600 + r)
            elastic = run("on", args.nproc, args.epochs, tmp, 29700 + r)
            ratios.append(elastic / plain)
            print(f"round {r + 1}: plain {plain:8.0f} samples/s, elastic {elastic:8.0f} "
                  f"samples/s, elastic / plain {elastic / plain:.3f}", flush=True)
    print(f"Trainer throughput with elastic= / without: {statistics.median(ratios):.3f} "
          f"(median of {args.rounds} alternated rounds; {args.nproc} workers, MNIST CNN, "
          f"{args.epochs} epochs each)")


if __name__ == "__main__":
    main()
