"""The oracle: gradients averaged the obvious way, one blocking all-reduce per parameter.

Slow and obviously right (picotron's first step); tests hold the bucketed Reducer
(reducer.py) against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep import comm


def naive_average_gradients(params: Sequence[torch.nn.Parameter],
                            group: comm.Group = None) -> None:
    """The oracle: one blocking all-reduce per parameter, then divide. Slow and obviously
    right; tests hold the bucketed reducer against it."""
    world_size = comm.size_of(group)
    for param in params:
        if param.grad is not None:
            comm.all_reduce(param.grad, "naive per-parameter all-reduce", group)
            param.grad.div_(world_size)
