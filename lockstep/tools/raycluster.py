"""A real Ray cluster on this machine, for tests and audits: a head node and worker nodes,
each started by Ray's own `ray start`, each with its CPUs counted out so that Ray Train
must spread its workers over the nodes -- on loopback, or one node per host of the
emulated cluster (tools/cluster.py). Stopping it kills exactly what it started, the nodes'
processes and theirs -- never `ray stop`, which would stop every Ray on the machine, a
user's too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lockstep.launch.elastic import free_port
from lockstep.tools.cluster import Cluster

READY_WITHIN_S = 120


@contextmanager
def local_ray_cluster(nodes: int, cpus_per_node: int = 1, hosts: Cluster | None = None
                      ) -> Iterator[str]:
    """Start `nodes` Ray nodes (the first the head); yields the head's address. With
    `hosts` (an emulated cluster), node i runs on host i, at that host's address, and
    reaches the others over the shaped links. Their sessions live in a folder of their
    own, short-named (Ray's socket paths must fit in 107 bytes), removed afterwards."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray is None:
        raise RuntimeError("the `ray` command is not installed: pip install 'lockstep[ray]'")
    port, sessions = free_port(), tempfile.mkdtemp(prefix="lsray")
    head = f"{hosts.address(0) if hosts else '127.0.0.1'}:{port}"
    started: list[subprocess.Popen[str]] = []
    try:
        for i in range(nodes):
            role = ["--head", f"--port={port}", "--include-dashboard=false"] if i == 0 \
                else [f"--address={head}"]
            where = [f"--node-ip-address={hosts.address(i)}"] if hosts else []
            started.append(_node([ray, "start", "--block", f"--num-cpus={cpus_per_node}",
                                  f"--temp-dir={sessions}/{i}", *role, *where], i, hosts))
        yield head
    finally:
        _stop(started)
        shutil.rmtree(sessions, ignore_errors=True)


def _stop(nodes: list[subprocess.Popen[str]]) -> None:
    """Kill every process the nodes started -- their workers too, which Ray puts in sessions
    of their own. (`ray start --block` stops its node on SIGTERM, but after ~30 s of drain.)
    The tree is read whole first: a child whose parent died first would be lost to init."""
    import psutil  # Ray's own dependency

    tree = [p for node in nodes for p in _with_descendants(psutil, node.pid)]
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=30)
    for node in nodes:
        with contextlib.suppress(subprocess.TimeoutExpired):  # (never hide why we stop)
            node.wait(timeout=30)


def _with_descendants(psutil: Any, pid: int) -> list[Any]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _node(command: list[str], host: int, hosts: Cluster | None) -> subprocess.Popen[str]:
    """One node, ready once `ray start` says so (an event, not a sleep)."""
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    node = hosts.popen(host, command, extra_env=env, **pipes) if hosts else \
        subprocess.Popen(command, env={**os.environ, **env}, text=True, **pipes)
    assert node.stdout is not None
    give_up = threading.Timer(READY_WITHIN_S, node.kill)  # a node that never says it is up
    give_up.start()
    seen = []
    try:
        for line in node.stdout:  # its exit (or the timer's kill) ends the loop
            seen.append(line)
            if "Ray runtime started" in line:  # what it prints later is read and dropped,
                threading.Thread(target=node.stdout.read, daemon=True).start()  # unblocked
                return node
    finally:
        give_up.cancel()
    _stop([node])  # what it started before failing goes too
    raise RuntimeError(f"{' '.join(command)} did not start within {READY_WITHIN_S}s or "
                       f"exited ({node.poll()}):\n{''.join(seen)}")
