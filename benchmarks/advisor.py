"""The scaling advisor's predictions against every mode measured, in the same job.

    python benchmarks/advisor.py                  # as root: the emulated cluster
    python benchmarks/advisor.py --local          # 2 processes on this host, no root

On each layout -- 2 and 4 emulated hosts of 1 process, joined at 1 Gbit/s and 100 Mbit/s
-- one job first asks `lockstep.advise` (a few seconds of measurement) and then trains every
mode the advisor weighs for a few steps each (the same world: rounds alternate the order,
the slowest rank's time counts), for the MNIST CNN and the char-GPT; each round asks the
advisor again first. It prints predicted against measured step time per mode (medians of
the rounds), the worst error, and whether the recommended mode was the fastest measured
(or within 10% of it). The emulated hosts share this machine's cores, one thread each.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lockstep
from lockstep import comm
from lockstep.advisor.predict import PERIODIC
from lockstep.demo.data import kjv_chars, mnist
from lockstep.demo.models import CharGPT, small_cnn
from lockstep.tools.bench import run_on_cluster
from lockstep.tools.cluster import cluster_available

WARMUP = 3
TIMED_STEPS = {"cnn": 30, "gpt": 8}  # a second or more of each mode, per round


def flat_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def workload(name: str, rank: int) -> tuple[torch.nn.Module, list[tuple[Any, Any]]]:
    """The model and this rank's batches (drawn once: data loading is not what is timed)."""
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)
    if name == "cnn":
        train, _ = mnist()
        model, per_rank = small_cnn(), 32
    else:
        train, _ = kjv_chars(block_size=64)
        model, per_rank = CharGPT(vocab=len(train.vocab)), 8  # type: ignore[attr-defined]
    batches = []
    for _ in range(8):
        picks = torch.randint(0, len(train), (per_rank,), generator=generator).tolist()  # type: ignore[arg-type]
        xs, ys = zip(*(train[i] for i in picks), strict=True)
        batches.append((torch.stack(xs), torch.stack(ys)))
    return model, batches


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def stepper(mode: Any, base: torch.nn.Module, batches: list[Any]) -> Callable[[], None]:
    replica = mode.config.build(copy.deepcopy(base))
    opt = replica.make_optimizer(optimizer)
    turn = itertools.cycle(batches)

    def step() -> None:
        x, y = next(turn)
        flat_loss(replica(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        replica.after_step()
    return step


def steps_for(mode: Any, model: str) -> int:
    """A window of whole rounds of a periodic mode (any H steps in a row hold one sync)."""
    if mode.fidelity != PERIODIC:
        return TIMED_STEPS[model]
    every = mode.config.sync_every
    return every * -(-TIMED_STEPS[model] // every)


def one_round(steppers: dict[str, tuple[Callable[[], None], int]], backwards: bool
              ) -> dict[str, float]:
    """Seconds per step of every mode, one after the other (the slowest rank's)."""
    times = {}
    for name in reversed(steppers) if backwards else steppers:
        step, count = steppers[name]
        comm.barrier("bench: start together")
        started = time.perf_counter()
        for _ in range(count):
            step()
        elapsed = torch.tensor([(time.perf_counter() - started) / count])
        comm.all_reduce(elapsed, "bench: the slowest rank", op=dist.ReduceOp.MAX)
        times[name] = elapsed.item()
    return times


def one_model(name: str, rounds: int) -> dict[str, Any]:
    """Each round asks the advisor again and then measures every mode: on these shared
    cores a measurement can move by a quarter between minutes, and a prediction is fairly
    judged against what was measured beside it. Medians over the rounds."""
    world = lockstep.init()
    base, batches = workload(name, world.rank)
    advise = functools.partial(lockstep.advise, base, iter(itertools.cycle(batches)),
                               optimizer, flat_loss)
    started = time.perf_counter()
    advice = advise()
    advise_s = [time.perf_counter() - started]
    steppers = {}
    for p in advice.predictions:
        step = stepper(p.mode, base, batches)
        for _ in range(WARMUP + (12 if "powersgd" in p.mode.name else 0)):  # its warm-up
            step()
        steppers[p.mode.name] = (step, steps_for(p.mode, name))
    predicted: dict[str, list[float]] = {n: [] for n in steppers}
    measured: dict[str, list[float]] = {n: [] for n in steppers}
    chosen = []
    for r in range(rounds):
        if r:
            started = time.perf_counter()
            advice = advise()
            advise_s.append(time.perf_counter() - started)
        chosen.append(advice.recommended.mode.name)
        for p in advice.predictions:
            predicted[p.mode.name].append(p.step_s * 1e3)
        for mode, seconds in one_round(steppers, backwards=r % 2 == 1).items():
            measured[mode].append(seconds * 1e3)
    if world.is_main:
        print(advice.table(), flush=True)
    return {"advice": advice.as_record(), "advise_s": max(advise_s),
            "predicted_ms": {k: statistics.median(v) for k, v in predicted.items()},
            "measured_ms": {k: statistics.median(v) for k, v in measured.items()},
            "measured_each_ms": measured, "predicted_each_ms": predicted,
            "recommended": max(chosen, key=chosen.count), "recommended_each": chosen}


def worker(models: list[str], rounds: int, result: Path) -> None:
    # The emulated hosts share this machine's cores: one thread each keeps them from
    # fighting over cores that a real host would have to itself.
    torch.set_num_threads(1)
    found = {name: one_model(name, rounds) for name in models}
    if lockstep.init().is_main:
        result.write_text(json.dumps(found))


def report(layout: str, found: dict[str, Any]) -> None:
    for name, run in found.items():
        advice, predicted, measured = run["advice"], run["predicted_ms"], run["measured_ms"]
        print(f"\n{layout}, {name} ({advice['samples_per_step']} samples/step): advice took "
              f"{run['advise_s']:.1f} s")
        print(f"{'mode':<18} {'predicted ms':>12} {'measured ms':>12} {'error':>7}")
        errors = {}
        for mode, got in measured.items():
            errors[mode] = predicted[mode] / got - 1
            print(f"{mode:<18} {predicted[mode]:>12.1f} {got:>12.1f} {errors[mode]:>+7.0%}")
        worst = max(errors, key=lambda k: abs(errors[k]))
        fastest = min(measured, key=measured.get)
        chosen = run["recommended"]
        print(f"worst error {errors[worst]:+.0%} ({worst}); median |error| "
              f"{statistics.median(abs(e) for e in errors.values()):.0%}; within 25%: "
              f"{sum(abs(e) <= 0.25 for e in errors.values())}/{len(errors)}")
        print(f"recommended {chosen} (rounds: {', '.join(run['recommended_each'])}), measured "
              f"{measured[chosen]:.1f} ms; fastest measured {fastest} "
              f"{measured[fastest]:.1f} ms: recommended is "
              f"{measured[chosen] / measured[fastest]:.2f}x the fastest's time")


def layouts(args: argparse.Namespace) -> Iterator[tuple[str, str | None, int]]:
    if args.local:
        yield "this host, 2 processes", None, 2
        return
    for bandwidth in args.bandwidths:
        for hosts in args.hosts:
            yield f"{hosts} hosts x 1 process at {bandwidth}", bandwidth, hosts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local", action="store_true", help="2 processes on this host")
    p.add_argument("--bandwidths", nargs="+", default=["1gbit", "100mbit"])
    p.add_argument("--hosts", nargs="+", type=int, default=[2, 4])
    p.add_argument("--models", nargs="+", default=["cnn", "gpt"], choices=["cnn", "gpt"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="runs/bench/advisor")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.models, args.rounds, Path(args.result))
        return 0
    if not args.local and (reason := cluster_available()) is not None:
        print(f"benchmarks/advisor.py needs an emulated cluster ({reason}); --local runs on "
              "this host")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for index, (layout, bandwidth, hosts) in enumerate(layouts(args)):
        result = (out / f"{bandwidth or 'local'}-{hosts}.json").resolve()
        job = ["--worker", "--rounds", str(args.rounds), "--result", str(result),
               "--models", *args.models]
        print(f"measuring {layout} ...", flush=True)
        if bandwidth is None:
            import subprocess
            subprocess.run([sys.executable, "-m", "lockstep.launch.cli", "run", "-n", "2",
                            os.path.abspath(__file__), *job], check=True)
            found = json.loads(result.read_text())
        else:
            found = run_on_cluster(bandwidth, 1, os.path.abspath(__file__), job,
                                   29430 + index, result, hosts=hosts)
        if found is not None:
            report(layout, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
