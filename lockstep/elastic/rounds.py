"""How a wrapper that trains in rounds -- local SGD, DiLoCo, streaming DiLoCo -- lives
through a regroup. Its replicas meet only at a round's average (`synchronise`), so the
wrapper keeps its round's progress through a failure instead of being rebuilt (a
DataParallel's reducer is built for one world size and must be)."""

from __future__ import annotations

from typing import Any


def trains_in_rounds(model: Any) -> bool:
    """Whether `model` meets its peers only at round ends. Not `after_step`: every Replica
    answers that, a DataParallel too."""
    return callable(getattr(model, "synchronise", None))


def sync_round(model: Any, retry: bool) -> None:
    """Count the inner step and synchronise at the round's end; with `retry` (the previous
    try failed and the survivors regrouped) only synchronise again: the optimizer has
    stepped, and `after_step` counted the step before it failed."""
    if retry:
        model.synchronise()
    else:
        model.after_step()


def before_planned_regroup(model: Any) -> None:
    """Joiners come in: the wrapper is rebuilt for the new world, and building it
    broadcasts rank 0's parameters. Bring every replica level first, on the old group: a
    no-op for local SGD and DiLoCo, whose joiners come at a round's end, where they are
    level; streaming DiLoCo's fragments never are all at once (its `finish`)."""
    if trains_in_rounds(model):
        model.finish()


def leaving_group(model: Any) -> None:
    """The old group is about to go: what the wrapper has in flight on it is dropped
    (streaming DiLoCo's exchanges), whole -- never half-applied -- and holds nothing of
    it alive."""
    drop = getattr(model, "drop_in_flight", None)
    if callable(drop):
        drop()
