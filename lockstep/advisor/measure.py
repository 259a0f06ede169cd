"""What the advisor measures of the model, once, on every rank of the job as launched.

A few plain steps of the user's model with no communication at all: forward, backward
(and the moment each parameter's gradient is ready, which decides how much of a bucket's
communication backward can hide), the optimizer's step, DiLoCo's outer step; what each
compressor costs per step (compression.py: the cast's work alone, PowerSGD and TopK with
their collectives); and how much communication beside backward slows it. Every rank
measures at once, as they will train -- on a shared host the processes compete for its
cores, and the measurement should see that -- and each step counts at its slowest rank,
since a synchronous step waits for it; no step is counted faster than the ranks keep up
when they run step after step.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.advisor.compression import compressor_seconds, group_of_one
from lockstep.advisor.costmodel import median_seconds
from lockstep.replication import memory
from lockstep.replication.precision import autocast
from lockstep.replication.replica import DataParallel
from lockstep.sharding.zero import plan_units


@dataclass(frozen=True)
class ModelCost:
    """One rank's model, measured (seconds are the slowest rank's medians)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    outer_s: float
    """DiLoCo's outer step (SGD with Nesterov momentum) over the whole model."""
    ready_s: tuple[float, ...]
    """Per trainable parameter, in registration order: seconds into backward until its
    gradient was ready."""
    shapes: tuple[tuple[int, ...], ...]
    element_size: int
    state_bytes: int
    """The optimizer's state for the whole model, after a step."""
    unit_numels: tuple[int, ...]
    """ZeRO-3's units (a layer each), in forward order."""
    compress_s: dict[str, float]
    """Each compressor's seconds per step ("bf16", "powersgd", "topk"): the cast's work
    alone (its all-reduce is timed with the wire's); PowerSGD and TopK whole, through the
    job's own group, their collectives and the waits at them included."""
    wrapper_s: float = 0.0
    """lockstep's own work in a synchronous step, beyond the model's (hooks, buckets)."""
    micro_steps: int = 1
    """Forward-backward passes per optimizer step (gradient accumulation)."""
    device: str = "cpu"
    """Where it computes: "cpu" or "cuda" (what overlaps with what differs)."""
    interference: float = 0.0
    """Seconds of backward lost per second that a gradient all-reduce runs beside it: the
    transport's copies and sums and the kernel's socket work take cores backward needs
    (on a CPU whose cores the ranks share, a large share; on a GPU, next to none)."""

    @property
    def numels(self) -> list[int]:
        return [int(torch.Size(s).numel()) for s in self.shapes]

    @property
    def param_bytes(self) -> int:
        return sum(self.numels) * self.element_size

    @property
    def compute_s(self) -> float:
        """Forward and backward over one optimizer step's micro-batches."""
        return self.micro_steps * (self.forward_s + self.backward_s)


Batches = Iterator[tuple[Any, Any]]


def measure_model(module: nn.Module, batches: Batches,
                  make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                  loss_fn: Callable[[Any, Any], torch.Tensor], steps: int = 10,
                  precision: str = "fp32", micro_steps: int = 1) -> ModelCost:
    """Time `steps` plain steps (after two to warm up) of a copy of `module` -- the user's
    model is left as it was. Collective: every rank measures; each step counts at its
    slowest rank's time, as a synchronous step does."""
    model = copy.deepcopy(module)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params)

    def loss(net: nn.Module, x: Any, y: Any) -> torch.Tensor:
        with autocast(precision, params[0].device):
            return loss_fn(net(x), y)

    own = torch.tensor(_timed_steps(model, params, optimizer, loss, batches, steps),
                       dtype=torch.float64)
    # The median step: a fresh process's first steps can stall (a page fault storm, a
    # neighbour starting up) and no later step looks like them.
    phases = _slowest_rank_s(own).median(dim=0).values
    # ... and no faster than the ranks keep up step after step (_back_to_back_s)
    phases *= max(_back_to_back_s(model, optimizer, loss, batches, steps) /
                  phases[:3].sum().item(), 1.0)
    forward_s, backward_s, optimizer_s, *ready = phases.tolist()
    interference = _interference(model, params, loss, batches,
                                 own[:, 1].median().item(), steps)
    loss(model, *next(batches)).backward()  # once more: the gradients compression sends
    alone = group_of_one()
    try:
        extra = [_outer_step_s(params),
                 _wrapper_s(module, make_optimizer, loss, batches, alone),
                 *compressor_seconds(params, alone).values()]
    finally:
        comm.destroy_group(alone)
    slowest = comm.control_tensor(extra, dtype=torch.float64)
    comm.all_reduce(slowest, "advisor: the slowest rank's other measurements",
                    op=torch.distributed.ReduceOp.MAX)
    outer_s, wrapper_s, *compress = slowest.tolist()
    return ModelCost(forward_s, backward_s, optimizer_s, outer_s,
                     tuple(min(r, backward_s) for r in ready),
                     tuple(tuple(p.shape) for p in params), params[0].element_size(),
                     memory.state_bytes(optimizer), _unit_numels(model),
                     dict(zip(("bf16", "powersgd", "topk"), compress, strict=True)),
                     wrapper_s, micro_steps, params[0].device.type, interference)


def _slowest_rank_s(mine: torch.Tensor) -> torch.Tensor:
    """Per step, the slowest rank's row -- its forward, backward, optimizer and readiness
    times -- on every rank. Not each column's maximum: where ranks share cores, the rank
    slowest in forward is seldom the one slowest in backward, and a step of the slowest
    forward, backward and optimizer of different ranks was longer than any rank's step
    (measured 44 ms against 34 for local SGD on 4 emulated hosts over 2 cores)."""
    mine = mine.to(comm.device_of())  # (NCCL takes no CPU tensors)
    totals = mine[:, :3].sum(dim=1)
    slowest = comm.all_reduce(totals.clone(), "advisor: each step's slowest rank",
                              op=torch.distributed.ReduceOp.MAX)
    is_slowest = (totals == slowest).to(mine.dtype)
    # The slowest rank's row, and how many ranks tied for it, summed over the ranks
    rows = comm.all_reduce(torch.cat([mine * is_slowest[:, None], is_slowest[:, None]], dim=1),
                           "advisor: the slowest rank's own times")
    return (rows[:, :-1] / rows[:, -1:]).cpu()


def _back_to_back_s(model: nn.Module, optimizer: torch.optim.Optimizer,
                    loss: Callable[[nn.Module, Any, Any], torch.Tensor], batches: Batches,
                    steps: int) -> float:
    """The slowest rank's mean step over `steps` plain steps run back to back, every rank
    at once. Where ranks share cores, a step measured alone from a common start (as
    _timed_steps does) is quicker than the steps a job keeps up: on 4 emulated hosts
    over 2 cores the MNIST CNN measured 24-29 ms a step so, and trained at 36-41."""
    drawn = [next(batches) for _ in range(steps)]  # (loading data is not what is timed)
    comm.barrier("advisor: measure steps back to back")
    started = time.perf_counter()
    for x, y in drawn:
        loss(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mine = comm.control_tensor([(time.perf_counter() - started) / steps], dtype=torch.float64)
    return comm.all_reduce(mine, "advisor: the slowest rank's steps back to back",
                           op=torch.distributed.ReduceOp.MAX).item()


def _interference(model: nn.Module, params: list[nn.Parameter],
                  loss: Callable[[nn.Module, Any, Any], torch.Tensor], batches: Batches,
                  backward_alone_s: float, steps: int) -> float:
    """How much a gradient all-reduce beside backward slows it: backward timed with an
    all-reduce of the whole gradient's size started as it begins (on every rank at once,
    through the job's own links), against this rank's backward alone; the seconds lost,
    per second the all-reduce was under way during backward (at most one: the two on one
    core), the ranks' mean. Collective. On a GPU, none: the collective runs on the GPU's
    own engines beside the kernels, and neither call here would wait for them.

    The cost model's collectives are timed alone and its backward alone; a synchronous
    step runs them together. On 4 emulated hosts sharing 2 cores, leaving this out put
    every synchronous mode 14-28% under its measured step."""
    if params[0].device.type == "cuda":
        return 0.0
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    beside, overlap = [], []
    for step in range(steps + 1):
        x, y = next(batches)
        comm.barrier("advisor: measure a step together")
        value = loss(model, x, y)
        started = time.perf_counter()
        pending = comm.all_reduce_async(flat, "advisor: an all-reduce beside backward")
        value.backward()
        backward_s = time.perf_counter() - started
        pending.wait()
        model.zero_grad(set_to_none=True)
        if step:  # (the first warms the transport's buffers up)
            beside.append(backward_s)
            overlap.append(min(backward_s, time.perf_counter() - started))
    lost, during = statistics.median(beside) - backward_alone_s, statistics.median(overlap)
    # An all-reduce over in a sliver of backward (a fast link) tells nothing: noise over
    # next to nothing
    rate = min(max(lost, 0.0) / during, 1.0) if during > 0.05 * backward_alone_s else 0.0
    mine = comm.control_tensor([rate], dtype=torch.float64)
    comm.all_reduce(mine, "advisor: backward's slowing beside an all-reduce")
    return mine.item() / comm.size_of()


def _wrapper_s(module: nn.Module,
               make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
               loss: Callable[[nn.Module, Any, Any], torch.Tensor], batches: Batches,
               alone: comm.Group, steps: int = 8) -> float:
    """lockstep's own work in a synchronous step -- readiness hooks, filling buckets, the
    non-finite check, the collective ledger: DataParallel over a group of this rank alone
    against the plain model, a step of each in turn, the difference of their medians."""
    plain, wrapped = copy.deepcopy(module), DataParallel(copy.deepcopy(module), group=alone)
    pairs = [(net, make_optimizer(net.parameters())) for net in (plain, wrapped)]
    times: list[list[float]] = [[], []]
    try:
        for step in range(steps + 2):
            x, y = next(batches)
            for (net, optimizer), seconds in zip(pairs, times, strict=True):
                started = time.perf_counter()
                loss(net, x, y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step >= 2:
                    seconds.append(time.perf_counter() - started)
    finally:
        wrapped.close()
    return max(statistics.median(times[1]) - statistics.median(times[0]), 0.0)


def _timed_steps(model: nn.Module, params: list[nn.Parameter],
                 optimizer: torch.optim.Optimizer,
                 loss: Callable[[nn.Module, Any, Any], torch.Tensor], batches: Batches,
                 steps: int) -> list[list[float]]:
    """Per timed step: this rank's forward, backward and optimizer seconds, then each
    parameter's seconds into backward until its gradient was ready."""
    ready = [0.0] * len(params)
    handles = [p.register_post_accumulate_grad_hook(
        lambda _, i=i: ready.__setitem__(i, time.perf_counter())) for i, p in enumerate(params)]
    rows = []
    try:
        for step in range(steps + 2):
            x, y = next(batches)
            # Every rank computes at once, as in training: on a shared host, a rank that
            # ran alone while others were elsewhere would have the cores to itself.
            comm.barrier("advisor: measure a step together")
            started = time.perf_counter()
            value = loss(model, x, y)
            forward_done = time.perf_counter()
            value.backward()
            backward_done = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= 2:  # (the first two warm caches and allocators up)
                rows.append([forward_done - started, backward_done - forward_done,
                             time.perf_counter() - backward_done,
                             *(t - forward_done for t in ready)])
    finally:
        for handle in handles:
            handle.remove()
    return rows


def _unit_numels(model: nn.Module) -> tuple[int, ...]:
    named = dict(model.named_parameters())
    return tuple(sum(named[n].numel() for n in unit) for unit in plan_units(model))


def _outer_step_s(params: list[nn.Parameter]) -> float:
    """DiLoCo's outer step: the pseudo-gradient formed, an SGD-Nesterov step, the weights
    copied back (rounds.DiLoCo.synchronise, less its all-reduce)."""
    theta = [p.detach().clone().float().requires_grad_(True) for p in params]
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)

    def step() -> None:
        for t, p in zip(theta, params, strict=True):
            t.grad = t.detach() - p.detach().float()
        outer.step()
        with torch.no_grad():
            for t, p in zip(theta, params, strict=True):
                p.copy_(t)

    return median_seconds(step, 3)
