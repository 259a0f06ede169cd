"""A real Ray cluster on this machine, for tests and audits: a head node and worker nodes,
each started by Ray's own `ray start`, each with its CPUs counted out so that Ray Train
must spread its workers over the nodes. Stopping it kills exactly what it started, the nodes'
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


@contextmanager
def local_ray_cluster(nodes: int, cpus_per_node: int = 1) -> Iterator[str]:
    """Start `nodes` Ray nodes (the first the head); yields the head's address. Their
    sessions live in a folder of their own, short-named (Ray's socket paths must fit in
    107 bytes), removed afterwards."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray is None:
        raise RuntimeError("the `ray` command is not installed: pip install 'lockstep[ray]'")
    port, sessions = free_port(), tempfile.mkdtemp(prefix="lsray")
    started: list[subprocess.Popen[str]] = []
    try:
        started.append(_node(ray, cpus_per_node, ["--head", f"--port={port}",
                                                  "--include-dashboard=false",
                                                  f"--temp-dir={sessions}"]))
        for _ in range(nodes - 1):
            started.append(_node(ray, cpus_per_node, [f"--address=127.0.0.1:{port}"]))
        yield f"127.0.0.1:{port}"
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
        node.wait(timeout=30)


def _with_descendants(psutil: Any, pid: int) -> list[Any]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _node(ray: str, cpus: int, args: list[str]) -> subprocess.Popen[str]:
    """One node, ready once `ray start` says so (an event, not a sleep)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    node = subprocess.Popen([ray, "start", "--block", f"--num-cpus={cpus}", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert node.stdout is not None
    seen = []
    for line in node.stdout:  # its exit ends the loop
        seen.append(line)
        if "Ray runtime started" in line:  # what it prints later is read and dropped, so
            threading.Thread(target=node.stdout.read, daemon=True).start()  # it never blocks
            return node
    raise RuntimeError(f"ray start {' '.join(args)} exited ({node.wait()}):\n{''.join(seen)}")
