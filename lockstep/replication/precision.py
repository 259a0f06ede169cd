"""Mixed precision: low-precision math in forward and backward, fp32 everywhere it counts.

Parameters, gradients (as the optimizer sees them) and optimizer state stay in fp32 -- the
"master weights"; autocast runs the matmuls and convolutions in bf16 or fp16.

- bf16 has fp32's exponent range: autocast alone is enough, on CPU as on GPU.
- fp16 has a narrow range: small gradients underflow to zero. Dynamic loss scaling
  multiplies the loss by a large factor before backward and divides the gradients by it
  before the step. If any gradient overflowed, the step is skipped and the scale halved;
  after `growth_interval` clean steps it doubles. The overflow decision is one flag
  reduced across ranks, so every rank skips the same steps and keeps the same scale --
  otherwise replicas would part ways on the first overflow.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from lockstep import comm
from lockstep.replication.join import joined

PRECISIONS = ("fp32", "bf16", "fp16")

# Scalers that have scaled a loss and not yet stepped: their backward may overflow on
# purpose, and the agreed skip is theirs to make (nonfinite.py stands aside meanwhile).
_scaling: weakref.WeakSet[LossScaler] = weakref.WeakSet()


def loss_scaling_pending() -> bool:
    return bool(_scaling)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Run the enclosed forward (and loss) in `precision`; fp32 is a no-op."""
    check_precision(precision)
    if precision == "fp32":
        yield
        return
    with torch.autocast(device.type, dtype=_DTYPES[precision]):
        yield


class LossScaler:
    """Dynamic loss scaling whose skip decision every rank shares.

        scaler = LossScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)        # optional: before clipping gradients
        scaler.step(optimizer)            # skipped on every rank if any rank overflowed

    Under `model.join()`, pass the scaler along with the optimizers
    (`model.join([optimizer, scaler])`): a rank that ran out of data then answers the
    overflow vote and keeps the same scale as the others.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 group: comm.Group = None) -> None:
        self.scale_value = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.group = group
        self.good_steps = 0
        self.skipped_steps = 0
        self._unscaled: torch.optim.Optimizer | None = None
        self._found_inf = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        _scaling.add(self)
        return loss * self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by the scale and agree, across ranks, whether any was not
        finite. Returns that shared verdict."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        found = torch.zeros(1, device=grads[0].device if grads else comm.device_of(self.group))
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, torch.full((1,), 1.0 / self.scale_value, device=found.device))
        self._unscaled, self._found_inf = optimizer, self._agree(bool(found.item() > 0))
        return self._found_inf

    def _agree(self, overflowed: bool) -> bool:
        """Whether any rank overflowed. Under join() the question is a turn of its
        handshake, which a rank out of data answers too (and then `follow`s)."""
        join = joined(self.group)
        if join is not None:
            return join.vote(self, overflowed)
        found = comm.control_tensor([float(overflowed)], self.group, torch.float32)
        comm.all_reduce(found, "loss scaler: agree whether any rank overflowed", self.group,
                        op=torch.distributed.ReduceOp.MAX)
        return bool(found.item() > 0)

    def follow(self, verdict: bool) -> None:
        """A step this rank sat out under join() (it had run out of data): keep the scale
        every other rank keeps. `verdict`: whether some rank overflowed."""
        self._update(stepped=not verdict)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless some rank overflowed; adjust the scale. Returns whether it stepped."""
        if self._unscaled is not optimizer:
            self.unscale_(optimizer)
        stepped = not self._found_inf
        if stepped:
            optimizer.step()
        elif hasattr(optimizer, "skipped"):  # (ZeRO under fault tolerance: the step's state)
            optimizer.skipped()
        self._update(stepped)
        _scaling.discard(self)
        self._unscaled = None
        return stepped

    def _update(self, stepped: bool) -> None:
        if not stepped:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
