"""Is a checkpoint folder intact, and is it safe to read? Both are checked before loading.

Intact: every file the manifest lists has its size and SHA-256. The manifest is a checksum,
not a signature -- whoever can write the folder can recompute it -- so the format is checked
too: only lockstep's own file names, every tensor file's header (lockstep.training.tensorfile) and
the pieces they describe (lockstep.training.checkpoint_files), and every JSON file parses as an
object. Nothing is unpickled, ever; a pickle found in a checkpoint is refused and described
by the globals it names, read from its opcodes.

Safe to read: only regular files that the manifest lists, inside the folder, opened without
following a link or waiting for a writer (tensorfile.open_regular), their type and size
checked before any is opened and every header before any file is hashed -- so a named pipe,
a link or a sparse terabyte is refused at once on rank 0, and the others hear of it. Fits:
given what the loading model holds (`Expected`), every tensor's dtype and shape, and
state.json's content, are checked too: wrong content is skipped, never converted.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import pickletools
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep.training import checkpoint_files
from lockstep.training.tensorfile import (
    MAX_HEADER_BYTES,
    FormatError,
    natural,
    no_duplicates,
    open_regular,
)

MANIFEST = "MANIFEST.json"
STATE = "state.json"
_FILES = re.compile(r"MANIFEST\.json|state\.json|rng-rank\d+\.json|tensors-rank\d+\.safetensors")


MAX_JSON_BYTES = 64 << 20  # a manifest, state or RNG file: kilobytes in practice
_SLACK = 8  # a tensor file may hold this many times the model's state (another optimizer's)
_HASHED_ANYWAY = 1 << 30  # a refused file this small is hashed too, to tell corrupt from crafted


@dataclass(frozen=True)
class Expected:
    """What the model, optimizer and extra tensors loading a checkpoint hold, so that a
    checkpoint can be checked against them before any of its data is read."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Every tensor's key (checkpoint_files' layout): its global shape and dtype."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Shapes as the model has them (the layout flattens parameters), for messages."""
    state: Callable[[dict[str, Any]], str | None] | None = None
    """What is wrong with state.json's content for this run, or None."""

    def max_file_bytes(self) -> int:
        data = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in self.tensors.values())
        return _SLACK * data + 8 + MAX_HEADER_BYTES


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_of(folder: Path) -> dict[str, Any]:
    """The manifest of every file in `folder` (but itself)."""
    return {"files": {p.name: {"bytes": p.stat().st_size, "sha256": _digest(p)}
                      for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}}


def verify(folder: Path, expected: Expected | None = None) -> str | None:
    """None if `folder` is a checkpoint lockstep can load, else what is wrong with it; never
    raises for what is in the folder (rank 0 decides for every rank: it must answer)."""
    try:
        return _verify(folder, expected)
    except (OSError, ValueError, RecursionError, MemoryError) as error:  # e.g. a file gone
        return f"cannot be checked ({type(error).__name__}: {error})"


def _verify(folder: Path, expected: Expected | None) -> str | None:
    """None if `folder` is a complete, intact checkpoint that lockstep can read safely (and,
    given `expected`, one that fits the model loading it); otherwise what is wrong with it.
    The manifest is a checksum, not a signature (whoever can write the folder can recompute
    it), so the format is checked as well. The cheap checks come first: every file's type
    and size before any is opened, every header before any file is hashed (a file is
    hashed only once its header accounts for its size, or when it is small), so a named
    pipe, a link or a sparse terabyte is refused at once, not waited on or read."""
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        return manifest
    for name in manifest:  # checked before any file is opened: a name is not a path
        if not _plain_name(name):
            return f"its manifest names {name!r}, which is not a file of a checkpoint"
    limit = expected.max_file_bytes() if expected else None
    for name, entry in manifest.items():
        problem = _check_file(folder / name, entry["bytes"], limit)
        if problem is not None:
            return problem
    for name in manifest:
        if not _FILES.fullmatch(name):
            return _foreign(folder / name)
    refusal = _refusal(folder, set(manifest), expected)
    for name, entry in manifest.items():  # a refusal may be a disk's flipped bit: say so
        if (refusal is None or entry["bytes"] <= (limit or _HASHED_ANYWAY)) and \
                _digest(folder / name) != entry["sha256"]:
            return f"{name} is corrupt (checksum mismatch)"
    return refusal


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _check_file(path: Path, listed: int, limit: int | None) -> str | None:
    """A file's type and size, from lstat: nothing is opened, no link is followed."""
    try:
        info = path.lstat()
    except OSError:
        return f"{path.name} is missing"
    if stat.S_ISLNK(info.st_mode):
        return (f"refused to read {path}: it is a symbolic link; lockstep reads only regular "
                "files inside the checkpoint folder")
    if not stat.S_ISREG(info.st_mode):
        return f"refused to read {path}: it is not a regular file (a named pipe, a folder...)"
    if info.st_size != listed:
        return f"{path.name} is truncated or grown ({info.st_size} of {listed} bytes)"
    if path.name.endswith(".json") and info.st_size > MAX_JSON_BYTES:
        return f"refused to read {path}: {info.st_size} bytes, more than a JSON file may hold"
    if limit is not None and info.st_size > limit:
        return (f"refused to read {path}: {info.st_size} bytes, more than this model's state "
                f"could take ({limit} at most)")
    return None


def _read_manifest(folder: Path) -> dict[str, dict[str, Any]] | str:
    try:
        files = read_json(folder / MANIFEST)["files"]
        if isinstance(files, dict) and all(
                isinstance(e, dict) and natural(e.get("bytes")) and isinstance(e.get("sha256"), str)
                for e in files.values()):
            return dict(files)
    except FormatError as error:
        return f"its manifest is missing or unreadable ({error})"
    except (KeyError, TypeError):
        pass
    return "its manifest is missing or unreadable"


def listed_files(folder: Path) -> set[str]:
    """The names a checkpoint's manifest lists: the only files of it that may be read."""
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        raise FormatError(f"{folder / MANIFEST}: {manifest}")
    return set(manifest)


def _refusal(folder: Path, names: set[str], expected: Expected | None) -> str | None:
    """Why lockstep will not read this checkpoint, or None: every header and JSON file is
    checked here, on rank 0, so that a crafted one is skipped like a corrupt one."""
    for required in (STATE, checkpoint_files.TENSORS.format(0)):
        if required not in names:
            return f"{required} is missing"
    try:
        found = checkpoint_files.catalog(folder, names)
        json_files = {n: read_json(folder / n) for n in sorted(names)
                      if n.endswith(".json") and n != MANIFEST}
    except FormatError as error:
        return f"refused to read {error}"
    if expected is None:
        return None
    problem = checkpoint_files.mismatch(found, expected.tensors, expected.shapes)
    if problem is None and expected.state is not None:
        try:
            problem = expected.state(json_files[STATE])
        except Exception as error:  # a field the schema missed: still a skip, not a crash
            problem = f"its content cannot be checked ({type(error).__name__}: {error})"
        problem = problem and f"{folder / STATE}: {problem}"
    return problem and f"refused to load {problem}"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a regular file of at most MAX_JSON_BYTES. Raises FormatError."""
    with open_regular(path, MAX_JSON_BYTES) as f:
        raw = f.read()
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise FormatError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: not a JSON object")
    return value


def _foreign(path: Path) -> str:
    """What a file that lockstep does not write is, for the refusal message. A pickle is
    described by the globals it names, read from its opcodes -- never by loading it."""
    try:
        with open_regular(path) as f:
            head = f.read(1 << 20)
    except FormatError as error:
        return f"refused to read {error}"
    if not (head.startswith(b"\x80") or path.name == ".metadata"):
        return f"refused to read {path}: lockstep does not write such a file in a checkpoint"
    names = pickle_globals(head)
    odd = [n for n in names if not n.startswith(("torch.", "pathlib.", "collections."))]
    what = f"a pickle naming {', '.join(names)}" if names else "a pickle"
    if odd:
        what += ", which is not DCP metadata"
    return (f"refused to read {path}: it is {what}. A pickle can run code, and lockstep's "
            "checkpoints hold none (torch.distributed.checkpoint's format, which earlier "
            "versions wrote, is refused too)")


def pickle_globals(data: bytes) -> list[str]:
    """The module.name globals a pickle refers to, read statically with pickletools."""
    names: list[str] = []
    strings: list[str] = []
    memo: dict[int, str] = {}
    pushed: str | None = None
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif op.name == "MEMOIZE" and pushed is not None:
                memo[len(memo)] = pushed
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT") and pushed is not None:
                memo[int(str(arg))] = pushed
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and int(str(arg)) in memo:
                strings.append(memo[int(str(arg))])
            pushed = arg if isinstance(arg, str) and "UNICODE" in op.name else None
            if pushed is not None:
                strings.append(pushed)
    except Exception:  # truncated or malformed: what was read is enough for a message
        pass
    return sorted(set(names))
