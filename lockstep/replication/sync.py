"""Synchronous data parallelism as a training mode: its settings, and the model they build.

    TrainConfig(parallel=SyncConfig(algorithm="hierarchical", compress="bf16"))

Gradients are averaged every step by DataParallel (replica.py); these are its choices of
how buckets travel (reduction.py) and what a bad gradient does (nonfinite.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from lockstep.replication.choices import check_combination
from lockstep.replication.nonfinite import check_mode
from lockstep.replication.replica import DataParallel


@dataclass
class SyncConfig:
    """Gradients averaged across ranks every step."""

    mode: ClassVar[str] = "sync"
    algorithm: str = "auto"
    """How buckets are summed: "auto" ("shm" where every rank is on one host's CPU and
    nothing is compressed, "native" elsewhere), "native", "ring", "tree", "shm" or
    "hierarchical"."""
    compress: Any = None
    """What goes on the wire: None, "bf16", "fp16", PowerSGD(...) or TopK(...). With
    "hierarchical", "bf16"/"fp16" compress the cross-host leg only; "shm" takes none."""
    bucket_mb: float | None = None
    """The gradient bucket cap (None: the algorithm's default)."""
    find_unused: bool = False
    """Allow parameters that get no gradient on some steps."""
    nonfinite: str = "error"
    """A NaN or inf in some rank's gradient: "error" stops the run at that step (naming the
    step, the ranks and the first parameter, before any checkpoint takes the bad weights),
    "skip" drops the step on every rank and counts it (`skipped_steps` in the metrics), or
    "off". fp16's loss scaler skips overflowing steps in any case."""

    def __post_init__(self) -> None:
        self.validate()  # a combination that cannot work is refused here, not in a worker

    def validate(self) -> None:
        check_combination(self.algorithm, self.compress)
        check_mode(self.nonfinite)

    def build(self, module: nn.Module) -> DataParallel:
        return DataParallel(module, bucket_mb=self.bucket_mb, find_unused=self.find_unused,
                            algorithm=self.algorithm, compress=self.compress,
                            nonfinite=self.nonfinite)
