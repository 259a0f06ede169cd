"""All-reduce algorithms side by side: bus bandwidth over message sizes, measured and
predicted by the alpha-beta model, on loopback and on an emulated cluster.

    python benchmarks/allreduce.py              # loopback, then 2 hosts x 2 at 1gbit and 100mbit
    python benchmarks/allreduce.py --settings loopback

Settings (each a separate job, its algorithms measured in the same run):
  loopback   2 ranks on this host
  1gbit      2 emulated hosts x 2 processes, 1 Gbit/s links (needs root for namespaces)
  100mbit    the same at 100 Mbit/s, up to 16 MB messages (a 64 MB one takes ~10 s)

Every rank starts each all-reduce together (a barrier) and the slowest rank's time counts.
Each round (5 on loopback, 3 on the emulated links) probes the links, and the host stage
just before the algorithms that use it, then measures every cell; the table shows median
times over rounds, and each prediction's error is the median of its per-round errors.
Prints one table per setting, checks the issue's targets, and writes allreduce.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import lockstep
from lockstep.advisor import costmodel
from lockstep.comm.topology import Topology
from lockstep.launch.run import LaunchSpec, run
from lockstep.replication.choices import make_algorithm
from lockstep.tools.bench import run_on_cluster
from lockstep.tools.cluster import cluster_available

KB, MB = 1024, 1024 * 1024
SETTINGS = {
    # Loopback's "link" is the shared cores themselves, the noisiest: more rounds (~25 s
    # each); a rate-limited link is steady, and a round there takes minutes. The link
    # probe's largest size ("probe_mb") spans the judged range (4 MB up) where a probe
    # stays short; on the slowest link it repeats less.
    "loopback": {"hosts": 1, "algorithms": ["native", "ring", "tree", "shm"], "max": 64 * MB,
                 "rounds": 5, "probe_mb": 64, "probe_repeats": 15},
    "1gbit": {"hosts": 2, "algorithms": ["native", "ring", "tree", "hierarchical"],
              "max": 64 * MB, "rounds": 3, "probe_mb": 32, "probe_repeats": 15},
    "100mbit": {"hosts": 2, "algorithms": ["native", "ring", "hierarchical"], "max": 16 * MB,
                "rounds": 3, "probe_mb": 2, "probe_repeats": 2},
}
SIZES = [4 * KB * 4 ** i for i in range(9)]  # 4 KB .. 64 MB


def worker(setting: str, rounds: int, out: Path) -> None:
    world = lockstep.init()
    spec = SETTINGS[setting]
    sizes = [s for s in SIZES if s <= spec["max"]]
    measured: dict[tuple[str, int], list[float]] = {}
    predicted: dict[tuple[str, int], list[float]] = {}
    for round_ in range(rounds):
        # Each round probes again before it measures: a shared machine's speed drifts, and
        # a prediction is fairly judged only against what it was made for. For the same
        # reason the host stage is probed just before the algorithms that use it.
        link, local = probe_links(setting, world)
        host = None
        for algorithm in spec["algorithms"]:
            if algorithm in ("shm", "hierarchical") and host is None:
                host = costmodel.probe_host(Topology.build(world.rank, world.world_size,
                                                           world.local_world_size))
            # One instance for every size, as DataParallel keeps one for every bucket
            # (ring and tree make a process group each time one is built).
            algo = make_algorithm(algorithm, None, world.local_world_size)
            try:
                for nbytes in sizes:
                    seconds = costmodel.time_reduction(algo, nbytes)
                    guess = costmodel.predict(algorithm, nbytes, world.world_size,
                                              world.local_world_size, link, local, host)
                    measured.setdefault((algorithm, nbytes), []).append(seconds)
                    predicted.setdefault((algorithm, nbytes), []).append(guess)
                    if world.is_main:
                        print(f"  {setting:8s} round {round_ + 1}/{rounds} {algorithm:12s} "
                              f"{nbytes / KB:8.0f} KB  {seconds * 1e3:9.2f} ms", flush=True)
            finally:
                algo.close()
    if world.is_main:
        # The error is taken per round (each prediction against its own measurement),
        # then the median over rounds; the times shown are each one's median.
        rows = [{"algorithm": a, "bytes": n, "seconds": statistics.median(measured[(a, n)]),
                 "predicted": statistics.median(predicted[(a, n)]),
                 "error": statistics.median(p / m - 1 for p, m in
                                            zip(predicted[(a, n)], measured[(a, n)],
                                                strict=True))}
                for a, n in measured]
        out.write_text(json.dumps({"setting": setting, "world_size": world.world_size,
                                   "hosts": world.num_hosts, "rounds": rounds,
                                   "link": costmodel.describe(link),
                                   "local": costmodel.describe(local),
                                   "host": costmodel.describe_host(host)
                                   if host is not None else "-",
                                   "rows": rows}))


def probe_links(setting: str, world: lockstep.World) -> tuple[
        costmodel.LinkCost, costmodel.LinkCost]:
    """The slowest link a flat algorithm crosses (to another host if there is one), and a
    link inside a host."""
    spec, hosts = SETTINGS[setting], world.num_hosts
    link = costmodel.probe(0, world.local_world_size if hosts > 1 else 1,
                           large_bytes=spec["probe_mb"] * MB, repeats=spec["probe_repeats"])
    local = costmodel.probe(0, 1) if hosts > 1 and world.local_world_size > 1 else link
    return link, local


def launch_setting(setting: str, rounds: int | None, out: Path) -> dict[str, object] | None:
    spec = SETTINGS[setting]
    rounds = rounds or spec["rounds"]
    args = ["--worker", setting, "--rounds", str(rounds), "--result", str(out)]
    if spec["hosts"] == 1:
        code = run(LaunchSpec(nproc=2, target=os.path.abspath(__file__), args=args))
        return json.loads(out.read_text()) if code == 0 else None
    reason = cluster_available()
    if reason is not None:
        print(f"skipping {setting}: no emulated cluster here ({reason})")
        return None
    return run_on_cluster(setting, 2, os.path.abspath(__file__), args, 29410, out,
                          show_output=True)


def report(result: dict[str, object]) -> list[str]:
    rows, n = result["rows"], result["world_size"]  # type: ignore[index]
    print(f"\n{result['setting']}: {n} ranks on {result['hosts']} host(s), median of "
          f"{result['rounds']} rounds; last round's link "
          f"{result['link']}; inside a host {result['local']}; shared-memory stage "
          f"{result['host']}")
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))  # type: ignore[union-attr]
    sizes = sorted({r["bytes"] for r in rows})  # type: ignore[union-attr]
    table = {(r["algorithm"], r["bytes"]): r for r in rows}  # type: ignore[union-attr]
    print("bus bandwidth, GB/s (measured / predicted)")
    print(f"{'size':>9s} " + " ".join(f"{a:>19s}" for a in algorithms))
    for size in sizes:
        cells = []
        for a in algorithms:
            r = table[(a, size)]
            cells.append(f"{costmodel.bus_bandwidth(size, r['seconds'], n) / 1e9:8.3f} / "
                         f"{costmodel.bus_bandwidth(size, r['predicted'], n) / 1e9:8.3f}")
        print(f"{costmodel.size_label(size):>9s} " + " ".join(f"{c:>19s}" for c in cells))
    return _targets(result["setting"], table, algorithms, sizes)  # type: ignore[arg-type]


def _targets(setting: str, table: dict[tuple[str, int], dict[str, float]],
             algorithms: list[str], sizes: list[int]) -> list[str]:
    lines = []
    large = [s for s in sizes if s >= 16 * MB]
    if setting in ("loopback", "1gbit") and large:
        worst = min(table[("native", s)]["seconds"] / table[("ring", s)]["seconds"]
                    for s in large)
        lines.append(f"{setting}: ring / native bus bandwidth at 16 MB and up: worst "
                     f"{worst:.2f} (target >= 0.80)")
    if setting == "100mbit":
        ratios = [table[("native", s)]["seconds"] / table[("hierarchical", s)]["seconds"]
                  for s in sizes if s >= MB]
        lines.append(f"100mbit: hierarchical / native speed at 1 MB and up: "
                     f"{', '.join(f'{r:.2f}' for r in ratios)} (target > 1)")
    errors = [abs(table[(a, s)]["error"]) for a in algorithms for s in sizes if s >= 4 * MB]
    if errors:
        lines.append(f"{setting}: prediction error at 4 MB and up: median "
                     f"{statistics.median(errors):.0%}, worst {max(errors):.0%} "
                     "(target within 25%)")
    return lines


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def plot(results: list[dict[str, object]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        n, rows = result["world_size"], result["rows"]  # type: ignore[index]
        for i, a in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):  # type: ignore[union-attr]
            mine = [r for r in rows if r["algorithm"] == a]  # type: ignore[union-attr]
            sizes = [r["bytes"] for r in mine]
            ax.plot(sizes, [costmodel.bus_bandwidth(r["bytes"], r["seconds"], n) / 1e9
                            for r in mine], "o-", color=f"C{i}", label=f"{a}")
            ax.plot(sizes, [costmodel.bus_bandwidth(r["bytes"], r["predicted"], n) / 1e9
                            for r in mine], "--", color=f"C{i}", alpha=0.6)
        ax.set(xscale="log", title=f"{result['setting']}: {n} ranks, {result['hosts']} host(s)",
               xlabel="message bytes", ylabel="bus bandwidth GB/s (dashed: model)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--rounds", type=_positive,
                   help="probe and measure this many times in every setting (default: 5 on "
                        "loopback, 3 on the emulated links); the medians are reported")
    p.add_argument("--out", default="runs/bench/allreduce")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, Path(args.result))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, checks = [], []
    for setting in args.settings:
        print(f"measuring {setting} ...", flush=True)
        result = launch_setting(setting, args.rounds, (out / f"{setting}.json").resolve())
        if result is not None:
            results.append(result)
    for result in results:
        checks += report(result)
    print("\n" + "\n".join(checks))
    if results:
        plot(results, out / "allreduce.png")
        print(f"plot: {out / 'allreduce.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
