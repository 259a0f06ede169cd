"""LockstepStrategy's logic, for either of Lightning's packages: `lightning`
(lightning.py) and the older `pytorch_lightning` (pytorch_lightning.py) each put it in
front of their own DDPStrategy. It names nothing of either, so one body serves both.

It is Lightning's DDPStrategy with the model wrapped by `parallel.build` (lockstep.DataParallel
or, with ShardConfig, lockstep.shard) in place of torch's DDP. Everything else is
Lightning's: its launcher (or torchrun's, or `lockstep run`'s environment), its process
group -- which `lockstep.init()` adopts, so the watchdog names a stalled rank -- its
sampler, precision plugin, gradient accumulation (through `no_sync`) and callbacks.

Under ZeRO (ShardConfig) the optimizer `configure_optimizers` returns is rebuilt over this
rank's shards (its class and settings; one parameter group) and its schedulers follow it.
Checkpoints stay Lightning's own files, the same as DDP's: the model's whole state dict
(stage 3 gathers it) and the optimizer's whole state, assembled from every rank's shards
(sharding/consolidate.py), so a checkpoint loads at any stage, any world size, or under
DDPStrategy. Gradient clipping by norm needs the norm over every rank's shards: override
`configure_gradient_clipping` to call `optimizer.clip_grad_norm_(value)`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout

from lockstep.comm.world import import_what_binds_the_default_group, init
from lockstep.replication.replica import DataParallel
from lockstep.replication.sync import SyncConfig
from lockstep.sharding.consolidate import load_whole_state_dict, whole_state_dict
from lockstep.sharding.optimizer import ZeroOptimizer, numeric_settings
from lockstep.sharding.sharded import ShardConfig, ShardedDataParallel
from lockstep.training.protocols import Replica

# DDP's own arguments and where lockstep takes them instead.
_DDP_ARGUMENTS = {"find_unused_parameters": "find_unused=True",
                  "bucket_cap_mb": "bucket_mb=...",
                  "ddp_comm_hook": "compress=... (bf16, fp16, PowerSGD, TopK)"}


if TYPE_CHECKING:  # what the mixin stands in front of, for the type checker
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy
else:
    _DDPStrategy, Trainer = object, Any


class LockstepMixin(_DDPStrategy):
    """Lightning's DDP strategy with lockstep's wrapper (see the module's docstring).

    Args:
        parallel: SyncConfig (the default: synchronous, any algorithm and compression) or
            ShardConfig (ZeRO 1-3).
        stall_after: seconds a collective may wait before the watchdog names the ranks
            that have not reached it (lockstep.init's; None: its default).
        Lightning's strategy arguments (accelerator, cluster_environment, checkpoint_io,
        precision_plugin, process_group_backend, timeout, start_method) as DDPStrategy's.
    """

    strategy_name = "lockstep"

    def __init__(self, parallel: SyncConfig | ShardConfig | None = None, *,
                 stall_after: float | None = None,
                 timeout: timedelta | None = default_pg_timeout, **kwargs: Any) -> None:
        self.parallel = SyncConfig() if parallel is None else parallel
        if not isinstance(self.parallel, (SyncConfig, ShardConfig)):
            raise ValueError(
                f"LockstepStrategy trains with SyncConfig or ShardConfig, not "
                f"{type(self.parallel).__name__}: local SGD, DiLoCo and asynchronous training "
                "keep state between steps (rounds, outer momentum) that Lightning's checkpoint "
                "would not hold; use lockstep.Trainer for them")
        self.parallel.validate()
        super().__init__(timeout=timeout, **kwargs)
        for name in self._ddp_kwargs:  # what DDPStrategy would hand torch's DDP
            where = _DDP_ARGUMENTS.get(name, "...: see its fields")
            raise TypeError(f"LockstepStrategy takes lockstep's settings in parallel=, not "
                            f"DDP's {name}=: use {type(self.parallel).__name__}({where})")
        self._stall_after = stall_after
        # each ZeRO optimizer -> the parameters, in order, its whole state dict is about
        self._whole_params: dict[ZeroOptimizer, list[nn.Parameter]] = {}

    # ---- the process group and the wrapper ------------------------------------------------

    def setup_distributed(self) -> None:
        import_what_binds_the_default_group()  # before Lightning makes the group
        super().setup_distributed()
        init(timeout=self._timeout, stall_after=self._stall_after)  # adopts Lightning's group

    def setup(self, trainer: Trainer) -> None:
        scaled = getattr(self.precision_plugin, "scaler", None) is not None  # fp16's
        if isinstance(self.parallel, ShardConfig):
            _refuse_under_zero(self.global_rank, trainer.gradient_clip_val, scaled)
        elif scaled and self.parallel.nonfinite == "error":
            # torch's GradScaler skips the steps that overflow (fp16's common false alarm);
            # the averaged gradient is the same on every rank, so they all skip alike
            self.parallel = dataclasses.replace(self.parallel, nonfinite="off")
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return self.parallel.build(model)

    def _register_ddp_hooks(self) -> None:
        """Nothing: compression and the reduction come from `parallel`."""

    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        self._whole_params = {}
        if isinstance(self.model, ShardedDataParallel):
            if len(self.optimizers) != 1:
                raise ValueError(f"rank {self.global_rank}: ZeRO shards one optimizer over "
                                 f"every trainable parameter; configure_optimizers gave "
                                 f"{len(self.optimizers)}")
            self.optimizers = [self._over_shards(self.model, self.optimizers[0])]

    def _over_shards(self, model: ShardedDataParallel, optimizer: torch.optim.Optimizer
                     ) -> ZeroOptimizer:
        """The same optimizer (class, settings) over this rank's shards; its schedulers are
        pointed at it."""
        if len(optimizer.param_groups) != 1:
            raise ValueError(f"rank {self.global_rank}: ZeRO steps one parameter group; "
                             f"configure_optimizers gave {type(optimizer).__name__} with "
                             f"{len(optimizer.param_groups)}")
        sharded_params = {p for g in model.zero_groups for p in g.params}
        if set(optimizer.param_groups[0]["params"]) != sharded_params:
            raise ValueError(f"rank {self.global_rank}: ZeRO steps every trainable parameter; "
                             "this optimizer covers some only: give the others "
                             "requires_grad_(False)")
        sharded = model.make_optimizer(type(optimizer), **_constructor_settings(optimizer))
        sharded.param_groups[0].update(numeric_settings(optimizer.param_groups[0]))
        self._whole_params[sharded] = list(optimizer.param_groups[0]["params"])
        for config in self.lr_scheduler_configs:
            _repoint(config.scheduler, optimizer, sharded)
        return sharded

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization backs up more than once per training_step (a GAN): each
        backward is armed again, as DDPStrategy does for torch's DDP."""
        module = self.lightning_module
        if isinstance(self.model, DataParallel) and module is not None \
                and not module.automatic_optimization:
            self.model.prepare_for_backward(closure_loss)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if isinstance(self.model, Replica):
            self.model.after_step()
        return out

    def teardown(self) -> None:
        if isinstance(self.model, Replica):  # the hooks go; stage 3 gives the parameters back
            trainer = getattr(self.lightning_module, "_trainer", None)
            if isinstance(self.model, ShardedDataParallel) and getattr(trainer, "interrupted",
                                                                       False):
                self.model.abandon()  # failed: the others may be mid-step, no collective
            else:
                getattr(self.model, "close", lambda: None)()
            self.model = self.lightning_module
        super().teardown()

    # ---- checkpoints: Lightning's files, whole tensors --------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if isinstance(self.model, ShardedDataParallel):
            return self.model.full_state_dict()  # a collective: every rank dumps
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if isinstance(optimizer, ZeroOptimizer):
            return whole_state_dict(optimizer, self._whole_params[optimizer])
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not any(isinstance(o, ZeroOptimizer) for o in self.optimizers):
            return super().load_optimizer_state_dict(checkpoint)  # (and onto the device)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"],
                                    strict=True):  # shards land on their parameters' device
            assert isinstance(optimizer, ZeroOptimizer)  # under ShardConfig, every one is
            load_whole_state_dict(optimizer, self._whole_params[optimizer], state)
        return None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("lockstep", cls, description="lockstep's DataParallel, "
                                   "synchronous (SyncConfig defaults)", override=True)


def _constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The settings `optimizer` was made with, as its constructor takes them (its defaults
    may hold more: AdamW keeps decoupled_weight_decay, which it does not take)."""
    takes = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in takes}


def _refuse_under_zero(rank: int, clip_value: Any, scaled: bool) -> None:
    if clip_value:
        raise ValueError(
            f"rank {rank}: gradient_clip_val would clip each rank's shard of the gradient by "
            "its own norm under ZeRO; clip by the global norm in your LightningModule instead "
            "(Trainer without gradient_clip_val): def configure_gradient_clipping(self, "
            "optimizer, *args): optimizer.clip_grad_norm_(1.0)")
    if scaled:
        raise ValueError(
            f"rank {rank}: fp16's GradScaler decides to skip a step from this rank's shard "
            "alone under ZeRO, so ranks could disagree; use precision='bf16-mixed'")


def _repoint(scheduler: Any, old: torch.optim.Optimizer, optimizer: ZeroOptimizer) -> None:
    """Point a torch LR scheduler that drives `old` at `optimizer` -- and the schedulers it
    chains (SequentialLR, ChainedScheduler) -- counting its steps as the scheduler's own
    wrapper does (else the scheduler warns that it ran before any optimizer step)."""
    for inner in getattr(scheduler, "_schedulers", ()):
        _repoint(inner, old, optimizer)
    if scheduler.optimizer is not old:
        return
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):  # a second scheduler
        return
    step = optimizer.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted  # type: ignore[method-assign]

