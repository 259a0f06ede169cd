"""The two answers to `Survival` (protocols.py), what the Trainer's loop asks of fault
tolerance.

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

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from lockstep.comm.world import World, current
from lockstep.elastic.job import Elastic
from lockstep.training.resume import RunState

T = TypeVar("T")


class Steady:
    """No fault tolerance: `train_step(model, step)`, the update, the model's after_step."""

    def __init__(self, model: Any, update: Callable[[], None], step: int = 0) -> None:
        self.model, self.update, self.step = model, update, step
        self.joined_running = False  # every worker starts the job together

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


def elastic_survival(module: nn.Module, optimizer: torch.optim.Optimizer, config: Any,
                     update: Callable[[], None], carried: Mapping[str, Any],
                     train_set: Any, eval_set: Any) -> Elastic:
    """Join (or form) the Trainer's fault-tolerant job. `carried` (objects with state_dict;
    None for one the run lacks) travel to joiners. Every worker must agree on what decides
    the training -- the config (its display aside) and the data's size -- or a joiner is
    refused (elastic/terms.py)."""
    from lockstep.training.configfile import as_record

    record = {k: v for k, v in as_record(config).items() if k not in ("progress", "trackers")}
    agree = {"config": record, "train_samples": len(train_set),
             "eval_samples": len(eval_set) if eval_set is not None else None}
    state = {name: obj for name, obj in carried.items() if obj is not None}
    return Elastic(module, optimizer, config.parallel.build, state=state,
                   config=config.elastic, update=update, agree=agree)


class CarriedRunState:
    """The run's evaluation history, as a state_dict a joining worker receives (its step
    comes from the job)."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.state.history}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.history = list(saved["history"])
