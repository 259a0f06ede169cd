"""Ray Train across two hosts of the emulated cluster: one Ray node per host, the workers'
gradients crossing the shaped link -- the same per-step losses as `lockstep run -n 2`.

Makes 2 hosts (network namespaces, `tc tbf` at --bandwidth; needs root), starts a Ray head
on host 0 and a worker node on host 1 (one CPU each: Ray must put a worker on each host),
runs examples/ray_train_mnist.py through Ray Train from host 0, then the same loop under
`lockstep run -n 2` on loopback, and compares.

    python benchmarks/ray_hosts.py                     # 1gbit
    python benchmarks/ray_hosts.py --bandwidth 100mbit
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lockstep.tools.cluster import Cluster
from lockstep.tools.raycluster import local_ray_cluster

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "ray_train_mnist.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lockstep-ray-hosts-"))
    steps = ["--steps", str(args.steps)]
    started = time.perf_counter()
    with Cluster(hosts=2, bandwidth=args.bandwidth) as hosts, \
            local_ray_cluster(2, hosts=hosts) as address:
        driver = hosts.popen(0, [sys.executable, EXAMPLE, "--ray", address, *steps,
                                 "--out", str(work / "ray.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output, _ = driver.communicate(timeout=600)
        if driver.returncode != 0:
            raise SystemExit(f"the Ray Train job failed:\n{output[-3000:]}")
    ray_seconds = time.perf_counter() - started
    subprocess.run([str(Path(sys.executable).parent / "lockstep"), "run", "-n", "2", EXAMPLE,
                    *steps, "--out", str(work / "lockstep.json")], check=True,
                   capture_output=True)
    ray, ours = (json.loads((work / f"{n}.json").read_text())["losses"]
                 for n in ("ray", "lockstep"))
    placed = sorted({line.split("ip=")[1].split(",")[0] for line in output.splitlines()
                     if "world_rank=" in line and "ip=" in line})
    gap = max(abs(a - b) for a, b in zip(ray, ours, strict=True))
    print(f"== Ray Train on 2 emulated hosts at {args.bandwidth} ==")
    print(f"workers placed at {', '.join(placed)}; {len(ray)} steps in {ray_seconds:.0f}s "
          "(hosts, Ray nodes and the job's start included)")
    print(f"per-step losses against lockstep run -n 2: largest difference {gap:.1e}"
          + (" (the same, bit for bit)" if ray == ours else ""))


if __name__ == "__main__":
    main()
