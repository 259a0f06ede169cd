"""Tensors as raw typed bytes in the safetensors layout, read as if the file were hostile.

A file is an 8-byte little-endian header length, a JSON header, then the tensors' bytes:

    {"__metadata__": {"key": "value", ...},                     # strings only
     "model.fc.weight": {"dtype": "F32", "shape": [10, 64], "data_offsets": [0, 2560]}, ...}

It holds numbers and JSON, nothing that can name code, so loading one cannot run anything:
the reader checks every number in the header against the file before using it (header
length, dtype, shape, offsets, and that the tensors tile the data exactly), then reads only
the byte ranges asked for. A header that declares more than the file holds is refused before
anything is allocated. The layout is safetensors' own, so its tools can open these files.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; real headers are a few MB at most

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class FormatError(ValueError):
    """A tensor file that is not what it claims to be; the message names the file."""


def open_regular(path: Path, max_bytes: int | None = None) -> io.BufferedReader:
    """Open `path` for reading only if it is a regular file of at most `max_bytes`.

    A checkpoint's files come from whoever can write its folder: a named pipe never ends
    (a read waits for ever), a sparse file can claim a terabyte at no cost, and a link can
    point anywhere. So the last component is never followed (O_NOFOLLOW), the open cannot
    wait for a writer (O_NONBLOCK), and the type and size are checked on the descriptor
    itself, so the file cannot be swapped between the check and the read. Raises
    FormatError naming the file and saying what it is; nothing of its content is read."""
    if "\0" in str(path):
        raise FormatError(f"{str(path)!r}: a file name with a NUL byte")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if os.path.islink(path):
            raise FormatError(f"{path}: is a symbolic link; lockstep reads only regular "
                              "files inside the checkpoint folder") from None
        raise FormatError(f"{path}: cannot be opened ({error.strerror})") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"is {_kind(info.st_mode)}, not a regular file"
    elif max_bytes is not None and info.st_size > max_bytes:
        problem = f"holds {info.st_size} bytes, more than the {max_bytes} it may"
    if problem is not None:
        os.close(fd)
        raise FormatError(f"{path}: {problem}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


@dataclass(frozen=True)
class Entry:
    """One tensor in a file: where its bytes lie (absolute offsets) and how to read them."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    path: Path
    entries: dict[str, Entry]
    metadata: dict[str, str]


def _check_little_endian() -> None:
    # The bytes are written and read in the machine's order; the format says little-endian.
    if sys.byteorder != "little":
        raise NotImplementedError("lockstep's tensor files need a little-endian machine")


def write(path: Path, tensors: Mapping[str, torch.Tensor],
          metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (any device, any layout) and string `metadata` to `path`, fsynced."""
    _check_little_endian()
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for tensor in tensors.values():
            if tensor.numel():
                flat = tensor.detach().to("cpu").contiguous().reshape(-1)
                f.write(flat.view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())  # the checkpoint is renamed into place only once durable


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two entries under one name would make "which one is read" a matter of parser detail.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"the name {key!r} appears twice")
        out[key] = value
    return out


def read_header(path: Path, max_bytes: int | None = None) -> Header:
    """The validated header of `path`, a regular file of at most `max_bytes`. Raises
    FormatError naming the file and the problem."""
    with open_regular(path, max_bytes) as f:
        return _parse_header(path, f)


def _parse_header(path: Path, f: io.BufferedReader) -> Header:
    try:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise FormatError(f"declares a header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length).decode("utf-8"), object_pairs_hook=no_duplicates)
        if not isinstance(header, dict):
            raise FormatError("its header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or \
                not all(isinstance(v, str) for v in metadata.values()):
            raise FormatError("its __metadata__ is not a map of strings")
        entries = {name: _entry(name, spec, 8 + length) for name, spec in header.items()}
        _check_tiling(entries, 8 + length, size)
    except FormatError as error:
        raise FormatError(f"{path}: {error}") from None
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deep
        raise FormatError(f"{path}: its header is not valid JSON ({error})") from None
    return Header(path, entries, metadata)


def _entry(name: str, spec: Any, data_start: int) -> Entry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise FormatError(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
    dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:  # e.g. bytes or an object type: only plain numbers are data here
        raise FormatError(f"entry {name!r} has dtype {spec['dtype']!r}, not one of "
                          f"{', '.join(DTYPES)}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(natural(d) for d in shape):
        raise FormatError(f"entry {name!r} has shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or \
            not all(natural(o) for o in offsets) or offsets[0] > offsets[1]:
        raise FormatError(f"entry {name!r} has data_offsets {offsets!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != offsets[1] - offsets[0]:
        raise FormatError(f"entry {name!r}: shape {shape} of {spec['dtype']} needs "
                          f"{math.prod(shape) * itemsize} bytes, its offsets span "
                          f"{offsets[1] - offsets[0]}")
    return Entry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(entries: dict[str, Entry], data_start: int, size: int) -> None:
    """The tensors must cover the data exactly, in order, without gaps or overlaps: no byte
    is read twice under two names, and none hides unaccounted for."""
    at = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != at:
            raise FormatError(f"entry {entry.name!r} starts at byte {entry.begin - data_start} "
                              f"of the data, expected {at - data_start}")
        at = entry.end
    if at != size:
        raise FormatError(f"the tensors end at byte {at} of a {size}-byte file")


def read(f: io.BufferedReader, entry: Entry, start: int, count: int) -> torch.Tensor:
    """Elements [start, start + count) of `entry`, flattened, from the open file `f`."""
    if not 0 <= start <= start + count <= entry.numel:
        raise FormatError(f"elements {start}..{start + count} of {entry.name!r} are out of "
                          f"its {entry.numel}")
    if count == 0:
        return torch.empty(0, dtype=entry.dtype)
    dtype = torch.uint8 if entry.dtype == torch.bool else entry.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = bytearray(count * itemsize)
    f.seek(entry.begin + start * itemsize)
    if f.readinto(buffer) != len(buffer):
        raise FormatError(f"{entry.name!r} is cut short")
    values = torch.frombuffer(buffer, dtype=dtype)
    return values != 0 if entry.dtype == torch.bool else values  # a bool is 0 or 1, nothing else
