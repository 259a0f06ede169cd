"""Start the members of an etcd cluster for a job's store (see lockstep/elastic/etcd.py):
on one machine for tests, or one per host of an emulated cluster (`lockstep cluster --etcd
3`). Needs the `etcd` binary (Debian: `apt install etcd-server`).

    with EtcdMembers.local(3) as etcd:
        ...  # lockstep run --elastic --rdzv-endpoint {etcd.address} ...
        etcd.kill(0)  # any one member may go: the other two are a majority
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Spawn = Callable[[int, list[str]], "subprocess.Popen[Any]"]
"""Starts member i's command (on its host)."""


@dataclass(frozen=True)
class Member:
    name: str
    host: str  # the address the others and the clients reach it at
    client_port: int = 2379
    peer_port: int = 2380

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


def etcd_available() -> str | None:
    """None if the etcd binary is here, else how to get it."""
    if shutil.which("etcd") is None:
        return "the etcd binary is not installed (Debian: apt install etcd-server)"
    return None


class EtcdMembers:
    """A fresh etcd cluster of `members`, each started by `spawn`, data in a folder of its
    own that is removed on exit (with every member still running)."""

    def __init__(self, members: Sequence[Member], spawn: Spawn | None = None,
                 ready_timeout_s: float = 30.0) -> None:
        reason = etcd_available()
        if reason is not None:
            raise RuntimeError(f"cannot start etcd: {reason}")
        self.members = list(members)
        self.spawn: Spawn = spawn or (lambda i, command: subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.ready_timeout_s = ready_timeout_s
        self.data = tempfile.mkdtemp(prefix="lockstep-etcd-")
        self.procs: list[subprocess.Popen[Any]] = []

    @classmethod
    def local(cls, count: int = 3) -> EtcdMembers:
        """`count` members on this machine's loopback, on free ports."""
        ports = _free_ports(2 * count)
        return cls([Member(f"m{i}", "127.0.0.1", ports[2 * i], ports[2 * i + 1])
                    for i in range(count)])

    @property
    def address(self) -> str:
        """What --rdzv-endpoint takes: etcd://HOST:PORT,HOST:PORT,..."""
        return "etcd://" + ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    def __enter__(self) -> EtcdMembers:
        try:
            self.procs = [self.spawn(i, self._command(i, "new")) for i in range(len(self.members))]
            self._wait_ready(range(len(self.members)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def _command(self, i: int, state: str) -> list[str]:
        m = self.members[i]
        return ["etcd", "--name", m.name, "--data-dir", f"{self.data}/{m.name}",
                "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", ",".join(f"{o.name}={o.peer_url}" for o in self.members),
                "--initial-cluster-state", state, "--initial-cluster-token", self.data]

    def restart(self, i: int) -> None:
        """Member i again, from its data (a host that came back): it catches up with the
        others."""
        self.kill(i)
        self.procs[i] = self.spawn(i, self._command(i, "existing"))
        self._wait_ready([i])

    def _wait_ready(self, which: Iterable[int]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        for i in which:
            m = self.members[i]
            while not _healthy(m):
                proc = self.procs[i]
                if proc.poll() is not None:
                    raise RuntimeError(f"etcd member {m.name} exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {m.name} at {m.client_url} was not "
                                       f"healthy within {self.ready_timeout_s:.0f}s")
                time.sleep(0.1)

    def kill(self, i: int) -> None:
        """Member i dies (SIGKILL), as with its host."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def __exit__(self, *exc: object) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.data, ignore_errors=True)  # made above, for these members only


def _healthy(member: Member) -> bool:
    try:
        with urllib.request.urlopen(f"{member.client_url}/health", timeout=1.0) as reply:
            return b'"true"' in reply.read()
    except OSError:
        return False


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()
