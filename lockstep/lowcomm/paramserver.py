"""An asynchronous parameter server over torch.distributed's key-value store.

Rank 0 serves: it holds the parameters and the optimizer. Every other rank is a worker: it
computes a gradient on its own data, pushes it, and pulls fresh parameters -- without
waiting for the other workers. The server applies each gradient as it arrives (scaled by
1/workers, so that with plain SGD a full round of updates equals one averaged step).

The training budget is a number of updates; the server tells the workers to stop when it
is spent, so fast workers simply do more of the work. Staleness -- how many updates
happened between the parameters a gradient was computed on and its arrival -- is bounded:

- max_staleness = 0 is synchronous SGD: each round every worker waits for permission,
  reads the snapshot taken when the round began, and the round ends when all have pushed
  (a worker silent for `dead_after_s` while others progress is dropped from the rounds).
- max_staleness > 0: nobody waits. A gradient staler than the bound is rejected (counted,
  not applied) and its worker just pulls fresh parameters, so a straggler slows only
  itself.

A worker that fails says so (`Worker.fail`) and is dropped at once; one silent for
`dead_after_s` while others progress, or (once it has pushed) while no worker progresses at
all, is dropped too.
When every worker is gone before the budget is spent, the server stops with an error
naming each one and why (ParameterServerError) rather than wait for them forever.

The server reports how many gradients it applied and rejected and their staleness.

Everything travels through the store the process group already has (TCPStore under
torchrun): workers block on the server's grants with store.wait, no busy polling, and a
dead worker leaves no broken socket behind in anyone's process group.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lockstep.logs import get_logger
from lockstep.optim import set_lr
from lockstep.replication.choices import refusing

log = get_logger(__name__)
_POLL_S = 0.0005


def session_prefix() -> str:
    """A key prefix unique to this run, agreed by all ranks (collective): a second run on
    the same process group must not see the first one's keys."""
    from lockstep import comm

    token = comm.broadcast_object(uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None, 0,
                                  "parameter server: agree on a session")
    return f"lockstep/ps/{token}/"


def _put(store: dist.Store, key: str, data: bytes) -> None:
    store.set(key, data)  # type: ignore[arg-type]  # the store takes bytes as well as str


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().numpy().tobytes()


def _from_bytes(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())


def flatten_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def _pieces(module: nn.Module, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter,
                                                                     torch.Tensor]]:
    """Each parameter with its piece of `flat`, laid out as flatten_params lays them."""
    offset = 0
    for p in module.parameters():
        yield p, flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def load_flat(module: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        for p, piece in _pieces(module, flat):
            p.copy_(piece)


class ParameterServerError(RuntimeError):
    """Every worker is gone before the training budget was spent."""


@dataclass
class ServerStats:
    applied: int = 0
    rejected: int = 0
    staleness: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {"applied": self.applied, "rejected": self.rejected,
                "dead_workers": len(self.dead),
                "staleness_mean": statistics.fmean(self.staleness) if self.staleness else 0.0,
                "staleness_max": max(self.staleness, default=0)}


class ParameterServer:
    """The server half: run `serve()` on rank 0 until every worker is done or dead."""

    def __init__(self, module: nn.Module,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 prefix: str, updates: int, max_staleness: int = 4,
                 dead_after_s: float = 60.0,
                 lr_at: Callable[[int], float] | None = None) -> None:
        self.module, self.prefix, self.updates = module, prefix, updates
        self.optimizer = optimizer(module.parameters())
        self.store = dist.distributed_c10d._get_default_store()
        self.workers = list(range(1, dist.get_world_size()))
        self.max_staleness, self.dead_after_s = max_staleness, dead_after_s
        self.lr_at = lr_at
        self.version = 0
        self.clock = dict.fromkeys(self.workers, 0)  # gradients applied per worker
        self.granted = dict.fromkeys(self.workers, -1)
        self.last_heard = dict.fromkeys(self.workers, time.monotonic())
        self.done: set[int] = set()
        self.gone: dict[int, str] = {}  # dead workers: why
        self.stats = ServerStats()
        self._looked = 0.0  # when failure reports were last read

    def serve(self) -> ServerStats:
        """Apply gradients until the budget of updates is spent (or, at bound 0, until
        every worker is done or dead), then publish the final parameters."""
        self._publish()
        self._snapshot = 0
        _put(self.store, f"{self.prefix}params@0", self._published)
        self._grant()
        while self.stats.applied < self.updates and \
                len(self.done) + len(self.stats.dead) < len(self.workers):
            if not self._take_any():
                self._check_dead()
                time.sleep(_POLL_S)
        self.store.set(f"{self.prefix}stop", "1")
        if not self.done and self.stats.applied < self.updates:
            why = "; ".join(f"worker rank {w} {reason}" for w, reason in self.gone.items())
            raise ParameterServerError(
                f"rank 0: parameter server: every worker is gone ({why}), with "
                f"{self.stats.applied} of {self.updates} updates applied; nothing is left to "
                "train the model")
        _put(self.store, f"{self.prefix}final", _to_bytes(flatten_params(self.module)))
        return self.stats

    def _publish(self) -> None:
        """Put the parameters, after their version, where workers pull them; kept, so a
        round's snapshot is a copy of it rather than a read back from the store."""
        self._published = np.int64(self.version).tobytes() + \
            _to_bytes(flatten_params(self.module))
        _put(self.store, f"{self.prefix}params", self._published)

    def _live(self) -> list[int]:
        return [w for w in self.workers if w not in self.done and w not in self.stats.dead]

    def _grant(self) -> None:
        """At bound 0, let every live worker start the next round once all have finished
        this one, from a snapshot taken when the round began (a worker that starts late
        must not see the round's first updates: that would not be synchronous SGD)."""
        if self.max_staleness:
            return  # nobody waits
        live = self._live()
        slowest = min((self.clock[w] for w in live), default=0)
        if slowest > self._snapshot:
            self._snapshot = slowest
            _put(self.store, f"{self.prefix}params@{slowest}", self._published)
            if slowest >= 2:  # every live worker has read the one two rounds back
                self.store.delete_key(f"{self.prefix}params@{slowest - 2}")
        for w in live:
            while self.granted[w] < slowest:
                self.granted[w] += 1
                self.store.set(f"{self.prefix}go/{w}/{self.granted[w]}", "1")

    def _take_any(self) -> bool:
        took = False
        for w in self._live():
            if self.store.check([f"{self.prefix}done/{w}"]) and not self._pending(w):
                self.done.add(w)
                self._grant()
                took = True
            elif self._pending(w):
                self._apply(w)
                took = True
        return took

    def _pending(self, w: int) -> bool:
        return self.store.check([f"{self.prefix}grad/{w}/{self.clock[w]}"])

    def _apply(self, w: int) -> None:
        key = f"{self.prefix}grad/{w}/{self.clock[w]}"
        data = self.store.get(key)
        self.store.delete_key(key)
        used = int(np.frombuffer(data[:8], dtype=np.int64)[0])
        self.clock[w] += 1
        self.last_heard[w] = time.monotonic()
        if self.max_staleness and self.version - used > self.max_staleness:
            self.stats.rejected += 1  # too old: its worker will pull fresh parameters
            return
        grad = _from_bytes(data[8:]).div_(len(self.workers))
        self.stats.staleness.append(self.version - used)
        for p, piece in _pieces(self.module, grad):
            p.grad = piece.to(p.dtype)
        if self.lr_at is not None:
            set_lr(self.optimizer, self.lr_at(self.version // len(self.workers)))
        self.optimizer.step()
        self.version += 1
        self.stats.applied += 1
        self._publish()
        self._grant()

    def _check_dead(self) -> None:
        """Drop workers that said they failed, and those silent for dead_after_s while
        others progressed -- or, once started, while none did: nothing will ever come."""
        now = time.monotonic()
        if now - self._looked > 0.1:  # a store read per worker: not at every poll
            self._looked = now
            for w in self._live():
                if self.store.check([f"{self.prefix}failed/{w}"]):
                    reason = self.store.get(f"{self.prefix}failed/{w}").decode(errors="replace")
                    self._drop(w, f"failed: {reason}")
        silent = {w: now - self.last_heard[w] for w in self._live()
                  if now - self.last_heard[w] > self.dead_after_s}
        dead, stuck = silent_to_drop(silent, {w: self.clock[w] for w in self._live()})
        for w in dead:
            self._drop(w, f"sent nothing for {silent[w]:.0f}s" +
                       ("" if stuck else " while others progressed"))
        if dead:  # the others may have been waiting on a round the dead held up: their
            for other in self._live():  # silence counts from now, when the drop frees them
                self.last_heard[other] = now

    def _drop(self, w: int, reason: str) -> None:
        log.warning("parameter server: worker rank %d %s; treating it as dead", w, reason)
        self.gone[w] = reason
        self.stats.dead.append(w)
        self._grant()


def silent_to_drop(silent: dict[int, float], clock: dict[int, int]) -> tuple[list[int], bool]:
    """Which silent workers are dead, given every live worker's clock (gradients applied),
    and whether the job was stuck (no live worker heard from lately).

    A silent worker behind the others is dead: they progressed without it. When every
    live worker is silent, those behind go first -- the ones ahead may only be waiting on
    the round the laggards hold up (a loaded machine can let both silences pass the bound
    before the server looks). Only when none is behind is everyone who has pushed dead:
    nothing will ever come. One that never pushed may still be starting: it must fail()."""
    ahead = max(clock.values(), default=0)
    stuck = bool(silent) and len(silent) == len(clock)
    behind = [w for w in sorted(silent) if clock[w] < ahead]
    if behind or not stuck:
        return behind, stuck
    return [w for w in sorted(silent) if clock[w] > 0], stuck


class Worker:
    """The worker half: call `exchange()` after each backward instead of optimizer.step()."""

    def __init__(self, module: nn.Module, prefix: str, max_staleness: int,
                 timeout_s: float = 300.0) -> None:
        self.module, self.prefix = module, prefix
        self.max_staleness = max_staleness
        self.store = dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self.step = 0
        self.version = -1
        self.bytes_sent = 0

    def pull(self) -> bool:
        """Load the parameters for the next step; False once the budget is spent. At bound
        0, first wait for the round to open, and read its snapshot."""
        if self.store.check([f"{self.prefix}stop"]):
            return False
        if self.max_staleness == 0:
            key = f"{self.prefix}go/{self.rank}/{self.step}"
            self._wait(key, f"the parameter server's permission for step {self.step} (the "
                            "other workers have not finished the round)")
            self.store.delete_key(key)
            data = self.store.get(f"{self.prefix}params@{self.step}")
        else:
            data = self.store.get(f"{self.prefix}params")
        self.version = int(np.frombuffer(data[:8], dtype=np.int64)[0])
        load_flat(self.module, _from_bytes(data[8:]))
        return True

    def push(self) -> None:
        """Send this step's gradient, computed on the parameters of the last pull."""
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                           .detach().reshape(-1).float() for p in self.module.parameters()])
        payload = np.int64(self.version).tobytes() + _to_bytes(grads)
        _put(self.store, f"{self.prefix}grad/{self.rank}/{self.step}", payload)
        self.bytes_sent += len(payload) - 8
        self.step += 1

    def fail(self, error: BaseException) -> None:
        """Tell the server this worker stopped with `error`: it drops the worker at once
        (and stops, naming it, if no worker is left) instead of waiting for it."""
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        try:
            self.store.set(f"{self.prefix}failed/{self.rank}", reason)
        except Exception as unreachable:  # the store went with the server: nobody waits
            log.warning("rank %d: could not tell the parameter server that this worker "
                        "failed: %s", self.rank, unreachable)

    def finish(self) -> None:
        """Say this worker is done; wait for and load the server's final parameters."""
        self.store.set(f"{self.prefix}done/{self.rank}", "1")
        self._wait(f"{self.prefix}final", "the parameter server's final parameters")
        load_flat(self.module, _from_bytes(self.store.get(f"{self.prefix}final")))

    def _wait(self, key: str, what: str) -> None:
        from datetime import timedelta

        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except Exception as error:
            raise RuntimeError(f"rank {self.rank}: waited {self.timeout_s:.0f}s for {what}: "
                               f"{error}") from error


@refusing(compress="the parameter server exchanges whole fp32 gradients and parameters "
                   "with each worker; compression is for SyncConfig's all-reduce (or send "
                   "less often: LocalSGDConfig, DiLoCoConfig)")
@dataclass
class AsyncConfig:
    """Asynchronous training (lockstep.AsyncTrainer): rank 0 serves the parameters, the
    other ranks push gradients without waiting for each other."""

    mode: ClassVar[str] = "async"
    max_staleness: int = 4
    """How many steps a worker may run ahead of the slowest live one (0: synchronous)."""
    dead_after_s: float = 60.0
    """A worker silent this long while others progress no longer holds them back."""

    def validate(self) -> None:
        if self.max_staleness < 0 or self.dead_after_s <= 0:
            raise ValueError("max_staleness must be >= 0 and dead_after_s > 0; got "
                             f"{self.max_staleness} and {self.dead_after_s}")
