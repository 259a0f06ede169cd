"""Configs from TOML/JSON files and --set overrides (data, checked against TrainConfig), the
PNG, optional pieces reported once, and the trackers. One process, no world needed."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

import lockstep
from lockstep.training import configfile, optional, trackers
from lockstep.training.runlog import RunLog


def test_a_toml_file_then_overrides_make_a_checked_config(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[trainer]\nglobal_batch_size = 96\nlr = 1\ndecay = "cosine"\n'
                    'trackers = ["tensorboard", "mlflow"]\nmax_steps = 50\n')
    config = configfile.configure(lockstep.TrainConfig(), toml,
                                  ["trainer.lr=0.05", "max_steps=none", "precision=bf16",
                                   "trackers=tensorboard", "progress=false"])
    assert (config.global_batch_size, config.lr, config.decay) == (96, 0.05, "cosine")
    assert config.max_steps is None and config.precision == "bf16"
    assert config.trackers == ("tensorboard",) and config.progress is False
    assert isinstance(configfile.configure(lockstep.TrainConfig(), toml).lr, float)  # 1 -> 1.0


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.learning_rate=0.1", "has no field 'learning_rate'"),
    ("epochs=two", "epochs: expected int, got 'two'"),
    ("epochs=1.5", "epochs: expected int, got 1.5"),
    ("progress=1", "progress: expected bool, got 1"),
    ("lr", "expected KEY=VALUE"),
])
def test_a_wrong_name_or_type_is_an_error_naming_the_field(override: str, message: str) -> None:
    with pytest.raises(configfile.ConfigError, match=message):
        configfile.configure(lockstep.TrainConfig(), None, [override])


def test_config_files_are_data_never_code(tmp_path: Path) -> None:
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps({"run_dir": "__import__('os').system('touch pwned')"}))
    config = configfile.configure(lockstep.TrainConfig(), evil)
    assert config.run_dir.startswith("__import__")  # a string, kept as a string
    assert not Path("pwned").exists()
    (tmp_path / "bad.toml").write_text("lr = [")
    with pytest.raises(configfile.ConfigError, match=r"bad\.toml"):
        configfile.load_file(tmp_path / "bad.toml")


def test_trackers_named_must_exist_and_be_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown tracker 'neptune'"):
        lockstep.TrainConfig(trackers=("neptune",)).validate()
    monkeypatch.setattr(trackers, "available", lambda module: module != "wandb")
    with pytest.raises(ValueError, match="'wandb', which is not installed: pip install wandb"):
        lockstep.TrainConfig(trackers=("tensorboard", "wandb")).validate()


def test_a_missing_optional_piece_is_reported_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lockstep.training.optional").addHandler(handler)
    monkeypatch.setattr(optional, "_reported", set())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    monkeypatch.setattr(trackers, "available", lambda module: module != "tensorboard")
    try:
        for attempt in range(2):
            log = RunLog(tmp_path / f"run{attempt}", True, 10, 0, progress=False, config={})
            log.record("train", 1, loss=1.0)
            log.close()
            assert lockstep.training.runlog.plot_run(tmp_path / f"run{attempt}") is None
    finally:
        logging.getLogger("lockstep.training.optional").removeHandler(handler)
    assert records == [
        "skipped tensorboard logging: pip install tensorboard (or 'lockstep[plots]')",
        "skipped training.png: pip install matplotlib (or 'lockstep[plots]')"]
    assert not (tmp_path / "run0/tensorboard").exists()


def test_a_tensorboard_that_does_not_import_is_reported_not_fatal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed (found) but broken: it was on by default and crashed rank 0's fit()."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lockstep.training.optional").addHandler(handler)
    monkeypatch.setattr(optional, "_reported", set())
    monkeypatch.setattr(trackers, "available", lambda module: True)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import fails
    try:
        assert trackers.open_trackers(("tensorboard",), tmp_path, {}) == []
    finally:
        logging.getLogger("lockstep.training.optional").removeHandler(handler)
    assert len(records) == 1 and records[0].startswith(
        "skipped tensorboard logging: it is installed but does not import"), records


def test_the_png_has_its_titled_panels_and_the_config(tmp_path: Path) -> None:
    """Four panels; six for a run that recorded a step timeline (its attribution)."""
    pytest.importorskip("matplotlib", reason="the PNG is matplotlib's; 'make setup' installs it")
    log = RunLog(tmp_path / "run", True, 20, 0, progress=False,
                 config={"global_batch_size": 64, "lr": 0.003, "seed": 0, "mode": "sync"},
                 trackers=())
    for step in range(1, 21):
        log.record("train", step, loss=2.0 / step, lr=0.003 * min(1, step / 5),
                   samples_per_s=1000.0 + step)
    log.record("eval", 20, loss=0.2, accuracy=0.9)
    log.close()
    from lockstep.training import plots

    assert plots.config_line(tmp_path / "run") == "global_batch_size=64, lr=0.003, seed=0"
    figure = plots.plot_run(tmp_path / "run")
    assert figure is not None and figure.stat().st_size > 20_000
    assert plots.panel_titles(tmp_path / "run") == ["loss", "test accuracy", "learning rate",
                                                    "throughput"]
    with (tmp_path / "run" / "metrics.jsonl").open("a") as metrics:  # a run with a timeline
        for step in (10, 20):
            metrics.write(json.dumps({
                "kind": "timeline", "step": step, "timeline_step_ms": 50.0 + step,
                "timeline_hidden": 0.4, "timeline_slowest": 1, "timeline_behind": 0.25,
                "timeline_cause": "its data loading"}) + "\n")
    assert plots.panel_titles(tmp_path / "run")[4:] == ["step time",
                                                        "communication and stragglers"]
    small = figure.stat().st_size
    assert plots.plot_run(tmp_path / "run") == figure and figure.stat().st_size > small


def test_lockstep_plot_0_leaves_the_picture_out(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="the PNG is matplotlib's; 'make setup' installs it")
    from lockstep.training import plots

    log = RunLog(tmp_path, True, 20, 0, progress=False,
                 config={"global_batch_size": 64, "lr": 0.003, "seed": 0, "mode": "sync"},
                 trackers=())
    log.record("train", 1, loss=1.0)
    log.close()
    monkeypatch.setenv(plots.ENV, "0")
    plots.plot_at_end(tmp_path)
    assert not (tmp_path / "training.png").exists()
    monkeypatch.setenv(plots.ENV, "1")
    plots.plot_at_end(tmp_path)
    assert (tmp_path / "training.png").stat().st_size > 10_000


def test_mlflow_logs_the_config_and_metrics_offline_to_a_file_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip(
        "mlflow", reason="MLflow is an optional tracker (pip install mlflow); not in [dev]: "
        "it brings ~60 packages")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets; undone after
    run_dir = tmp_path / "run"
    log = RunLog(run_dir, True, 10, 0, progress=False, config={"lr": 0.1, "seed": 3,
                 "max_steps": None}, trackers=("mlflow",))
    log.record("train", 5, loss=0.5)
    log.record("eval", 10, loss=0.25, accuracy=0.75)
    log.close()
    client = mlflow.tracking.MlflowClient((run_dir / "mlruns").resolve().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    assert run.data.params == {"lr": "0.1", "seed": "3", "max_steps": "None"}
    assert run.data.metrics == {"train/loss": 0.5, "eval/loss": 0.25, "eval/accuracy": 0.75}
    assert run.info.status == "FINISHED"


def test_nested_configs_from_a_file_and_dotted_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "diloco.toml"
    toml.write_text('[trainer]\nlr = 0.01\n[trainer.parallel]\nmode = "diloco"\n'
                    'sync_every = 20\n[trainer.checkpoint]\nevery_steps = 100\n')
    config = configfile.configure(lockstep.TrainConfig(), toml,
                                  ["trainer.parallel.outer_lr=0.5", "checkpoint.resume=never"])
    assert config.parallel == lockstep.DiLoCoConfig(sync_every=20, outer_lr=0.5)
    assert config.checkpoint == lockstep.CheckpointConfig(every_steps=100, resume="never")
    switched = configfile.configure(config, None, ["parallel.mode=sync",
                                                   "parallel.algorithm=ring"])
    assert switched.parallel == lockstep.SyncConfig(algorithm="ring")
    with pytest.raises(configfile.ConfigError, match="mode must be one of"):
        configfile.configure(config, None, ["parallel.mode=gossip"])
    with pytest.raises(configfile.ConfigError, match="has no field 'sync_every'"):
        configfile.configure(lockstep.TrainConfig(), None, ["parallel.sync_every=3"])
    record = json.loads(json.dumps(configfile.as_record(config)))
    assert configfile.apply(lockstep.TrainConfig(), record, "record") == config


def test_a_mode_and_its_fields_are_set_in_one_command_in_any_order() -> None:
    """`--set trainer.parallel.sync_every=20` on a sync config needs the mode: given in the
    same command, before or after, it is applied first; missing, the error says so."""
    want = lockstep.LocalSGDConfig(sync_every=20)
    for overrides in (["trainer.parallel=local_sgd", "trainer.parallel.sync_every=20"],
                      ["trainer.parallel.sync_every=20", "trainer.parallel=localsgd"],
                      ["trainer.parallel.sync_every=20", "trainer.parallel.mode=local-sgd"]):
        assert configfile.configure(lockstep.TrainConfig(), None, overrides).parallel == want
    diloco = configfile.configure(lockstep.TrainConfig(), None, [
        "parallel.outer_lr=0.5", "parallel.mode=diloco", "parallel.sync_every=5"]).parallel
    assert diloco == lockstep.DiLoCoConfig(sync_every=5, outer_lr=0.5)
    with pytest.raises(configfile.ConfigError, match=r"SyncConfig has no field 'sync_every'; "
                       r"modes local_sgd, diloco and streaming_diloco have it: choose the "
                       r"mode too, e\.g\. "
                       r"--set trainer\.parallel\.mode=local_sgd"):
        configfile.configure(lockstep.TrainConfig(), None, ["trainer.parallel.sync_every=20"])
