"""Run a function on every rank of a real multi-process Gloo world -- for tests and tools.

Starting a process costs ~2 s of `import torch` here, so a `World` of N processes is started
once and then runs many functions. Each function runs on all ranks with the default
process group already made (a fresh FileStore per world) and `lockstep.init()` already
called; its per-rank return values come back in rank order. A deadline guards every call:
a world that does not answer in time is killed and the error says which function hung and
which ranks never answered. Any failure also discards the world (its collectives may be
out of step), and the next call starts a fresh one.

Processes come from a forkserver that has already imported torch, which makes starting a
world ~10x cheaper than plain spawn while keeping spawn's safety (nothing is forked from a
process that has started threads).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "lockstep", "lockstep.replication.replica",
            "lockstep.training.trainer"]


class WorldError(RuntimeError):
    """A function failed or hung on some rank of a test world."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, store_path: str, timeout_s: float,
            tasks: Any, results: Any, env: dict[str, str], backend: str) -> None:
    # One host by default; LOCAL_WORLD_SIZE in `env` splits the world into emulated hosts.
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank % local_world_size),
                      LOCAL_WORLD_SIZE=str(local_world_size))
    import torch
    import torch.distributed as dist

    import lockstep

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    if backend == "nccl":  # one GPU per rank, as lockstep.init picks it
        torch.cuda.set_device(rank % local_world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    lockstep.init()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs, probe = task
        try:
            value = fn(*args, **kwargs)
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
            continue
        if probe:  # a function that caught a collective failure may have broken the group
            try:
                if backend == "gloo":  # NCCL has no monitored barrier
                    dist.monitored_barrier(timeout=timedelta(seconds=10))
                else:
                    dist.barrier()
            except RuntimeError as error:
                results.put((rank, False, f"{_name(fn)} returned, but left the process "
                                          f"group unusable: {error}"))
                continue
        results.put((rank, True, value))
    dist.destroy_process_group()


class World:
    """N processes joined in one process group (Gloo; NCCL on GPUs when asked), kept alive
    between calls."""

    def __init__(self, world_size: int, collective_timeout_s: float = 30.0,
                 env: dict[str, str] | None = None, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self.collective_timeout_s = collective_timeout_s
        self.env = dict(env or {})
        self._procs: list[Any] = []
        self._store_dir: tempfile.TemporaryDirectory[str] | None = None

    def _start(self) -> None:
        ctx = _context()
        self._store_dir = tempfile.TemporaryDirectory(prefix="lockstep-world-")
        store_path = os.path.join(self._store_dir.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"lockstep-rank{rank}",
                                   args=(rank, self.world_size, store_path,
                                         self.collective_timeout_s, self._tasks[rank],
                                         self._results, self.env, self.backend))
                       for rank in range(self.world_size)]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable[..., Any], *args: Any, deadline_s: float = 120.0,
            breaks_group: bool = False, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.

        Afterwards every rank checks the group still works (a monitored barrier), so a
        function that leaves it broken is blamed, not the next one. A function that breaks
        it on purpose (to test an error) says `breaks_group=True`: the world is then retired.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs, not breaks_group))
        results, failures = self._collect(fn, deadline_s)
        if breaks_group:
            self.close()
        if failures:
            self.close()
            detail = "\n".join(f"--- rank {rank} ---\n{tb}"
                               for rank, tb in sorted(failures.items()))
            raise WorldError(f"{_name(fn)} failed on rank(s) {sorted(failures)} of a world of "
                             f"{self.world_size}:\n{detail}")
        return [results[rank] for rank in range(self.world_size)]

    def _collect(self, fn: Callable[..., Any], deadline_s: float
                 ) -> tuple[dict[int, Any], dict[int, str]]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + deadline_s
        while len(results) + len(failures) < self.world_size:
            if failures:  # the rest may be stuck waiting for the failed rank
                deadline = min(deadline, time.monotonic() + self.collective_timeout_s + 5)
            try:
                rank, ok, value = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                silent = [r for r in range(self.world_size) if r not in results | failures]
                self.close()
                if failures:
                    return results, failures
                raise WorldError(f"{_name(fn)} hung: rank(s) {silent} of a world of "
                                 f"{self.world_size} did not finish within {deadline_s:.0f}s; "
                                 "the world was killed") from None
            (results if ok else failures)[rank] = value
        return results, failures

    def close(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        self._procs = []
        if self._store_dir is not None:
            self._store_dir.cleanup()
            self._store_dir = None

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@contextlib.contextmanager
def collectives_issued() -> Iterator[list[str]]:
    """The labels of the collectives (and host barriers) this process issues inside the
    block, group by group in the order each issued them, as the stall watchdog's ledger
    numbers them (it is on in a World): filled in as the block ends."""
    from lockstep.comm.ledger import ledger

    def newest() -> dict[str, int]:
        return {key: max((n for n, _, _ in ledger.recent(key, 1)), default=0)
                for key in list(ledger.history)}

    labels: list[str] = []
    before = newest()
    try:
        yield labels
    finally:
        labels += [label for key, last in newest().items() if last > before.get(key, 0)
                   for _, _, label in ledger.recent(key, last - before.get(key, 0))]
