"""TrainConfig: everything that decides what is trained, each part owned by its module.

    TrainConfig(global_batch_size=256, epochs=3, lr=0.1, warmup_steps=100,
                parallel=DiLoCoConfig(sync_every=50),
                checkpoint=CheckpointConfig(every_steps=500))

The Trainer's own settings (the global batch, the schedule, precision, evaluation, logging)
sit at the top. How the model is made parallel is one nested config from the module that
does it -- SyncConfig (sync.py), ShardConfig (sharded.py), LocalSGDConfig and DiLoCoConfig
(lowcomm/rounds.py), StreamingDiLoCoConfig (lowcomm/streaming.py), AsyncConfig
(paramserver.py, for AsyncTrainer) -- and the checkpoints' is
CheckpointConfig (resume.py). Each validates itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep.elastic.config import ElasticConfig
from lockstep.lowcomm.paramserver import AsyncConfig
from lockstep.lowcomm.rounds import DiLoCoConfig, LocalSGDConfig
from lockstep.lowcomm.streaming import StreamingDiLoCoConfig
from lockstep.optim import LRSchedule, goyal_schedule
from lockstep.replication.precision import check_precision
from lockstep.replication.sync import SyncConfig
from lockstep.sharding.sharded import ShardConfig
from lockstep.training import trackers
from lockstep.training.resume import CheckpointConfig

ParallelConfig = (SyncConfig | ShardConfig | LocalSGDConfig | DiLoCoConfig |
                  StreamingDiLoCoConfig | AsyncConfig)
PARALLEL_CONFIGS: tuple[type, ...] = (SyncConfig, ShardConfig, LocalSGDConfig, DiLoCoConfig,
                                      StreamingDiLoCoConfig, AsyncConfig)


@dataclass
class TrainConfig:
    """The same config gives the same training at any world size."""

    global_batch_size: int = 64
    """Samples per optimizer step, over all ranks and accumulation micro-steps."""
    max_batch_per_rank: int | None = None
    """Most samples one rank runs through the model at once (a memory cap); gradient
    accumulation makes up the rest. None: no cap."""
    epochs: int = 1
    """Passes over the training set (each uses len(train) // global_batch_size steps)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps, if sooner."""
    lr: float | None = None
    """Peak learning rate, set on the optimizer every step. None: leave the optimizer's lr
    alone (and step `scheduler` if given)."""
    base_batch_size: int | None = None
    """If set, `lr` is the rate for this batch size and is scaled linearly to the global
    batch (Goyal et al. 2017); warmup then starts from the unscaled rate."""
    warmup_steps: int = 0
    """Steps of linear warmup to the peak learning rate."""
    decay: str = "none"
    """After warmup: "none" (constant) or "cosine" (to zero at the last step)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm (over all parameters) to this value."""
    precision: str = "fp32"
    """"fp32", "bf16" (autocast) or "fp16" (autocast and dynamic loss scaling agreed by
    all ranks). Weights, gradients and optimizer state stay fp32 in every case."""
    eval_every_epochs: int = 1
    """Evaluate on the test set every this many epochs (and always at the end)."""
    eval_every_steps: int | None = None
    """Also evaluate every this many steps (for runs shorter than an epoch)."""
    eval_batch_size: int = 256
    """Per-rank batch for evaluation."""
    run_dir: str = "runs/lockstep"
    """Where checkpoints, metrics.jsonl, config.json, TensorBoard events and the plot go."""
    seed: int = 0
    """Seeds data order and each rank's RNG, and the model's initial weights when the
    Trainer is given a function that builds the model (see `Trainer`)."""
    log_every_steps: int = 10
    """Average the loss over ranks and record metrics every this many steps."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    trackers: tuple[str, ...] = ("tensorboard",)
    """Where metrics and this config go besides metrics.jsonl and config.json:
    "tensorboard", "mlflow", "wandb" (offline by default; see trackers.py)."""
    parallel: ParallelConfig = field(default_factory=SyncConfig)
    """How replicas are kept in step: SyncConfig (every step), ShardConfig (ZeRO),
    LocalSGDConfig, DiLoCoConfig or StreamingDiLoCoConfig (every few steps); AsyncConfig
    with AsyncTrainer."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written, how many are kept, and what to resume from."""
    timeline: str | None = None
    """Record where each step's time went on every rank and write one trace there at the
    end, for Perfetto or chrome://tracing (lockstep/comm/timeline.py). None: not recorded,
    unless `lockstep run --timeline PATH` asked for it."""
    elastic: ElasticConfig | None = None
    """Fault tolerance (under `lockstep run --elastic`): a worker's death costs at most the
    step it interrupted, the survivors go on at once, and workers started later join at a
    step boundary -- with the same global batches, schedule and checkpoints. None: a
    failure stops the run (resume it from its last checkpoint)."""

    def lr_schedule(self, total_steps: int) -> LRSchedule | None:
        """The learning rate per step that `lr` and its settings ask for (None: no `lr`)."""
        if self.lr is None:
            return None
        if self.base_batch_size:
            return goyal_schedule(self.lr, self.global_batch_size, self.base_batch_size,
                                  self.warmup_steps, total_steps, self.decay)
        return LRSchedule(self.lr, self.warmup_steps, 0.0, total_steps, self.decay)

    def mid_epoch_eval_due(self, step: int, epoch: int, epoch_done: bool,
                           total_steps: int) -> bool:
        """An evaluation after `step`: eval_every_steps says so, and neither the epoch's
        end nor the run's will evaluate there."""
        every = self.eval_every_steps
        return every is not None and step % every == 0 and step < total_steps and not (
            epoch_done and epoch % self.eval_every_epochs == 0)

    def validate(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.max_batch_per_rank is not None and self.max_batch_per_rank < 1:
            raise ValueError("max_batch_per_rank must be >= 1")
        if not isinstance(self.parallel, PARALLEL_CONFIGS):
            names = ", ".join(c.__name__ for c in PARALLEL_CONFIGS)
            raise ValueError(f"parallel must be one of {names}; got {self.parallel!r}")
        check_precision(self.precision)
        trackers.check(self.trackers)
        self.parallel.validate()
        self.checkpoint.validate()
        if self.elastic is not None and isinstance(self.parallel, AsyncConfig):
            raise ValueError(
                "elastic= with parallel=AsyncConfig: the parameter server keeps the optimizer "
                "state on one rank, which no survivor could continue from. Use SyncConfig, "
                "ShardConfig, LocalSGDConfig or DiLoCoConfig with elastic=")
        if self.elastic is not None and isinstance(self.parallel, StreamingDiLoCoConfig) \
                and self.parallel.replica_size != 1:
            raise ValueError(
                "elastic= with StreamingDiLoCoConfig(replica_size=...): a death would leave "
                "its replica a rank short, and replicas of unequal size cannot share the "
                "exchanges' pieces. Use replica_size=1 with elastic=")
