"""Checkpoints that are well formed but hold the wrong content, and the messages around
resuming: a state.json whose fields have the wrong type or range is skipped for the previous
checkpoint with a warning naming the file and the field (never a raw TypeError, never used);
a model changed since its checkpoints is told its real shapes and what to do; a run that had
already finished is not trained, evaluated or exported again. Exported weights are never
converted to another dtype, and a missing safetensors says what to install."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.testing import World
from lockstep.training import checkpoint
from tests.models import make_model
from tests.test_checkpoint_safety import _Records, forge_manifest
from tests.test_trainer import config, digit_sets, sgd, train

# (field, crafted value): each is valid JSON; none is a position of this run.
STATE_CASES: list[tuple[str, Any]] = [
    ("step_in_epoch", -2), ("global_step", "4"), ("history", "not a list"),
    ("sampler.position", -96), ("epoch", 1.5), ("scheduler.last_epoch", "x")]


def _edit_state(folder: Path, field: str, value: Any) -> None:
    state = json.loads((folder / "state.json").read_text())
    *outer, last = field.split(".")
    inner = state
    for name in outer:
        inner = inner[name]
    inner[last] = value
    (folder / "state.json").write_text(json.dumps(state))
    forge_manifest(folder)


def _train(run_dir: str, **overrides: object) -> tuple[lockstep.Trainer, dict[str, Any]]:
    """test_trainer's run with a learning-rate scheduler, whose state is checkpointed too."""
    train_set, test_set = digit_sets()
    trainer = lockstep.Trainer(
        make_model("mlp"), sgd, train_set, test_set,
        config=config(run_dir, max_steps=4, checkpoint_every_steps=2, **overrides),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10))
    return trainer, trainer.fit()


def _resume_and_listen(run_dir: str, **overrides: object) -> dict[str, Any]:
    """Resume (resume="auto"), keeping what rank 0 printed and the loader warned."""
    records, printed = _Records(), io.StringIO()
    logging.getLogger("lockstep.training.checkpoint").addHandler(records)
    try:
        with contextlib.redirect_stdout(printed):
            _, summary = _train(run_dir, resume="auto", **overrides)
        outcome = f"trained to step {summary['steps']}"
    except Exception as error:  # what a user would see instead of a skip
        outcome = f"raised {type(error).__name__}: {error}"
    finally:
        logging.getLogger("lockstep.training.checkpoint").removeHandler(records)
    return {"printed": printed.getvalue(), "warnings": records.lines, "outcome": outcome}


def check_wrong_state_fields(run_dir: str) -> list[dict[str, Any]]:
    world = lockstep.init()
    _train(run_dir)
    newest = Path(run_dir) / "checkpoints" / "step-00000004"
    pristine = Path(run_dir) / "pristine"
    if world.is_main:
        shutil.copytree(newest, pristine)
    results = []
    for field, value in STATE_CASES:
        if world.is_main:
            shutil.rmtree(newest)
            shutil.copytree(pristine, newest)
            _edit_state(newest, field, value)
        world.barrier()
        results.append({"field": field, **_resume_and_listen(run_dir)})
    return results


def test_wrong_state_fields_are_skipped_with_a_warning_naming_the_field(
        world2: World, tmp_path: Path) -> None:
    results = world2.run(check_wrong_state_fields, str(tmp_path / "run"), deadline_s=300)
    for rank, per_case in enumerate(results):
        for r in per_case:
            field = r["field"]
            assert r["outcome"] == "trained to step 4", (field, r["outcome"])
            if rank == 0:
                assert "step-00000002 at step 2" in r["printed"], (field, r["printed"])
                warning = next(w for w in r["warnings"] if "skipping" in w)
                assert "state.json" in warning and f"field '{field}'" in warning, warning


def check_a_changed_model(run_dir: str) -> str:
    """Resume a run with a narrower first layer: its checkpoints cannot hold this model."""
    lockstep.init()
    train(run_dir, max_steps=2, checkpoint_every_steps=2)
    narrower = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    train_set, test_set = digit_sets()
    trainer = lockstep.Trainer(narrower, sgd, train_set, test_set,
                               config=config(run_dir, resume="auto", max_steps=4))
    try:
        trainer.fit()
    except checkpoint.CheckpointError as error:
        return str(error)
    return "resumed"


def test_a_changed_model_is_told_its_real_shapes_and_what_to_do(world2: World,
                                                                tmp_path: Path) -> None:
    for rank, said in enumerate(world2.run(check_a_changed_model, str(tmp_path / "run"))):
        assert f"rank {rank}:" in said, said
        assert "model.0.weight has shape [64, 64] in the checkpoint and [32, 64] in this " \
            "model" in said, said
        assert "new run_dir" in said and "resume='never'" in said, said


def check_a_finished_run_again(run_dir: str) -> dict[str, Any]:
    world = lockstep.init()
    trainer, first = train(run_dir, max_steps=4)
    exported = Path(run_dir) / "model.pt"
    metrics = Path(run_dir) / "metrics.jsonl"
    trainer.export(exported)
    written = exported.stat().st_mtime_ns if world.is_main else 0
    lines = len(metrics.read_text().splitlines()) if world.is_main else 0
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        again, second = train(run_dir, max_steps=4, resume="auto")
        again.export(exported)
    return {"first": first, "second": second, "printed": printed.getvalue(),
            "rewritten": world.is_main and exported.stat().st_mtime_ns != written,
            "new_metrics": world.is_main and len(metrics.read_text().splitlines()) - lines}


def test_a_finished_run_started_again_does_no_work_and_returns_its_results(
        world2: World, tmp_path: Path) -> None:
    main, other = world2.run(check_a_finished_run_again, str(tmp_path / "run"))
    assert "run already complete at step 4" in main["printed"]
    assert "left as it is" in main["printed"]
    assert main["new_metrics"] == 0 and not main["rewritten"]  # no evaluation, no export
    assert main["second"]["already_finished"] and not main["first"]["already_finished"]
    for key in ("steps", "test_loss", "test_accuracy", "fingerprint"):
        assert main["second"][key] == main["first"][key], key
    assert other["second"]["steps"] == 4


def test_load_weights_refuses_another_dtype(tmp_path: Path) -> None:
    model = make_model("mlp")
    as_int = {k: (v * 100).to(torch.int64) for k, v in model.state_dict().items()}
    torch.save(as_int, tmp_path / "ints.pt")
    with pytest.raises(ValueError, match=r"ints.pt: 0.weight is stored as torch.int64, the "
                                         r"module holds torch.float32"):
        lockstep.load_weights(make_model("mlp"), tmp_path / "ints.pt")
    if lockstep.training.optional.available("safetensors"):
        from safetensors.torch import save_file

        save_file(as_int, str(tmp_path / "ints.safetensors"))
        with pytest.raises(ValueError, match=r"is stored as torch\.int64"):
            lockstep.load_weights(make_model("mlp"), tmp_path / "ints.safetensors")


def test_safetensors_missing_says_what_to_install(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install safetensors \(or pip "
                                                  r"install 'lockstep\[export\]'\)"):
        lockstep.export_weights(make_model("mlp"), tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()
