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

from lockstep.algorithms import AllReduce
from lockstep.async_trainer import AsyncTrainer
from lockstep.checkpoint import CheckpointError, fingerprint
from lockstep.comm import CollectiveError
from lockstep.compress import PowerSGD, TopK
from lockstep.consistency import ModelMismatchError
from lockstep.export import export_weights, load_weights
from lockstep.join import JoinError
from lockstep.lowcomm import DiLoCo, DiLoCoConfig, LocalSGD, LocalSGDConfig
from lockstep.memory import memory_report
from lockstep.nonfinite import NonFiniteGradientError
from lockstep.optim import LAMB, LARS, LRSchedule
from lockstep.paramserver import AsyncConfig
from lockstep.precision import LossScaler
from lockstep.reducer import UnusedParameterError, naive_average_gradients
from lockstep.reduction import Bucket, Reduction
from lockstep.replica import DataParallel
from lockstep.resume import CheckpointConfig
from lockstep.sampler import ShardedSampler
from lockstep.seeding import seed_everything
from lockstep.sharded import ShardConfig, ShardedDataParallel, shard
from lockstep.sync import SyncConfig
from lockstep.syncbn import SyncBatchNorm, convert_sync_batchnorm
from lockstep.trainconfig import TrainConfig
from lockstep.trainer import Trainer
from lockstep.world import World, init

__version__ = "0.1.0"

__all__ = [
    "LAMB",
    "LARS",
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
    "JoinError",
    "LRSchedule",
    "LocalSGD",
    "LocalSGDConfig",
    "LossScaler",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "PowerSGD",
    "Reduction",
    "ShardConfig",
    "ShardedDataParallel",
    "ShardedSampler",
    "SyncBatchNorm",
    "SyncConfig",
    "TopK",
    "TrainConfig",
    "Trainer",
    "UnusedParameterError",
    "World",
    "convert_sync_batchnorm",
    "export_weights",
    "fingerprint",
    "init",
    "load_weights",
    "memory_report",
    "naive_average_gradients",
    "seed_everything",
    "shard",
]
