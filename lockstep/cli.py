"""The `lockstep` command: `lockstep run` launches workers, `lockstep demo` shows the library."""

from __future__ import annotations

import argparse
import sys

from lockstep.launch import LaunchSpec, run


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("run", help="launch N workers of a script (torchrun-compatible)",
                            description="Launch workers with the torchrun environment. On one "
                            "host: `lockstep run -n 4 train.py --lr 0.1`. Across hosts, run "
                            "the same command on each with --nnodes and --rdzv-endpoint.")
    p.add_argument("-n", "--nproc-per-node", type=int, default=1, dest="nproc",
                   help="workers on this host (default 1)")
    p.add_argument("--nnodes", default="1", help="number of hosts, or MIN:MAX")
    p.add_argument("--node-rank", type=int, default=None, help="this host's rank")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="HOST:PORT of the rendezvous (one host of the job) for several hosts")
    p.add_argument("--rdzv-id", default=None, help="job id shared by all hosts")
    p.add_argument("--local-addr", default=None,
                   help="this host's address as the other hosts reach it")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--elastic", action="store_true",
                   help="fault tolerant (lockstep.Elastic): a worker that dies does not stop "
                   "the others, and the same command started later adds workers to the job")
    p.add_argument("-m", "--module", action="store_true", help="target is a module")
    p.add_argument("target", help="script path (or module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own options (see `lockstep demo -h`)
        from lockstep import demo

        return demo.main(argv[1:])
    if argv[:1] == ["cluster"]:
        from lockstep import cluster

        return cluster.main(argv[1:])
    parser = argparse.ArgumentParser(prog="lockstep", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run(commands)
    commands.add_parser("demo", help="train a small CNN on real MNIST, 1 then 2 workers")
    commands.add_parser("cluster", help="run a command on each host of an emulated cluster "
                        "(network namespaces with rate-limited links; needs root)")
    args = parser.parse_args(argv)
    launch = run
    if args.elastic:
        from lockstep.elastic_launch import run_elastic as launch
    return launch(LaunchSpec(nproc=args.nproc, target=args.target, args=args.args,
                          module=args.module, nnodes=args.nnodes, node_rank=args.node_rank,
                          rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                          local_addr=args.local_addr, max_restarts=args.max_restarts))


if __name__ == "__main__":
    sys.exit(main())
