"""lockstep: data-parallel training for PyTorch.

The path one step takes:

    dataset ──ShardedSampler──► this rank's slice of the global batch
            ──replica forward/backward──► per-parameter gradients (hooks fire as each is ready)
            ──bucket plan──► flat buckets, reverse registration order, small first bucket
            ──Reducer──► async all-reduce per bucket, launched in the same order on every rank
            ──end of backward──► .grad holds the average over ranks
            ──optimizer step──► the identical update everywhere

    import lockstep
    world = lockstep.init()
    model = lockstep.DataParallel(net.to(world.device))
    sampler = lockstep.ShardedSampler(dataset, shuffle=True, seed=0)

Beside the path: `Trainer`/`TrainConfig` (the loop), `seed_everything`, `export_weights` /
`load_weights` (weights for inference), `configfile` (TOML/JSON configs and --set
overrides), `trackers` (TensorBoard, MLflow, W&B), and `lockstep env` for bug reports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time each name loads on first use
    from lockstep.advisor.advise import Advice, advise
    from lockstep.comm import CollectiveError
    from lockstep.comm.timeline import record_timeline
    from lockstep.comm.world import World, init
    from lockstep.elastic import Elastic, ElasticConfig
    from lockstep.lowcomm.paramserver import AsyncConfig
    from lockstep.lowcomm.rounds import DiLoCo, DiLoCoConfig, LocalSGD, LocalSGDConfig
    from lockstep.lowcomm.streaming import StreamingDiLoCo, StreamingDiLoCoConfig
    from lockstep.optim import LAMB, LARS, LRSchedule
    from lockstep.replication.algorithms import AllReduce
    from lockstep.replication.compress import PowerSGD, TopK
    from lockstep.replication.consistency import ModelMismatchError
    from lockstep.replication.ddp_args import NothingToTrainError
    from lockstep.replication.drift import DriftCheck, DriftError
    from lockstep.replication.join import JoinError
    from lockstep.replication.memory import memory_report
    from lockstep.replication.nonfinite import NonFiniteGradientError
    from lockstep.replication.oracle import naive_average_gradients
    from lockstep.replication.precision import LossScaler
    from lockstep.replication.reduction import Bucket, Reduction
    from lockstep.replication.replica import DataParallel
    from lockstep.replication.sync import SyncConfig
    from lockstep.replication.syncbn import SyncBatchNorm, convert_sync_batchnorm
    from lockstep.replication.unused import UnusedParameterError
    from lockstep.seeding import seed_everything
    from lockstep.sharding.optimizer import ZeroOptimizer
    from lockstep.sharding.sharded import ShardConfig, ShardedDataParallel, shard
    from lockstep.training.async_trainer import AsyncTrainer
    from lockstep.training.checkpoint import CheckpointError, fingerprint
    from lockstep.training.config import TrainConfig
    from lockstep.training.export import export_weights, load_weights
    from lockstep.training.resume import CheckpointConfig
    from lockstep.training.sampler import ShardedSampler
    from lockstep.training.trainer import Trainer

__version__ = "0.1.0"

# The public names and the module each lives in. Loaded on first use (PEP 562), so `import
# lockstep` -- and the `lockstep` command -- costs nothing until a name is needed: asking
# `lockstep run` about a missing script does not wait for torch to import.
_WHERE = {
    "Advice": "lockstep.advisor.advise",
    "AllReduce": "lockstep.replication.algorithms",
    "AsyncConfig": "lockstep.lowcomm.paramserver",
    "AsyncTrainer": "lockstep.training.async_trainer",
    "Bucket": "lockstep.replication.reduction",
    "CheckpointConfig": "lockstep.training.resume",
    "CheckpointError": "lockstep.training.checkpoint",
    "CollectiveError": "lockstep.comm",
    "DataParallel": "lockstep.replication.replica",
    "DiLoCo": "lockstep.lowcomm.rounds",
    "DiLoCoConfig": "lockstep.lowcomm.rounds",
    "DriftCheck": "lockstep.replication.drift",
    "DriftError": "lockstep.replication.drift",
    "Elastic": "lockstep.elastic",
    "ElasticConfig": "lockstep.elastic",
    "JoinError": "lockstep.replication.join",
    "LAMB": "lockstep.optim",
    "LARS": "lockstep.optim",
    "LRSchedule": "lockstep.optim",
    "LocalSGD": "lockstep.lowcomm.rounds",
    "LocalSGDConfig": "lockstep.lowcomm.rounds",
    "LossScaler": "lockstep.replication.precision",
    "ModelMismatchError": "lockstep.replication.consistency",
    "NothingToTrainError": "lockstep.replication.ddp_args",
    "NonFiniteGradientError": "lockstep.replication.nonfinite",
    "PowerSGD": "lockstep.replication.compress",
    "Reduction": "lockstep.replication.reduction",
    "ShardConfig": "lockstep.sharding.sharded",
    "StreamingDiLoCo": "lockstep.lowcomm.streaming",
    "StreamingDiLoCoConfig": "lockstep.lowcomm.streaming",
    "ShardedDataParallel": "lockstep.sharding.sharded",
    "ShardedSampler": "lockstep.training.sampler",
    "SyncBatchNorm": "lockstep.replication.syncbn",
    "SyncConfig": "lockstep.replication.sync",
    "TopK": "lockstep.replication.compress",
    "TrainConfig": "lockstep.training.config",
    "Trainer": "lockstep.training.trainer",
    "UnusedParameterError": "lockstep.replication.unused",
    "World": "lockstep.comm.world",
    "advise": "lockstep.advisor.advise",
    "convert_sync_batchnorm": "lockstep.replication.syncbn",
    "export_weights": "lockstep.training.export",
    "fingerprint": "lockstep.training.checkpoint",
    "init": "lockstep.comm.world",
    "load_weights": "lockstep.training.export",
    "memory_report": "lockstep.replication.memory",
    "naive_average_gradients": "lockstep.replication.oracle",
    "record_timeline": "lockstep.comm.timeline",
    "seed_everything": "lockstep.seeding",
    "shard": "lockstep.sharding.sharded",
    "ZeroOptimizer": "lockstep.sharding.optimizer",
}
_SUBPACKAGES = ("advisor", "comm", "demo", "elastic", "launch", "lowcomm", "replication",
                "sharding", "tools", "training")


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"lockstep.{name}")
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBPACKAGES])


__all__ = [
    "LAMB",
    "LARS",
    "Advice",
    "AllReduce",
    "AsyncConfig",
    "AsyncTrainer",
    "Bucket",
    "CheckpointConfig",
    "CheckpointError",
    "CollectiveError",
    "DataParallel",
    "DiLoCo",
    "DiLoCoConfig",
    "DriftCheck",
    "DriftError",
    "Elastic",
    "ElasticConfig",
    "JoinError",
    "LRSchedule",
    "LocalSGD",
    "LocalSGDConfig",
    "LossScaler",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "NothingToTrainError",
    "PowerSGD",
    "Reduction",
    "ShardConfig",
    "ShardedDataParallel",
    "ShardedSampler",
    "StreamingDiLoCo",
    "StreamingDiLoCoConfig",
    "SyncBatchNorm",
    "SyncConfig",
    "TopK",
    "TrainConfig",
    "Trainer",
    "UnusedParameterError",
    "World",
    "ZeroOptimizer",
    "advise",
    "convert_sync_batchnorm",
    "export_weights",
    "fingerprint",
    "init",
    "load_weights",
    "memory_report",
    "naive_average_gradients",
    "record_timeline",
    "seed_everything",
    "shard",
]
