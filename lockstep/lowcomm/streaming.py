"""Streaming DiLoCo (Douillard et al. 2025): DiLoCo whose exchanges trickle instead of burst.

DiLoCo stops every rank each H steps while the whole model's pseudo-gradient crosses the
link. Streaming DiLoCo changes three things:

- **Fragments.** The model is cut into P fragments (contiguous groups of layers, balanced by
  size). Each fragment has its own round of H steps, staggered by H/P: fragment p is sent
  at steps (p+1)·H/P, then every H. The link carries one fragment at a time, so its peak use
  is a fragment wide, not a model wide.
- **Overlap.** A fragment's exchange is launched (an asynchronous collective: the backend's
  threads carry it) and training goes on; `overlap` (tau) steps later its average arrives and
  the outer step is taken on it. The rank kept training meanwhile, so the new shared
  parameters are mixed into the local ones: local = mixing·local + (1-mixing)·shared
  (mixing 0 takes the shared ones, as DiLoCo does).
- **Fewer bits.** The pseudo-gradient may be sent as bf16, fp8 (e4m3) or 4-bit integers with
  a scale per block (wireformat.py); every rank decodes and averages in fp32. With error
  feedback a rank keeps what rounding took and sends it with the fragment's next exchange.

With one fragment, no overlap and mixing 0 this is DiLoCo, step for step (a test holds it to
that). A checkpoint may be written at any step: an exchange in flight is waited for and its
average saved, to be applied at the step it was due; each rank's own parameters (replicas
differ between a fragment's syncs) are saved per rank.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lockstep import comm
from lockstep.comm import stophook, timeline
from lockstep.lowcomm.fragments import layer_units, plan_fragments
from lockstep.lowcomm.replicas import ReplicaGroups, check_size, resolve_size
from lockstep.lowcomm.rounds import DiLoCo, average_in_place
from lockstep.replication import wireformat
from lockstep.replication.choices import refusing
from lockstep.replication.compress import PER_RANK

WIRES = ("full", *wireformat.FORMATS)


@dataclass
class _Exchange:
    """One fragment's pseudo-gradient on its way: sent at one step, applied at `due`."""

    due: int
    pending: comm.Pending | None
    received: torch.Tensor  # the all-reduced sum, or every rank's encoded bytes
    numel: int
    averaged: torch.Tensor | None = None  # once waited for
    sent_at: int = -1  # the inner step it was sent at


class StreamingDiLoCo(DiLoCo):
    """DiLoCo with fragments synced on staggered rounds, overlapped and quantised.

    Args:
        module: the model, identical on every rank (rank 0's is broadcast).
        every: inner steps per fragment's round (H).
        fragments: how many fragments (P <= H); each is a run of whole layers.
        overlap: steps between sending a fragment and applying its average (tau < H).
        mixing: the share of this rank's own parameters kept when the average is applied.
        wire: "full" (the parameters' dtype, all-reduced), "bf16", "e4m3", "int8" or
            "int4".
        error_feedback: keep what the wire format rounded off and send it next time.
        outer_lr, outer_momentum, nesterov: the outer SGD (the paper: 0.7, 0.9, True).
        replica_size: ranks per replica (replicas.py): consecutive ranks that average
            their gradients every step (a DataParallel among them) and send each
            fragment once between them. 1: every rank is a replica of its own.
    """

    def __init__(self, module: nn.Module, every: int = 50, fragments: int = 4,
                 overlap: int = 1, mixing: float = 0.5, wire: str = "full",
                 error_feedback: bool = False, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True,
                 group: comm.Group = None, replica_size: int | str = 1) -> None:
        try:
            _check(every, fragments, overlap, mixing, wire, error_feedback)
            params, units = list(module.parameters()), layer_units(module)
            runs = plan_fragments([sum(params[i].numel() for i in u) for u in units],
                                  fragments)
            if replica_size != 1 and group is not None:
                raise ValueError("replica_size > 1 cuts the whole world into replicas; it "
                                 "takes no group=")
        except ValueError as error:
            raise ValueError(f"rank {comm.rank_of(group)}: {error}") from None
        replica_size = resolve_size(replica_size)
        # Replicas first: each takes its first rank's model, and the broadcast across them
        # (DiLoCo's, below) then brings rank 0's to every rank before theta is copied
        self.replicas = ReplicaGroups(replica_size, module) if replica_size != 1 else None
        if self.replicas is not None:
            group = self.replicas.across  # the rounds' exchanges go between replicas
        super().__init__(module, every, outer_lr, outer_momentum, nesterov, group=group)
        self.overlap, self.mixing, self.wire = overlap, mixing, wire
        # quantised only when it travels: a lone replica's exchange stays in full precision
        self.encodes = wire != "full" and comm.size_of(self.group) > 1
        self.fragments = [[i for j in run for i in units[j]] for run in runs]
        # where each fragment lies in the model's flat pseudo-gradient (checkpoints keep one)
        sizes = [sum(self.theta[i].numel() for i in f) for f in self.fragments]
        self.spans = [slice(end - size, end)
                      for size, end in zip(sizes, itertools.accumulate(sizes), strict=True)]
        # the part of each fragment this rank sends: all of it, or its replica place's piece
        self.pieces = [slice(0, s.stop - s.start) if self.replicas is None
                       else self.replicas.piece(s.stop - s.start) for s in self.spans]
        self.offsets = [(k + 1) * every // fragments for k in range(fragments)]
        self.in_flight: dict[int, _Exchange] = {}
        self._applied_at = [-1] * fragments  # the step each fragment last took an average
        self.residuals = ([torch.zeros(p.stop - p.start, dtype=torch.float32)
                           for p in self.pieces] if error_feedback else None)
        self._saved: dict[str, torch.Tensor] = {}  # checkpoint_tensors' buffers, reused

    # -- the replica ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.module if self.replicas is None else self.replicas.model)(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.nullcontext() if self.replicas is None else self.replicas.model.no_sync():
            yield

    def comm_stats(self) -> dict[str, float]:
        stats = super().comm_stats()
        return stats if self.replicas is None else self.replicas.stats(stats)

    def _average_buffers(self, what: str) -> None:
        """Buffers (BatchNorm's statistics) averaged over every rank: with replicas, over
        the whole world at once (each rank's differ, within a replica too)."""
        buffers = list(self.module.buffers())
        if self.replicas is None:
            self._average(buffers, what)
        else:
            self._round_bytes += average_in_place(buffers, what, None)

    # -- the schedule -------------------------------------------------------------------

    def sends_at(self, step: int) -> list[int]:
        """The fragments whose round ends at inner step `step`."""
        return [k for k, first in enumerate(self.offsets)
                if step >= first and (step - first) % self.every == 0]

    def after_step(self) -> None:
        self.local_steps += 1
        self.synchronise()
        if self.local_steps % self.every == 0:  # bytes per step over the last H steps
            self._close_round_stats()

    def synchronise(self) -> None:
        """This inner step's exchanges: send the fragments whose round ends now, apply the
        averages due now. (Elastic calls it again after a failed step: an exchange lost
        with a peer was dropped, never half-applied, and its fragment is sent again.)"""
        step = self.local_steps
        for k in self.sends_at(step):
            if k not in self.in_flight:
                self._send(k, due=step + self.overlap)
        for k in sorted(k for k, exchange in self.in_flight.items() if exchange.due == step):
            self._take_average(k, self.mixing)

    def in_sync(self) -> bool:
        """Always: what the replicas share (the outer parameters and momenta) agrees at every
        step, and a checkpoint can be written at any step (see checkpoint_tensors)."""
        return True

    def finish(self) -> None:
        """End of training: apply what is in flight, then sync every fragment that trained
        since it last took the shared parameters, and take them, so every replica ends
        identical. (A fragment that took them this very step is left: another outer step
        on its zero pseudo-gradient would still move it, by the momentum.)"""
        for k in sorted(self.in_flight, key=lambda k: self.in_flight[k].due):
            self._take_average(k, self.mixing)
        for k in range(len(self.fragments)):
            if not (self.mixing == 0 and self._applied_at[k] == self.local_steps):
                self._send(k, due=self.local_steps)
                self._take_average(k, mixing=0.0)
        self._average_buffers("streaming DiLoCo final buffer average")

    # -- one fragment's exchange ---------------------------------------------------------

    def _send(self, k: int, due: int) -> None:
        whole = self._pseudo_gradient(self.fragments[k])
        # Whether each rank's pseudo-gradient is finite rides with it (a slot per rank,
        # after it): a NaN or inf would spoil every replica's copy of the fragment, and
        # the 8- and 4-bit formats would hide it. Checked on arrival, before it is applied
        # -- not by a blocking exchange of its own at every send. (Judged on the whole
        # fragment: every rank of a replica sees the same verdict.)
        rank, size = comm.rank_of(self.group), comm.size_of(self.group)
        bad = not bool(torch.isfinite(whole).all())
        delta = whole[self.pieces[k]]
        what = f"streaming DiLoCo fragment {k} exchange"
        with timeline.span(f"{what} sent", "comm"), stophook.awaited_later():
            if not self.encodes:
                received = torch.cat([delta, delta.new_zeros(size)])
                received[delta.numel() + rank] = float(bad)
                pending = comm.all_reduce_async(received, what, self.group)
                sent = received.numel() * received.element_size()
            else:
                received, pending, sent = self._send_encoded(k, delta, bad, what)
        self._round_bytes += sent
        self.in_flight[k] = _Exchange(due, pending, received, delta.numel(),
                                      sent_at=self.local_steps)
        if k == len(self.fragments) - 1:  # buffers (BatchNorm's statistics): once a round
            self._average_buffers("streaming DiLoCo buffer average")

    def _send_encoded(self, k: int, delta: torch.Tensor, bad: bool,
                      what: str) -> tuple[torch.Tensor, comm.Pending, int]:
        encoded = wireformat.encode_keeping(  # what rounding takes goes with the next one
            self.wire, delta.float(), None if self.residuals is None else self.residuals[k])
        # then 4 bytes, the first a flag (4: each rank's row keeps the scales aligned)
        payload = torch.cat([encoded, encoded.new_tensor([int(bad), 0, 0, 0])])
        received = payload.new_empty(payload.numel() * comm.size_of(self.group))
        return received, comm.all_gather_async(received, payload, what, self.group), \
            payload.numel()

    def _arrived(self, k: int) -> torch.Tensor:
        """Fragment k's average pseudo-gradient, waited for once."""
        exchange = self.in_flight[k]
        if exchange.averaged is None:
            if exchange.pending is not None:
                try:
                    exchange.pending.wait()
                except Exception:
                    del self.in_flight[k]  # dropped whole: the fragment goes again
                    raise
            size, numel = comm.size_of(self.group), exchange.numel
            if not self.encodes:
                total, flags = exchange.received[:numel], exchange.received[numel:]
            else:  # every rank's bytes, summed in fp32
                rows = exchange.received.view(size, -1)
                total = wireformat.decode_sum(self.wire, rows[:, :-4], numel)
                flags = rows[:, -4]
            diverged = [r for r, bad in enumerate(flags.tolist()) if bad]
            averaged = total.div_(size)
            if self.replicas is not None:  # this rank's piece: the replica's whole
                span = self.spans[k]
                averaged, diverged = self.replicas.gather(
                    averaged, span.stop - span.start, flags.to(averaged.dtype),
                    f"streaming DiLoCo fragment {k}'s pieces gathered within the replica")
            if diverged:
                del self.in_flight[k]
                who = f"rank(s) {diverged}" if self.replicas is None \
                    else self.replicas.named(diverged)
                raise FloatingPointError(
                    f"rank {comm.rank_of()}: streaming DiLoCo fragment {k}'s pseudo-gradient "
                    f"at inner step {exchange.sent_at} is not finite on {who}: their training "
                    "diverged (a NaN or inf loss) since the fragment last synced. Lower the "
                    "learning rate, or clip gradients (grad_clip_norm)")
            exchange.averaged = averaged
        return exchange.averaged

    def _take_average(self, k: int, mixing: float) -> None:
        """The outer step on fragment k's average, mixed into this rank's parameters."""
        with timeline.span(f"streaming DiLoCo fragment {k} applied", "comm"):
            averaged = self._arrived(k)
            del self.in_flight[k]
        self._applied_at[k] = self.local_steps
        self._outer_step(self.fragments[k], averaged, mixing)

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """DiLoCo's outer state, and: the step in the schedule; each exchange in flight,
        waited for, as its average and the step it is due at; this rank's own parameters
        and error feedback (per rank). Loaded in place, then taken up by `loaded`."""
        tensors = super().checkpoint_tensors()
        saved = self._kept()
        saved["streaming.step"].fill_(self.local_steps)
        saved["streaming.due"].fill_(-1)
        for k in list(self.in_flight):
            saved["streaming.arrived"][self.spans[k]].copy_(self._arrived(k))
            saved["streaming.due"][k] = self.in_flight[k].due
        for i, p in enumerate(self.module.parameters()):
            saved[f"{PER_RANK}streaming.local.{i}"].copy_(p.detach())
        return {**tensors, **saved}

    def _kept(self) -> dict[str, torch.Tensor]:
        if not self._saved:
            total = self.spans[-1].stop
            dtype = functools.reduce(torch.promote_types, [t.dtype for t in self.theta]) \
                if not self.encodes else torch.float32
            self._saved = {"streaming.step": torch.zeros(1, dtype=torch.int64),
                           "streaming.due": torch.zeros(len(self.fragments), dtype=torch.int64),
                           "streaming.arrived": torch.zeros(total, dtype=dtype)}
            for i, p in enumerate(self.module.parameters()):
                self._saved[f"{PER_RANK}streaming.local.{i}"] = torch.empty_like(p.detach())
            for k, residual in enumerate(self.residuals or []):
                self._saved[f"{PER_RANK}streaming.feedback.{k}"] = residual
        return self._saved

    def loaded(self, own_state: bool) -> None:
        """After a checkpoint was loaded into checkpoint_tensors(): resume the schedule and
        the exchanges in flight; with `own_state` (the same world size wrote it) each rank
        takes back its own parameters, else every rank goes on from rank 0's."""
        saved = self._kept()
        self.local_steps = int(saved["streaming.step"].item())
        self.in_flight.clear()
        for k, (span, due) in enumerate(zip(self.spans, saved["streaming.due"].tolist(),
                                            strict=True)):
            if due >= 0:
                averaged = saved["streaming.arrived"][span].clone()
                self.in_flight[k] = _Exchange(due, None, averaged, averaged.numel(), averaged)
        if own_state:
            with torch.no_grad():
                for i, p in enumerate(self.module.parameters()):
                    p.copy_(saved[f"{PER_RANK}streaming.local.{i}"])
            if self.replicas is not None:
                self.replicas.check_identical(list(self.module.parameters()))
        elif self.residuals is not None:
            for residual in self.residuals:
                residual.zero_()

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """What every replica holds identically at every step: the outer parameters and
        momenta (each rank's own parameters differ between a fragment's syncs)."""
        return {f"outer state '{k}'": t for k, t in super().checkpoint_tensors().items()}

    def drop_in_flight(self) -> None:
        """Forget the exchanges in flight: their group is gone (Elastic regrouped after a
        failure). Each is dropped whole, never half-applied: its fragment's progress stays
        in the local parameters and goes with the fragment's next exchange (and one due to
        be sent at the failed step is sent again, when Elastic calls `synchronise`)."""
        self.in_flight.clear()

    def close(self) -> None:
        """Drop what is in flight (a regroup that rebuilds the wrapper closes this one);
        give back the replica's DataParallel and groups."""
        self.drop_in_flight()
        if self.replicas is not None:
            self.replicas.close()


def _check(every: int, fragments: int, overlap: int, mixing: float, wire: str,
           error_feedback: bool) -> None:
    if every < fragments or fragments < 1:
        raise ValueError(f"streaming DiLoCo staggers its fragments over a round: it needs "
                         f"1 <= fragments <= sync_every; got {fragments} and {every}")
    if not 0 <= overlap < every:
        raise ValueError(f"streaming DiLoCo's overlap must be 0 <= overlap < sync_every (a "
                         f"fragment's average arrives before its next round); got {overlap}")
    if not 0 <= mixing < 1:
        raise ValueError(f"mixing must be 0 <= mixing < 1 (the share of the rank's own "
                         f"parameters kept); got {mixing}")
    wireformat.check_choice(wire, WIRES, error_feedback, "streaming DiLoCo")


@refusing(compress="streaming DiLoCo sends one fragment's pseudo-gradient at a time: "
                   "wire='bf16', 'e4m3', 'int8' or 'int4' sends it in fewer bits; PowerSGD "
                   "and TopK compress SyncConfig's per-step gradients")
@dataclass
class StreamingDiLoCoConfig:
    """Streaming DiLoCo as a training mode: fragments of the model synced on staggered
    rounds of `sync_every` steps, each exchange overlapped with the next inner steps."""

    mode: ClassVar[str] = "streaming_diloco"
    sync_every: int = 50
    """Inner steps per fragment's round (H)."""
    fragments: int = 4
    """How many fragments the model is cut into (runs of whole layers)."""
    overlap: int = 1
    """Steps between sending a fragment and applying its average (tau)."""
    mixing: float = 0.5
    """The share of a rank's own parameters kept when a fragment's average is applied."""
    wire: str = "full"
    """How pseudo-gradients travel: "full" precision, "bf16", "e4m3", "int8" or "int4"."""
    error_feedback: bool = False
    """Send what the wire format rounded off with the fragment's next exchange."""
    outer_lr: float = 0.7
    """The outer learning rate."""
    outer_momentum: float = 0.9
    """The outer Nesterov momentum (0: plain SGD)."""
    replica_size: int | str = 1
    """Ranks per replica: consecutive ranks that average their gradients every step and
    exchange fragments as one replica ("host": the workers of one host). 1: every rank
    trains a replica of its own."""

    def validate(self) -> None:
        _check(self.sync_every, self.fragments, self.overlap, self.mixing, self.wire,
               self.error_feedback)
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"streaming DiLoCo needs outer_lr > 0 and 0 <= outer_momentum "
                             f"< 1; got {self.outer_lr} and {self.outer_momentum}")
        check_size(self.replica_size)

    def build(self, module: nn.Module) -> StreamingDiLoCo:
        return StreamingDiLoCo(module, self.sync_every, self.fragments, self.overlap,
                               self.mixing, self.wire, self.error_feedback, self.outer_lr,
                               self.outer_momentum, replica_size=self.replica_size)
