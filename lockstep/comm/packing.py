"""An object and its tensors as one buffer: what a joiner's state travels as (two messages,
its size and the buffer, where an object and one tensor per dtype took a round trip each).

The buffer holds the pickled object, with the tensors' shapes and dtypes, then each
tensor's bytes, every part starting at a multiple of 16 bytes (so each can be viewed as
its dtype). Pickled among the ranks of one job -- rank 0's own state, sent to a joiner over
the job's group -- and unpickled as data only: containers, numbers, strings, torch's dtypes
and devices, numpy arrays (an RNG's state) and the classes the caller names; any other
name in the bytes is refused, never imported or called.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
from collections.abc import Sequence
from typing import Any

import torch

_ALIGN = 16


def pack(obj: Any, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sizes, payload): the pickled part's and the whole buffer's lengths, and the buffer."""
    head = pickle.dumps((obj, [(tuple(t.shape), t.dtype) for t in tensors]))
    parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
    parts += [_raw_bytes(t) for t in tensors]
    starts = list(itertools.accumulate((_aligned(len(p)) for p in parts), initial=0))
    payload = torch.empty(starts[-1], dtype=torch.uint8)
    for part, start in zip(parts, starts, strict=False):
        payload[start:start + len(part)] = part
    return torch.tensor([len(head), len(payload)], dtype=torch.int64), payload


def sizes_buffer() -> torch.Tensor:
    """Where the receiver takes `pack`'s sizes."""
    return torch.empty(2, dtype=torch.int64)


def payload_buffer(sizes: torch.Tensor) -> torch.Tensor:
    """Where the receiver takes the buffer those sizes announce."""
    return torch.empty(int(sizes[1]), dtype=torch.uint8)


def unpack(sizes: torch.Tensor, payload: torch.Tensor, allow: Sequence[type] = ()
           ) -> tuple[Any, list[torch.Tensor]]:
    """`pack`'s object and tensors again (the tensors on the CPU, each its own memory).
    `allow`: classes the object may hold besides plain data (see _DataOnly)."""
    head = int(sizes[0])
    obj, layout = _DataOnly(io.BytesIO(payload[:head].numpy().tobytes()), allow).load()
    tensors, start = [], _aligned(head)
    for shape, dtype in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append(payload[start:start + nbytes].view(dtype).reshape(shape).clone())
        start += _aligned(nbytes)
    return obj, tensors


_DATA = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
         ("collections", "OrderedDict"), ("torch", "device"), ("numpy", "ndarray"),
         ("numpy", "dtype"), ("numpy._core.multiarray", "_reconstruct"),
         ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
         ("numpy.core.multiarray", "scalar")}


class _DataOnly(pickle.Unpickler):
    """An unpickler that finds only the names plain data needs (and `allow`): a pickle
    naming anything else -- a function to call, a class to build -- is refused."""

    def __init__(self, file: io.BytesIO, allow: Sequence[type]) -> None:
        super().__init__(file)
        self.allow = {(c.__module__, c.__qualname__): c for c in allow}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allow:
            return self.allow[module, name]
        if (module, name) in _DATA or (module == "torch" and
                                       isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"a packed state names {module}.{name}, which is not plain data (containers, "
            "numbers, strings, torch dtypes and devices, numpy arrays) nor one of "
            f"{sorted(f'{m}.{n}' for m, n in self.allow)}: refused, not run")


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as bytes, whatever its layout (strided, expanded, a conjugate view)."""
    return t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1) \
        .view(torch.uint8)


def _aligned(nbytes: int) -> int:
    return nbytes + -nbytes % _ALIGN
