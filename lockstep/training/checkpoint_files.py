"""What a checkpoint's tensor files hold, and filling live state from them at any world size.

Each rank writes one file, `tensors-rank{r}.safetensors` (lockstep.training.tensorfile): its pieces
of every sharded tensor (the local shards of a ShardedTensor, see lockstep.sharding.reshard) and, on
rank 0, every whole tensor (the same on every rank, so one copy is enough) and every plain
value (an optimizer's hyperparameters) as JSON in the header. A piece is a range
[start, start + numel) of its flattened global tensor. Loading walks the *target* state --
whole tensors, or this rank's shards, as views into the live model and optimizer -- and
copies in whatever pieces overlap each one, so a checkpoint written at stage 3 on 3 ranks
loads at stage 1 on 2, as with torch.distributed.checkpoint, but from files that hold only
numbers and JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lockstep.training import tensorfile
from lockstep.training.tensorfile import Entry, FormatError, Header

TENSORS = "tensors-rank{}.safetensors"
_PIECES, _VALUES, _RANKS = "lockstep.pieces", "lockstep.values", "lockstep.ranks"
_SHAPES = "lockstep.shapes"  # the model's own shapes of flattened tensors, for messages
_MAX_RANKS = 1 << 20
OPTIONAL = "optim_groups/"
"""Plain values a checkpoint written by an earlier lockstep may lack (reshard.GROUPS)."""


@dataclass(frozen=True)
class Leaf:
    """One value of a nested state dict, and where it sits (to replace a plain value)."""

    key: str
    container: Any
    slot: Any
    value: Any


def leaves(tree: Any, path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every tensor and plain value in nested dicts (and lists of dicts, as an optimizer's
    param_groups), keyed by its path joined with '/'."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for slot, value in items:
        here = (*path, str(slot))
        if isinstance(value, dict) or (isinstance(value, list) and any(
                isinstance(v, (dict, torch.Tensor)) for v in value)):
            yield from leaves(value, here)
        else:
            yield Leaf("/".join(p.replace("%", "%25").replace("/", "%2F") for p in here),
                       tree, slot, value)


# ---- writing ---------------------------------------------------------------------------


def write_rank(path: Path, bundle: dict[str, Any], rank: int, world_size: int,
               shapes: dict[str, list[int]] | None = None) -> None:
    """This rank's file: its shards; on rank 0 also the whole tensors and plain values, and
    `shapes`, the model's own shapes of tensors the layout flattens."""
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[Any]] = {}
    values: dict[str, Any] = {}
    for leaf in leaves(bundle):
        if isinstance(leaf.value, ShardedTensor):
            for shard in leaf.value.local_shards():
                if shard.tensor.dim() != 1 or leaf.key in tensors:
                    raise TypeError(f"checkpoint: {leaf.key} is sharded other than as one "
                                    "1-D piece per rank (lockstep.sharding.reshard's layout)")
                tensors[leaf.key] = shard.tensor
                pieces[leaf.key] = [list(whole_shape(leaf.value)[0]),
                                    shard.metadata.shard_offsets[0]]
        elif isinstance(leaf.value, torch.Tensor):
            if rank == 0:
                tensors[leaf.key], pieces[leaf.key] = leaf.value, [list(leaf.value.shape), 0]
        elif rank == 0:
            values[leaf.key] = _plain(leaf.key, leaf.value)
    metadata = {_PIECES: json.dumps(pieces)}
    if rank == 0:
        metadata.update({_VALUES: json.dumps(values), _RANKS: str(world_size),
                         _SHAPES: json.dumps(shapes or {})})
    tensorfile.write(path, tensors, metadata)


def whole_shape(value: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """A tensor's shape and dtype; a ShardedTensor's whole ones, read from its metadata (its
    .size() and .dtype print torch's "we are deprecating ShardedTensor" FutureWarning)."""
    if isinstance(value, ShardedTensor):
        meta = value.metadata()
        return tuple(meta.size), meta.tensor_properties.dtype
    return tuple(value.shape), value.dtype


def _plain(key: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise TypeError(f"checkpoint: {key} = {value!r} is neither a tensor nor plain data "
                        "(numbers, strings, lists); a checkpoint holds nothing else") from None
    return value


# ---- reading ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + entry.numel) of the flattened global tensor of `shape`."""

    path: Path
    entry: Entry
    start: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Catalog:
    """Every piece of every tensor in a checkpoint's files, and its plain values."""

    pieces: dict[str, list[Piece]]
    values: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]


def catalog(folder: Path, listed: set[str]) -> Catalog:
    """Read and check every tensor file's header (not the data). Only files in `listed`
    (the manifest's names) are read. Raises FormatError naming the file and what is wrong."""
    first = _header(folder, 0, listed)
    ranks = first.metadata.get(_RANKS, "")
    if not ranks.isdigit() or not 0 < int(ranks) <= _MAX_RANKS:
        raise FormatError(f"{first.path}: {_RANKS} is {ranks!r}, not a number of ranks")
    values = _json(first, _VALUES)
    pieces: dict[str, list[Piece]] = {}
    for rank in range(int(ranks)):
        header = first if rank == 0 else _header(folder, rank, listed)
        described = _json(header, _PIECES)
        if set(described) != set(header.entries):
            raise FormatError(f"{header.path}: its pieces and its tensors differ")
        for key, spec in described.items():
            pieces.setdefault(key, []).append(_piece(header, key, spec))
    for key, found in pieces.items():
        _check_disjoint(key, found)
    return Catalog(pieces, values, _shapes(first))


def _header(folder: Path, rank: int, listed: set[str]) -> Header:
    name = TENSORS.format(rank)
    if name not in listed:  # never read, so nothing of it can show in a message
        raise FormatError(f"{folder / name}: not listed in the checkpoint's manifest")
    return tensorfile.read_header(folder / name)


def _shapes(header: Header) -> dict[str, tuple[int, ...]]:
    """The model's shapes (for messages only); absent in older checkpoints."""
    if _SHAPES not in header.metadata:
        return {}
    shapes = _json(header, _SHAPES)
    if not all(isinstance(s, list) and all(tensorfile.natural(d) for d in s)
               for s in shapes.values()):
        raise FormatError(f"{header.path}: its {_SHAPES} are not lists of sizes")
    return {key: tuple(shape) for key, shape in shapes.items()}


def mismatch(found: Catalog, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
             shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The first tensor the checkpoint lacks or holds with another shape or dtype than the
    model (whose own shapes are `shapes`), or None. A dtype is never converted: int64
    numbers in a float32 weight are not the weights that were saved."""
    for key, (shape, dtype) in expected.items():
        pieces = found.pieces.get(key)
        if not pieces:
            return f"{pieces_file(found)}: it has no tensor {key}, which this model holds"
        saved = pieces[0]
        if saved.entry.dtype != dtype:
            return (f"{saved.path}: {key} is stored as {_name(saved.entry.dtype)}, this model "
                    f"holds {_name(dtype)}")
        if saved.shape != shape:
            then = _own_shape(key, saved.shape, found.shapes)
            return (f"{saved.path}: {key} has shape {list(then)} in the checkpoint and "
                    f"{list(_own_shape(key, shape, shapes))} in this model. The model has "
                    "changed since this checkpoint was written: to train the changed model, "
                    "give it a new run_dir (or remove these checkpoints and use "
                    "resume='never')")
    return None


def pieces_file(found: Catalog) -> str:
    return str(next((p[0].path for p in found.pieces.values() if p), "its tensor files"))


def _own_shape(key: str, flat: tuple[int, ...], shapes: dict[str, tuple[int, ...]]
               ) -> tuple[int, ...]:
    """A tensor's shape in the model; an optimizer state has its parameter's shape."""
    if key in shapes:
        return shapes[key]
    if key.startswith("optim.") and key.count(".") >= 2:
        return shapes.get("model." + key[len("optim."):].rsplit(".", 1)[0], flat)
    return flat


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _json(header: Header, name: str) -> dict[str, Any]:
    try:
        value = json.loads(header.metadata.get(name, ""),
                           object_pairs_hook=tensorfile.no_duplicates)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise FormatError(f"{header.path}: its {name} is not a JSON object")
    return value


def _piece(header: Header, key: str, spec: Any) -> Piece:
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)
            and all(tensorfile.natural(v) for v in [*spec[0], spec[1]])):
        raise FormatError(f"{header.path}: piece {key!r} is described as {spec!r}")
    piece = Piece(header.path, header.entries[key], spec[1], tuple(spec[0]))
    if piece.start + piece.entry.numel > math.prod(piece.shape):
        raise FormatError(f"{header.path}: piece {key!r} lies outside its tensor")
    return piece


def _check_disjoint(key: str, pieces: list[Piece]) -> None:
    """One shape and dtype per tensor, and no element written twice."""
    pieces.sort(key=lambda p: p.start)
    end = 0
    for piece in pieces:
        if (piece.shape, piece.entry.dtype) != (pieces[0].shape, pieces[0].entry.dtype):
            raise FormatError(f"{piece.path}: {key!r} disagrees with {pieces[0].path} on its "
                              "shape or dtype")
        if piece.start < end:
            raise FormatError(f"{piece.path}: {key!r} overlaps another rank's piece")
        end = piece.start + piece.entry.numel


# ---- loading into live state -------------------------------------------------------------


def fill(bundle: dict[str, Any], found: Catalog) -> None:
    """Copy the checkpoint into `bundle`'s tensors (views into the live state) in place, and
    replace its plain values. Raises ValueError when the checkpoint lacks what it needs."""
    with contextlib.ExitStack() as stack:
        files: dict[Path, io.BufferedReader] = {}

        def open_file(path: Path) -> io.BufferedReader:
            if path not in files:  # a regular file, no link: see tensorfile.open_regular
                files[path] = stack.enter_context(tensorfile.open_regular(path))
            return files[path]

        for leaf in list(leaves(bundle)):
            if isinstance(leaf.value, ShardedTensor):
                for shard in leaf.value.local_shards():
                    _fill(found, leaf.key, whole_shape(leaf.value)[0],
                          shard.metadata.shard_offsets[0], shard.tensor, open_file)
            elif isinstance(leaf.value, torch.Tensor):
                _fill(found, leaf.key, tuple(leaf.value.shape), 0, leaf.value, open_file)
            elif leaf.key in found.values:
                saved = found.values[leaf.key]  # JSON has no tuples: keep the live kind
                if not _same_kind(leaf.value, saved):
                    raise ValueError(f"the checkpoint's value for {leaf.key} is {saved!r}, "
                                     f"where this run has {leaf.value!r}")
                tuple_like = isinstance(leaf.value, tuple) and isinstance(saved, list)
                leaf.container[leaf.slot] = tuple(saved) if tuple_like else saved
            elif not leaf.key.startswith(OPTIONAL):
                raise ValueError(f"the checkpoint has no value for {leaf.key}")
            else:  # written before these were kept: the live value stays
                continue


def _same_kind(live: Any, saved: Any) -> bool:
    """Whether a saved plain value may stand for the live one: a number for a number (a
    flag for a flag), text for text, a list for a list or tuple of as many such."""
    if isinstance(live, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(live) and all(
            _same_kind(a, b) for a, b in zip(live, saved, strict=True))
    if isinstance(live, bool) or isinstance(saved, bool):
        return isinstance(live, bool) and isinstance(saved, bool)
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float))
    return type(live) is type(saved)


@torch.no_grad()
def _fill(found: Catalog, key: str, shape: tuple[int, ...], start: int, dest: torch.Tensor,
          open_file: Any) -> None:
    """Fill `dest`, elements [start, start + dest.numel()) of tensor `key`, from the pieces."""
    pieces = found.pieces.get(key)
    if not pieces:
        raise ValueError(f"the checkpoint has no tensor {key}")
    if pieces[0].shape != shape:
        raise ValueError(f"{key} has shape {list(pieces[0].shape)} in the checkpoint and "
                         f"{list(shape)} here")
    if pieces[0].entry.dtype != dest.dtype:  # converting would load other numbers
        raise ValueError(f"{pieces[0].path}: {key} is stored as {_name(pieces[0].entry.dtype)}, "
                         f"this model holds {_name(dest.dtype)}")
    count = dest.numel()
    values = torch.empty(count, dtype=dest.dtype)
    covered = 0
    for piece in pieces:
        lo, hi = max(start, piece.start), min(start + count, piece.start + piece.entry.numel)
        if hi > lo:
            values[lo - start:hi - start] = tensorfile.read(open_file(piece.path), piece.entry,
                                                            lo - piece.start, hi - lo)
            covered += hi - lo
    if covered != count:
        raise ValueError(f"the checkpoint holds {covered} of the {count} values of {key} "
                         "this rank needs")
    dest.copy_(values.view(dest.shape))
