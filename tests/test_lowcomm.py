"""Low-communication modes: the H=1 limits equal synchronous training, and DiLoCo's outer
state survives a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

import lockstep
from lockstep.testing import World
from tests.models import digest, make_model
from tests.test_trainer import digit_sets


def plain_sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def run(run_dir: str, parallel: object = None, resume: str = "never",
        checkpoint_every_steps: int | None = None, **overrides: object
        ) -> tuple[list[torch.Tensor], str, dict[str, float]]:
    """Train with `parallel` (SyncConfig by default; AsyncTrainer for AsyncConfig)."""
    lockstep.init()
    train_set, test_set = digit_sets()
    config = lockstep.TrainConfig(
        global_batch_size=48, epochs=1, run_dir=run_dir, progress=False,
        parallel=parallel or lockstep.SyncConfig(),  # type: ignore[arg-type]
        checkpoint=lockstep.CheckpointConfig(every_steps=checkpoint_every_steps,
                                             resume=resume), **overrides)  # type: ignore[arg-type]
    if isinstance(parallel, lockstep.AsyncConfig):
        asynchronous = lockstep.AsyncTrainer(make_model("mlp"), plain_sgd, train_set,
                                             test_set, config=config)
        asynchronous.fit()
        module = asynchronous.module
        return [t.clone() for t in module.state_dict().values()], digest(module), {}
    trainer = lockstep.Trainer(make_model("mlp"), plain_sgd, train_set, test_set,
                               config=config)
    trainer.fit()
    module = trainer.model.module
    return ([t.clone() for t in module.state_dict().values()], digest(module),
            trainer.model.comm_stats())


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_h1_limits_equal_synchronous_sgd(world: World, tmp_path: Path) -> None:
    sync = world.run(run, str(tmp_path / "sync"))
    local = world.run(run, str(tmp_path / "local"), lockstep.LocalSGDConfig(sync_every=1))
    diloco = world.run(run, str(tmp_path / "diloco"), lockstep.DiLoCoConfig(
        sync_every=1, outer_lr=1.0, outer_momentum=0.0))
    for results in (local, diloco):
        assert gap(results[0][0], sync[0][0]) < 5e-5
        assert len({r[1] for r in results}) == 1  # replicas identical


def test_local_rounds_send_h_times_fewer_bytes(world2: World, tmp_path: Path) -> None:
    _, _, sync = world2.run(run, str(tmp_path / "sync"))[0]
    _, _, diloco = world2.run(run, str(tmp_path / "d"), lockstep.DiLoCoConfig(
        sync_every=10, pseudo_grad_bf16=True))[0]
    assert diloco["bytes_sent"] * 10 * 2 <= sync["bytes_sent"] * 1.01  # H=10, and bf16


def test_diloco_outer_state_resumes_exactly(world2: World, tmp_path: Path) -> None:
    diloco = lockstep.DiLoCoConfig(sync_every=5)
    whole = world2.run(run, str(tmp_path / "whole"), diloco)
    part = str(tmp_path / "part")
    world2.run(run, part, diloco, max_steps=15, checkpoint_every_steps=5)
    resumed = world2.run(run, part, diloco, resume="auto")
    assert resumed[0][1] == whole[0][1]  # bitwise: theta and outer momentum restored


def test_configs_refuse_compress_with_the_reason() -> None:
    """Not Python's bare "unexpected keyword argument": why, and what to use instead
    (issue 28, finding 21)."""
    import pytest

    cases = [(lockstep.ShardConfig, "ShardConfig\\(wire='bf16' or 'int8'\\)"),
             (lockstep.LocalSGDConfig, "pseudo_grad_bf16=True"),
             (lockstep.DiLoCoConfig, "pseudo_grad_bf16=True"),
             (lockstep.StreamingDiLoCoConfig, "wire='bf16', 'e4m3', 'int8' or 'int4'"),
             (lockstep.AsyncConfig, "compression is for SyncConfig")]
    for config, instead in cases:
        with pytest.raises(ValueError, match=f"{config.__name__} takes no compress=: .*{instead}"):
            config(compress="bf16")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="ShardConfig\\(algorithm='ring'\\): ZeRO moves"):
        lockstep.ShardConfig(stage=2, algorithm="ring").validate()
    assert lockstep.DiLoCoConfig(sync_every=3).sync_every == 3  # everything else as before


def check_join_on_rounds() -> list[str]:
    """join() on LocalSGD and DiLoCo: a reason, not an AttributeError; enable=False is a
    no-op, as DDP's."""
    lockstep.init()
    messages = []
    for mode in (lockstep.LocalSGD, lockstep.DiLoCo):
        model = mode(make_model("mlp"), every=2)
        with model.join(enable=False):
            pass
        try:
            with model.join():
                pass
        except lockstep.JoinError as error:
            messages.append(str(error))
    return messages


def test_join_on_low_communication_modes_is_refused_with_the_reason(world2: World) -> None:
    for rank, messages in enumerate(world2.run(check_join_on_rounds)):
        assert len(messages) == 2
        for message in messages:
            assert message.startswith(f"rank {rank}: join() is for gradients averaged every "
                                      "step") and "same number of batches" in message
