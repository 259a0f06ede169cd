"""The emulated cluster: hosts as network namespaces with shaped links, always torn down,
and a real 2-host x 2-process job through torchrun's rendezvous that trains exactly like one
process. Needs root: without it these tests skip, saying so."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lockstep.cores import HOST_CORES
from lockstep.elastic import etcd
from lockstep.elastic.etcdstore import EtcdStore
from lockstep.tools.cluster import Cluster, cluster_available, parse_bandwidth
from tests import multihost_job

REASON = cluster_available()
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster: {REASON}")
BIN = Path(sys.executable).parent
HOST_NAMESPACE = re.compile(r"lockstep-[0-9a-f]+-h\d+")


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_bandwidth_parsing() -> None:
    assert parse_bandwidth("100mbit") == 1e8 and parse_bandwidth("1gbit") == 1e9
    with pytest.raises(ValueError, match="like 100mbit"):
        parse_bandwidth("fast")


def test_each_host_takes_its_share_of_the_cores_for_its_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hosts share this machine's cores: each one's workers thread over its share (on
    2 hosts over 2 cores, a host that took both made OpenMP's threads wait on each other:
    the char-GPT's forward 137 ms a step instead of 77). A user's own setting wins."""
    monkeypatch.delenv(HOST_CORES, raising=False)
    cores = len(os.sched_getaffinity(0))
    assert Cluster(hosts=2).env(1)[HOST_CORES] == str(max(1, cores // 2))
    assert Cluster(hosts=4 * cores).env(0)[HOST_CORES] == "1"
    monkeypatch.setenv(HOST_CORES, "3")
    assert Cluster(hosts=2).env(0)[HOST_CORES] == "3"


@needs_namespaces
def test_hosts_exist_inside_and_are_removed_even_when_a_command_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), Cluster(hosts=3, bandwidth="100mbit") as c:
        assert {c.netns(h) for h in range(3)} <= namespaces()
        results = c.run([["sh", "-c", f"ip -o -4 addr show; getent hosts {c.address(1)}"],
                         ["sh", "-c", "exit 3"], ["sleep", "30"]], timeout=60)
        assert c.address(0) in results[0].stdout
        # A name for every host's address, from a hosts file of the cluster's own (no DNS
        # server is reachable inside: torch warned on every connection it accepted).
        assert re.search(rf"^{re.escape(c.address(1))}\s+{c.netns(1)}$", results[0].stdout,
                         re.MULTILINE), results[0]
        assert results[1].returncode == 3
        assert results[2].returncode != 0  # stopped because host 1 failed, not after 30 s
        raise RuntimeError("boom")
    assert not {c.netns(h) for h in range(3)} & namespaces()
    assert c.bridge not in links() and f"lsv{c.tag}" not in links()
    assert not any(Path("/etc/netns", c.netns(h)).exists() for h in range(3))


@needs_namespaces
def test_two_clusters_whose_tags_pick_one_subnet_get_two() -> None:
    """Tags 0001 and 00fb both map to 10.213.1: the second cluster, built while the first
    stands (two test processes at once), takes another subnet, and each one's hosts reach
    this machine reaches each one's hosts (before, both bridges took 10.213.1.254/24, and
    what this machine sent to 10.213.1.x went out of one of them only)."""
    serve = "import socket; s = socket.create_server(('', 7000)); s.accept()[0].sendall(b'%s')"
    with Cluster(hosts=2, tag="0001") as a, Cluster(hosts=2, tag="00fb") as b:
        assert a.subnet != b.subnet
        for c in (a, b):
            server = c.popen(1, [sys.executable, "-c", serve % c.tag])
            deadline = time.monotonic() + 30
            while True:
                try:
                    with socket.create_connection((c.address(1), 7000), timeout=5) as s:
                        assert s.recv(16) == c.tag.encode()
                        break
                except ConnectionRefusedError:  # not listening yet
                    assert time.monotonic() < deadline, f"cluster {c.tag}: host 1 unreachable"
                    time.sleep(0.05)
            server.wait(timeout=30)


@needs_namespaces
def test_an_etcd_member_per_host_answers_through_a_host_kill_and_a_cut_link() -> None:
    """`Cluster(etcd=3)`: a member on each host, `{etcd}` naming them; the store answers
    after host 0 is killed whole and while host 1's link is cut (host 2 and the restarted
    host 0 are a majority); its data folder goes with the cluster."""
    with Cluster(hosts=3, bandwidth=None, etcd=3) as c:
        assert c.etcd_members is not None
        address = c.expand(["{etcd}"], 0)[0]
        assert address == "etcd://" + ",".join(f"{c.address(h)}:2379" for h in range(3))
        endpoints, _ = etcd.parse(address)
        store = EtcdStore(endpoints, "cluster-test/", timedelta(seconds=5))
        store.set("k", "1")
        c.kill_host(0)
        assert store.add("n", 1) == 1 and store.get("k") == b"1"
        c.etcd_members.restart(0)
        c.cut_link(1)
        assert store.add("n", 1) == 2
        c.cut_link(1, cut=False)
        data = Path(c.etcd_members.data)
        assert data.is_dir()
    assert not data.exists() and not {c.netns(h) for h in range(3)} & namespaces()


@needs_namespaces
def test_links_are_shaped_to_the_given_bandwidth(tmp_path: Path) -> None:
    script = tmp_path / "throughput.py"
    script.write_text(
        "import socket, sys, time\n"
        "if sys.argv[1] == '0':\n"
        "    s = socket.create_server(('0.0.0.0', 5601)); c, _ = s.accept(); n = 0\n"
        "    t = time.time()\n"
        "    while (d := c.recv(1 << 20)): n += len(d)\n"
        "    print(n * 8 / (time.time() - t) / 1e6)\n"
        "else:\n"
        "    time.sleep(0.5); c = socket.create_connection((sys.argv[2], 5601))\n"
        "    for _ in range(16): c.sendall(b'x' * (1 << 20))\n")
    with Cluster(hosts=2, bandwidth="100mbit") as c:
        results = c.run([[sys.executable, str(script), "{host}", "{host0}"]] * 2, timeout=60)
    mbit = float(results[0].stdout)
    assert 70 < mbit < 105, f"{mbit:.0f} Mbit/s through a 100 Mbit/s link"


@needs_namespaces
def test_sigterm_tears_the_cluster_down(tmp_path: Path) -> None:
    # Its own hosts only, told by the namespaces its commands run in: another cluster test
    # running beside it (pytest -n 2) makes hosts of the same form, and `cluster_available`
    # a `lockstep-probe-*` namespace -- catching either made this test fail.
    marker = f"{60 + secrets.randbelow(1000) / 1000:.3f}"  # sleep 60.xyz: ours alone
    log = tmp_path / "cluster.log"  # a file, not a pipe: nothing blocks on an unread pipe
    with log.open("w") as stderr:
        proc = subprocess.Popen([str(BIN / "lockstep"), "cluster", "--hosts", "2", "--",
                                 "sleep", marker], stderr=stderr, text=True)
    made: set[str] = set()
    deadline = time.monotonic() + 120  # generous: CI machines are shared and can be slow
    while len(made) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        made = _namespaces_running(f"sleep\0{marker}")
    if len(made) < 2:
        proc.kill()
        proc.wait()
        pytest.fail(f"the cluster never came up (exit {proc.returncode}):\n{log.read_text()}")
    assert all(HOST_NAMESPACE.fullmatch(n) for n in made), made
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not made & namespaces()


def _namespaces_running(command: str) -> set[str]:
    """The named network namespaces of the processes whose command line (NUL-separated)
    holds `command`: a process's /proc/PID/ns/net is the same file as /run/netns/NAME."""
    by_inode = {}
    for name in namespaces():
        with contextlib.suppress(OSError):
            by_inode[os.stat(f"/run/netns/{name}").st_ino] = name
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if command.encode() in cmdline.read_bytes():
                found.add(by_inode.get(os.stat(cmdline.parent / "ns" / "net").st_ino))
        except OSError:  # it ended in between
            continue
    return {name for name in found if name is not None}


@needs_namespaces
def test_cluster_streams_each_hosts_output_live_prefixed_by_host(tmp_path: Path) -> None:
    # Each host says hello on stdout and stderr, then waits for a file the test writes only
    # after it has read both hellos: output that came only at the end would never arrive.
    go = tmp_path / "go"
    talk = ("import sys, time, pathlib\n"
            "print('hello from', sys.argv[1]); print('err from', sys.argv[1], file=sys.stderr)\n"
            "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.05)\n"
            "print('bye from', sys.argv[1])\n")
    proc = subprocess.Popen([str(BIN / "lockstep"), "cluster", "--hosts", "2", "--bandwidth",
                             "none", "--", sys.executable, "-c", talk, "{host}", str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen: list[str] = []
        assert proc.stdout is not None
        while not {"[host 0] hello from 0", "[host 1] hello from 1", "[host 0] err from 0",
                   "[host 1] err from 1"} <= set(seen):
            line = proc.stdout.readline()
            assert line, f"the cluster ended before both hosts spoke: {seen}"
            seen.append(line.rstrip("\n"))
        assert proc.poll() is None  # read while the hosts were still running
        go.write_text("")
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert {"[host 0] bye from 0", "[host 1] bye from 1"} <= set(rest.splitlines())


def reference_weights() -> dict[str, torch.Tensor]:
    net = multihost_job.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(multihost_job.STEPS):
        x, y = multihost_job.global_batch(step, 4 * multihost_job.PER_RANK)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.state_dict()


@needs_namespaces
def test_two_hosts_of_two_train_like_one_process(tmp_path: Path) -> None:
    """Native and hierarchical all-reduce, one after the other in one launch."""
    out = tmp_path / "weights"
    job = [str(BIN / "lockstep"), "run", "-n", "2", "--nnodes", "2", "--node-rank", "{host}",
           "--rdzv-endpoint", "{host0}:29400", "--local-addr", "{addr}",
           str(Path(multihost_job.__file__)), str(out), ",".join(ALGORITHMS)]
    with Cluster(hosts=2, bandwidth="1gbit") as c:
        results = c.run([job, job], timeout=240)
    assert all(r.returncode == 0 for r in results), results[0].stderr[-2000:] + \
        results[1].stderr[-2000:]
    for r in results:  # torch's noise, once on every host
        assert "node_rank is only used" not in r.stderr, r.stderr
        assert "hostname of the client socket cannot be retrieved" not in r.stderr, r.stderr
    assert "trained on 4 ranks, 2 hosts" in results[0].stdout + results[1].stdout
    for algorithm in ALGORITHMS:
        trained = torch.load(f"{out}.{algorithm}.pt", weights_only=True)
        for name, expected in reference_weights().items():
            assert (trained[name] - expected).abs().max().item() < 5e-5, (algorithm, name)


ALGORITHMS = ("native", "hierarchical")
