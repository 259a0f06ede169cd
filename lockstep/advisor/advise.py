"""The scaling advisor: measure once, predict every mode, recommend one.

    advice = lockstep.advise(net, batches, lambda p: torch.optim.AdamW(p, lr=3e-4))
    print(advice.table())

Collective: call it on every rank of the job as you would launch it (`lockstep advise` does
it for a Trainer script). It measures the model (measure.py) and the links (wire.py) in a
few seconds, predicts each mode's step time (predict.py), and recommends the most faithful
mode within 5% of the fastest: exact training (any algorithm, any ZeRO stage) before
16-bit gradients, before lossy compression, before replicas that train apart between syncs:
a less faithful mode must be predicted more than 5% faster than every more faithful one,
and the reasons say what it trades.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.advisor.measure import Batches, ModelCost, measure_model
from lockstep.advisor.predict import EXACT, TRADE, Prediction, predict_all
from lockstep.advisor.wire import Asking, WireCost, measure_wire
from lockstep.comm.world import current

ENV = "LOCKSTEP_ADVISE"
"""Set by `lockstep advise` for the workers it starts: where to write the advice as JSON
("" for nowhere: the table is printed in any case)."""

WITHIN = 1.05  # a more faithful mode is preferred while at most this much slower
CLEARLY = 1.05  # a mode must be predicted this much faster than the default to replace it


@dataclass(frozen=True)
class Advice:
    model: ModelCost
    wire: WireCost
    predictions: list[Prediction]
    samples_per_step: int
    memory_bytes: float

    @property
    def recommended(self) -> Prediction:
        """The most faithful mode within WITHIN of the fastest that fits -- the default
        where nothing of that fidelity is predicted CLEARLY faster."""
        fitting = [p for p in self.predictions if p.fits] or self.predictions
        fastest = min(p.step_s for p in fitting)
        best = min((p for p in fitting if p.step_s <= WITHIN * fastest),
                   key=lambda p: (p.mode.fidelity, p.step_s))
        default = self.default
        if default.fits and default.mode.fidelity == best.mode.fidelity and \
                default.step_s <= CLEARLY * best.step_s:
            return default
        return best

    @property
    def default(self) -> Prediction:
        """What SyncConfig() trains with: algorithm="auto" is shm where the ranks share one
        host's CPU (the only layout whose modes include it), native elsewhere."""
        names = {p.mode.name for p in self.predictions}
        return self.prediction("sync shm" if "sync shm" in names else "sync native")

    def prediction(self, name: str) -> Prediction:
        return next(p for p in self.predictions if p.mode.name == name)

    def reasons(self) -> list[str]:
        """Why the recommended mode, in sentences a person can check."""
        best, sync = self.recommended, self.default
        said = [f"{self.wire.bus_gbit():.2f} Gbit/s all-reduce bus bandwidth over "
                f"{self.wire.world_size} ranks: sync would spend {sync.comm_share:.0%} of "
                "each step communicating"]
        if best is not sync:
            said.append(f"{best.mode.name} predicted {sync.step_s / best.step_s:.2f}x as fast "
                        "as sync")
        else:
            said.append(f"keep the default: no mode is predicted more than {WITHIN - 1:.0%} "
                        "faster than an exact one, and no exact one more than "
                        f"{CLEARLY - 1:.0%} faster than the default")
        if best.mode.fidelity != EXACT:
            said.append(f"its trade: {TRADE[best.mode.fidelity]}")
        if sync.fits:
            said.append(f"ZeRO unnecessary: the model state ({_mb(sync.state_bytes)} per "
                        f"rank) fits in {_mb(self.memory_bytes)}")
        else:
            said.append(f"sync needs {_mb(sync.state_bytes)} per rank, over the "
                        f"{_mb(self.memory_bytes)} a rank has: only sharded modes fit")
        return said

    def table(self) -> str:
        m = self.model
        head = [f"measured: forward {m.forward_s * 1e3:.1f} ms, backward "
                f"{m.backward_s * 1e3:.1f} ms, optimizer {m.optimizer_s * 1e3:.1f} ms per "
                f"step ({self.samples_per_step} samples a step over {self.wire.world_size} "
                f"ranks, {sum(m.numels) / 1e6:.2f} M parameters)", "",
                f"{'mode':<18} {'step ms':>8} {'samples/s':>10} {'vs sync':>8} "
                f"{'comm':>5} {'MB/step':>8} {'state/rank':>11}"]
        sync = self.prediction("sync native").step_s
        rows = [f"{p.mode.name:<18} {p.step_s * 1e3:>8.1f} "
                f"{self.samples_per_step / p.step_s:>10.0f} {sync / p.step_s:>7.2f}x "
                f"{p.comm_share:>5.0%} {p.wire_bytes / 1e6:>8.2f} {_mb(p.state_bytes):>11}"
                + ("" if p.fits else "  does not fit") + ("  <- recommended"
                                                          if p is self.recommended else "")
                for p in self.predictions]
        return "\n".join(head + rows + ["", f"recommended: {self.recommended.mode.name}: "
                                        + "; ".join(self.reasons())])

    def as_record(self) -> dict[str, Any]:
        return {"recommended": self.recommended.mode.name, "reasons": self.reasons(),
                "samples_per_step": self.samples_per_step,
                "world_size": self.wire.world_size, "bus_gbit": self.wire.bus_gbit(),
                "compute_ms": {"forward": self.model.forward_s * 1e3,
                               "backward": self.model.backward_s * 1e3,
                               "optimizer": self.model.optimizer_s * 1e3,
                               "diloco_outer": self.model.outer_s * 1e3,
                               "lockstep_wrapper": self.model.wrapper_s * 1e3,
                               "compress_bf16": self.model.compress_s["bf16"] * 1e3},
                "compressors_ms": {k: v * 1e3 for k, v in self.model.compress_s.items()
                                   if k != "bf16"},  # (their collectives included)
                "interference": self.model.interference,
                "collectives_ms": {kind: {str(n): t * 1e3 for n, t in sorted(points.items())}
                                   for kind, points in self.wire.timed.items()},
                "modes": [{"mode": p.mode.name, "step_ms": p.step_s * 1e3,
                           "comm_share": p.comm_share, "wire_bytes": p.wire_bytes,
                           "state_bytes": p.state_bytes, "fits": p.fits}
                          for p in self.predictions]}


def advise(model: nn.Module, batches: Batches,
           optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
           loss_fn: Callable[[Any, Any], torch.Tensor] = torch.nn.functional.cross_entropy,
           precision: str = "fp32", micro_steps: int = 1) -> Advice:
    """Measure `model` on `batches` (this rank's, as it would train) and the job's links,
    and predict every mode. Collective; the model is left untouched."""
    world = current()
    first = next(batches)
    per_rank = len(first[0])

    def again() -> Batches:
        yield first
        yield from batches

    cost = measure_model(model, again(), optimizer, loss_fn, precision=precision,
                         micro_steps=micro_steps)
    asking = Asking(world.world_size, world.local_world_size)
    predict_all(cost, asking, 0)  # which collectives, at which sizes, the modes issue
    wire = measure_wire(asking.asked, world.local_world_size)
    memory = memory_per_rank(world.device, world.local_world_size)
    return Advice(cost, wire, predict_all(cost, wire, memory),
                  per_rank * micro_steps * world.world_size, memory)


def memory_per_rank(device: torch.device, local_world_size: int) -> float:
    """What one rank may fill: its GPU, or its share of the host's available memory."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / local_world_size
    return float("inf")


def requested() -> str | None:
    """Where `lockstep advise` wants the advice written ("": nowhere), if it started this
    worker; None if it did not."""
    return os.environ.get(ENV)


def report(advice: Advice, path: str) -> None:
    """Print the table and write the JSON record to `path`, if one is given (rank 0)."""
    if comm.rank_of() != 0:
        return
    print(advice.table(), flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(advice.as_record(), indent=1))


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
