"""The tensors in a model's output, whatever its structure."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def find_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in a model's output: tensors, sequences, mappings (Hugging Face's
    ModelOutput is one) and dataclasses, nested."""
    if depth > 32:  # a cycle, or a structure too deep to be a model's output
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item, depth + 1)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from find_tensors(item, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, f.name, None), depth + 1)
