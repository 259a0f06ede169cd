"""What you see when a worker stalls or falls out of step: torch DDP against lockstep.

Three workers train a small model, 0.3 s a step, with a 12 s collective timeout, in two
situations:

  stop: worker 2 is stopped (SIGSTOP) at step 4 -- a hung process, a frozen host;
  skip: worker 2 skips one backward at step 2 -- a desync: from then on its gradients are
        averaged with the others' of the step before, until someone waits forever.

Each runs once as plain DDP under `torchrun` and once as lockstep under `lockstep run`
(the same script with `lockstep.DataParallel`), and what each printed is shown side by
side, every line stamped with the seconds since worker 2 stalled or skipped. A stopped
worker ignores the SIGTERM the launcher sends once the others fail; torchrun kills it 30 s
later, and this example kills it 3 s after the timeout instead, alike for both columns.

    python examples/stall_vs_ddp.py                # both situations, about 2 minutes
    python examples/stall_vs_ddp.py --only skip
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

TIMEOUT_S = 12

SCRIPT = textwrap.dedent("""
    import os, signal, time, datetime, torch, torch.distributed as dist
    SITUATION, LIBRARY = os.environ["SITUATION"], os.environ["LIBRARY"]
    if LIBRARY == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={timeout}))
        rank = dist.get_rank()
        model = DDP(torch.nn.Linear(8, 2))
    else:
        import lockstep
        rank = lockstep.init(timeout={timeout}).rank
        model = lockstep.DataParallel(torch.nn.Linear(8, 2))
    for step in range(8):
        time.sleep(0.3)  # a step takes a while
        if rank == 2 and step == 4 and SITUATION == "stop":
            print(f"STALLED {{os.getpid()}} {{time.time()}}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = model(torch.ones(4, 8)).sum()
        if rank == 2 and step == 2 and SITUATION == "skip":
            print(f"STALLED {{os.getpid()}} {{time.time()}}", flush=True)
            continue  # forgot the backward
        loss.backward()
    print(f"worker {{rank}} finished", flush=True)
""").format(timeout=TIMEOUT_S)


def launch(script: Path, library: str, situation: str) -> list[tuple[float, str]]:
    """Run 3 workers; every output line with the seconds since worker 2 stalled."""
    bin_dir = Path(sys.executable).parent
    # (torchrun's log folder beside the script: by default it leaves a torchelastic_* in /tmp)
    argv = ([str(bin_dir / "torchrun"), "--nproc-per-node=3", "--standalone",
             f"--log-dir={script.parent / 'torchrun-logs'}"]
            if library == "ddp" else [str(bin_dir / "lockstep"), "run", "-n", "3"])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(SITUATION=situation, LIBRARY=library, OMP_NUM_THREADS="1")
    job = subprocess.Popen([*argv, str(script)], env=env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    lines: list[tuple[float, str]] = []
    stalled: list[float] = []
    timer: threading.Timer | None = None
    assert job.stdout is not None
    for line in job.stdout:
        if found := re.match(r"STALLED (\d+) ([\d.]+)", line):
            stalled.append(float(found.group(2)))
            if situation == "stop":  # what torchrun does 30 s after the others fail
                timer = threading.Timer(TIMEOUT_S + 3, os.kill,
                                        (int(found.group(1)), signal.SIGKILL))
                timer.start()
            continue
        lines.append((time.time(), line.rstrip()))
    job.wait()
    if timer is not None:
        timer.cancel()
    zero = stalled[0] if stalled else lines[0][0]
    return [(at - zero, text) for at, text in lines]


_BOILERPLATE = ("Traceback (most recent call last):", "The above exception was the direct",
                "*****", "Setting OMP_NUM_THREADS")


def _keep(text: str) -> bool:
    """Drop traceback frames and boilerplate (alike in both columns): what is left is what
    each one said."""
    text = re.sub(r"^\[rank\d+\]: ?", "", text)  # torchrun's prefix on a worker's output
    return not (text.startswith(("  File ", "    ")) or set(text.strip()) <= {"^", "~"}
                or any(b in text for b in _BOILERPLATE))


def columns(left: list[tuple[float, str]], right: list[tuple[float, str]]) -> str:
    width = max(60, (shutil.get_terminal_size((160, 40)).columns - 3) // 2)

    def cells(lines: list[tuple[float, str]]) -> list[str]:
        out: list[str] = []
        for at, text in lines:
            wrapped = textwrap.wrap(text, width - 8) or [""]
            out += [f"{at:+6.1f}s {wrapped[0]}"] + [f"{'':8s}{w}" for w in wrapped[1:]]
        return out

    a, b = cells([x for x in left if _keep(x[1])]), cells([x for x in right if _keep(x[1])])
    rows = [f"{'torch DDP (torchrun)':{width}s} | lockstep (lockstep run)",
            f"{'-' * width}-+-{'-' * width}"]
    for k in range(max(len(a), len(b))):
        rows.append(f"{a[k] if k < len(a) else '':{width}s} | {b[k] if k < len(b) else ''}")
    return "\n".join(rows)


TITLES = {"stop": "worker 2 is stopped (SIGSTOP) at step 4",
          "skip": "worker 2 skips one backward at step 2 (a desync)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=list(TITLES), help="one situation only")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        for situation in [args.only] if args.only else list(TITLES):
            print(f"\n=== {TITLES[situation]}; collective timeout {TIMEOUT_S}s; seconds since "
                  "then ===", flush=True)
            ddp = launch(script, "ddp", situation)
            ours = launch(script, "lockstep", situation)
            print(columns(ddp, ours), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
