"""`lockstep run --elastic`: workers that may die, and be added, without stopping the rest.

torchrun's agent stops every worker when one fails and restarts them all -- the opposite of
what a fault-tolerant job (lockstep.Elastic) needs. This launcher hosts the job's store (or
finds the store another launcher of the job hosts at --rdzv-endpoint, or etcd's), starts N
workers with LOCKSTEP_ELASTIC pointing at it, and watches them: a worker that dies is
reported at once and the others go on. The same command started again later -- on this
host or another -- adds workers, which join the running job at its next step boundary.

The workers start before this launcher loads torch (jobstore.py holds all it needs torch
for): each worker loads its own meanwhile and connects once the store answers. Loaded
first, torch's ~2 s of import came twice, one after the other, before a restarted worker
could even begin its own start. Where the launcher neither hosts the store (workers wait
on it) nor holds an etcd lease (renewed on a thread of its own), its import runs at a lower
priority, so that on a machine of few cores it takes the CPU its workers leave rather than
half of theirs.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, ModuleType

from lockstep.cores import AUTO_THREADS, threads_per_worker
from lockstep.elastic import etcd
from lockstep.elastic.config import ENV_INITIAL, ENV_STORE
from lockstep.launch.run import LaunchSpec, refused

SAY = "lockstep run --elastic:"  # what begins each of the launcher's messages
_TOGETHER_S = 0.5  # workers that exit this close together are reported as one event
_IMPORT_NICENESS = 10  # a thread at nice 10 gets about a tenth of a core a nice-0 one wants


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


@dataclass
class _StorePlace:
    """Where the job keeps its store, settled before torch loads: the endpoint asked for;
    the address its workers connect to (etcd's: under the run's prefix); the arguments
    that add workers later; the port this launcher claimed to host it on (bound and
    listening, so that no other process -- nor a worker connecting to itself -- takes it
    meanwhile; torch's store adopts the socket); etcd's lease; and whether this launcher
    started the job."""

    endpoint: str
    address: str
    rejoin: str
    listener: socket.socket | None = None
    lease: etcd.LauncherLease | None = None
    started: bool = False

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()
        if self.listener is not None:
            self.listener.close()  # (a no-op once the store took it: detached)


def run_elastic(spec: LaunchSpec, timeout_s: float = 60.0) -> int:
    """Launch this host's workers of an elastic job and wait. Returns 0 if the job
    finished (on whichever workers were left), else the first failed worker's code."""
    if refused(spec):
        return 2
    workers: list[subprocess.Popen[bytes]] = []
    place: _StorePlace | None = None
    handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        place = _find_store(spec)
        host = os.environ.get("LOCKSTEP_HOST") or spec.local_addr or socket.gethostname()
        for local_rank in range(spec.nproc):
            workers.append(_start(spec, place.address, host, local_rank))
        return _watch(workers, place, host, spec.target, timeout_s)
    except _Interrupted as stop:
        _stop(workers)
        return 128 + stop.signum
    except (RuntimeError, OSError, ValueError) as error:
        _stop(workers)
        print(f"{SAY} {error}", file=sys.stderr)
        return 2
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if place is not None:
            place.close()


def _find_store(spec: LaunchSpec) -> _StorePlace:
    """The job's store for this launch: its run in etcd (joined over HTTP), or a TCP port
    this launcher claims to host it on (the job's first launcher: the endpoint is this
    host's and free, or --node-rank 0 says so), or the one another launcher hosts."""
    endpoint = spec.rdzv_endpoint
    if endpoint is not None and endpoint.startswith(etcd.SCHEME):
        job = spec.rdzv_id or "lockstep"
        _load_jobstore(urgent=True)  # (torch first: an import holding the GIL for long
        address, lease, started = etcd.join_job(endpoint, job)  # would starve the lease)
        return _StorePlace(endpoint, address, f"--rdzv-endpoint {endpoint} --rdzv-id {job}",
                      lease=lease, started=started)
    if endpoint is None:  # a job of this host alone, on a port the system picks
        chosen = _listen("127.0.0.1", 0)
        endpoint = f"127.0.0.1:{chosen.getsockname()[1]}"
        return _StorePlace(endpoint, endpoint, f"--rdzv-endpoint {endpoint}", chosen, started=True)
    host, _, port = endpoint.rpartition(":")
    listener = None if spec.node_rank not in (None, 0) else \
        _claim_port(host, int(port), needed=spec.node_rank == 0)
    return _StorePlace(endpoint, endpoint, f"--rdzv-endpoint {endpoint}", listener,
                  started=listener is not None)


def _claim_port(host: str, port: int, needed: bool) -> socket.socket | None:
    """The endpoint's port, bound and listening here, if this host can serve it: its
    address is ours and no one listens on it (else None, or an error if `needed`)."""
    try:
        return _listen(host, port)
    except OSError as error:
        if error.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL) and not needed:
            return None
        raise OSError(error.errno, f"cannot host the job's store at {host}:{port}: "
                                   f"{error.strerror}") from None


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT and listening (workers that connect before the store
    is up wait in its backlog). SO_REUSEADDR, as torch's store sets it: a job that just
    ended leaves its connections in TIME_WAIT on the port, and without it the command run
    again took them for a live store, waited for one, and said none answered."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def _watch(workers: list[subprocess.Popen[bytes]], place: _StorePlace, host: str, target: str,
           timeout_s: float) -> int:
    """Open the job's store (hosting it on the claimed port), then supervise the workers
    already started. If the store cannot be had: the workers' outcome if they all ended
    well already (a short job's store may be gone with it), else the error."""
    def running() -> bool:
        return any(w.poll() is None for w in workers)

    hosting = place.listener is not None
    try:
        jobstore = _load_jobstore(urgent=hosting)
        listen_fd = place.listener.detach() if place.listener is not None else None
        store = jobstore.open_job_store(place.address, listen_fd, timeout_s, running)
    except (RuntimeError, OSError, ValueError):
        if not running() and all(w.returncode == 0 for w in workers):
            return _supervise(workers, _unnamed)
        raise
    if place.started:
        print(f"{SAY} job store at {place.endpoint}; to add workers later, run on any "
              f"host: lockstep run --elastic -n 1 {place.rejoin} {target}", file=sys.stderr,
              flush=True)
    code = _supervise(workers, lambda pid: jobstore.worker_name(store, host, pid),
                      lambda pid: jobstore.mark_gone(store, host, pid))
    if hosting:
        jobstore.serve_until_idle(store)
    return code


def _unnamed(pid: int) -> str:
    return f"a worker of this host (pid {pid})"


def _load_jobstore(urgent: bool) -> ModuleType:
    """jobstore.py, and torch with it. Unless `urgent` (workers wait on the store this
    launcher hosts), loaded on a thread of lower priority (Linux sets it per thread; the
    launcher's own keeps its priority, to answer a worker's exit at once)."""
    name = "lockstep.launch.jobstore"
    if urgent or sys.platform != "linux":
        return importlib.import_module(name)
    loaded: list[ModuleType | BaseException] = []

    def load() -> None:
        me = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, me,
                           min(os.getpriority(os.PRIO_PROCESS, me) + _IMPORT_NICENESS, 19))
        try:
            loaded.append(importlib.import_module(name))
        except BaseException as error:  # (raised again on the launcher's thread)
            loaded.append(error)

    thread = threading.Thread(target=load, name="lockstep-launcher-import", daemon=True)
    thread.start()
    thread.join()
    if isinstance(loaded[0], BaseException):
        raise loaded[0]
    return loaded[0]


def _stop(workers: list[subprocess.Popen[bytes]]) -> None:
    """Stop workers this launcher started and has given up on (no store for them)."""
    for w in workers:
        if w.poll() is None:
            w.terminate()
    for w in workers:
        try:
            w.wait(timeout=10)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


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
                    print(f"{SAY} {name(w.pid)} {_how(w.returncode)}{goes_on}",
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
        print(f"{SAY} {len(failures)} of this host's {started} workers were lost; the "
              "others finished the job", file=sys.stderr)
        return 0
    print(f"{SAY} every worker this launcher started has failed (see above)",
          file=sys.stderr)
    first = failures[0]
    return first if first > 0 else 1
