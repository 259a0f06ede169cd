"""The elastic launcher's hold on the job's store, once its workers have started.

The launcher hosts the store (the job's first launcher, at a TCP endpoint), or connects to
the one another launcher hosts, or to etcd's; it names its workers in messages by their id
in the job, tells the job at once when one exits, and a hosting launcher keeps serving
while workers started elsewhere train. Everything here needs torch, which the launcher
loads only after starting its workers (elastic.py says why).
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from lockstep.elastic import etcd
from lockstep.elastic.heartbeat import Liveness
from lockstep.elastic.store import PREFIX, connect
from lockstep.launch.elastic import SAY

_JOB_KEY = PREFIX + "job"


def open_job_store(address: str, listen_fd: int | None, timeout_s: float,
                   wanted: Callable[[], bool]) -> dist.Store:
    """The job's store at `address` (etcd's, or HOST:PORT): hosted here on the socket
    `listen_fd` (bound and listening) if given, else the one served there -- waited for
    while `wanted()` (this launcher's workers still run) and for up to `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    if address.startswith(etcd.SCHEME):  # replicated: nobody hosts it
        return connect(address, timeout)
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    if listen_fd is not None:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listen_fd)
        store.set(_JOB_KEY, "1")
        return store
    _wait_for_listener(host, port, time.monotonic() + timeout_s, wanted)
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    if not store.check([_JOB_KEY]):
        raise RuntimeError(f"the store at {address} is not an elastic lockstep job's")
    return store


def _wait_for_listener(host: str, port: int, deadline: float,
                       wanted: Callable[[], bool]) -> None:
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() > deadline or not wanted():
                raise RuntimeError(f"no elastic job answered at {host}:{port} ({error}); "
                                   "start the first launcher of the job there") from None
        time.sleep(0.2)


def _worker_id(store: dist.Store, host: str, pid: int) -> int | None:
    """The job's id of this host's worker `pid`, as it said when it arrived; None if it had
    not joined yet. Raises if the job's store is gone."""
    view = dist.PrefixStore(PREFIX, store)
    for worker in range(int(view.add("next_id", 0))):
        key = f"host/{worker}"
        if view.check([key]) and json.loads(view.get(key)) == [host, pid]:
            return worker
    return None


def worker_name(store: dist.Store, host: str, pid: int) -> str:
    """A worker as the membership's messages name it: by its id in the job (handed out as
    workers arrive, so not its place among this host's workers), pid and host."""
    with contextlib.suppress(Exception):  # the job's store is gone with its launcher
        worker = _worker_id(store, host, pid)
        if worker is not None:
            return f"worker {worker} (pid {pid} on host {host})"
    return f"a worker of this host (pid {pid}) that had not joined the job yet"


def mark_gone(store: dist.Store, host: str, pid: int) -> None:
    """Tell the job that this host's worker `pid` has exited: its peers take it as gone at
    once (heartbeat.Liveness), instead of waiting for its heartbeat to stand still."""
    with contextlib.suppress(Exception):  # the job's store may be gone too
        worker = _worker_id(store, host, pid)
        if worker is not None:
            dist.PrefixStore(PREFIX, store).set(f"left/{worker}", "1")


def serve_until_idle(store: dist.Store, quiet_s: float = 5.0) -> None:
    """This launcher serves the job's store: keep it up while workers started elsewhere
    still train (each is gone once it left or its heartbeat stood still)."""
    view = dist.PrefixStore(PREFIX, store)
    liveness = Liveness(view, quiet_s)
    said, since = False, time.monotonic()
    while True:
        workers = range(int(view.add("next_id", 0)))
        if all(liveness.observe(w) == "dead" for w in workers):
            return
        if not said and time.monotonic() - since > quiet_s + 1:
            said = True
            print(f"{SAY} serving the job's store until the workers started elsewhere "
                  "finish", file=sys.stderr, flush=True)
        time.sleep(0.2)
