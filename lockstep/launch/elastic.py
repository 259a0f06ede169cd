"""`lockstep run --elastic`: workers that may die, and be added, without stopping the rest.

torchrun's agent stops every worker when one fails and restarts them all -- the opposite of
what a fault-tolerant job (lockstep.Elastic) needs. This launcher hosts the job's store (or
finds the store another launcher of the job hosts at --rdzv-endpoint), starts N workers
with LOCKSTEP_ELASTIC pointing at it, and watches them: a worker that dies is reported at
once and the others go on. The same command started again later -- on this host or
another -- adds workers, which join the running job at its next step boundary.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType

import torch.distributed as dist

from lockstep.cores import AUTO_THREADS, threads_per_worker
from lockstep.elastic import etcd
from lockstep.elastic.config import ENV_INITIAL, ENV_STORE
from lockstep.elastic.heartbeat import Liveness
from lockstep.elastic.store import PREFIX
from lockstep.launch.run import LaunchSpec, refused

_JOB_KEY = PREFIX + "job"
_SAY = "lockstep run --elastic:"
_TOGETHER_S = 0.5  # workers that exit this close together are reported as one event


def run_elastic(spec: LaunchSpec, timeout_s: float = 60.0) -> int:
    """Launch this host's workers of an elastic job and wait. Returns 0 if the job
    finished (on whichever workers were left), else the first failed worker's code."""
    if refused(spec):
        return 2
    endpoint = spec.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    lease: etcd.LauncherLease | None = None
    store: dist.Store
    try:
        if endpoint.startswith(etcd.SCHEME):  # replicated: nobody hosts it
            job = spec.rdzv_id or "lockstep"
            store, address, lease, started = etcd.join_job(endpoint, job,
                                                           timedelta(seconds=timeout_s))
            hosting, again = False, f"--rdzv-endpoint {endpoint} --rdzv-id {job}"
        else:
            store, hosting = open_store(endpoint, spec.node_rank, timeout_s)
            address, started, again = endpoint, hosting, f"--rdzv-endpoint {endpoint}"
    except (RuntimeError, OSError, ValueError) as error:
        print(f"{_SAY} {error}", file=sys.stderr)
        return 2
    if started:
        print(f"{_SAY} job store at {endpoint}; to add workers later, run on any host: "
              f"lockstep run --elastic -n 1 {again} {spec.target}", file=sys.stderr,
              flush=True)
    host = os.environ.get("LOCKSTEP_HOST") or spec.local_addr or socket.gethostname()
    workers = [_start(spec, address, host, i) for i in range(spec.nproc)]
    try:
        code = _supervise(workers, lambda pid: worker_name(store, host, pid),
                          lambda pid: mark_gone(store, host, pid))
    finally:
        if lease is not None:
            lease.close()
    if hosting:
        _serve_until_idle(store)
    return code


def open_store(endpoint: str, node_rank: int | None, timeout_s: float
               ) -> tuple[dist.Store, bool]:
    """The job's store: hosted here if the endpoint is this host's and nobody serves it
    yet (or --node-rank 0 says so), else the one being served there."""
    host, _, port_text = endpoint.rpartition(":")
    port = int(port_text)
    timeout = timedelta(seconds=timeout_s)
    hosting = node_rank == 0 if node_rank is not None else _can_bind(host, port)
    if hosting:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timeout)
        store.set(_JOB_KEY, "1")
        return store, True
    _wait_for_listener(host, port, time.monotonic() + timeout_s)
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    if not store.check([_JOB_KEY]):
        raise RuntimeError(f"the store at {endpoint} is not an elastic lockstep job's")
    return store, False


def _can_bind(host: str, port: int) -> bool:
    """Whether this host could serve the endpoint: its address is ours and no one listens
    on the port. SO_REUSEADDR, as the store's own socket: a job that just ended leaves its
    connections in TIME_WAIT on the port, and without it the command run again took them
    for a live store, waited for one, and said none answered."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no elastic job answered at {host}:{port} ({error}); "
                                   "start the first launcher of the job there") from None
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(spec: LaunchSpec, endpoint: str, host: str,
           local_rank: int) -> subprocess.Popen[bytes]:
    target = ["-m", spec.target] if spec.module else [spec.target]
    return subprocess.Popen([sys.executable, "-u", *target, *spec.args],
                            env=worker_env(spec, endpoint, host, local_rank))


def worker_env(spec: LaunchSpec, endpoint: str, host: str, local_rank: int
               ) -> dict[str, str]:
    """A worker's environment: this launcher's, with the job's store, its host and its
    threads (the user's OMP_NUM_THREADS, or this host's share of the cores -- which the
    worker takes again as the job's workers on its host change: cores.share_cores)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", AUTO_THREADS)}
    initial = int(spec.nnodes.split(":")[-1]) * spec.nproc
    env.update({ENV_STORE: endpoint, ENV_INITIAL: str(initial), "LOCKSTEP_HOST": host,
                "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(spec.nproc)})
    if not env.get("OMP_NUM_THREADS"):  # the user's choice wins, and stays
        threads = str(threads_per_worker(spec.nproc))
        env.update({"OMP_NUM_THREADS": threads, AUTO_THREADS: threads})
    return env


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


def _supervise(workers: list[subprocess.Popen[bytes]], name: Callable[[int], str],
               gone: Callable[[int], None] = lambda pid: None) -> int:
    """Wait for every worker, reporting each one that fails when it fails (`name`: how to
    call the worker with this pid; `gone`: tell the job it exited)."""
    stopping: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        for w in workers:
            if w.poll() is None:
                w.terminate()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    failures: list[int] = []
    try:
        running = dict(enumerate(workers))
        while running:
            ended = [i for i, w in running.items() if w.poll() is not None]
            for i in ended:  # at once: the peers need not wait out its heartbeat. (One
                if running[i].returncode != 0:  # that finished said so: the store that
                    gone(running[i].pid)  # heard it may be gone already with its host)
            failed = any(running[i].returncode for i in ended)
            if failed and len(ended) < len(running):  # killed together: told together
                time.sleep(_TOGETHER_S)
                later = [i for i, w in running.items() if w.poll() is not None and i not in ended]
                for i in later:
                    if running[i].returncode != 0:
                        gone(running[i].pid)
                ended += later
            for w in [running.pop(i) for i in ended]:  # (popped first: `running` then
                if w.returncode != 0 and not stopping:  # holds only those still alive)
                    failures.append(w.returncode)
                    goes_on = "; the job goes on without it" if running else ""
                    print(f"{_SAY} {name(w.pid)} {_how(w.returncode)}{goes_on}",
                          file=sys.stderr, flush=True)
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping:
        return 128 + stopping[0]
    return _outcome(failures, len(workers))


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _outcome(failures: list[int], started: int) -> int:
    if not failures:
        return 0
    if len(failures) < started:
        print(f"{_SAY} {len(failures)} of this host's {started} workers were lost; the "
              "others finished the job", file=sys.stderr)
        return 0
    print(f"{_SAY} every worker this launcher started has failed (see above)",
          file=sys.stderr)
    first = failures[0]
    return first if first > 0 else 1


def _serve_until_idle(store: dist.Store, quiet_s: float = 5.0) -> None:
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
            print(f"{_SAY} serving the job's store until the workers started elsewhere "
                  "finish", file=sys.stderr, flush=True)
        time.sleep(0.2)
