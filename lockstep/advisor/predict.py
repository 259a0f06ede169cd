"""The advisor's model of a step: pure arithmetic on what was measured (measure.py,
wire.py), for every mode lockstep offers on this layout.

A synchronous step is forward, then backward with each gradient bucket sent as soon as its
last gradient is ready -- buckets go one after the other, so a bucket starts when it is
ready and the one before it is done -- then the optimizer:

    step = forward + max(backward, the last bucket done) + optimizer

(with gradient accumulation, the earlier micro-steps' forward and backward come first).
A cast halves what each bucket sends and adds its local work; PowerSGD and TopK take what
they were timed at, wire and all, through the job's own group; ZeRO-1 and 2 step
1/N of the optimizer and all-gather the parameters after it (2 reduce-scatters where 1
all-reduces); ZeRO-3 gathers each layer before its forward and again in backward (the
next one prefetched while the current one computes) and reduce-scatters its gradient.
Local SGD and DiLoCo compute every step and all-reduce the model once every H steps.
Every synchronous mode adds lockstep's own per-step work (hooks, buckets, checks), measured
on a DataParallel over a group of one rank.
Model state per rank follows ZeRO's formulas (zero.py); activations are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lockstep.advisor.compression import TOPK_RATIO, powersgd_numels
from lockstep.advisor.measure import ModelCost
from lockstep.advisor.wire import (
    ALL_REDUCE,
    GATHER_SHARDS,
    GATHER_SHM,
    REDUCE_SCATTER,
    STAGED_ALL_REDUCE,
    STAGED_REDUCE_SCATTER,
    Asking,
    WireCost,
    algorithms_for,
)
from lockstep.lowcomm.rounds import DiLoCoConfig, LocalSGDConfig
from lockstep.replication.buckets import (
    MB,
    ParamSlot,
    default_bucket_mb,
    plan_before_backward,
)
from lockstep.replication.compress import PowerSGD, TopK
from lockstep.replication.sync import SyncConfig
from lockstep.sharding.sharded import ShardConfig

EXACT, ROUNDED, COMPRESSED, PERIODIC = range(4)
"""How far a mode's training departs from one process on the global batch: not at all
(every algorithm, every ZeRO stage), by 16-bit rounding of the gradients, by a lossy
compression with error feedback, by replicas that drift between syncs."""

TRADE = {ROUNDED: "gradients rounded to 16 bits on the wire",
         COMPRESSED: "gradients compressed, what is dropped carried to the next step",
         PERIODIC: "replicas train apart between syncs: check its convergence"}

LOCAL_SGD_EVERY, DILOCO_EVERY = (8, 32), (10, 50)


@dataclass(frozen=True)
class Mode:
    name: str
    fidelity: int
    config: Any
    """The TrainConfig(parallel=...) that builds it."""


@dataclass(frozen=True)
class Prediction:
    mode: Mode
    step_s: float
    compute_s: float
    """Forward, backward and optimizer alone: the step with nothing to wait for."""
    wire_bytes: float
    """Payload a rank puts on the wire per step, on average."""
    state_bytes: float
    """Parameters, gradients and optimizer state one rank holds."""
    fits: bool = True

    @property
    def comm_share(self) -> float:
        """The share of the step spent waiting for communication."""
        return max(self.step_s - self.compute_s, 0.0) / self.step_s if self.step_s else 0.0


def modes(world_size: int, local_world_size: int, device: str = "cpu") -> list[Mode]:
    found = [Mode(f"sync {a}", EXACT, SyncConfig(algorithm=a))
             for a in algorithms_for(world_size, local_world_size, device)]
    found += [Mode(f"sync {c}", ROUNDED, SyncConfig(compress=c)) for c in ("bf16", "fp16")]
    found += [Mode("sync powersgd", COMPRESSED, SyncConfig(compress=PowerSGD())),
              Mode("sync topk", COMPRESSED, SyncConfig(compress=TopK(TOPK_RATIO)))]
    found += [Mode(f"ZeRO-{s}", EXACT, ShardConfig(stage=s)) for s in (1, 2, 3)]
    found += [Mode(f"local SGD H={h}", PERIODIC, LocalSGDConfig(sync_every=h))
              for h in LOCAL_SGD_EVERY]
    found += [Mode(f"DiLoCo H={h}", PERIODIC, DiLoCoConfig(sync_every=h)) for h in DILOCO_EVERY]
    return found


def predict_all(model: ModelCost, wire: WireCost, memory_bytes: float) -> list[Prediction]:
    """Every mode's prediction; a mode whose model state exceeds `memory_bytes` per rank
    is marked as not fitting."""
    found = []
    for mode in modes(wire.world_size, wire.local_world_size, model.device):
        p = predict(mode, model, wire)
        found.append(Prediction(p.mode, p.step_s, p.compute_s, p.wire_bytes, p.state_bytes,
                                p.state_bytes <= memory_bytes))
    return found


def predict(mode: Mode, model: ModelCost, wire: WireCost) -> Prediction:
    config, n = _resolved(mode.config, wire, model.device), wire.world_size
    S = model.param_bytes
    state = _state_bytes(config, S, model.state_bytes, n)
    if isinstance(config, (LocalSGDConfig, DiLoCoConfig)):
        every = config.sync_every
        sync = wire.all_reduce("native", S) + \
            (model.outer_s if isinstance(config, DiLoCoConfig) else 0.0)
        compute = model.compute_s + model.optimizer_s
        return Prediction(mode, compute + sync / every, compute, S / every, state)
    optimizer = model.optimizer_s / n if isinstance(config, ShardConfig) else model.optimizer_s
    compute = model.compute_s + optimizer + model.wrapper_s  # (lockstep's own work too)
    if isinstance(config, ShardConfig) and config.stage == 3:
        step, sent = _zero3(model, wire, config)
        return Prediction(mode, step + optimizer + model.wrapper_s, compute, sent, state)
    buckets = _buckets(model, config)
    durations, sent = _bucket_times(config, model, wire, buckets)
    after = 0.0
    if isinstance(config, ShardConfig):  # the parameters all-gathered after the step
        after = sum(_gather(config, wire, b) for b in _sizes(model, buckets))
        sent += S
    ready = [max(model.ready_s[i] for i in b) for b in buckets]
    if _in_line(config, wire):  # summed on backward's own thread: it waits for each
        backward_end = model.backward_s + sum(durations)
    else:
        backward_end = _pipeline(ready, durations, model.backward_s, model.interference)
    earlier = (model.micro_steps - 1) * (model.forward_s + model.backward_s)
    step = earlier + model.forward_s + backward_end + optimizer + after + model.wrapper_s
    return Prediction(mode, step, compute, sent, state)


def _resolved(config: Any, wire: WireCost, device: str) -> Any:
    """A SyncConfig's algorithm="auto" as the job would resolve it on this layout
    (choices.resolve_algorithm): shm inside one host of several ranks on its CPU,
    uncompressed -- where the layout's modes include it -- else native."""
    if not isinstance(config, SyncConfig) or config.algorithm != "auto":
        return config
    shared = config.compress is None and \
        "shm" in algorithms_for(wire.world_size, wire.local_world_size, device)
    return replace(config, algorithm="shm" if shared else "native")


def _pipeline(ready: Sequence[float], durations: Sequence[float], backward_s: float,
              interference: float = 0.0) -> float:
    """When backward's wait ends: buckets sent in order, each once ready and its
    predecessor done. Backward loses `interference` seconds per second of communication
    under way beside it (measure._interference), its readiness times stretched alike:
    rounds of the two until they agree (each round's backward is no shorter than the
    last's, and it is bounded by all the communication, so they settle)."""
    stretched = backward_s
    for _ in range(100):
        done, beside = _in_order(ready, durations, stretched / backward_s if backward_s
                                 else 1.0, stretched)
        settled = backward_s + interference * beside
        if settled - stretched < 1e-9:
            break
        stretched = settled
    return max(done, stretched)


def _in_order(ready: Sequence[float], durations: Sequence[float], scale: float,
              backward_s: float) -> tuple[float, float]:
    """When the last bucket is done, its readiness times scaled by `scale`, and how long
    communication was under way within the first `backward_s` seconds."""
    done = beside = 0.0
    for at, takes in zip(ready, durations, strict=True):
        start = max(done, at * scale)
        done = start + takes
        beside += max(min(done, backward_s) - start, 0.0)
    return done, beside


def _buckets(model: ModelCost, config: Any) -> list[tuple[int, ...]]:
    """The parameter indices of each gradient bucket, in launch order (buckets.py's plan,
    with the mode's cap)."""
    algorithm = getattr(config, "algorithm", "native")
    cap = config.bucket_mb or default_bucket_mb(algorithm)
    slots = [ParamSlot(i, n, "float", model.element_size) for i, n in enumerate(model.numels)]
    return [spec.param_indices for spec in plan_before_backward(slots, int(cap * MB))]


def _sizes(model: ModelCost, buckets: list[tuple[int, ...]]) -> list[int]:
    numels = model.numels
    return [sum(numels[i] for i in b) * model.element_size for b in buckets]


def _bucket_times(config: Any, model: ModelCost, wire: WireCost,
                  buckets: list[tuple[int, ...]]) -> tuple[list[float], float]:
    """Seconds each bucket's reduction takes, and the payload bytes of them all."""
    sizes = _sizes(model, buckets)
    total = sum(sizes)
    compress = getattr(config, "compress", None)
    if isinstance(config, ShardConfig):
        return [_reduce(config, wire, s) for s in sizes], float(total)
    if compress is None:
        return [wire.all_reduce(config.algorithm, s) for s in sizes], float(total)
    if compress in ("bf16", "fp16"):
        work = model.compress_s["bf16"]
        return [wire.all_reduce(f"native {compress}", s // 2) + work * s / total
                for s in sizes], total / 2
    # PowerSGD and TopK were timed through the job's own group (compression.py): their
    # seconds hold their collectives and the waits at them, shared by the buckets' sizes
    if isinstance(compress, PowerSGD):
        sent = sum(4.0 * sum(powersgd_numels(model.shapes[i] for i in b)) for b in buckets)
        return [model.compress_s["powersgd"] * s / total for s in sizes], sent
    assert isinstance(compress, TopK)
    picks = [max(1, int(compress.ratio * s / 4)) for s in sizes]  # values + int32 indices
    return [model.compress_s["topk"] * s / total for s in sizes], float(sum(picks) * 8)


def _gather(config: ShardConfig, wire: WireCost, nbytes: int) -> float:
    """Seconds for one of ZeRO's gathers of parameter shards."""
    return _zero_collective(config, wire, GATHER_SHM, GATHER_SHARDS, nbytes)


def _reduce(config: ShardConfig, wire: WireCost, nbytes: int) -> float:
    """Seconds for ZeRO's reduction of one gradient bucket (stage 1 all-reduces it)."""
    if config.stage == 1:
        return _zero_collective(config, wire, STAGED_ALL_REDUCE, f"{ALL_REDUCE} native", nbytes)
    return _zero_collective(config, wire, STAGED_REDUCE_SCATTER, REDUCE_SCATTER, nbytes)


def _zero_collective(config: ShardConfig, wire: WireCost, on_host: str, sockets: str,
                     nbytes: int) -> float:
    """Seconds for one of ZeRO's collectives: through host memory where algorithm="auto"
    (or "shm") takes it -- every rank on one host's CPU (sharding/hostshards.py, staging.py;
    measure_wire times it only there) -- else through the backend's sockets."""
    shared = _host_memory(config, wire)
    if shared and isinstance(wire, Asking):
        wire.time(sockets, nbytes)  # (asked too: where memory cannot be shared)
    elif shared and on_host not in wire.timed:
        shared = False
    return wire.time(on_host if shared else sockets, nbytes)


def _host_memory(config: ShardConfig, wire: WireCost) -> bool:
    """Whether ZeRO's algorithm takes host memory on this layout (where it can be mapped)."""
    return config.algorithm != "native" and wire.world_size == wire.local_world_size


def _in_line(config: Any, wire: WireCost) -> bool:
    """Whether the buckets are summed on backward's own thread, as each fills -- through
    host memory (the shm all-reduce; ZeRO's staging where it was timed) -- so backward
    waits for each instead of computing on beside it."""
    if isinstance(config, ShardConfig):
        kind = STAGED_ALL_REDUCE if config.stage == 1 else STAGED_REDUCE_SCATTER
        return _host_memory(config, wire) and kind in wire.timed
    return getattr(config, "algorithm", None) == "shm"


def _zero3(model: ModelCost, wire: WireCost, config: ShardConfig) -> tuple[float, float]:
    """Forward and backward at stage 3, and its payload. Each unit is gathered before its
    forward and again in backward, where its gradient is also reduce-scattered. On a GPU
    the next unit's gather is prefetched while the current one computes, so gathers after
    the first hide behind forward (and backward's traffic behind backward). On CPU the
    same cores run the collectives and the compute, through Python hooks on the training
    thread, and little hides: on 2 emulated hosts at 1 Gbit/s the char-GPT measured 220 ms
    a step where hiding would have made it 117; the sum of the two made it 205."""
    units = [n * model.element_size for n in model.unit_numels]
    gather = [_gather(config, wire, u) for u in units]
    scatter = [_reduce(config, wire, u) for u in units]
    if model.device == "cuda":
        forward = gather[0] + max(model.forward_s, sum(gather[1:]))
        backward = gather[-1] + max(model.backward_s, sum(gather[:-1]) + sum(scatter[1:])) \
            + scatter[0]
    else:
        forward = model.forward_s + sum(gather)
        backward = model.backward_s + sum(gather) + sum(scatter)
    earlier = (model.micro_steps - 1) * (forward + backward)
    return earlier + forward + backward, 3.0 * sum(units)


def _state_bytes(config: Any, params: int, optimizer: int, n: int) -> float:
    """Per rank: ZeRO's formulas (zero.py) with this optimizer's measured state; error
    feedback keeps a gradient-sized residual; DiLoCo an fp32 anchor and its momentum."""
    grads = params
    if isinstance(config, ShardConfig):
        return {1: params + grads + optimizer / n, 2: params + (grads + optimizer) / n,
                3: (params + grads + optimizer) / n}[config.stage]
    whole = params + grads + optimizer
    if isinstance(config, DiLoCoConfig):
        return whole + 2 * params
    if isinstance(getattr(config, "compress", None), (PowerSGD, TopK)):
        return whole + grads
    return whole
