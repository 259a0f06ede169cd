"""Do the approximate features still learn? Train each variant to the end and compare.

Each variant is a full Trainer run with 2 workers, on the demo task (the small CNN on real
MNIST digits, as `lockstep demo`) and on the char-GPT (KJV text), seeing the same number of
samples: mixed precision (bf16, fp16), compression (PowerSGD rank 4, 8, 12 and 16, rank 8
and 12 with bf16 factors, TopK 1% and 10%, each sent whole through the learning-rate
warm-up), and the low-communication modes (local SGD every 10 steps, DiLoCo every 50, an
asynchronous parameter server with staleness bound 4 -- which runs 3 ranks: a server and 2
workers), streaming DiLoCo (in full precision and 4-bit) and ZeRO with int8 or bf16
collectives, against synchronous fp32. Prints test accuracy and final test loss side by
side, with the gap to the baseline. `--nproc 4` runs 4 workers instead of 2.

    python benchmarks/convergence.py                       # everything (~3 hours)
    python benchmarks/convergence.py --tasks mnist --variants fp32 bf16 fp16
    python benchmarks/convergence.py --tasks chargpt --variants fp32 PowerSGD-4 \
        --chargpt-steps 1913 --out runs/bench/convergence-epoch   # one epoch of the text
    python benchmarks/convergence.py --tasks chargpt --variants fp32 PowerSGD-12-bf16 \
        --seed 1 --out runs/bench/convergence-seed1    # another initialisation and data order
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import lockstep
from lockstep.demo import data
from lockstep.demo.models import CharGPT, small_cnn
from lockstep.launch.run import LaunchSpec, run
from lockstep.training import configfile
from lockstep.training.feed import steps_per_epoch


def _compressed(kind: Any, **options: Any) -> dict[str, Any]:
    """A variant whose compressor is made for the recipe's warm-up (sent whole until then)."""
    return {"parallel": {"compress": lambda warmup: kind(**options, warmup_steps=warmup)}}


def _streaming(every: int, int4: bool = False, **options: Any) -> dict[str, Any]:
    """A streaming DiLoCo variant: 4 fragments, overlap 2 unless `options` say otherwise;
    `int4`: pseudo-gradients in 4 bits with error feedback."""
    wire = {"wire": "int4", "error_feedback": True} if int4 else {}
    return {"parallel": {"mode": "streaming_diloco", "sync_every": every, "fragments": 4,
                         "overlap": 2, **wire, **options}}


VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    # Compressors send whole through the learning-rate warm-up (their argument).
    "PowerSGD-4": _compressed(lockstep.PowerSGD, rank=4),
    "PowerSGD-8": _compressed(lockstep.PowerSGD, rank=8),
    "PowerSGD-16": _compressed(lockstep.PowerSGD, rank=16),
    "PowerSGD-12": _compressed(lockstep.PowerSGD, rank=12),
    # Factors in bf16: half the bytes of the same rank.
    "PowerSGD-8-bf16": _compressed(lockstep.PowerSGD, rank=8, wire_dtype="bf16"),
    "PowerSGD-12-bf16": _compressed(lockstep.PowerSGD, rank=12, wire_dtype="bf16"),
    # Rank 4 only where it shrinks a matrix 16x or more: the char-GPT's embeddings (its
    # output layer, tied, and the positions; 12-14x at rank 4) travel whole.
    "PowerSGD-4-min16": _compressed(lockstep.PowerSGD, rank=4, min_compression=16.0),
    "TopK-1%": _compressed(lockstep.TopK, ratio=0.01),
    "TopK-10%": _compressed(lockstep.TopK, ratio=0.1),
    "LocalSGD-10": {"parallel": {"mode": "local_sgd", "sync_every": 10}},
    "DiLoCo-50": {"parallel": {"mode": "diloco", "sync_every": 50}},
    "DiLoCo-10": {"parallel": {"mode": "diloco", "sync_every": 10}},
    # Outer lr 1 without momentum: plain averaging of the inner runs (local SGD with Adam).
    "DiLoCo-50-avg": {"parallel": {"mode": "diloco", "sync_every": 50, "outer_lr": 1.0,
                                   "outer_momentum": 0.0}},
    "DiLoCo-50-m.5": {"parallel": {"mode": "diloco", "sync_every": 50, "outer_lr": 1.0,
                                   "outer_momentum": 0.5}},
    "async-4": {"parallel": {"mode": "async", "max_staleness": 4}},
    # Streaming DiLoCo: 4 fragments on staggered rounds, each exchange applied 2 steps late
    # and mixed half into the local progress (the paper's alpha 0.5); in full precision or
    # 4-bit, with error feedback
    "Streaming-50": _streaming(50),
    "Streaming-50-int4": _streaming(50, int4=True),
    "Streaming-20": _streaming(20),
    "Streaming-20-int4": _streaming(20, int4=True),
    "Streaming-10-int4": _streaming(10, int4=True),
    # overlap 1 instead of 2: not the lever at 4 workers over one epoch (+3.7%, as overlap 2)
    "Streaming-10-int4-o1": _streaming(10, int4=True, overlap=1),
    "Streaming-10-int4-a.75": _streaming(10, int4=True, mixing=0.75),
    "Streaming-5-int4": _streaming(5, int4=True, overlap=1),
    # With 4 workers the mixing's best is still the paper's 0.5 (H=5, overlap 1, 1000
    # steps: 0.25 ended +8.5%, 0.5 +4.9%, 0.75 +6.8%), and the recipe's inner learning rate
    # (2e-3 ended +6.3%; 4.5e-3 at H=10 trailed too, below)
    "Streaming-5-int4-a.75": _streaming(5, int4=True, overlap=1, mixing=0.75),
    "Streaming-5-int4-a.25": _streaming(5, int4=True, overlap=1, mixing=0.25),
    "Streaming-5-int4-inner.67": {**_streaming(5, int4=True, overlap=1), "lr": 2e-3},
    "Streaming-10-int4-a0": _streaming(10, int4=True, mixing=0.0),
    # replicas of 2 ranks (replica_size=2): with --nproc 4, 2 replicas of 16 sequences a
    # step, gradients averaged within each every step (MB/step: between the replicas)
    "Streaming-10-int4-r2": _streaming(10, int4=True, replica_size=2),
    "Streaming-5-int4-r2": _streaming(5, int4=True, overlap=1, replica_size=2),
    # other outer settings than the paper's 0.7 / 0.9 (less momentum suits DiLoCo-50 here;
    # at H=10 both ended higher on the char-GPT: +3.3% and +4.8% against +2.5%, seed 0)
    "Streaming-20-int4-m.5": _streaming(20, int4=True, outer_lr=1.0, outer_momentum=0.5),
    "Streaming-10-int4-m.5": _streaming(10, int4=True, outer_lr=1.0, outer_momentum=0.5),
    "Streaming-10-int4-lr1": _streaming(10, int4=True, outer_lr=1.0),
    # the outer learning rate lower and higher at 4 workers (DiLoCo's scaling laws, Charles
    # et al. 2025, find the best one rising with the replicas). Neither is the lever: over
    # one epoch lr 0.5 ended +3.9% (0.7: +3.7%), and lr 1 trailed 0.7 by 1-2.6 points at
    # every window of 100 steps through the 1500 it ran
    "Streaming-10-int4-lr.5": _streaming(10, int4=True, outer_lr=0.5),
    # the inner learning rate 1.5x the recipe's: with 4 workers a rank's batch is 8
    # sequences. Not the lever: +3.8% at 4 workers over one epoch, where 3e-3 ended +3.7%
    # (and half of it trailed 3e-3 by 0.5-2.5 points through the 600 steps it ran)
    "Streaming-10-int4-inner1.5": {**_streaming(10, int4=True), "lr": 4.5e-3},
    # ZeRO with its collectives in fewer bits (its fp32 counterpart: ZeRO-2, ZeRO-3)
    "ZeRO-2": {"parallel": {"mode": "shard", "stage": 2}},
    "ZeRO-2-int8": {"parallel": {"mode": "shard", "stage": 2, "wire": "int8",
                                 "error_feedback": True}},
    "ZeRO-3": {"parallel": {"mode": "shard", "stage": 3}},
    "ZeRO-3-int8": {"parallel": {"mode": "shard", "stage": 3, "wire": "int8",
                                 "error_feedback": True}},
    "ZeRO-3-bf16": {"parallel": {"mode": "shard", "stage": 3, "wire": "bf16"}},
}
RANKS = {"async-4": 3}  # a parameter server and 2 workers (with --nproc 2)
TASKS = {
    # The demo's recipe (lockstep/demo.py): 6 epochs of 62 steps of 64 digits.
    "mnist": {"config": dict(global_batch_size=64, epochs=6, lr=3e-3, warmup_steps=20,
                             decay="cosine")},
    # The char-GPT example's recipe, shortened: 1000 steps of 32 sequences of 64 characters.
    "chargpt": {"config": dict(global_batch_size=32, max_steps=1000, lr=3e-3, warmup_steps=100,
                               decay="cosine", grad_clip_norm=1.0, eval_batch_size=512)},
}


def build(task: str, seed: int) -> tuple[torch.nn.Module, Any, Any, Any]:
    torch.manual_seed(seed)
    if task == "mnist":
        train, test = data.mnist()
        return small_cnn(), train, test, lambda p: torch.optim.Adam(p)
    train, test = data.kjv_chars(block_size=64)
    return (CharGPT(vocab=len(train.vocab)), train, test,
            lambda p: torch.optim.AdamW(p, weight_decay=0.1))


def worker(task: str, variant: str, out: Path, asked: dict[str, Any]) -> None:
    world = lockstep.init()
    model, train, test, optimizer = build(task, asked["seed"])
    recipe: dict[str, Any] = dict(TASKS[task]["config"], seed=asked["seed"])  # data order
    if asked["chargpt_steps"]:
        recipe["max_steps"] = asked["chargpt_steps"]  # the cosine decay stretches with it
        # as many epochs as that takes (under the recipe's one epoch, 2000 stopped at 1913)
        per_epoch = steps_per_epoch(train, recipe["global_batch_size"])
        recipe["epochs"] = -(-recipe["max_steps"] // per_epoch)
    config = configfile.apply(lockstep.TrainConfig(
        **recipe, run_dir=str(out.parent / out.stem), progress=False, log_every_steps=10,
        checkpoint=lockstep.CheckpointConfig(resume="never")),
        _resolved(VARIANTS[variant], recipe["warmup_steps"]), variant)
    entry = lockstep.AsyncTrainer if isinstance(config.parallel, lockstep.AsyncConfig) \
        else lockstep.Trainer
    summary = entry(model, optimizer, train, test, config=config).fit()
    if world.is_main:
        summary.pop("server", None)
        out.write_text(json.dumps({**summary, "bytes_per_step": _bytes(out.parent / out.stem),
                                   "asked": asked}))


def _resolved(overrides: dict[str, Any], warmup: int) -> dict[str, Any]:
    """A variant's settings, with a compressor made for the recipe's warm-up."""
    return {k: _resolved(v, warmup) if isinstance(v, dict) else v(warmup) if callable(v)
            else v for k, v in overrides.items()}


def _bytes(run_dir: Path) -> float:
    from lockstep.training.runlog import read_metrics

    sent = [r["bytes_sent"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    return sent[-1] if sent else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default="runs/bench/convergence")
    p.add_argument("--reuse", action="store_true",
                   help="report finished variants from their saved results (those run with the "
                        "same --seed and --chargpt-steps) instead of rerunning")
    p.add_argument("--chargpt-steps", type=int, default=None,
                   help="train the char-GPT this many steps instead of 1000 (an epoch is 1913; "
                        "more takes more epochs)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model's initialisation and the data order")
    p.add_argument("--nproc", type=int, default=2, help="workers (async: one more, the server)")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.chargpt_steps is not None and args.chargpt_steps < 1:
        p.error(f"--chargpt-steps must be at least 1, got {args.chargpt_steps}")
    if args.worker:
        task, variant, out = args.worker
        worker(task, variant, Path(out), _asked(task, args))
        return 0
    for task in args.tasks:
        asked = _asked(task, args)
        results = {}
        for variant in args.variants:
            out = (Path(args.out) / task / f"{variant}-n{args.nproc}.json").resolve()
            out.parent.mkdir(parents=True, exist_ok=True)
            if args.reuse and out.exists():
                saved = json.loads(out.read_text())
                if saved.get("asked", {"chargpt_steps": None, "seed": 0}) == asked:
                    results[variant] = saved
                    continue
            print(f"{task} / {variant} ...", flush=True)
            shutil.rmtree(out.parent / out.stem, ignore_errors=True)  # a fresh run each time
            nproc = args.nproc + 1 if variant in RANKS else args.nproc
            code = run(LaunchSpec(nproc=nproc, target=os.path.abspath(__file__),
                                  args=["--worker", task, variant, str(out)]
                                  + _worker_flags(asked)))
            if code == 0:
                results[variant] = json.loads(out.read_text())
        report(task, results, args.nproc)
    return 0


def _asked(task: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a run of `task` was asked for beyond its recipe (saved with its result)."""
    return {"chargpt_steps": args.chargpt_steps if task == "chargpt" else None,
            "seed": args.seed}


def _worker_flags(asked: dict[str, Any]) -> list[str]:
    """The flags that make a worker's `_asked` equal the parent's."""
    steps = asked["chargpt_steps"]
    return ["--seed", str(asked["seed"])] + (["--chargpt-steps", str(steps)] if steps else [])


def report(task: str, results: dict[str, dict[str, Any]], nproc: int) -> None:
    base = results.get("fp32")
    print(f"\n{task}: {nproc} workers; gaps against fp32 uncompressed")
    print(f"{'variant':16s} {'accuracy':>9s} {'gap':>7s} {'test loss':>10s} {'gap':>7s} "
          f"{'MB/step':>8s}")
    for name, r in results.items():
        acc_gap = f"{r['test_accuracy'] - base['test_accuracy']:+.4f}" if base else ""
        loss_gap = f"{r['test_loss'] / base['test_loss'] - 1:+.1%}" if base else ""
        print(f"{name:16s} {r['test_accuracy']:9.4f} {acc_gap:>7s} {r['test_loss']:10.4f} "
              f"{loss_gap:>7s} {r['bytes_per_step'] / 1e6:8.3f}")


if __name__ == "__main__":
    sys.exit(main())
