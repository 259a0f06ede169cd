"""ZeRO applied from outside: `lockstep.shard(module, stage)` (as torch's `fully_shard`).

    model = lockstep.shard(net, stage=3)        # every rank, like DataParallel(net)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=3e-4)

The result is a DataParallel whose buckets travel ZeRO's way (gradients.ShardedReduction): the
module's parameters are laid out in flat groups and, at stage 3, sharded and gathered just
in time (gather.py). It owns what sharding changes: the optimizer over shards, state dicts
(whole through `full_state_dict`, a collective; sharded for checkpoints) and its memory
report. DataParallel itself knows nothing of any of this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lockstep import comm
from lockstep.replication import memory
from lockstep.replication.choices import FAULT_TOLERANT, refusing
from lockstep.replication.drift import replicated
from lockstep.replication.join import JoinError, JoinHook
from lockstep.replication.nonfinite import check_mode
from lockstep.replication.reduction import Reduction
from lockstep.replication.replica import DataParallel
from lockstep.sharding import compressed
from lockstep.sharding.gather import Gatherer, gather_all, guard_orphans
from lockstep.sharding.gradients import ShardedReduction
from lockstep.sharding.hostshards import ALGORITHMS, HostShards, pick_algorithm
from lockstep.sharding.optimizer import ZeroOptimizer
from lockstep.sharding.zero import FlatGroup, build_groups, reducer_params

STAGES = (1, 2, 3)

class ShardedDataParallel(DataParallel):
    """DataParallel with ZeRO stage 1 (optimizer state sharded), 2 (and gradients) or 3
    (and parameters). From stage 2 on, gradients live in the optimizer's shards, not in
    `.grad`; at stage 1 `.grad` holds the whole averaged gradient from backward until the
    optimizer's step, which frees it. Takes DataParallel's arguments except
    algorithm/compress/reduction.

    Args:
        stage: 1, 2 or 3.
        unit: for stage 3, which modules are gathered as one unit (default: every module
            that owns parameters, i.e. each layer).
        mirror: also keep the next rank's shard (zero.py), so one rank's death loses
            nothing; None: when built by fault tolerance (lockstep.Elastic turns it on).
        wire: "full", or "bf16" / "int8" for stage 2-3's reduce-scatters and gathers
            (compressed.py: ZeRO++'s qgZ and qwZ).
        error_feedback: with a compressed wire, carry what a gradient's encoding rounded
            off into the next step (costs a full gradient bucket per rank).
        algorithm: "auto" (the default: "shm" where every rank is on one host's CPU,
            else "native"), "native" (the backend's gathers), or "shm": the shards live in
            host-shared memory and a gather copies them (hostshards.py); reduce-scatters
            and stage 1's all-reduce stay on the backend.
    """

    def __init__(self, module: nn.Module, stage: int = 3, *,
                 unit: Callable[[nn.Module], bool] | None = None, mirror: bool | None = None,
                 wire: str = "full", error_feedback: bool = False, **kwargs: Any) -> None:
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 1, 2 or 3; got {stage!r}")
        compressed.check(wire, stage, error_feedback)
        algorithm = kwargs.pop("algorithm", None) or "auto"
        if algorithm not in ALGORITHMS:
            raise ValueError(f"lockstep.shard reduces with its own reduce-scatter and "
                             f"all-gather; its algorithm= is 'auto', 'native' or 'shm' "
                             f"(gathers through one host's memory), not {algorithm!r}")
        for name in ("compress", "reduction"):
            if kwargs.get(name) is not None:
                raise ValueError(f"lockstep.shard reduces with its own reduce-scatter and "
                                 f"all-gather; it takes no {name}=")
        self.stage, self._unit = stage, unit
        self.wire, self._error_feedback = wire, error_feedback
        self.mirror = FAULT_TOLERANT.get() if mirror is None else mirror
        self.algorithm = pick_algorithm(algorithm, kwargs.get("group"), stage, wire,
                                        self.mirror)
        if self.mirror and wire != "full":
            raise ValueError(
                f"rank {comm.rank_of(kwargs.get('group'))}: ZeRO with wire={wire!r} "
                "under fault tolerance: a mirrored shard is the next "
                "rank's master, reduce-scattered a second time and rebuilt exactly after a "
                "death; the compressed collectives do not carry it yet. Use wire='full' with "
                "elastic=, or the compressed wire without it")
        self.gatherer: Gatherer | None = None
        super().__init__(module, **kwargs)
        if stage < 3 and wire != "full":  # the forward computes with decoded copies from
            gather_all(self.zero_groups, "gather of decoded parameters", self.group)  # step 0

    def _pick_algorithm(self, requested: str, compress: Any, reduction: Reduction | None,
                        module: nn.Module) -> str:
        # ZeRO's own pick is self.algorithm (its gathers); its flat groups are cut at the
        # network's bucket cap whatever the gathers take
        return "native"

    def _make_reduction(self, algorithm: str, compress: Any,
                        reduction: Reduction | None) -> Reduction:
        """Lay the parameters out in flat groups and, at stage 3, shard them."""
        self.zero_groups = build_groups(self.module, self.stage, self.group,
                                        *self._bucket_bytes, self._unit, self.mirror, self.wire)
        if self.algorithm == "shm":
            HostShards(self.zero_groups, self.stage, self.group)
        sharding = ShardedReduction(self.zero_groups, self.stage, self.group,
                                    self._error_feedback)
        if self.stage == 3:
            self.gatherer = Gatherer(self.module, self.zero_groups, self.group)
            sharding.on_reduced = self.gatherer.reduced
            sharding.on_step_end = self.gatherer.end_of_step
            for g in self.zero_groups:
                g.release()  # sharded at rest
            self._owned.add(_Orphaning(self.gatherer).release)
        return sharding

    def _reduced_params(self) -> list[tuple[str, nn.Parameter]]:
        return reducer_params(self.zero_groups)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        raise ValueError(f"rank {comm.rank_of(self.group)}: lockstep.shard reduces with its "
                         "own reduce-scatter and all-gather; it takes no communication hook")

    def _follow_requires_grad(self) -> None:
        if self._requires_grad_changed():
            raise ValueError(f"rank {comm.rank_of(self.group)}: requires_grad changed after "
                             "sharding; the sharded layout is fixed: shard the module again")

    def make_optimizer(self, optimizer: Any, **kwargs: Any) -> ZeroOptimizer:
        """The optimizer over this rank's shards, with torch's step/zero_grad/param_groups/
        state_dict, and a clip_grad_norm_ that sums the norm over every rank's shards."""
        def make(params: Any) -> torch.optim.Optimizer:
            return optimizer(params, **kwargs)

        return ZeroOptimizer(self.zero_groups, self.stage, self.group, make)

    def _join_hook(self, optimizers: list[Any], sync_final_model: bool) -> JoinHook:
        raise JoinError(f"rank {comm.rank_of(self.group)}: join() does not shadow ZeRO's "
                        "reduce-scatters and gathers; give every rank the same number of "
                        "batches")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict, whole, as copies. At stage 3 it gathers the parameters:
        a collective, so every rank must call it."""
        if self.gatherer is not None:
            with self.gatherer.all_gathered(exact=True):
                return super().full_state_dict()
        if self.wire == "full":
            return super().full_state_dict()
        # The full buffers hold decoded copies: gather the masters exactly, read them, and
        # put the decoded copies back (training goes on as if nobody had looked).
        gather_all(self.zero_groups, "exact gather for a state dict", self.group, exact=True)
        whole = super().full_state_dict()
        gather_all(self.zero_groups, "gather of decoded parameters", self.group)
        return whole

    replicated_optimizer = False  # each rank's optimizer state is its own shard

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """What every rank holds whole (DriftCheck): as DataParallel's at stages 1-2; at
        stage 3 a parameter is only its shards, which have no replica: the frozen ones."""
        named = replicated(self.module, params=self.stage < 3, buffers=False)
        if not named:
            raise ValueError(
                f"rank {comm.rank_of(self.group)}: DriftCheck compares what replicas hold "
                "alike, and under ZeRO stage 3 there is nothing: each parameter lives only "
                "in its shards, one per rank, with no copy on another rank to compare with "
                "or repair from (the gathered parameters are the same bytes everywhere by "
                "construction). Use stage 1 or 2, or DataParallel, to check for drift")
        return named

    def memory_report(self, optimizer: Any) -> dict[str, int]:
        groups: list[FlatGroup] = self.zero_groups
        flats = [g.flat for g in groups if g.flat.untyped_storage().nbytes()]
        own = self.stage == 3 or self.wire != "full"  # masters in memory of their own
        params = flats + ([g.shard_param for g in groups] if own else [])
        grads = ([b.flat for b in self.reducer.buckets if b.flat.untyped_storage().nbytes()]
                 + ([g.shard_grad for g in groups] if self.stage > 1 else [])
                 + list(getattr(self.reduction, "feedback", None) or []))  # error feedback
        return memory.held(params, optimizer, grads)

    def abandon(self) -> None:
        """Drop the wrapper with no collective (a peer may be dead): at stage 3 the module's
        parameters stay views of freed buffers, for fault tolerance to refill
        (recovery.restore) from the shards it held aside."""
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
            self.gatherer = None
        super().close()

    def close(self) -> None:
        """As DataParallel's; at stage 3 the module first gets its full parameters back (a
        collective: every rank must call close())."""
        if self._release.alive and self.gatherer is not None:
            self.gatherer.give_back()
            self.gatherer = None
        super().close()


class _Orphaning:
    """Stage 3's part of a wrapper dropped without close(): the shards go with it, so the
    module's parameters have no values; every use of them is made an error."""

    def __init__(self, gatherer: Gatherer) -> None:
        self.gatherer = gatherer

    def release(self) -> None:
        if self.gatherer.managing:
            self.gatherer.remove_hooks()
            guard_orphans(self.gatherer.owners, self.gatherer.groups, self.gatherer.rank)


_OWN_COLLECTIVES = "ZeRO moves gradients and parameters with its own reduce-scatters and " \
    "all-gathers"


@refusing(
    compress=f"{_OWN_COLLECTIVES}: ShardConfig(wire='bf16' or 'int8') sends those in fewer "
             "bits (stages 2-3); PowerSGD and TopK are SyncConfig's, without sharding")
@dataclass
class ShardConfig:
    """ZeRO as a training mode: gradients averaged every step, model state sharded."""

    mode: ClassVar[str] = "shard"
    stage: int = 3
    """1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters)."""
    bucket_mb: float | None = None
    """The gradient bucket cap at stages 1-2 (None: DataParallel's default)."""
    find_unused: bool = False
    """Allow parameters that get no gradient on some steps."""
    nonfinite: str = "error"
    """What a NaN or inf in some rank's gradient does (see SyncConfig)."""
    wire: str = "full"
    """Stages 2-3: reduce-scatters and gathers in "full" precision, "bf16" or "int8"."""
    error_feedback: bool = False
    """With a compressed wire: carry each gradient's rounding into the next step."""
    algorithm: str = "auto"
    """"shm": gathers copy the shards from host-shared memory; "native": through the
    backend; "auto": shm where every rank is on one host's CPU, native elsewhere."""

    def validate(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 1, 2 or 3; got {self.stage!r}")
        check_mode(self.nonfinite)
        compressed.check(self.wire, self.stage, self.error_feedback)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"ShardConfig(algorithm={self.algorithm!r}): {_OWN_COLLECTIVES}, "
                             "through the backend ('native') or one host's memory ('shm'), "
                             "or the one that fits ('auto'); "
                             "ring, tree and hierarchical are SyncConfig's")

    def build(self, module: nn.Module) -> ShardedDataParallel:
        return shard(module, self.stage, bucket_mb=self.bucket_mb,
                     find_unused=self.find_unused, nonfinite=self.nonfinite, wire=self.wire,
                     error_feedback=self.error_feedback, algorithm=self.algorithm)


def shard(module: nn.Module, stage: int = 3, **kwargs: Any) -> ShardedDataParallel:
    """Data parallelism with ZeRO `stage` applied to `module` (see ShardedDataParallel)."""
    return ShardedDataParallel(module, stage, **kwargs)
