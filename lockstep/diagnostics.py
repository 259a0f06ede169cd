"""Hangs that explain themselves.

Each rank publishes its progress (the training step it reached, and whether it has left) to
the process group's key-value store, at most once a second. When a collective fails or
times out, the waiting rank reads everyone's progress and names the rank that is behind or
gone, instead of leaving the user with a bare socket error.
"""

from __future__ import annotations

import atexit
import contextlib
import time

import torch.distributed as dist

_PREFIX = "lockstep/progress/"
_PUBLISH_INTERVAL_S = 1.0


class ProgressReporter:
    """Publishes this rank's step to the store; cheap enough to call every step."""

    def __init__(self) -> None:
        self.step = 0
        self._last_publish = 0.0
        self._store: dist.Store | None = None
        atexit.register(self.publish_exit)

    def _get_store(self) -> dist.Store | None:
        if self._store is None and dist.is_initialized():
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, ValueError):
                return None
        return self._store

    def advance(self) -> None:
        self.step += 1
        now = time.monotonic()
        if now - self._last_publish >= _PUBLISH_INTERVAL_S or self.step == 1:
            self._last_publish = now
            self._publish(state="running")

    def publish_exit(self) -> None:
        self._publish(state="exited")

    def _publish(self, state: str) -> None:
        store = self._get_store()
        if store is None or not dist.is_initialized():
            return
        # Progress is advisory: never let it break training or exit.
        with contextlib.suppress(Exception):
            store.set(f"{_PREFIX}{dist.get_rank()}", f"{self.step} {state} {time.time():.1f}")


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
    progress = _read_progress(world_size)
    if not progress:
        return "No progress reports were found (the store may be gone with rank 0)."
    now = time.time()
    parts = [f"rank {r}: step {s}{' (exited)' if state == 'exited' else ''}, "
             f"last report {now - stamp:.0f}s ago" for r, (s, state, stamp) in
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
        text += f" Rank(s) {behind} are behind: look at what they are doing (py-spy dump)."
    if silent:
        text += f" Rank(s) {silent} never reported progress."
    return text
