"""Tensors in fewer bits: the wire formats of streaming DiLoCo's exchanges and of ZeRO's
compressed reduce-scatters and gathers.

A format turns a flat float tensor into bytes (`encode`) and back (`decode`). The 8- and
4-bit formats carry one fp32 scale per block of BLOCK values (the block's largest magnitude
mapped to the format's largest value), so one large entry spoils the precision of 63
neighbours, not of the whole fragment -- the per-block scaling of ZeRO++'s qwZ/qgZ and of
the FP8 recipes.

    bf16  2 bytes a value (8 bits of mantissa)
    e4m3  1 byte a value (fp8: 3 bits of mantissa, within 1/16 relative) + 4 per block
    int8  1 byte a value (integers -127..127 of the block's scale) + 4 per block
    int4  half a byte a value (integers -7..7 of the block's scale) + 4 per block

(Full precision is no format: it goes by all-reduce, in the parameters' own dtype.) The
bytes are exchanged by all-gather and every rank decodes and sums them in fp32: an
all-reduce would add up the values in the wire format itself, rounding at each hop (and
there is no 4-bit addition to ask a backend for).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCK = 64
FORMATS = ("bf16", "e4m3", "int8", "int4")
_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_INT4_MAX = 7
_INT8_MAX = 127
_LARGEST = {"e4m3": _E4M3_MAX, "int8": _INT8_MAX, "int4": _INT4_MAX}


def check_choice(wire: str, allowed: Sequence[str], error_feedback: bool, who: str) -> None:
    """`wire` is one of `allowed` ("full": the tensors' own precision, sent as they are), and
    error feedback is asked for only where a format rounds something off."""
    if wire not in allowed:
        raise ValueError(f"{who}'s wire must be one of {', '.join(allowed)}; got {wire!r}")
    if error_feedback and wire == "full":
        narrow = " or ".join(repr(w) for w in allowed if w != "full")
        raise ValueError(f"error_feedback=True with wire='full': error feedback carries what a "
                         f"narrower wire rounds off, and full precision rounds nothing. Use it "
                         f"with wire={narrow}, or leave it off")


def encoded_bytes(name: str, numel: int) -> int:
    """How many bytes `encode(name, <numel values>)` returns."""
    blocks = -(-numel // BLOCK)
    if name == "bf16":
        return 2 * numel
    if name in ("e4m3", "int8"):
        return blocks * BLOCK + 4 * blocks
    return blocks * BLOCK // 2 + 4 * blocks  # int4: two values a byte


def encode(name: str, values: torch.Tensor) -> torch.Tensor:
    """`values` (1-D, float) as a flat uint8 tensor of `encoded_bytes(name, numel)`."""
    if name == "bf16":
        return _bytes(values.to(torch.bfloat16))
    blocks, scales = _blocks(values, _LARGEST[name])
    if name == "e4m3":
        body = _bytes(blocks.to(torch.float8_e4m3fn))
    elif name == "int8":
        body = _bytes(blocks.round().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8))
    else:
        nibbles = (blocks.round().clamp_(-_INT4_MAX, _INT4_MAX) + 8).to(torch.uint8).view(-1)
        body = nibbles[0::2] | (nibbles[1::2] << 4)
    return torch.cat([body.view(-1), _bytes(scales)])


def decode(name: str, data: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values that `encode(name, <numel values>)` gave `data` for."""
    if name == "bf16":
        return data.view(torch.bfloat16).float()
    blocks = -(-numel // BLOCK)
    scales = data[-4 * blocks:].view(torch.float32).view(blocks, 1)
    body = data[:-4 * blocks]
    if name == "e4m3":
        values = body.view(torch.float8_e4m3fn).float().view(blocks, BLOCK)
    elif name == "int8":
        values = body.view(torch.int8).float().view(blocks, BLOCK)
    else:
        nibbles = torch.stack([body & 0x0F, body >> 4], dim=1).view(-1)
        values = (nibbles.float() - 8).view(blocks, BLOCK)
    return (values * scales).view(-1)[:numel]


def encode_keeping(name: str, values: torch.Tensor,
                   feedback: torch.Tensor | None) -> torch.Tensor:
    """`encode`, with error feedback: `feedback` (as large as `values`, or None) is added
    first and replaced by what this encoding rounds off, to go with the next one. What a
    non-finite value would leave there is dropped (its step is dropped too), never kept to
    poison the steps after."""
    if feedback is None:
        return encode(name, values)
    values = values + feedback
    data = encode(name, values)
    feedback.copy_(values - decode(name, data, values.numel())).nan_to_num_(0.0, 0.0, 0.0)
    return data


def decode_sum(name: str, parts: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 sum of the `numel` values each row of `parts` (one rank's bytes per row)
    encodes, added in row order, so every rank that sums the same rows gets the same sum."""
    total = decode(name, parts[0], numel)
    for part in parts[1:]:
        total += decode(name, part, numel)
    return total


def _blocks(values: torch.Tensor, largest: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` padded to whole blocks, each divided by its scale, and the scales: each
    block's largest magnitude lands on `largest` (a block of zeros keeps scale 1). A block
    with a NaN or inf keeps a non-finite scale, so it decodes to NaN: an integer format
    would otherwise turn it into a finite value and hide it."""
    flat = values.float().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % BLOCK)).view(-1, BLOCK)
    scales = padded.abs().amax(dim=1, keepdim=True) / largest
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    return padded / scales, scales.view(-1)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)
