"""Training over a slow link: how long each mode takes to reach a target loss, and what it
sends.

On an emulated cluster of 2 hosts x 2 processes joined by a 100 Mbit/s link, a model
trains on real MNIST digits with the Trainer in each mode, one job after another, at the
same global batch (48):

    sync fp32           gradients all-reduced every step
    sync + PowerSGD-4   the same, rank-4 compressed
    local SGD (H=10)    parameters averaged every 10 steps
    DiLoCo (H=50)       an outer Nesterov step on the averaged pseudo-gradient every 50
    async (bound 4)     a parameter server on rank 0, 3 workers
    streaming (H=50)    streaming DiLoCo: 3 fragments on staggered rounds of 50, each
                        exchange overlapped with the next 15 steps (in int4, 12); with
                        host replicas, each host's 2 ranks one replica (replica_size)
    no-comm ceiling     the same steps with no collective: the fastest any mode could be

For each: wall-clock seconds until the training loss (averaged over 5 steps and all ranks)
first reaches the target, seconds per step, bytes each rank sends per step, and the peak
link use: the largest exchange (the most bytes host 0 sent in one burst) and the most it
sent within any one second (its link's counter read every 50 ms, from the first logged step
to the last: not fit()'s start, which sends the model, nor the final sync).
Prints a table and the issue's ratios, and writes low_comm.png (loss against time, and the
link's use over time) and results.json. Needs root.

The default model is an MLP (784-1024-1024-10, 1.9M parameters): 7.5 MB of gradient for
little compute, the regime these modes are for, where the link sets the pace. `--model
cnn` runs the demo's CNN (0.2M parameters), where compute on this machine's two shared
cores is a large part of a synchronous step and so caps what any mode can gain. `--model
gpt` trains the char-GPT (1.8M parameters, 400 steps of 48 sequences of the KJV text) to a
training loss of 1.9.

    python benchmarks/low_comm.py [--model mlp|cnn|gpt] [--bandwidth 100mbit] [--target 0.35]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.demo.data import kjv_chars, mnist
from lockstep.demo.models import CharGPT, small_cnn
from lockstep.tools.bench import run_on_cluster
from lockstep.tools.cluster import cluster_available
from lockstep.training import configfile
from lockstep.training.runlog import read_metrics

GLOBAL_BATCH = 48  # splits over the 4 synchronous ranks and the 3 asynchronous workers

MODES: dict[str, dict[str, Any]] = {
    "sync fp32": {},
    "sync + PowerSGD-4": {"parallel": {"compress": "powersgd"}},
    "local SGD (H=10)": {"parallel": {"mode": "local_sgd", "sync_every": 10}},
    "DiLoCo (H=50)": {"parallel": {"mode": "diloco", "sync_every": 50}},
    "async (bound 4)": {"parallel": {"mode": "async", "max_staleness": 4}},
    "streaming (H=50)": {"parallel": {"mode": "streaming_diloco", "sync_every": 50,
                                      "fragments": 3, "overlap": 15}},
    "streaming int4 (H=50)": {"parallel": {"mode": "streaming_diloco", "sync_every": 50,
                                           "fragments": 3, "overlap": 12, "wire": "int4"}},
    # each host one replica (replica_size="host"): gradients averaged on the host every
    # step, each fragment crossing the link once per host, each rank sending half of it
    "streaming int4 (H=50, host replicas)": {"parallel": {
        "mode": "streaming_diloco", "sync_every": 50, "fragments": 3, "overlap": 12,
        "wire": "int4", "replica_size": "host"}},
    # the same steps with no collective at all (each rank trains on its own share; one
    # average after the last step): the fastest any mode could be
    "no-comm ceiling": {"parallel": {"mode": "local_sgd", "sync_every": 10 ** 9}},
}


def build(model: str) -> tuple[nn.Module, Any, Any, dict[str, Any]]:
    """The model, its (train, test) data and its recipe."""
    if model == "gpt":  # the char-GPT on the KJV text, 400 steps
        train, test = kjv_chars(block_size=64)
        return CharGPT(vocab=len(train.vocab)), train, test, dict(
            max_steps=400, lr=3e-3, warmup_steps=50, grad_clip_norm=1.0, eval_batch_size=512)
    train, test = mnist()
    if model == "cnn":
        return small_cnn(), train, test, dict(epochs=2, lr=1e-3)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                         nn.ReLU(), nn.Linear(1024, 10)), train, test, dict(epochs=2, lr=1e-3)


def worker(mode: str, model_name: str, out: Path) -> None:
    world = lockstep.init()
    settings = {k: dict(v) for k, v in MODES[mode].items()}
    if settings.get("parallel", {}).get("compress") == "powersgd":
        settings["parallel"]["compress"] = lockstep.PowerSGD(rank=4, warmup_steps=10)
    torch.manual_seed(0)
    model, train, test, recipe = build(model_name)
    config = configfile.apply(lockstep.TrainConfig(
        global_batch_size=GLOBAL_BATCH, **recipe,
        run_dir=str(out.parent / out.stem), progress=False, log_every_steps=5,
        checkpoint=lockstep.CheckpointConfig(resume="never")), settings, mode)
    entry = lockstep.AsyncTrainer if isinstance(config.parallel, lockstep.AsyncConfig) \
        else lockstep.Trainer
    trainer = entry(model, lambda p: torch.optim.Adam(p), train, test, config=config)
    started = time.time()
    summary = trainer.fit()
    if world.is_main:
        out.write_text(json.dumps({"started": started, "summary": summary}))


def time_to_target(run_dir: Path, started: float, target: float) -> tuple[float, list, list]:
    records = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    times = [r["time"] - started for r in records]
    losses = [r["loss"] for r in records]
    reached = next((t for t, loss in zip(times, losses, strict=True) if loss <= target),
                   float("inf"))
    return reached, times, losses


def peak_rate(link: list[tuple[float, int]], window_s: float = 1.0) -> float:
    """The most megabytes host 0 sent within any `window_s`: how much link a mode needs at
    its busiest. (The rate itself says little: any exchange, large or small, runs at the
    link's full rate while it lasts; what differs is how long.)"""
    best = 0
    for i, (t, sent) in enumerate(link):
        later = [b for u, b in link[i + 1:] if u - t <= window_s]
        if later:
            best = max(best, later[-1] - sent)
    return best / 1e6


def bytes_per_step(run_dir: Path) -> float:
    sent = [r.get("bytes_sent") for r in read_metrics(run_dir) if r["kind"] == "train"]
    sent = [s for s in sent if s]
    return sum(sent) / len(sent) if sent else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--target", type=float, default=None,
                   help="training loss to reach (default: 0.35 on MNIST, 1.9 for the char-GPT)")
    p.add_argument("--model", choices=["mlp", "cnn", "gpt"], default="mlp")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--out", default="runs/bench/low_comm")
    p.add_argument("--reuse", action="store_true", help="report the results saved in --out "
                   "again (the same --bandwidth, --model and --target) instead of running")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.target is None:
        args.target = 1.9 if args.model == "gpt" else 0.35
    if args.worker:
        worker(args.worker[0], args.model, Path(args.worker[1]))
        return 0
    out = Path(args.out).resolve()
    if args.reuse:  # the table and plot again, from a run's saved results
        report(json.loads((out / "results.json").read_text()), args.target, args.bandwidth,
               args.model, out)
        return 0
    reason = cluster_available()
    if reason is not None:
        print(f"benchmarks/low_comm.py needs an emulated cluster: {reason}")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for mode in args.modes:
        result = out / f"{mode.split()[0].replace('+', '')}-{len(rows)}.json"
        print(f"{mode} ...", flush=True)
        shutil.rmtree(result.parent / result.stem, ignore_errors=True)  # a fresh run each time
        link: list[tuple[float, int]] = []  # host 0's link counter over time
        saved = run_on_cluster(args.bandwidth, 2, os.path.abspath(__file__), [
            "--worker", mode, str(result), "--model", args.model],
            29430, result, link=link)
        if saved is None:
            continue
        run_dir = result.parent / result.stem
        reached, times, losses = time_to_target(run_dir, saved["started"], args.target)
        rows[mode] = {"seconds": reached, "bytes": bytes_per_step(run_dir),
                      "accuracy": saved["summary"]["test_accuracy"], "times": times,
                      "losses": losses, "per_step": times[-1] / saved["summary"]["steps"],
                      "link": [(t - saved["started"], sent) for t, sent in link]}
    (out / "results.json").write_text(json.dumps(rows))  # the link samples too
    report(rows, args.target, args.bandwidth, args.model, out)
    return 0


def largest_burst(link: list[tuple[float, int]], busy: float = 1e6) -> float:
    """The most megabytes host 0 sent in one burst (consecutive samples above `busy` bytes
    per second): one exchange's size on the wire, which a mode must get across in the time
    it has -- the peak bandwidth it asks of the link."""
    best = run = 0
    for (t1, b1), (t2, b2) in itertools.pairwise(link):
        run = run + b2 - b1 if (b2 - b1) / (t2 - t1) > busy else 0
        best = max(best, run)
    return best / 1e6


def training_link(row: dict[str, Any]) -> list[tuple[float, int]]:
    """The link samples from the first logged step to the last: not fit()'s start, which
    sends the model (a burst every mode has, the no-comm ceiling too), nor the end's sync
    (streaming DiLoCo's finish syncs every fragment at once, for one final model)."""
    first, last = row["times"][0], row["times"][-1]
    return [(t, sent) for t, sent in row["link"] if first <= t <= last]


def report(rows: dict[str, dict[str, Any]], target: float, bandwidth: str, model: str,
           out: Path) -> None:
    print(f"\n{model}, 2 hosts x 2 processes at {bandwidth}; time to training loss {target}")
    width = max([22, *map(len, rows)])
    print(f"{'mode':{width}s} {'to target':>10s} {'s/step':>7s} {'KB sent/step':>13s} "
          f"{'peak MB/1s':>11s} {'burst MB':>9s} {'test acc':>9s}")
    for r in rows.values():
        r["peak"], r["burst"] = peak_rate(training_link(r)), largest_burst(training_link(r))
    for mode, r in rows.items():
        print(f"{mode:{width}s} {r['seconds']:9.1f}s {r['per_step']:7.3f} {r['bytes'] / 1e3:13.1f} "
              f"{r['peak']:11.2f} {r['burst']:9.2f} {r['accuracy']:9.4f}")
    ceiling = rows.get("no-comm ceiling")
    for mode in ("streaming (H=50)", "streaming int4 (H=50)",
                 "streaming int4 (H=50, host replicas)"):
        if ceiling and mode in rows:
            r = rows[mode]
            print(f"{mode} vs the no-comm ceiling: {r['per_step'] / ceiling['per_step']:.2f}x "
                  f"its time per step, {r['seconds'] / ceiling['seconds']:.2f}x its time to "
                  "the target (goal <= 1.2x)")
        if "DiLoCo (H=50)" in rows and mode in rows:
            diloco = rows["DiLoCo (H=50)"]
            print(f"{mode} peak link use: its largest exchange "
                  f"{rows[mode]['burst'] / diloco['burst']:.2f}x DiLoCo's (goal <= 0.2x); the "
                  f"most it sent in a second {rows[mode]['peak'] / diloco['peak']:.2f}x")
    if "sync fp32" in rows and "DiLoCo (H=50)" in rows:
        base, diloco = rows["sync fp32"], rows["DiLoCo (H=50)"]
        print(f"DiLoCo vs sync fp32: {base['seconds'] / diloco['seconds']:.1f}x faster to the "
              f"target (target >= 5x), {base['bytes'] / max(diloco['bytes'], 1):.0f}x fewer "
              "bytes per step (target >= 50x)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, wire) = plt.subplots(2, 1, figsize=(8, 8))
    for mode, r in rows.items():
        ax.plot(r["times"], r["losses"], label=mode, lw=1)
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="seconds", ylabel="training loss", yscale="log",
           title=f"{model}, 2 hosts x 2 processes, {bandwidth} link")
    ax.legend()
    ax.grid(alpha=0.3)
    for mode, r in rows.items():  # the link's use over time: a burst per round, or a trickle
        if "DiLoCo" in mode or "streaming" in mode:
            link = r["link"]
            rates = [(b2 - b1) * 8 / 1e6 / (t2 - t1)
                     for (t1, b1), (t2, b2) in itertools.pairwise(link)]
            wire.plot([t for t, _ in link[1:]], rates, label=mode, lw=0.8)
    wire.set(xlabel="seconds", ylabel="Mbit/s host 0 sent", title="bytes on the wire")
    wire.legend()
    wire.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "low_comm.png", dpi=100)
    print(f"plot: {out / 'low_comm.png'}")


if __name__ == "__main__":
    sys.exit(main())
