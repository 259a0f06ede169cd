"""What the Trainer's one loop asks -- of a parallel model (`Replica`: DataParallel, sharded
or not, LocalSGD, DiLoCo) and of fault tolerance (`Survival`: survival.py's Steady, or
lockstep.Elastic). Every capability plugs into the loop by answering one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from lockstep import comm
from lockstep.comm.world import World

T = TypeVar("T")


@runtime_checkable
class Replica(Protocol):
    """What the loop asks of a parallel model: DataParallel (sharded or not), LocalSGD and
    DiLoCo each answer it."""

    module: nn.Module
    group: comm.Group

    def no_sync(self) -> AbstractContextManager[None]: ...
    def after_step(self) -> None: ...
    def in_sync(self) -> bool: ...
    def finish(self) -> None: ...
    def comm_stats(self) -> dict[str, float]: ...
    def make_optimizer(self, optimizer: Any, **kwargs: Any) -> Any: ...
    def checkpoint_model(self) -> nn.Module: ...
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]: ...
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class Survival(Protocol):
    step: int
    """Steps the job has committed."""
    model: Any
    """The parallel model now (a Replica): read it again after every step."""
    joined_running: bool
    """This worker joined a job already training (it received the job's state)."""

    @property
    def world(self) -> World: ...
    def run_step(self, train_step: Callable[[Any, int], T]) -> T | None: ...
    def collective(self, fn: Callable[[], T], skipped: T | None = None) -> T | None: ...
    def finish(self) -> None: ...
