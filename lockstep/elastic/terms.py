"""The terms of a job: what every worker must agree on before it may train in it.

A joiner that differs from the job in what decides what is trained -- its model (names,
shapes, dtypes, which parameters train), its optimizer (kind and settings), the global
batch, the data (size, order) -- would either break the job (a wider layer fails every
member's collectives) or, worse, train silently on other samples than the members do. So
each worker publishes its terms when it arrives, and the members' rank 0 compares a
joiner's with its own before letting it in: a joiner that differs is refused, told why,
and the job goes on.

Terms are plain JSON (no code, no pickle): a dict of name -> value, where "model" maps
each parameter and buffer to [shape, dtype, role] (trainable, frozen or buffer).
`differences` says what differs, in words.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn


def terms_of(module: nn.Module, optimizer: torch.optim.Optimizer,
             agree: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This worker's terms: its model's layout, its optimizer's kind and settings, and
    `agree` (what else decides the training: the global batch, the data's size and seed)."""
    # Which parameters train, too: a joiner that froze another layer would build other
    # buckets (and Elastic's wrappers past step 0 skip DataParallel's own model check)
    model = {name: [list(p.shape), _dtype(p), "trainable" if p.requires_grad else "frozen"]
             for name, p in module.named_parameters()}
    model.update({name: [list(b.shape), _dtype(b), "buffer"]
                  for name, b in module.named_buffers()})
    inner = getattr(optimizer, "inner", optimizer)  # ZeRO's: the torch optimizer it steps
    settings = {key: value for key, value in inner.defaults.items()
                if isinstance(value, (bool, int, float, str, type(None)))}
    terms = {"model": model, "optimizer": {"kind": type(inner).__name__,
                                           "over_shards": inner is not optimizer, **settings}}
    for key, value in (agree or {}).items():
        terms[key] = json.loads(json.dumps(value))  # what a peer will read back
    return terms


def differences(job: Mapping[str, Any], joiner: Mapping[str, Any], limit: int = 3
                ) -> list[str]:
    """What differs between the job's terms and a joiner's, in words (at most `limit`):
    "config.global_batch_size: 24 here, 12 in the job"."""
    found = _model_differences(job.get("model") or {}, joiner.get("model") or {})
    ours = dict(_flat({k: v for k, v in job.items() if k != "model"}))
    theirs = dict(_flat({k: v for k, v in joiner.items() if k != "model"}))
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key, _UNSET) != theirs.get(key, _UNSET):
            found.append(f"{key}: {_show(theirs, key)} here, {_show(ours, key)} in the job")
    return found[:limit]


_UNSET = object()


def _flat(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _show(values: Mapping[str, Any], key: str) -> str:
    return repr(values[key]) if key in values else "not set"


def _model_differences(job: Mapping[str, Any], joiner: Mapping[str, Any]) -> list[str]:
    found = []
    for name in sorted(set(job) | set(joiner)):
        mine, theirs = joiner.get(name), job.get(name)
        if mine == theirs:
            continue
        if mine is None:
            found.append(f"model entry {name!r}: missing here, {_entry(theirs)} in the job")
        elif theirs is None:
            found.append(f"model entry {name!r}: {_entry(mine)} here, not in the job")
        else:
            found.append(f"model entry {name!r}: {_entry(mine)} here, {_entry(theirs)} in "
                         "the job")
    return found


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _entry(layout: Any) -> str:
    shape, dtype, role = layout
    return f"{list(shape)} {dtype}" + ("" if role == "trainable" else f" ({role})")
