"""Bytes of model state a rank holds: parameters, gradients, optimizer state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def memory_report(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds now, for a
    DataParallel (sharded or not) or a plain module."""
    report = getattr(model, "memory_report", None)
    if callable(report):  # a wrapper knows where its state lives (sharded or not)
        return dict(report(optimizer))
    params = list(model.parameters())
    return {"parameters": tensor_bytes(params),
            "gradients": tensor_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer_state": state_bytes(optimizer)}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def state_bytes(optimizer: Any) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))
