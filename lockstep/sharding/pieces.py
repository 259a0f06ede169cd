"""Stepping a large shard in cache-sized pieces (ZeroOptimizer's step).

torch's default optimizers on a CPU (the for-loop implementation) run each operation of an
update over a whole tensor before starting the next. ZeRO makes large tensors (a bucket's
shard is one flat tensor where the model had many small ones): AdamW on a 4.2M-element
shard streams its parameter, gradient and two moments (67 MB) through memory at every
operation -- 10-24 ms a step with two ranks on a 2-core machine. Over pieces of 2 MB, each
piece is still in cache for the operations after the first: 7.6-8.2 ms.

The arithmetic per element is unchanged, so the result is the same to the bit: only torch's
element-wise optimizers are split (their update of an element reads that element and the
tensor's step count, nothing else), and only their for-loop implementation (foreach and
fused ones already make one pass, or pass over all tensors at once). The optimizer's state
stays whole and keyed by the shard -- checkpoints, resharding and recovery read it as
before -- and a second optimizer of the same kind steps views of it, piece by piece; the
per-tensor counters it advanced (Adam's step) are written back after.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PIECE_NUMEL = 1 << 19  # 2 MB of fp32: a piece with its gradient and moments stays cached

# Optimizers whose update of an element reads only that element and per-tensor counters.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta)

Pieces = list[tuple[nn.Parameter, dict[str, Any]]]


class PiecewiseStep:
    """Steps `inner` as `inner.step()` would, over pieces of its large parameters."""

    def __init__(self, inner: torch.optim.Optimizer,
                 make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 piece_numel: int = PIECE_NUMEL) -> None:
        self.inner, self.make, self.piece_numel = inner, make, piece_numel
        self.stepper: torch.optim.Optimizer | None = None  # made at the first split step
        self.last_pieces = 0  # how many pieces the last split step stepped

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if not self._splittable():
            return self.inner.step(closure)
        loss = None
        if closure is not None:  # first, as torch's step does: it recomputes the gradients
            with torch.enable_grad():
                loss = closure()
        split = self._split()
        if split is None:
            self.inner.step()
            return loss
        stepper = self._stepper(split)
        self.last_pieces = len(stepper.param_groups[0]["params"])
        try:
            stepper.step()
            self._write_back_counters(split)
        finally:  # nothing of this step's views outlives it: not a state a load replaced,
            stepper.param_groups[0]["params"] = []  # nor stage 1's freed gradients
            stepper.state = defaultdict(dict)
        return loss

    def _splittable(self) -> bool:
        """Whether this optimizer may be stepped in pieces at all: torch's element-wise
        ones, in their for-loop implementation, on a CPU (on a GPU torch picks foreach)."""
        if type(self.inner) not in ELEMENTWISE or len(self.inner.param_groups) != 1:
            return False
        group = self.inner.param_groups[0]
        return not group.get("foreach") and not group.get("fused") and \
            all(p.device.type == "cpu" for p in group["params"])

    def _split(self) -> dict[nn.Parameter, Pieces] | None:
        """Each parameter's pieces, or None where stepping whole is as fast or the only
        right way: state not made yet (the first step makes it), or nothing large."""
        group = self.inner.param_groups[0]
        params = [p for p in group["params"] if p.grad is not None]
        if not any(p.numel() > self.piece_numel for p in params) or \
                not all(self.inner.state.get(p) for p in params):
            return None
        return {p: _pieces(p, self.inner.state[p], self.piece_numel) for p in params}

    def _stepper(self, split: dict[nn.Parameter, Pieces]) -> torch.optim.Optimizer:
        """The optimizer over this step's pieces, with the inner one's settings (a
        scheduler sets them on the inner one)."""
        views = [view for pieces in split.values() for view, _ in pieces]
        if self.stepper is None:
            self.stepper = self.make(views)
        self.stepper.param_groups[0].update(
            {k: v for k, v in self.inner.param_groups[0].items() if k != "params"})
        self.stepper.param_groups[0]["params"] = views
        self.stepper.state = defaultdict(
            dict, {view: state for pieces in split.values() for view, state in pieces})
        return self.stepper

    def _write_back_counters(self, split: dict[nn.Parameter, Pieces]) -> None:
        for p, pieces in split.items():
            whole, first = self.inner.state[p], pieces[0][1]
            if first is whole:
                continue
            for key, value in whole.items():
                if not elementwise(value, p):
                    if isinstance(value, torch.Tensor):
                        value.copy_(first[key])
                    else:
                        whole[key] = first[key]


def _pieces(p: nn.Parameter, state: dict[str, Any], size: int) -> Pieces:
    """Views of `p`, its gradient and its per-element state, `size` elements each;
    per-tensor counters copied into each piece. A small parameter is its own piece."""
    if p.numel() <= size:
        return [(p, state)]
    assert p.grad is not None
    flat, grad = p.detach().view(-1), p.grad.view(-1)
    pieces: Pieces = []
    for start in range(0, p.numel(), size):
        part = slice(start, start + size)
        view = nn.Parameter(flat[part])
        view.grad = grad[part]
        pieces.append((view, {
            key: value.view(-1)[part] if elementwise(value, p) else
            value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}))
    return pieces


def elementwise(value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state is one value per element of `param` (a momentum), not one
    for the whole tensor (Adam's step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and \
        value.numel() == param.numel()
