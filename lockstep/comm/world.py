"""The world: who this process is among the workers, and the process group that joins them.

`init()` turns the environment torchrun (or `lockstep run`) sets up into a process group and a
`World`. Without a launcher it makes a world of one on an in-memory store, so the same script
runs unchanged on a laptop, under `lockstep run -n 4`, and across hosts.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.comm import allocator, watchdog
from lockstep.comm.diagnostics import reporter
from lockstep.logs import get_logger, setup_logging

log = get_logger(__name__)

DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("LOCKSTEP_TIMEOUT", "300")))

# How long a store has to answer a connection it accepted: a program silent this long is
# not one. A store answers in a millisecond, but about 1 connection in 25 takes 5 s (a
# retry inside TCPStore, measured on a loaded machine): three times that.
HANDSHAKE_S = 15.0

_world: World | None = None  # torch.distributed's default group is process-global; so is this.


@dataclass(frozen=True)
class World:
    """This process's place in the job. Created by `init()`; one per process."""

    rank: int
    """Global rank, 0 .. world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this host; picks the GPU."""
    local_world_size: int
    """Number of processes on this host."""
    device: torch.device
    """Where this rank's replica lives: cuda:LOCAL_RANK under NCCL, else cpu."""
    backend: str
    """The torch.distributed backend: "gloo" or "nccl"."""
    timeout: timedelta
    """How long any collective may wait before it fails with an explanation."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs, saves and prints summaries."""
        return self.rank == 0

    @property
    def num_hosts(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def barrier(self) -> None:
        from lockstep import comm  # world sits below comm in the layering

        comm.barrier("World.barrier()")

    def shutdown(self) -> None:
        """Destroy the process group; `init()` may be called again afterwards."""
        global _world
        if dist.is_initialized():
            dist.destroy_process_group()
        _world = None


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"lockstep.init: environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"lockstep.init: {name}={value!r} is not an integer") from None


def _pick_backend(requested: str | None) -> str:
    if requested is not None:
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def _pick_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _group_timeout() -> timedelta | None:
    """The timeout the default group's collectives were given when it was made (asked of
    each backend it has: a CUDA-only group has no CPU one)."""
    group = dist.distributed_c10d._get_default_group()
    for device in getattr(group, "_device_types", []):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options
            continue
    return None


def _world_from_group(backend: str, timeout: timedelta) -> World:
    # Without launcher variables the group is taken to live on one host (a test harness).
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    return World(rank, world_size, local_rank, local_world_size,
                 _pick_device(backend, local_rank), backend, timeout)


def init(backend: str | None = None, timeout: timedelta | float | None = None,
         stall_after: float | None = None) -> World:
    """Join the job: create the process group from torchrun's environment. Idempotent.

    Steps: read RANK/WORLD_SIZE/LOCAL_RANK (and MASTER_ADDR/MASTER_PORT through torch's env://
    rendezvous); pick NCCL with one GPU per LOCAL_RANK when CUDA is present, else Gloo on CPU;
    create the default process group with `timeout` for every collective; set up logging so
    that every record carries the rank and only rank 0 speaks at INFO.

    Without WORLD_SIZE in the environment this is a world of one on an in-memory store: no
    network, no launcher, and the same code paths as a real job.

    `stall_after` (seconds; else LOCKSTEP_STALL_AFTER, else min(15, timeout / 2); 0: off):
    a collective that waits longer is reported, naming the ranks that have not reached it
    and where they stand (watchdog.py). The same on every rank.
    """
    global _world
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    if _world is not None and dist.is_initialized():
        if stall_after is not None:  # a later call may change it
            seconds = _world.timeout.total_seconds()
            watchdog.start(watchdog.stall_after_setting(stall_after, seconds), seconds,
                           _world.backend)
        return _world
    import_what_binds_the_default_group()
    if dist.is_initialized():  # someone else (a test harness, Accelerate...) made the group
        # and lockstep's own waits (host barriers, the watchdog) keep the timeout it chose
        backend = backend or dist.get_backend()
        timeout = timeout or _group_timeout() or DEFAULT_TIMEOUT
        _world = _world_from_group(backend, timeout)
    elif "WORLD_SIZE" not in os.environ:
        chosen, timeout = _pick_backend(backend), timeout or DEFAULT_TIMEOUT
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        _world = World(0, 1, 0, 1, _pick_device(chosen, 0), chosen, timeout)
    else:
        _world = _init_from_env(_pick_backend(backend), timeout or DEFAULT_TIMEOUT)
    setup_logging(_world.rank)
    if _world.device.type == "cpu":  # gradients and buckets come and go every step
        log.debug("CPU memory: %s", allocator.keep_freed_memory())
    seconds = _world.timeout.total_seconds()
    watchdog.start(watchdog.stall_after_setting(stall_after, seconds), seconds, _world.backend)
    register_exit_once()
    log.info("lockstep world: %d rank(s), backend %s, device %s", _world.world_size,
             _world.backend, _world.device)
    return _world


def import_what_binds_the_default_group() -> None:
    """Import torch.distributed.nn before the default group exists. Its functional module
    binds `group.WORLD` as the default argument of ten functions when first imported, and
    torch._dynamo imports it (a first torch.compile or compiler.disable, e.g. when a wrapper
    is built). Imported after the group is made, those defaults hold the group for the life
    of the process: destroy_process_group cannot end its Gloo threads, which then run on
    through the interpreter's finalization -- where a native thread that needs the GIL
    aborts the process ("terminate called without an active exception"). Imported first,
    the defaults are None. (A group made before lockstep.init is beyond this.)"""
    import torch.distributed.nn  # noqa: F401


def retire_default_group() -> None:
    """Destroy the default group without waiting for its connections to close.

    destroy_process_group only forgets a group: its Gloo transport closes in the group's
    destructor, when the last reference goes, and that destructor waits 20-30 ms for Gloo's
    threads (3 ranks on this machine) -- a quarter of the time the members of an elastic
    job stood still to let a joiner in. The last reference is let go on a thread of its own:
    torch releases the GIL in a group's destructor, so this rank forms the next group
    meanwhile, and a peer blocked in a collective with it sees the sockets close as soon
    as before. Not a daemon: the interpreter waits for it before it finalizes (a destructor
    still running then would abort the process)."""
    if not dist.is_initialized():
        return
    last = [dist.group.WORLD]
    dist.destroy_process_group()
    threading.Thread(target=last.clear, name="lockstep-group-reaper").start()


_exit_registered = False


def register_exit_once() -> None:
    global _exit_registered
    if not _exit_registered:
        atexit.register(_at_exit)
        _exit_registered = True


_before_exit: list[Callable[[], None]] = []


def before_exit(release: Callable[[], None]) -> None:
    """Run `release` at exit before the process groups go (the layers above give back the
    threads and groups of what is still alive: replication/ownership.py). Local only: by
    then a peer may have exited, so `release` must issue no collective."""
    _before_exit.append(release)


def _at_exit() -> None:
    """Say this rank has left (so waiting peers can name it), then tear the group down:
    exiting with a live Gloo group intermittently aborts the process in torch's teardown
    ("terminate called without an active exception"), which a launcher reports as a crash.
    The progress thread stops first, waited for until it has: it must not be inside a store
    call meanwhile, nor when the interpreter finalizes (diagnostics.ProgressReporter.stop).

    destroy_process_group only forgets the groups: Gloo's threads (pt_gloo_runloop,
    gloo_tcp_loop) and the store's run until the last Python reference to a group goes.
    A wrapper still alive at exit holds its own groups, and reference cycles hold others
    until a collection, so they would run on through the interpreter's finalization, while
    peers exit and close the connections under them. So what is alive is released first,
    and a collection ends the groups left in cycles now, while the interpreter is whole."""
    reporter.stop((_world.timeout if _world is not None else DEFAULT_TIMEOUT).total_seconds())
    watchdog.flush()
    reporter.publish_exit()
    for release in _before_exit:
        with contextlib.suppress(Exception):  # exit goes on: the rest still needs releasing
            release()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _init_from_env(backend: str, timeout: timedelta) -> World:
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise RuntimeError(f"lockstep.init: RANK={rank} is outside 0..{world_size - 1} "
                           f"(WORLD_SIZE={world_size})")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(f"lockstep.init (rank {rank}): {name} is not set; launch with "
                               "`lockstep run` or torchrun, which set it")
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    device = _pick_device(backend, local_rank)
    # What init_process_group does with env://, but with a deadline on the rendezvous.
    store = dist.PrefixStore("default_pg", _rendezvous(rank, world_size, timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if backend == "nccl" else None)
    return World(rank, world_size, local_rank, local_world_size, device, backend, timeout)


def _rendezvous(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """torch's env:// store -- rank 0 hosts it at MASTER_ADDR:MASTER_PORT (under torchrun,
    the launcher does) -- reached within `timeout`, or an error naming the rank and address.

    TCPStore alone can wait forever: a client whose connection is accepted by some other
    program on that port (rank 0 having failed to bind it) waits for a reply that never
    comes. So a client first waits for anything to listen there (plain sockets, a clean
    deadline: rank 0 may start late), then lets TCPStore connect in a thread it abandons
    after HANDSHAKE_S -- a store answers a connection at once, so what is silent that long
    is some other program -- only ever blocked on a reply, which ends with the process."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    started = time.monotonic()
    deadline = started + timeout.total_seconds()
    try:
        if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return _env_store(rank, world_size, timeout)  # binds, or fails at once
        _wait_for_listener(deadline)
        answer_by = min(deadline, time.monotonic() + HANDSHAKE_S)
        return _within(answer_by, lambda: _env_store(rank, world_size, timeout))
    except Exception as error:
        problem = _rendezvous_problem(error, rank, time.monotonic() - started)
        raise RuntimeError(f"lockstep.init: rank {rank} could not reach the rendezvous at "
                           f"{where}: {problem}") from error


def _env_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    store: dist.Store = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))[0]
    store.set_timeout(timeout)
    return store


def _wait_for_listener(deadline: float) -> None:
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection(address, timeout=max(0.05, min(1.0, left))):
                return
        except OSError as error:
            if time.monotonic() + 0.1 >= deadline:
                raise TimeoutError(f"nothing accepted a connection there ({error})") from None
        time.sleep(0.1)


def _within(deadline: float, connect: Callable[[], dist.Store]) -> dist.Store:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(connect())
        except Exception as error:  # re-raised in the caller's thread
            outcome.append(error)

    thread = threading.Thread(target=run, name="lockstep-rendezvous", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not outcome:
        raise TimeoutError("a program accepted the connection there but never answered as a "
                           "torch.distributed store: another program holds the port")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _rendezvous_problem(error: Exception, rank: int, waited_s: float) -> str:
    if "EADDRINUSE" in str(error):
        return ("this rank hosts it, and the port is in use by another program "
                "(EADDRINUSE); set MASTER_PORT to a free port, the same on every rank")
    what = (str(error).strip().splitlines() or [type(error).__name__])[0]
    what = f"{what} (waited {waited_s:.0f}s)"
    if rank == 0:
        return f"{what}; check that every rank was started with the same MASTER_ADDR/PORT"
    return (f"{what}. Rank 0 hosts it: check that rank 0 is running, that MASTER_ADDR and "
            "MASTER_PORT are the same on every rank, and that no other program holds the port")


def adopt(world: World) -> None:
    """Make `world` the current one. The elastic membership (membership.py) re-creates the
    default process group when workers leave or join; the World describing it follows."""
    global _world
    _world = world


def current() -> World:
    """The world made by `init()`; calls `init()` if nobody has yet."""
    return _world if _world is not None and dist.is_initialized() else init()
