"""Hangs that explain themselves.

Each rank publishes its progress (the training step it reached, and whether it has left) to
the process group's key-value store, at most once a second. When a collective fails or
times out, the waiting rank reads everyone's progress and names the rank that is behind or
gone, instead of leaving the user with a bare socket error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from lockstep.logs import get_logger

log = get_logger(__name__)

_PREFIX = "lockstep/progress/"
_PUBLISH_INTERVAL_S = 0.5
_STOP_WAIT_S = 300.0  # the default collective (and store) timeout


PEER_CLOSED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What Gloo's and the store's errors say when the other end's process is gone: its
sockets closed (killed, crashed, or its group torn down). The one list every check of a
broken connection reads: collectives' explanations, fault tolerance's failures, the
store's loss."""

_STORE_LOST = (*PEER_CLOSED, "Connection reset", "Connection was likely closed",
               "Connection refused", "Failed to recv")


def peer_closed(error: BaseException) -> bool:
    """Whether `error` says the other end of a connection is gone."""
    return any(sign in str(error) for sign in PEER_CLOSED)


def connection_lost(error: BaseException) -> bool:
    """Whether a store call failed because its server is gone (the connection broke: a
    TCPStore client never reconnects), rather than a slow answer."""
    return any(sign in str(error) for sign in _STORE_LOST)


class ProgressReporter:
    """Publishes this rank's step to the store from a daemon thread.

    `advance()` is a plain increment, cheap enough for every step. The thread publishes the
    latest value twice a second, and keeps doing so while the training thread is blocked in
    a collective, so a waiting rank always reads its peers' progress less than a second old.
    """

    def __init__(self) -> None:
        self.step = 0
        self._published: tuple[int, str] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # More work for the same thread, at the same pace (the stall watchdog's checks):
        # one thread per process, however many watchers.
        self.ticks: list[Callable[[], None]] = []
        self.store_lost = False  # its server is gone: every later call would fail too

    def advance(self) -> None:
        self.step += 1
        if self._thread is None:
            self.start()

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="lockstep-progress",
                                            daemon=True)
            self._thread.start()

    def stop(self, wait_s: float = _STOP_WAIT_S) -> None:
        """End the thread and wait until it has (at exit, before the process group goes).

        Waited for to the end, not for a moment: a thread still inside a store call when
        the interpreter finalizes aborts the process as the call returns ("terminate called
        without an active exception": CPython ends a daemon thread that wants the GIL back
        then, and the unwinding crosses torch's C++), or reads a store being destroyed. A
        store call ends within the store's timeout, which bounds `wait_s`."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=wait_s)
        if thread.is_alive():
            log.warning("the progress thread is still inside a store call after %.0fs; "
                        "exiting anyway", wait_s)

    def _run(self) -> None:
        while not self._stop.is_set() and not self.store_lost:  # (each failed call logs
            self.publish("running")                                # a C++ stack trace)
            for tick in list(self.ticks):
                if self._stop.is_set():  # exit waits for this thread: no new store calls
                    return
                tick()
            self._stop.wait(_PUBLISH_INTERVAL_S)

    def publish_exit(self) -> None:
        self.publish("exited")

    def publish(self, state: str) -> None:
        with self._lock:
            if self._published == (self.step, state) or not dist.is_initialized():
                return
            if self.store_lost:
                return
            # Progress is advisory: never let it break training or exit.
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set(f"{_PREFIX}{dist.get_rank()}",
                          f"{self.step} {state} {time.time():.1f}")
                self._published = (self.step, state)
            except Exception as error:
                self.store_lost = connection_lost(error)


reporter = ProgressReporter()


def _read_progress(world_size: int) -> dict[int, tuple[int, str, float]]:
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return {}
    found: dict[int, tuple[int, str, float]] = {}
    for rank in range(world_size):
        key = f"{_PREFIX}{rank}"
        try:
            if store.check([key]):
                step, state, stamp = store.get(key).decode().split()
                found[rank] = (int(step), state, float(stamp))
        except Exception:
            continue
    return found


def explain_stall(rank: int, world_size: int) -> str:
    """A sentence or two on which ranks are behind, for an error message."""
    reporter.publish("running")
    progress = _read_progress(world_size)
    if not progress:
        return "No progress reports were found (the store may be gone with rank 0)."
    now = time.time()
    parts = [f"rank {r}: step {s}{' (exited)' if state == 'exited' else ''}, "
             f"last report {max(0.0, now - stamp):.0f}s ago" for r, (s, state, stamp) in
             sorted(progress.items())]
    text = "Progress by rank: " + "; ".join(parts) + "."
    silent = [r for r in range(world_size) if r not in progress]
    exited = [r for r, (_, state, _) in progress.items() if state == "exited" and r != rank]
    steps = {r: s for r, (s, _, _) in progress.items()}
    behind = [r for r in steps if steps[r] < max(steps.values())]
    if exited:
        text += (f" Rank(s) {exited} left while this rank still waited: if they ran out of "
                 "data early (uneven inputs), wrap the loop in `with model.join():` or give "
                 "every rank the same number of batches (lockstep.ShardedSampler does).")
    elif behind:
        text += (f" Rank(s) {behind} are behind: if they have no more data (uneven inputs), "
                 "wrap the loop in `with model.join():`; if they are stuck, `py-spy dump "
                 "--pid PID` shows where.")
    if silent:
        text += f" Rank(s) {silent} never reported progress."
    return text
