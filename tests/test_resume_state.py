"""Resume is bitwise for state each rank holds for itself: a compressor's error feedback
(PowerSGD, TopK) and, in local SGD and DiLoCo, each rank's own optimizer state. Before,
the first was lost and rank 0's optimizer state was restored on every rank (0.10 to 0.39
relative off an uninterrupted run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep.testing import World
from tests.models import make_model
from tests.test_trainer import digit_sets


def momentum_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(run_dir: str, mode: str, max_steps: int, resume: str = "never",
          every: int | None = None) -> str:
    lockstep.init()
    parallel = MODES[mode]()  # a compressor is state: one per run
    train_set, _ = digit_sets()
    config = lockstep.TrainConfig(
        global_batch_size=48, epochs=1, max_steps=max_steps, run_dir=run_dir, progress=False,
        parallel=parallel, checkpoint=lockstep.CheckpointConfig(every_steps=every,
                                                                resume=resume))
    trainer = lockstep.Trainer(make_model("mlp"), momentum_sgd, train_set, config=config)
    return str(trainer.fit()["fingerprint"])  # the whole model (ZeRO-3's gathered)


def interrupted_and_whole(tmp: str, mode: str) -> tuple[str, str]:
    """The same 20 steps uninterrupted, and stopped after 10 then resumed."""
    whole = train(f"{tmp}/whole", mode, 20)
    train(f"{tmp}/part", mode, 10, every=5)
    return train(f"{tmp}/part", mode, 20, resume="auto"), whole


MODES: dict[str, Any] = {
    "powersgd": lambda: lockstep.SyncConfig(compress=lockstep.PowerSGD(rank=2, warmup_steps=3)),
    "topk": lambda: lockstep.SyncConfig(compress=lockstep.TopK(ratio=0.1)),
    "local_sgd": lambda: lockstep.LocalSGDConfig(sync_every=5),
    "diloco": lambda: lockstep.DiLoCoConfig(sync_every=5),
    # fragments sent at steps 2, 4, 6, 8, 10...: one is in flight at the step-10 checkpoint
    "streaming": lambda: lockstep.StreamingDiLoCoConfig(sync_every=6, fragments=3),
    "streaming_int4": lambda: lockstep.StreamingDiLoCoConfig(
        sync_every=6, fragments=3, overlap=2, wire="int4", error_feedback=True),
    # ZeRO's wire in fewer bits: the masters resharded, each rank's error feedback its own
    "zero2_int8": lambda: lockstep.ShardConfig(stage=2, wire="int8", error_feedback=True),
    "zero3_bf16": lambda: lockstep.ShardConfig(stage=3, wire="bf16", error_feedback=True),
    "sync": lambda: lockstep.SyncConfig(),  # nothing per rank: any world size resumes it
    "streaming_pairs": lambda: lockstep.StreamingDiLoCoConfig(  # "streaming", in replicas
        sync_every=6, fragments=3, replica_size=2),
    # replicas of 2 ranks (of 4): each rank's error feedback is its own piece's
    "streaming_replicas": lambda: lockstep.StreamingDiLoCoConfig(
        sync_every=6, fragments=3, overlap=2, wire="int4", error_feedback=True,
        replica_size=2),
}


@pytest.mark.parametrize("mode", ["powersgd", "topk", "local_sgd", "diloco", "streaming",
                                  "streaming_int4", "zero2_int8", "zero3_bf16"])
def test_interrupted_run_resumes_bitwise(world2: World, tmp_path: Path, mode: str) -> None:
    for resumed, whole in world2.run(interrupted_and_whole, str(tmp_path), mode):
        assert resumed == whole


def test_replicas_resume_bitwise(world4: World, tmp_path: Path) -> None:
    for resumed, whole in world4.run(interrupted_and_whole, str(tmp_path),
                                     "streaming_replicas"):
        assert resumed == whole


def resumed_in_pairs(tmp: str) -> str:
    try:
        return train(f"{tmp}/part", "streaming_pairs", 20, resume="auto")
    except ValueError as error:
        return str(error)


def test_a_checkpoint_of_ranks_apart_is_refused_to_replicas(world4: World,
                                                             tmp_path: Path) -> None:
    """Written by 4 ranks each a replica of its own (their parameters apart), resumed in
    replicas of 2 ranks: each rank would take back its own parameters and optimizer state,
    and the ranks of one replica would stay apart for good. Refused, on every rank."""
    world4.run(train, f"{tmp_path}/part", "streaming", 10, every=5)
    for rank, said in enumerate(world4.run(resumed_in_pairs, str(tmp_path))):
        assert said.startswith(f"rank {rank}: the checkpoint gives the ranks of this replica "
                               "different parameters: it was written with another "
                               "replica_size"), said


def resumed_here(tmp: str, mode: str) -> tuple[str, list[str]]:
    """The run resumed here, and what rank_state warned."""
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lockstep.training.rank_state")
    logger.addHandler(handler)
    try:
        return train(f"{tmp}/part", mode, 20, resume="auto"), said
    finally:
        logger.removeHandler(handler)


LOST = {"powersgd": "each rank starts its error feedback from zero, so training goes on, "
                    "but not bitwise",
        "local_sgd": "each rank takes rank 0's optimizer state (local rounds), so training "
                     "goes on, but not bitwise",
        "streaming": "each rank takes rank 0's optimizer state (local rounds) and takes rank "
                     "0's parameters (streaming DiLoCo's differ per rank between syncs), so",
        "sync": None}  # the optimizer state is the same on every rank: nothing is lost


@pytest.mark.parametrize("mode", list(LOST))
def test_per_rank_state_resumes_at_another_world_size(world2: World, world3: World,
                                                      tmp_path: Path, mode: str) -> None:
    """Written by 2 ranks, resumed by 3: no rank has its own state to take; the run goes on
    (rank 0's optimizer state, error feedback from zero) and says what it lost -- and says
    nothing where nothing was per rank (the warning once fired for every resume at another
    world size, a synchronous job's after an elastic one lost a host included)."""
    world2.run(train, f"{tmp_path}/part", mode, 10, every=5)
    results = world3.run(resumed_here, str(tmp_path), mode)
    assert len({final for final, _ in results}) == 1  # the replicas agree at the end
    said = [m for m in results[0][1] if "was written by 2 rank(s) and this run has 3" in m]
    expected = LOST[mode]
    assert [expected in m for m in said] == ([True] if expected else []), said


def deprecation_warnings(run_dir: str) -> list[str]:
    """A rank's own tensors go to its file as torch's ShardedTensor (rank_state.py), whose
    .size() and .dtype warn that ShardedTensor is deprecated -- once per rank, in the user's
    output, wherever a checkpoint is written, looked for (every start) or loaded."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(run_dir, "diloco", 10, every=5)
        train(run_dir, "diloco", 15, resume="auto")
    return [str(w.message) for w in caught if "ShardedTensor" in str(w.message)]


def test_checkpoints_of_a_ranks_own_state_warn_nothing(world2: World, tmp_path: Path) -> None:
    assert world2.run(deprecation_warnings, str(tmp_path)) == [[], []]
