"""A newcomer's first hour (issue 16): a seed that decides the whole run, a progress bar that
ends at 100%, a finished run that says so, the config kept in the run folder, and weights
exported for inference. Real Gloo worlds; one world runs all the Trainer checks."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import lockstep
from lockstep.testing import World
from lockstep.training import configfile
from tests.models import digits

STEPS = 60  # 2 epochs of 30 steps; logging every 7 steps leaves steps after the last log


def unseeded_mlp() -> nn.Module:
    """Built from whatever the global RNG holds: a new model every call unless seeded."""
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))


def fit(run_dir: Path, seed: int = 0, resume: str = "auto", progress: bool = False
        ) -> tuple[lockstep.Trainer, dict]:
    x, y = digits()
    config = lockstep.TrainConfig(global_batch_size=48, epochs=2, lr=0.05,
                                  run_dir=str(run_dir), seed=seed, log_every_steps=7,
                                  progress=progress,
                                  checkpoint=lockstep.CheckpointConfig(resume=resume))
    trainer = lockstep.Trainer(unseeded_mlp, lambda p: torch.optim.SGD(p, momentum=0.9),
                               TensorDataset(x[:1440], y[:1440]),
                               TensorDataset(x[1440:], y[1440:]), config=config)
    return trainer, trainer.fit()


def check_a_first_hour(root: str) -> dict[str, object]:
    world = lockstep.init()
    root_path = Path(root)
    shown = io.StringIO()
    with contextlib.redirect_stderr(shown), contextlib.redirect_stdout(shown):
        trainer, first = fit(root_path / "a", seed=3, progress=True)
    again = fit(root_path / "b", seed=3)[1]["fingerprint"]
    other = fit(root_path / "c", seed=4)[1]["fingerprint"]
    exported = {suffix: trainer.export(root_path / f"model{suffix}")
                for suffix in (".pt", ".safetensors")}
    probe = digits()[0][:16]
    with torch.no_grad():
        outputs = trainer.model.module.eval()(probe)
    rerun = io.StringIO()
    with contextlib.redirect_stdout(rerun):
        _, second = fit(root_path / "a", seed=3, resume="auto")
    return {"rank": world.rank, "bar": shown.getvalue(), "first": first, "again": again,
            "other": other, "exported": exported, "outputs": outputs,
            "rerun": rerun.getvalue(), "second": second}


def test_a_newcomers_run_is_seeded_complete_recorded_and_exportable(world2: World,
                                                                    tmp_path: Path) -> None:
    main, other_rank = world2.run(check_a_first_hour, str(tmp_path))
    # Finding 6: the seed decides the initial weights too, so a run repeats exactly.
    assert main["first"]["fingerprint"] == main["again"] != main["other"]
    # Finding 4: the bar counts the steps after the last log point (the last of epoch 1).
    assert f"{STEPS}/{STEPS}" in main["bar"]
    assert other_rank["bar"] == ""  # rank 0 alone shows it
    # Finding 5: a finished run says so and trains nothing more.
    assert f"run already complete at step {STEPS}" in main["rerun"]
    assert "new run_dir" in main["rerun"]
    assert main["second"]["steps"] == STEPS
    assert main["second"]["fingerprint"] == main["first"]["fingerprint"]
    metrics = (tmp_path / "a/metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "train"' in line for line in metrics) == 9  # 7..56 and 60, once
    # The config is kept in the run folder, as data a later run can read back.
    saved = json.loads((tmp_path / "a/config.json").read_text())
    assert saved["seed"] == 3 and saved["global_batch_size"] == 48
    assert saved["trackers"] == ["tensorboard"]
    again = configfile.configure(lockstep.TrainConfig(), tmp_path / "a/config.json")
    parallel = {k: v for k, v in saved["parallel"].items() if k != "mode"}
    assert saved["parallel"]["mode"] == "sync"
    assert again == lockstep.TrainConfig(**{
        **saved, "trackers": ("tensorboard",), "parallel": lockstep.SyncConfig(**parallel),
        "checkpoint": lockstep.CheckpointConfig(**saved["checkpoint"])})
    assert (again.seed, again.epochs, again.log_every_steps) == (3, 2, 7)
    events = b"".join(p.read_bytes() for p in (tmp_path / "a/tensorboard").iterdir())
    assert b"hparams" in events and b"global_batch_size" in events
    # Exported weights load into a plain model, no optimizer, and give the same outputs.
    assert other_rank["exported"] == {".pt": None, ".safetensors": None}
    probe = digits()[0][:16]
    for path in main["exported"].values():
        plain = lockstep.load_weights(unseeded_mlp(), path).eval()
        with torch.no_grad():
            assert torch.equal(plain(probe), main["outputs"])


def test_seed_everything_repeats_a_model_built_outside_the_trainer() -> None:
    lockstep.seed_everything(7)
    first = unseeded_mlp()
    lockstep.seed_everything(7)
    second = unseeded_mlp()
    assert lockstep.fingerprint(first) == lockstep.fingerprint(second)
    assert lockstep.fingerprint(first) != lockstep.fingerprint(unseeded_mlp())


def check_export_under_zero3(path: str) -> dict[str, torch.Tensor]:
    lockstep.seed_everything(11)
    net = unseeded_mlp()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = lockstep.shard(net, 3)  # each rank now holds a shard of each weight
    model.make_optimizer(torch.optim.SGD, lr=0.1)
    lockstep.export_weights(model, path)
    return before


def test_export_gathers_the_whole_weights_under_zero3(world2: World, tmp_path: Path) -> None:
    before = world2.run(check_export_under_zero3, str(tmp_path / "zero3.pt"))[0]
    loaded = lockstep.load_weights(unseeded_mlp(), tmp_path / "zero3.pt").state_dict()
    assert loaded.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(loaded[name], tensor), name
