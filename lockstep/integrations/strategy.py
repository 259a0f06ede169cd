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

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout

from lockstep.comm.world import import_what_binds_the_default_group, init
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
        for name in set(kwargs) & set(_DDP_ARGUMENTS):
            raise TypeError(f"LockstepStrategy takes lockstep's settings in parallel=, not "
                            f"DDP's {name}=: use {type(self.parallel).__name__}"
                            f"({_DDP_ARGUMENTS[name]})")
        super().__init__(timeout=timeout, **kwargs)
        self._stall_after = stall_after
        self._whole_params: dict[ZeroOptimizer, list[nn.Parameter]] = {}  # -> saved as

    # ---- the process group and the wrapper ------------------------------------------------

    def setup_distributed(self) -> None:
        import_what_binds_the_default_group()  # before Lightning makes the group
        super().setup_distributed()
        init(timeout=self._timeout, stall_after=self._stall_after)  # adopts Lightning's group

    def setup(self, trainer: Trainer) -> None:
        if isinstance(self.parallel, ShardConfig) and trainer.gradient_clip_val:
            raise ValueError(
                f"rank {self.global_rank}: gradient_clip_val clips by this rank's shard of "
                "the gradient under ZeRO; clip by the global norm in your LightningModule: "
                "def configure_gradient_clipping(self, optimizer, gradient_clip_val, "
                "gradient_clip_algorithm): optimizer.clip_grad_norm_(gradient_clip_val)")
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return self.parallel.build(model)

    def _register_ddp_hooks(self) -> None:
        """Nothing: compression and the reduction come from `parallel`."""

    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        if isinstance(self.model, ShardedDataParallel):
            self.optimizers = [self._over_shards(self.model, o) for o in self.optimizers]

    def _over_shards(self, model: ShardedDataParallel, optimizer: torch.optim.Optimizer
                     ) -> ZeroOptimizer:
        """The same optimizer (class, settings) over this rank's shards; its schedulers are
        pointed at it."""
        if len(optimizer.param_groups) != 1:
            raise ValueError(f"rank {self.global_rank}: ZeRO steps one parameter group; "
                             f"configure_optimizers gave {type(optimizer).__name__} with "
                             f"{len(optimizer.param_groups)}")
        sharded = model.make_optimizer(type(optimizer), **_constructor_settings(optimizer))
        sharded.param_groups[0].update(numeric_settings(optimizer.param_groups[0]))
        self._whole_params[sharded] = list(optimizer.param_groups[0]["params"])
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer is optimizer:
                _repoint(config.scheduler, sharded)
        return sharded

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if isinstance(self.model, Replica):
            self.model.after_step()
        return out

    def teardown(self) -> None:
        if isinstance(self.model, Replica):  # the hooks go; stage 3 gives the parameters back
            close = getattr(self.model, "close", None)
            if close is not None:
                close()
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


def _repoint(scheduler: Any, optimizer: ZeroOptimizer) -> None:
    """Point a torch LR scheduler at `optimizer`, counting its steps as the scheduler's own
    wrapper does (else the scheduler warns that it ran before any optimizer step)."""
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):  # a second scheduler
        return
    step = optimizer.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted  # type: ignore[method-assign]

