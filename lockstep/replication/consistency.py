"""Replicas that are the same: checked when a model is wrapped.

Every rank must build the same model before wrapping it; if one did not (another width, a
missing layer, a frozen parameter), collectives over mismatched buffers would hang or mix
unrelated numbers. A fingerprint of every rank's parameter and buffer names, shapes, dtypes
and trainability is compared first; only on a mismatch are the descriptions exchanged, to
name the first difference and the ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from torch import nn

from lockstep import comm


class ModelMismatchError(RuntimeError):
    """Ranks wrapped models with different parameters or buffers."""


LEVELLED_ELSEWHERE: ContextVar[bool] = ContextVar("lockstep_levelled_elsewhere", default=False)


@contextlib.contextmanager
def levelled_elsewhere() -> Iterator[None]:
    """A DataParallel built inside neither checks that the replicas match nor broadcasts
    rank 0's parameters (DDP's init_sync=False): the caller makes them match itself.
    lockstep.Elastic does, for DataParallel past step 0 (not ZeRO): a joiner's model was
    compared with the job's before it was let in (elastic/terms.py: names, shapes, dtypes,
    which parameters train), and rank 0's state goes to every rank not level
    (handover.py) -- the check and the broadcast were a tenth of a joiner's way in."""
    token = LEVELLED_ELSEWHERE.set(True)
    try:
        yield
    finally:
        LEVELLED_ELSEWHERE.reset(token)


def _describe(module: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    entries = [(f"parameter {n}", tuple(p.shape), str(p.dtype), p.requires_grad)
               for n, p in module.named_parameters()]
    entries += [(f"buffer {n}", tuple(b.shape), str(b.dtype), False)
                for n, b in module.named_buffers()]
    return entries


def verify_replicas_match(module: nn.Module, group: comm.Group = None) -> None:
    """Raise ModelMismatchError on every rank if any rank's model differs from rank 0's."""
    described = _describe(module)
    digest = hashlib.sha256(repr(described).encode()).hexdigest()
    digests = comm.all_gather_object(digest, "model fingerprint exchange", group)
    if len(set(digests)) == 1:
        return
    everyone = comm.all_gather_object(described, "model description exchange", group)
    raise ModelMismatchError(_first_difference(everyone, comm.rank_of(group)))


def _first_difference(described: list[list[tuple[Any, ...]]], me: int) -> str:
    reference = described[0]
    for rank, entries in enumerate(described[1:], start=1):
        for position in range(max(len(reference), len(entries))):
            ours = reference[position] if position < len(reference) else None
            theirs = entries[position] if position < len(entries) else None
            if ours != theirs:
                return (f"rank {me}: DataParallel found different models across ranks: entry "
                        f"{position} is {_fmt(ours)} on rank 0 but {_fmt(theirs)} on rank "
                        f"{rank}. Every rank must build the same model before wrapping it.")
    return f"rank {me}: model fingerprints differ across ranks"


def _fmt(entry: tuple[Any, ...] | None) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad or name.startswith("buffer") else ", frozen"
    return f"{name} (shape {list(shape)}, {dtype.removeprefix('torch.')}{frozen})"
