"""lockstep's fault tolerance beside torchft's, on the same job and machine.

Three workers train the MNIST CNN (lockstep.demo; 32 samples per worker per step, Adam) in
three ways, one launch each:

    DDP        torch's DistributedDataParallel under `lockstep run -n 3`: nothing survives
               a failure; the per-step yardstick
    torchft    torchft (nightly) with its lighthouse: each worker a replica group of one
               under its own torchrun, torchft.DistributedDataParallel and torchft.Optimizer
               over ProcessGroupGloo, the Manager's quorum every step (as its README runs
               its train_ddp.py)
    lockstep   lockstep.Elastic under `lockstep run --elastic -n 3`

In the torchft and lockstep runs, worker 1 is killed with SIGKILL once the job has trained
KILL_AT steps, and its command is started again once the others train on. Every worker
notes when it is ready (data and model built and each system's modules loaded, before it
joins) and when each of its steps completes; from those:

    per-step cost      median time between consecutive steps before the kill, against DDP's
    training again     from the kill to the first step a survivor begins after it and
                       completes (a step in flight may complete after the kill: its
                       all-reduce was done before)
    joiner training    from the restarted worker being ready to its first completed step
    joiner counting    ... to the first step its own gradient is part of: torchft's joiner
                       heals in its first step -- it computes, sends zeros in the average
                       (Manager.is_participating() is False while healing) and takes the
                       others' state -- so its work counts from its second; lockstep's
                       joiner trains its share of the global batch in its first
    command -> training  from the restarted worker's command being started to its first
                       completed step: what a user waits, its interpreter and imports
                       included (each system's launch as its README gives it: `lockstep
                       run --elastic -n 1 ...`; `torchrun --nnodes=1 --nproc_per_node=1`)

The launches run in a palindrome (DDP, torchft, lockstep, lockstep, torchft, DDP with
--rounds 2); each number is the median over rounds. With --spare-core the job runs on
core 0 and the restarted worker's command on core 1 alone, as a replacement machine would
bring its own CPU: otherwise its start (torch's import above all) shares two cores with
the three members, and that share, not either system, sets its command -> training.

    pip install torchft-nightly    # (its 0.2.0 release crashed its survivors on a kill here)
    python benchmarks/vs_torchft.py [--rounds 2] [--spare-core]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lockstep.launch.elastic import free_port  # noqa: E402

WORKERS, PER_WORKER, KILL_AT, VICTIM = 3, 32, 150, 1
ENDLESS = 10**9  # the jobs with a kill train until the measurements are in, then go
SYSTEMS = ("DDP", "torchft", "lockstep")


# ---- the workers ---------------------------------------------------------------------------


def note(out: Path, worker: str, **entry: Any) -> None:
    with (out / f"{worker}.jsonl").open("a") as f:
        f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **entry}) + "\n")


def setup() -> tuple[Any, Any, Any, Any]:
    import torch

    from lockstep.demo.data import mnist
    from lockstep.demo.models import small_cnn
    torch.set_num_threads(1)  # every system's workers alike (lockstep's keeps it: cores.py)
    train_set, _ = mnist()
    torch.manual_seed(0)
    net = small_cnn()
    return torch, train_set.tensors[0], train_set.tensors[1], net


def batch(torch: Any, images: Any, labels: Any, step: int, slot: int) -> tuple[Any, Any]:
    """Worker slot `slot`'s share of global batch `step` (the same samples in every system)."""
    start = (step * WORKERS + slot) * PER_WORKER % (len(images) - PER_WORKER)
    return images[start:start + PER_WORKER], labels[start:start + PER_WORKER]


def ddp_worker(out: Path, steps: int) -> None:
    torch, images, labels, net = setup()
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    note(out, f"ddp-{rank}", kind="ready")
    model = DistributedDataParallel(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for step in range(steps):
        started = time.time()
        x, y = batch(torch, images, labels, step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        note(out, f"ddp-{rank}", kind="step", step=step + 1, started=started, counted=True)
    # DDP's reducer goes before its group: freed after the group was destroyed, it hung
    # (in 2 of 4 launches) at the worker's exit.
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()


def torchft_worker(out: Path, steps: int, replica: int) -> None:
    torch, images, labels, net = setup()
    from datetime import timedelta

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    note(out, f"torchft-{replica}", kind="ready")
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=lambda s: (net.load_state_dict(s["model"]),
                                                 optimizer.load_state_dict(s["optim"])),
                      state_dict=lambda: {"model": net.state_dict(),
                                          "optim": optimizer.state_dict()},
                      replica_id=f"vs_torchft_{replica}", timeout=timedelta(seconds=30),
                      rank=0, world_size=1, store_addr=os.environ["MASTER_ADDR"],
                      store_port=int(os.environ["MASTER_PORT"]))  # torchrun's agent's store
    model = DistributedDataParallel(manager, net)
    managed = Optimizer(manager, optimizer)
    while manager.current_step() < steps:
        step, started = manager.current_step(), time.time()
        x, y = batch(torch, images, labels, step, replica)
        managed.zero_grad()  # starts the step's quorum
        torch.nn.functional.cross_entropy(model(x), y).backward()
        counted = manager.is_participating()  # (False while it heals: it sent zeros)
        managed.step()  # steps only if every replica's all-reduce succeeded
        if manager.current_step() > step:
            note(out, f"torchft-{replica}", kind="step", step=manager.current_step(),
                 started=started, counted=counted)
    manager.shutdown()


def lockstep_worker(out: Path, steps: int) -> None:
    torch, images, labels, net = setup()
    from lockstep.elastic import Elastic, batch_slice  # (loaded before ready, as torchft is)
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    name = f"lockstep-{os.getpid()}"
    note(out, name, kind="ready")
    job = Elastic(net, optimizer, agree={"per_worker": PER_WORKER})

    def train_step(model: Any, step: int) -> float:
        world = job.world  # the whole global batch, split over whoever is here now
        start = step * WORKERS * PER_WORKER % (len(images) - WORKERS * PER_WORKER)
        mine = batch_slice(0, WORKERS * PER_WORKER, world.rank, world.world_size)
        x = images[start:start + WORKERS * PER_WORKER][mine]
        y = labels[start:start + WORKERS * PER_WORKER][mine]
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
        (loss / (WORKERS * PER_WORKER) * world.world_size).backward()
        return loss.item()

    while job.step < steps:
        started = time.time()
        if job.run_step(train_step) is not None:  # (None: brought level, trained nothing)
            note(out, name, kind="step", step=job.step, started=started, counted=True)
    job.finish()


# ---- launching and measuring ----------------------------------------------------------------


def records(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every worker's notes so far: whole lines only (a worker may be writing the last)."""
    return {f.stem: [json.loads(line) for line in f.read_text().split("\n")[:-1] if line]
            for f in out.glob("*.jsonl")}


def wait_for(predicate: Any, what: str, timeout: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"vs_torchft: {what} did not happen within {timeout:.0f}s")


def steps_done(out: Path) -> int:
    return max((r["step"] for rs in records(out).values() for r in rs if r["kind"] == "step"),
               default=0)


def worker_command(*args: str) -> list[str]:
    """This script as one of the workers, for a launcher or the interpreter to start."""
    return [os.path.abspath(__file__), "--worker", *args]


def run_ddp(out: Path, steps: int, members: list[str]) -> None:
    launch = [*members, sys.executable, "-m", "lockstep.launch.cli", "run", "-n", str(WORKERS)]
    done = subprocess.run([*launch, *worker_command("DDP", str(out), str(steps))], timeout=600,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vs_torchft: the DDP run failed:\n{done.stderr[-3000:]}")


def run_with_a_kill(system: str, out: Path, members: list[str], joiner: list[str]
                    ) -> dict[str, float]:
    """Start the job, kill worker VICTIM at KILL_AT steps, start it again; measure.
    `members`, `joiner`: what the job's and the restarted worker's commands run under."""
    procs: list[subprocess.Popen[bytes]] = []
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
             "start_new_session": True}
    try:
        if system == "torchft":
            lighthouse = free_port()
            procs.append(subprocess.Popen(
                [*members, str(Path(sys.executable).parent / "torchft_lighthouse"),
                 "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms",
                 "10000", "--bind", f"[::]:{lighthouse}"], **quiet))  # type: ignore[call-overload]

            def start(replica: int, pin: list[str]) -> subprocess.Popen[bytes]:  # (its README)
                env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{lighthouse}"}
                return subprocess.Popen(  # type: ignore[call-overload]
                    [*pin, sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                     "--nproc_per_node=1", f"--master_port={free_port()}", "--",
                     *worker_command("torchft", str(out), str(ENDLESS), str(replica))],
                    env=env, **quiet)
            procs += [start(r, members) for r in range(WORKERS)]
            restart = lambda: start(VICTIM, joiner)  # noqa: E731
        else:
            endpoint = f"127.0.0.1:{free_port()}"
            launch = [sys.executable, "-m", "lockstep.launch.cli", "run", "--elastic",
                      "--rdzv-endpoint", endpoint, "-n"]
            job = worker_command("lockstep", str(out), str(ENDLESS))
            procs.append(subprocess.Popen(  # type: ignore[call-overload]
                [*members, *launch, str(WORKERS), *job], **quiet))
            restart = lambda: subprocess.Popen(  # type: ignore[call-overload]  # noqa: E731
                [*joiner, *launch, "1", *job], **quiet)
        wait_for(lambda: steps_done(out) >= KILL_AT, f"{system}: {KILL_AT} steps")
        victim = _victim(system, out)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        trained = wait_for(lambda: _first_step_after(out, killed, exclude=victim),
                           f"{system}: a step after the kill")
        restarted = time.time()
        procs.append(restart())
        joiner = wait_for(lambda: _new_worker_stepping(out, killed),
                          f"{system}: the restarted worker's first step")
        first_step = _new_worker_stepping(out, killed, since_ready=False)
        counting = wait_for(lambda: _new_worker_stepping(out, killed, counted=True),
                            f"{system}: the restarted worker's first step that counted")
        return {"step": _step_time(out, killed), "again": trained - killed, "join": joiner,
                "counts": counting, "command": first_step - restarted}
    finally:  # every process of the run, each started in a session of its own
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _victim(system: str, out: Path) -> int:
    """The pid of the worker to kill: torchft's replica VICTIM, or lockstep's second worker."""
    name = f"torchft-{VICTIM}" if system == "torchft" else sorted(records(out))[VICTIM]
    return int(records(out)[name][0]["pid"])


def _first_step_after(out: Path, moment: float, exclude: int) -> float | None:
    """When the first step begun after `moment` completed (a step in flight at a kill may
    complete just after it, its all-reduce done before: not training again yet)."""
    times = [r["time"] for rs in records(out).values() for r in rs
             if r["kind"] == "step" and r["started"] > moment and r["pid"] != exclude]
    return min(times) if times else None


def _new_worker_stepping(out: Path, after: float, counted: bool = False,
                         since_ready: bool = True) -> float | None:
    """Seconds from the restarted worker's ready note to its first completed step (with
    `counted`, its first whose gradient was part of the average; without `since_ready`,
    the moment of that step itself)."""
    for rs in records(out).values():
        ready = [r for r in rs if r["kind"] == "ready" and r["time"] > after]
        if ready:
            stepped = [r["time"] for r in rs if r["kind"] == "step"
                       and r["pid"] == ready[-1]["pid"] and (r["counted"] or not counted)]
            if not stepped:
                return None
            return min(stepped) - (ready[-1]["time"] if since_ready else 0.0)
    return None


def _step_time(out: Path, before: float) -> float:
    """Median seconds between a worker's consecutive steps, from step 10 to the kill."""
    gaps = []
    for rs in records(out).values():
        times = [r["time"] for r in rs if r["kind"] == "step" and r["step"] >= 10
                 and r["time"] < before]
        gaps += [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=KILL_AT + 20, help="the DDP run's length")
    p.add_argument("--keep", action="store_true", help="keep each run's step records")
    p.add_argument("--spare-core", action="store_true",
                   help="the job on core 0, the restarted worker's command on core 1 alone: "
                        "a replacement machine's own CPU (taskset)")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        system, out, steps, *rest = args.worker
        {"DDP": lambda: ddp_worker(Path(out), int(steps)),
         "torchft": lambda: torchft_worker(Path(out), int(steps), int(rest[0])),
         "lockstep": lambda: lockstep_worker(Path(out), int(steps))}[system]()
        return 0
    if shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) is None:
        p.error("torchft is not installed here: pip install torchft-nightly")
    members, joiner = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if args.spare_core \
        else ([], [])
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        for system in SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS)):
            out = Path(tempfile.mkdtemp(prefix=f"vs_torchft-{system}-"))
            print(f"round {r + 1}: {system} ...", flush=True)
            if system == "DDP":
                run_ddp(out, args.steps, members)
                results[system].append({"step": _step_time(out, float("inf"))})
            else:
                results[system].append(run_with_a_kill(system, out, members, joiner))
            if not args.keep:
                shutil.rmtree(out)
    report(results, args.rounds)
    return 0


def report(results: dict[str, list[dict[str, float]]], rounds: int) -> None:
    def median(system: str, key: str) -> float:
        return statistics.median(r[key] for r in results[system])

    ddp = median("DDP", "step")
    print(f"{WORKERS} workers, MNIST CNN, {PER_WORKER} samples each per step; medians of "
          f"{rounds} round(s)")
    print(f"{'':10s} {'step':>9s} {'vs DDP':>7s} {'kill -9 -> training':>20s} "
          f"{'restarted -> training':>22s} {'-> its gradient counts':>23s} "
          f"{'command -> training':>20s}")
    for system in SYSTEMS:
        step = median(system, "step")
        tail = "" if system == "DDP" else "".join(
            f" {median(system, key):{width}.2f}s"
            for key, width in (("again", 19), ("join", 21), ("counts", 22), ("command", 19)))
        print(f"{system:10s} {step * 1e3:7.2f}ms {step / ddp:6.2f}x{tail}")
    keys = ("again", "join", "counts", "command")
    again, join, counts, command = (median("lockstep", k) for k in keys)
    ft_again, ft_join, ft_counts, ft_command = (median("torchft", k) for k in keys)
    print(f"lockstep vs torchft: per-step cost {median('lockstep', 'step') / ddp:.2f}x DDP "
          f"against {median('torchft', 'step') / ddp:.2f}x (goal <= 1.01x); training again "
          f"{again:.2f}s after a kill against {ft_again:.2f}s (goal <= 1 s); a restarted "
          f"worker training {join:.2f}s after it is ready against {ft_join:.2f}s, its "
          f"gradient counting {counts:.2f}s after against {ft_counts:.2f}s (goal <= 1 s), "
          f"{command:.2f}s after its command against {ft_command:.2f}s")


if __name__ == "__main__":
    sys.exit(main())
