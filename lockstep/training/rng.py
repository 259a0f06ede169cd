"""A process's random state (torch, numpy, python, each CUDA device) as JSON, for a
checkpoint's `rng-rank{r}.json`: plain numbers and base64 text, nothing a loader would run.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
    }
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state["numpy"] = [kind, np.asarray(keys).tolist(), pos, has_gauss, gauss]
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                         for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch_bytes = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)),
                                                       dtype=torch.uint8) for s in state["cuda"]])


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value
