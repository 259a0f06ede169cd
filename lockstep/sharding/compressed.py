"""ZeRO's collectives in fewer bits (ZeRO++, Wang et al. 2023): gradients reduce-scattered
and parameters gathered as bf16, or as int8 with a scale per block of 64 values
(replication/wireformat.py).

- **Reduce-scatter** (qgZ): a rank encodes its gradient bucket one destination's chunk at a
  time, and an all-to-all hands every rank the N encodings of its own shard, which it
  decodes and sums in fp32. A backend sums only what it can add (there is no int8 with
  scales to ask it for) and would round at every hop. Each rank sends (N-1)/N of the
  encoded bucket, as a ring reduce-scatter sends of the plain one. With error feedback a
  rank keeps what its encoding rounded off -- a whole bucket per group, which gives back
  the gradient memory stage 2 saved -- and adds it to the next step's gradient.
- **Gathers** (qwZ): each owner encodes its shard and every rank, the owner too, decodes
  every shard into the full buffer, so all replicas compute with the same weights. The
  optimizer steps the exact shard (the master), kept in memory of its own (at stage 2 that
  is 4/N bytes per parameter more than plain ZeRO-2). State dicts and checkpoints read the
  masters, never the decoded copies.
"""

from __future__ import annotations

import torch

from lockstep import comm
from lockstep.replication import wireformat

WIRES = ("full", "bf16", "int8")


def check(wire: str, stage: int, error_feedback: bool = False) -> None:
    wireformat.check_choice(wire, WIRES, error_feedback, "ZeRO")
    if wire != "full" and stage == 1:
        raise ValueError(
            f"ZeRO stage 1 with wire={wire!r}: stage 1 all-reduces whole gradients, as "
            "DataParallel does; its wire is SyncConfig(compress='bf16'). Use stage 2 (the "
            "same memory for the optimizer state, gradients reduce-scattered) or 3, whose "
            "reduce-scatters and gathers wire= compresses")


def encoded_bytes(wire: str, numel: int, world_size: int) -> int:
    """What this rank puts on the wire to reduce-scatter a bucket of `numel` values."""
    return world_size * wireformat.encoded_bytes(wire, numel // world_size)


def reduce_scatter(bucket: torch.Tensor, wire: str, what: str, group: comm.Group,
                   feedback: torch.Tensor | None = None) -> torch.Tensor:
    """The sum over ranks of this rank's 1/N chunk of `bucket` (padded to N equal chunks),
    each rank's chunk sent in `wire`. `feedback` (the bucket's size): what the last encoding
    rounded off, added now and replaced by what this one rounds off."""
    size = comm.size_of(group)
    chunks = bucket.view(size, -1)
    kept = [None] * size if feedback is None else list(feedback.view(size, -1))
    sent = torch.cat([wireformat.encode_keeping(wire, chunk, k)
                      for chunk, k in zip(chunks, kept, strict=True)])
    received = torch.empty_like(sent)
    comm.all_to_all(received, sent, what, group)
    return wireformat.decode_sum(wire, received.view(size, -1), chunks.shape[1]).to(bucket.dtype)


class DecodingGather:
    """A gather of encoded shards in flight; `wait()` also decodes every shard into `flat`."""

    def __init__(self, pending: comm.Pending, received: torch.Tensor, flat: torch.Tensor,
                 wire: str, size: int) -> None:
        self.pending, self.received, self.flat, self.wire = pending, received, flat, wire
        self.size = size

    def wait(self) -> None:
        self.pending.wait()
        parts = self.received.view(self.size, -1)
        shard = self.flat.numel() // self.size
        with torch.no_grad():
            for k, part in enumerate(parts):
                self.flat[k * shard:(k + 1) * shard].copy_(
                    wireformat.decode(self.wire, part, shard))


def start_gather(flat: torch.Tensor, shard: torch.Tensor, wire: str, what: str,
                 group: comm.Group) -> DecodingGather:
    """Start filling `flat` (N shards) with every rank's `shard`, each sent in `wire`."""
    payload = wireformat.encode(wire, shard.detach())
    size = comm.size_of(group)
    received = payload.new_empty(payload.numel() * size)
    return DecodingGather(comm.all_gather_async(received, payload, what, group), received,
                          flat, wire, size)
