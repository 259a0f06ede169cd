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
"""

from lockstep.algorithms import AllReduce
from lockstep.checkpoint import CheckpointError, fingerprint
from lockstep.comm import CollectiveError
from lockstep.compress import PowerSGD, TopK
from lockstep.consistency import ModelMismatchError
from lockstep.drift import DriftCheck, DriftError
from lockstep.elastic import Elastic, ElasticConfig
from lockstep.join import JoinError
from lockstep.memory import memory_report
from lockstep.nonfinite import NonFiniteGradientError
from lockstep.optim import LAMB, LARS, LRSchedule
from lockstep.precision import LossScaler
from lockstep.reducer import UnusedParameterError, naive_average_gradients
from lockstep.reduction import Bucket, Reduction
from lockstep.replica import DataParallel
from lockstep.sampler import ShardedSampler
from lockstep.sharded import ShardedDataParallel, shard
from lockstep.syncbn import SyncBatchNorm, convert_sync_batchnorm
from lockstep.trainer import TrainConfig, Trainer
from lockstep.world import World, init

__version__ = "0.1.0"

__all__ = [
    "LAMB",
    "LARS",
    "AllReduce",
    "Bucket",
    "CheckpointError",
    "CollectiveError",
    "DataParallel",
    "DriftCheck",
    "DriftError",
    "Elastic",
    "ElasticConfig",
    "JoinError",
    "LRSchedule",
    "LossScaler",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "PowerSGD",
    "Reduction",
    "ShardedDataParallel",
    "ShardedSampler",
    "SyncBatchNorm",
    "TopK",
    "TrainConfig",
    "Trainer",
    "UnusedParameterError",
    "World",
    "convert_sync_batchnorm",
    "fingerprint",
    "init",
    "memory_report",
    "naive_average_gradients",
    "shard",
]
