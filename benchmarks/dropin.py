"""Three DDP training scripts, run as written and with lockstep swapped in, side by side.

Each script in examples/ddp_dropin/ is a real DDP script (nanoGPT's train.py, the PyTorch
DDP tutorial, a Hugging Face Trainer-style fine-tune) whose only wrapper-dependent line is
its import, picked by DROPIN=lockstep. For every script this runs it under
`torchrun --standalone --nproc-per-node 2` with DDP and with lockstep, alternating which
goes first each round, and prints:

- the largest |per-step loss difference| between lockstep and DDP over all steps and rounds
  (and between DDP's own rounds, which shows the runs are deterministic);
- the speed ratio lockstep/DDP: DDP's training-loop time over lockstep's (first step left
  out: startup, bucket rebuilds), the median over rounds, against the 0.95 target; and
  the same ratio of the median step, which a burst of load from elsewhere moves less.

    python benchmarks/dropin.py                     # 4 rounds of all three (minutes)
    python benchmarks/dropin.py --rounds 8 --scripts gpt

Times on a shared machine move a lot between minutes; only ratios within a round mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
TARGET = 0.95


@dataclass(frozen=True)
class Script:
    title: str
    file: str
    bench_args: tuple[str, ...]
    """Arguments for the benchmark's runs; {work} is the run's own scratch folder."""
    quick_args: tuple[str, ...]
    """A few steps only: what the tests run."""


SCRIPTS = {
    "gpt": Script("nanoGPT train.py (KJV chars, 2 layers, grad accumulation 2 per rank)",
                  "train_gpt.py",
                  ("--out_dir={work}/out", "--max_iters=60", "--lr_decay_iters=60",
                   "--eval_interval=1000"),
                  ("--out_dir={work}/out", "--max_iters=12", "--eval_iters=1",
                   "--eval_interval=12", "--always_save_checkpoint=True")),
    "cnn": Script("PyTorch DDP tutorial (CNN on MNIST, DistributedSampler)",
                  "train_cnn.py",
                  ("3", "1", "--snapshot_path", "{work}/snapshot.pt"),
                  ("2", "1", "--limit", "256", "--snapshot_path", "{work}/snapshot.pt")),
    "hf": Script("Hugging Face Trainer-style (ModelOutput, no_sync, find_unused_parameters)",
                 "train_classifier.py",
                 ("--output_dir", "{work}/out", "--max_steps", "60"),
                 ("--output_dir", "{work}/out", "--max_steps", "3",
                  "--max_train_samples", "256")),
}


class ScriptFailed(RuntimeError):
    """A script's torchrun exited non-zero; the message is the workers' own error line."""


def worker_error(stderr: str) -> str:
    """The exception line of the first worker traceback (torchrun prefixes `[rankN]: `)."""
    lines = [line.split("]: ", 1)[1] for line in stderr.splitlines()
             if re.match(r"\[rank\d+\]: \S", line)]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]
    return errors[0] if errors else "\n".join(stderr.strip().splitlines()[-5:])


def run_script(name: str, wrapper: str, quick: bool, work: Path,
               timeout: float = 600) -> dict[str, list[float]]:
    """Run one script under torchrun with `wrapper` ("ddp" or "lockstep"); rank 0's record:
    {"losses": [...], "step_seconds": [...]}."""
    script = SCRIPTS[name]
    work.mkdir(parents=True, exist_ok=True)
    args = [a.format(work=work) for a in (script.quick_args if quick else script.bench_args)]
    out = work / "record.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DROPIN=wrapper, DROPIN_OUT=str(out))
    result = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2",  # (its logs: not in /tmp)
         f"--log-dir={work / 'torchrun-logs'}",
         str(ROOT / "examples" / "ddp_dropin" / script.file), *args],
        cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    # torch's DDP itself, at exit, now and then dies with SIGABRT in its Gloo teardown
    # ("terminate called without an active exception") after the script has finished:
    # rank 0's record, written after the last step, says it did. Not lockstep's run: for
    # lockstep an abort is a failure (tests/test_exit.py).
    torch_abort_at_exit = wrapper == "ddp" and "(SIGABRT)" in result.stderr and out.is_file()
    if result.returncode != 0 and not torch_abort_at_exit:
        raise ScriptFailed(f"{script.file} with {wrapper}: {worker_error(result.stderr)}")
    record: dict[str, list[float]] = json.loads(out.read_text())
    return record


def max_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"the runs took different numbers of steps: {len(a)} and {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def loop_seconds(record: dict[str, list[float]]) -> float:
    return sum(record["step_seconds"][1:])


def bench(name: str, rounds: int, scratch: Path) -> None:
    """`rounds` runs with each wrapper, alternating which goes first; a wrapper that fails
    once is not run again (DDP's rounds still run, to show its losses and times)."""
    runs: dict[str, list[dict[str, list[float]]]] = {"ddp": [], "lockstep": []}
    failed: set[str] = set()
    for r in range(rounds):
        for wrapper in ("ddp", "lockstep") if r % 2 == 0 else ("lockstep", "ddp"):
            if wrapper in failed:
                continue
            try:
                runs[wrapper].append(run_script(name, wrapper, False,
                                                scratch / f"{name}-{wrapper}-{r}"))
            except ScriptFailed as e:
                print(f"  round {r}: FAILED {e}", flush=True)
                failed.add(wrapper)
    report(runs)


def report(runs: dict[str, list[dict[str, list[float]]]]) -> None:
    ddp, ours = runs["ddp"], runs["lockstep"]
    if ddp:
        steps, ddp_self = len(ddp[0]["losses"]), max(
            max_difference(ddp[0]["losses"], d["losses"]) for d in ddp)
        loop = statistics.median(loop_seconds(d) for d in ddp)
        print(f"  DDP: {len(ddp)} run(s) of {steps} steps, loop {loop:.2f} s (median); "
              f"max |loss difference| between DDP's own runs: {ddp_self:.1e}")
    if not (ddp and ours):
        print("  no comparison: a side did not finish", flush=True)
        return
    diff = max(max_difference(d["losses"], o["losses"]) for d in ddp for o in ours)
    ratios = [loop_seconds(d) / loop_seconds(o) for d, o in zip(ddp, ours, strict=False)]
    ratio = statistics.median(ratios)
    # The typical step, which a burst of load from elsewhere on the machine moves less.
    typical = statistics.median(statistics.median(d["step_seconds"][1:])
                                / statistics.median(o["step_seconds"][1:])
                                for d, o in zip(ddp, ours, strict=False))
    print(f"  max |loss difference| lockstep vs DDP: {diff:.1e}\n"
          f"  speed ratio lockstep/DDP: {ratio:.3f} (median of {len(ratios)} rounds: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; target >= {TARGET}) "
          f"{'ok' if ratio >= TARGET else 'BELOW TARGET'}\n"
          f"  median-step ratio lockstep/DDP: {typical:.3f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    args = p.parse_args()
    print(f"DDP scripts with lockstep swapped in: torchrun, 2 ranks (Gloo, CPU), "
          f"{args.rounds} rounds alternating which wrapper goes first", flush=True)
    with tempfile.TemporaryDirectory(prefix="dropin-") as scratch:
        for name in args.scripts:
            print(f"{name}: {SCRIPTS[name].title}", flush=True)
            bench(name, args.rounds, Path(scratch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
