"""Evaluation that is exact across ranks, and the default loss and accuracy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lockstep import comm
from lockstep.replication.precision import autocast
from lockstep.training.sampler import ShardedSampler

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """Fraction of correct argmax predictions per sample (per token, averaged, for
    sequences), or None when outputs are not class scores for these targets."""
    if targets.dtype != torch.long or outputs.shape[:-1] != targets.shape:
        return None
    correct = (outputs.argmax(-1) == targets).float()
    return correct.reshape(len(targets), -1).mean(1)


def flat_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class scores (B, C) or sequences of them (B, T, C)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, eval_set: Dataset[Any], loss_fn: LossFn, batch_size: int,
             precision: str, device: torch.device) -> dict[str, float]:
    """Loss and accuracy over the whole eval set, exact across ranks: the sampler's padding
    samples are not counted, and sums (not means) are reduced. Every rank calls it."""
    sampler = ShardedSampler(eval_set, shuffle=False)  # type: ignore[arg-type]
    rank, n = comm.rank_of(), comm.size_of()
    # Rank r holds positions r, r+N, ...; those past the end are padding repeats.
    valid = len(range(rank, len(eval_set), n))  # type: ignore[arg-type]
    loader = DataLoader(eval_set, batch_size=batch_size, sampler=sampler,
                        generator=torch.Generator())  # the global RNG untouched
    sums = comm.control_tensor([0, 0, 0], dtype=torch.float64)  # loss, correct, count
    model.eval()
    seen = 0
    for x, y in loader:
        x, y = x[: valid - seen].to(device), y[: valid - seen].to(device)
        seen += len(x)
        if len(x) == 0:
            break
        with autocast(precision, device):
            outputs = model(x)
            sums[0] += loss_fn(outputs, y).float().item() * len(x)
        accuracy = per_sample_accuracy(outputs, y)
        sums[1] += accuracy.sum().item() if accuracy is not None else float("nan")
        sums[2] += len(x)
    model.train()
    comm.all_reduce(sums, "trainer: evaluation sums")
    return {"loss": sums[0].item() / sums[2].item(), "accuracy": sums[1].item() / sums[2].item()}
