"""No host the job cannot lose: the job's store in a 3-member etcd, one member per host of an
emulated cluster, while each host in turn -- the first one included -- is killed whole.

    sudo .venv/bin/python benchmarks/elastic_etcd.py            # 3 hosts x 1 worker, 1gbit

3 hosts (lockstep.tools.cluster, `etcd=3`), each running an etcd member and one
`lockstep run --elastic --rdzv-endpoint etcd://...` of examples/elastic_mnist.py. Then, in
turn for hosts 0, 1 and 2: every process of the host is killed (SIGKILL: its launcher, its
worker, its etcd member); the time until the others train again is measured from the
workers' records; the host comes back (its etcd member from its data, its launcher again,
whose worker joins the running job). Last, the link of the host whose etcd member leads is
cut for 25 s (no connection closes: the others notice by their collective timeout, 10 s
here), then
restored; its worker, left out meanwhile, joins again by itself.

Prints each event's time to train again (the issue asks: within 20 s), then the audit:
every global batch trained exactly once, the world sizes, the test accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import elastic_recovery as er  # noqa: E402  (its launcher, records and audit)

from lockstep.tools.cluster import Cluster  # noqa: E402

HOSTS = 3


def leader(c: Cluster) -> int:
    """The host whose etcd member leads now (asked from this machine, over the bridge)."""
    assert c.etcd_members is not None
    for host, member in enumerate(c.etcd_members.members):
        request = urllib.request.Request(f"{member.client_url}/v3/maintenance/status", b"{}")
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                status = json.loads(reply.read())
        except OSError:
            continue
        if status.get("leader") == status["header"]["member_id"]:
            return host
    raise RuntimeError("no etcd member says it leads")


def trained_again(folder: Path, job: Any, since: float, world: int) -> float:
    """Seconds from `since` until a worker of a `world`-sized membership started a step."""
    hits = er.wait_for(folder, lambda r: r["time"] > since and r["world"] == world, job)
    return min(r["time"] for r in hits) - since


def hosts_in_turn(c: Cluster, folder: Path, jobs: dict[int, Any], start: Any,
                  events: list[tuple[str, float]], kills: int) -> None:
    """Kill each of the first `kills` hosts whole, in turn, and bring it back."""
    assert c.etcd_members is not None
    for host in range(kills):
        watch = jobs[(host + 1) % HOSTS]  # a live launcher: wait_for stops if it exits
        c.kill_host(host)
        killed = time.time()
        again = trained_again(folder, watch, killed, HOSTS - 1)
        events.append((f"host {host} killed (launcher, worker, etcd member)", again))
        print(f"host {host} killed: the others trained again {again:.1f}s later", flush=True)
        c.etcd_members.restart(host)
        jobs[host] = start(host)
        back = trained_again(folder, watch, time.time(), HOSTS)
        print(f"host {host} back: its worker joined, trained {back:.1f}s after its "
              "launcher started", flush=True)


def cut_the_leader(c: Cluster, folder: Path, jobs: dict[int, Any],
                   events: list[tuple[str, float]], seconds: float) -> None:
    """Cut the link of the host whose etcd member leads, for `seconds`; then restore it."""
    lead = leader(c)
    watch = jobs[(lead + 1) % HOSTS]
    c.cut_link(lead)
    cut = time.time()
    again = trained_again(folder, watch, cut, HOSTS - 1)
    events.append((f"host {lead}'s link cut (its etcd member led)", again))
    print(f"host {lead}'s link cut (etcd leader): the others trained again {again:.1f}s "
          "later", flush=True)
    time.sleep(max(0.0, seconds - (time.time() - cut)))
    c.cut_link(lead, cut=False)
    back = trained_again(folder, watch, time.time(), HOSTS)
    print(f"host {lead}'s link back: its worker joined again {back:.1f}s later", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--cut", type=float, default=25.0, help="seconds the leader's link is cut")
    p.add_argument("--kills", type=int, default=HOSTS, help="hosts killed in turn before "
                   "the cut (default: every one)")
    args = p.parse_args()
    # (a cut link is noticed by the collective timeout: 10 s here, not the default 15)
    extra = ["--epochs", str(args.epochs), "--collective-timeout", "10"]
    with tempfile.TemporaryDirectory(prefix="lockstep-etcd-") as tmp, \
            Cluster(hosts=HOSTS, bandwidth=args.bandwidth, etcd=HOSTS) as c:
        assert c.etcd_members is not None
        folder = Path(tmp)

        def start(host: int) -> Any:
            command = er.launcher(1, c.etcd_members.address, folder, extra)
            at = command.index("--elastic") + 1
            command[at:at] = ["--nnodes", str(HOSTS), "--rdzv-id", "etcd-bench"]
            return er.run_job([["ip", "netns", "exec", c.netns(host), *command]],
                              [c.env(host)])[0]

        print(f"== {HOSTS} hosts ({args.bandwidth}), etcd on each: {c.etcd_members.address}")
        jobs = {h: start(h) for h in range(HOSTS)}
        er.wait_for(folder, lambda r: r["attempt"] >= 20, jobs[HOSTS - 1])
        events = []
        try:
            hosts_in_turn(c, folder, jobs, start, events, kills=args.kills)
            cut_the_leader(c, folder, jobs, events, args.cut)
        except RuntimeError:  # a wait that failed: every host's side of the story
            for h, job in jobs.items():
                job.kill()
                print(f"-- host {h} --\n" + "\n".join(er.shown(job.communicate()[0])))
            raise
        outputs = [job.communicate()[0] for job in jobs.values()]
        print("\n== what the launchers printed ==")
        print("\n".join(f"[host {h}] {line}" for h, out in enumerate(outputs)
                        for line in er.shown(out)))
        audit = er.audit(folder, 96, 4000)
        print("\n== audit ==")
        for what, seconds in events:
            print(f"{what}: trained again after {seconds:.1f}s "
                  f"({'within' if seconds <= 20 else 'OVER'} 20 s)")
        print(f"world sizes, epoch by epoch: {' -> '.join(map(str, audit['worlds']))}")
        print(f"steps computed and redone: {audit['redone']}")
        print(f"global batches trained exactly once: {audit['steps'] - len(audit['bad_steps'])}"
              f" of {audit['steps']}" if not audit["bad_steps"] else
              f"STEPS WITH LOST OR REPEATED SAMPLES: {audit['bad_steps']}")
        print(f"test accuracy: {er.accuracy(''.join(outputs)):.4f}")


if __name__ == "__main__":
    main()
