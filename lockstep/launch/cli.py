"""The `lockstep` command: `lockstep run` launches workers, `lockstep demo` shows the library,
`lockstep env` reports versions and backends for a bug report."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lockstep
from lockstep.collector import freeze_at_exit
from lockstep.launch.run import LaunchSpec, refused, run


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _workers(text: str) -> int:
    """-n: a positive number of workers (argparse turns the error into a usage message)."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 worker, got {value}")
    return value


def _nnodes(text: str) -> str:
    """--nnodes: N or MIN:MAX, positive, MIN <= MAX (torchrun's syntax)."""
    match = re.fullmatch(r"(\d+)(?::(\d+))?", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2) or match.group(1)) < int(
            match.group(1)):
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got "
                                         f"{text!r}")
    return text


def _non_negative(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _add_launch(p: argparse.ArgumentParser) -> None:
    """The options `run` and `advise` share: where the workers go."""
    p.add_argument("-n", "--nproc-per-node", type=_workers, default=1, dest="nproc",
                   help="workers on this host (default 1)")
    p.add_argument("--nnodes", type=_nnodes, default="1",
                   help="number of hosts, or MIN:MAX (default 1); more than 1 needs "
                   "--rdzv-endpoint")
    p.add_argument("--node-rank", type=_non_negative, default=None,
                   help="this host's rank, 0 for the host that holds the rendezvous "
                   "(default: torchrun decides)")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="HOST:PORT of the rendezvous (one host of the job) for several hosts; "
                   "with --elastic also etcd://HOST:PORT,HOST:PORT,...: the job's store in etcd, "
                   "which survives the loss of any one host")
    p.add_argument("--rdzv-id", default=None,
                   help="job id shared by all hosts (default 'lockstep')")
    p.add_argument("--local-addr", default=None,
                   help="this host's address as the other hosts reach it")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--module", action="store_true", help="target is a module")
    p.add_argument("target", help="script path (or module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]
             ) -> argparse.ArgumentParser:
    p = commands.add_parser("run", help="launch N workers of a script (torchrun-compatible)",
                            description="Launch workers with the torchrun environment. On one "
                            "host: `lockstep run -n 4 train.py --lr 0.1`. Across hosts, run "
                            "the same command on each with --nnodes and --rdzv-endpoint.")
    _add_launch(p)
    p.add_argument("--max-restarts", type=_non_negative, default=0,
                   help="restart all workers up to this many times after a failure "
                   "(default 0); a Trainer script resumes from its last checkpoint")
    p.add_argument("--elastic", action="store_true",
                   help="fault tolerant (lockstep.Elastic): a worker that dies does not stop "
                   "the others, and the same command started later adds workers to the job")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="record where each step's time goes on every worker (a Trainer "
                   "script) and write one trace of all of them to PATH, for "
                   "ui.perfetto.dev or chrome://tracing")
    _add_target(p)
    return p


def _add_advise(commands: argparse._SubParsersAction[argparse.ArgumentParser]
                ) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "advise", help="predict each training mode's step time for a Trainer script, "
        "launched as `run` would, and recommend one",
        description="Launch the workers as `lockstep run` would; a Trainer script's fit() "
        "then measures the model and the links for a few seconds, predicts every mode (sync "
        "with each algorithm and compression, ZeRO 1-3, local SGD, DiLoCo) and prints the "
        "table and a recommendation instead of training.")
    _add_launch(p)
    p.add_argument("--json", default="", metavar="PATH",
                   help="also write the advice to PATH as JSON")
    _add_target(p)
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `lockstep` program itself, not a call from Python: ours to end
        freeze_at_exit()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own options (see `lockstep demo -h`)
        from lockstep.demo import demo

        return demo.main(argv[1:])
    if argv[:1] == ["cluster"]:
        from lockstep.tools import cluster

        return cluster.main(argv[1:])
    parser = argparse.ArgumentParser(prog="lockstep", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lockstep {lockstep.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = _add_run(commands)
    advise_parser = _add_advise(commands)
    commands.add_parser("demo", help="train a small CNN on real MNIST, 1 then 2 workers")
    commands.add_parser("cluster", help="run a command on each host of an emulated cluster "
                        "(network namespaces with rate-limited links; needs root)")
    commands.add_parser("env", help="versions, backends, CUDA/NCCL, cores and the torchrun "
                        "environment: what to paste into a bug report")
    args = parser.parse_args(argv)
    if args.command == "env":
        from lockstep.launch import envreport

        return envreport.main()
    chosen = run_parser if args.command == "run" else advise_parser
    if args.nnodes not in ("1", "1:1") and args.rdzv_endpoint is None:
        chosen.error(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (one host "
                     "of the job, the same on every host)")
    if args.command == "advise":
        return _advise(args)
    if (args.rdzv_endpoint or "").startswith("etcd://") and not args.elastic:
        run_parser.error("an etcd:// endpoint holds a fault-tolerant job's store: add --elastic")
    spec = _spec(args, args.max_restarts)
    if refused(spec):  # (torch is not loaded yet: told at once)
        return 2
    launch = run
    if args.elastic:
        from lockstep.launch.elastic import run_elastic as launch
    trace = Path(args.timeline).resolve() if args.timeline else None
    asked = contextlib.nullcontext() if trace is None else \
        _environment(_timeline_env(), str(trace))
    with asked:
        code = launch(spec)
    if code == 0 and trace is not None and not trace.exists():
        print(f"lockstep run: no timeline was written to {trace}: the Trainer records one "
              "while it trains (not when its run_dir holds a finished run); a script with "
              "its own loop does not", file=sys.stderr)
    return code


def _timeline_env() -> str:
    """The variable that asks the workers for a timeline (loaded only when one is asked
    for: timeline.py loads torch, which the elastic launcher loads after its workers)."""
    from lockstep.comm import timeline

    return timeline.ENV


def _spec(args: argparse.Namespace, max_restarts: int = 0) -> LaunchSpec:
    return LaunchSpec(nproc=args.nproc, target=args.target, args=args.args,
                      module=args.module, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                      local_addr=args.local_addr, max_restarts=max_restarts)


def _advise(args: argparse.Namespace) -> int:
    """Launch the workers with the advisor asked for; say so if none answered (a script
    that never builds a Trainer). The advice goes to --json, or to a file of our own that
    only tells whether it came."""
    if refused(_spec(args), "lockstep advise"):  # before the advisor loads torch
        return 2
    from lockstep.advisor.advise import ENV

    with tempfile.TemporaryDirectory(prefix="lockstep-advise-") as scratch:
        target = Path(args.json).resolve() if args.json else Path(scratch) / "advice.json"
        with _environment(ENV, str(target)):
            code = run(_spec(args))
        holds_rank_0 = args.nnodes in ("1", "1:1") or args.node_rank == 0
        if code == 0 and holds_rank_0 and not target.exists():
            print("lockstep advise: no advice came back: a Trainer script's fit() measures "
                  "and predicts; a script with its own loop calls lockstep.advise(model, "
                  "batches, optimizer) on every rank", file=sys.stderr)
            return 1
    return code


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (if given) for the workers this launch starts, and only them."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


if __name__ == "__main__":
    sys.exit(main())
