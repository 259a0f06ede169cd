"""Survival: what the Trainer's loop asks of fault tolerance -- as `Replica` is what it asks
of a parallel mode.

The loop hands each step to `run_step(train_step)` and its other collective work (the
logged loss's average, evaluation, checkpoints) to `collective(fn)`; it reads the step
reached from `step`, and the model and world from `model` and `world`, which may change
between steps. Two answer it:

- `Steady` (the default): nothing is expected to fail; each step runs once, and an error
  is raised as it comes.
- `lockstep.Elastic` (TrainConfig(elastic=ElasticConfig(...)) under `lockstep run
  --elastic`): a step interrupted by a peer's death is redone among the survivors, and
  workers that start later join at a step boundary (elastic/job.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from lockstep.comm.world import World, current

T = TypeVar("T")


@runtime_checkable
class Survival(Protocol):
    step: int
    """Steps the job has committed."""
    model: Any
    """The parallel model now (a Replica): read it again after every step."""

    @property
    def world(self) -> World: ...
    def run_step(self, train_step: Callable[[Any, int], T]) -> T | None: ...
    def collective(self, fn: Callable[[], T], skipped: T | None = None) -> T | None: ...
    def finish(self) -> None: ...


class Steady:
    """No fault tolerance: `train_step(model, step)`, the update, the model's after_step."""

    def __init__(self, model: Any, update: Callable[[], None], step: int = 0) -> None:
        self.model, self.update, self.step = model, update, step

    @property
    def world(self) -> World:
        return current()

    def run_step(self, train_step: Callable[[Any, int], T]) -> T | None:
        value = train_step(self.model, self.step)
        self.update()
        self.model.after_step()  # local SGD / DiLoCo: a round's end synchronises
        self.step += 1
        return value

    def collective(self, fn: Callable[[], T], skipped: T | None = None) -> T | None:
        return fn()

    def finish(self) -> None:
        pass
