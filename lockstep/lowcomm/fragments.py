"""How streaming DiLoCo cuts a model into fragments: pure planning, from layer sizes.

A fragment is a run of whole layers (a layer's weight and bias travel together), and the
runs are of nearly equal size, so the link carries about as much at each fragment's turn.
"""

from __future__ import annotations

import itertools

from torch import nn


def plan_fragments(unit_numels: list[int], fragments: int) -> list[range]:
    """Cut units (layers, in order; their sizes) into `fragments` contiguous runs of nearly
    equal size: run k ends at the unit boundary nearest k/fragments of the total."""
    if not 1 <= fragments <= len(unit_numels):
        raise ValueError(f"streaming DiLoCo needs 1 <= fragments <= the model's "
                         f"{len(unit_numels)} layers with parameters; got {fragments}")
    cumulative, bounds = list(itertools.accumulate(unit_numels)), [0]
    for k in range(1, fragments):
        target = cumulative[-1] * k / fragments
        ends = range(bounds[-1] + 1, len(unit_numels) - (fragments - k) + 1)  # none empty
        bounds.append(min(ends, key=lambda end: abs(cumulative[end - 1] - target)))
    bounds.append(len(unit_numels))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def layer_units(module: nn.Module) -> list[list[int]]:
    """The module's parameters (indices into .parameters()) grouped by the layer owning them."""
    units: dict[str, list[int]] = {}
    for index, (name, _) in enumerate(module.named_parameters()):
        units.setdefault(name.rpartition(".")[0], []).append(index)
    return list(units.values())
