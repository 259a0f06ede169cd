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
    return held(model.parameters(), optimizer)


def held(params: Iterable[torch.Tensor], optimizer: Any,
         grads: Iterable[torch.Tensor] | None = None) -> dict[str, int]:
    """The bytes of `params`, of their gradients (or of `grads`) and of `optimizer`'s state."""
    params = list(params)
    if grads is None:
        grads = [p.grad for p in params if p.grad is not None]
    return {"parameters": tensor_bytes(params), "gradients": tensor_bytes(grads),
            "optimizer_state": state_bytes(optimizer)}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def state_bytes(optimizer: Any) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))
