"""Ctrl-C on `lockstep run` and bad launcher arguments: one line each, never a traceback.
Real launches; the interrupt is a real SIGINT to the launcher's process group, as a
terminal sends it."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import lockstep
from lockstep.launch import cli
from lockstep.training import jobnote

BIN = Path(sys.executable).parent

JOB = textwrap.dedent("""
    import sys, time, torch, lockstep
    from torch.utils.data import TensorDataset
    x = torch.randn(960, 8)
    config = lockstep.TrainConfig(global_batch_size=16, epochs=100, run_dir=sys.argv[1],
                                  checkpoint=lockstep.CheckpointConfig(every_steps=5),
                                  log_every_steps=5)
    trainer = lockstep.Trainer(lambda: torch.nn.Linear(8, 2),
                               lambda p: torch.optim.SGD(p, lr=0.01),
                               TensorDataset(x, (x.sum(1) > 0).long()), config=config,
                               callbacks=[lambda t: time.sleep(0.02)])
    trainer.fit()
""")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def test_ctrl_c_says_once_that_the_job_was_interrupted_and_where_its_checkpoint_is(
        tmp_path: Path) -> None:
    script, run_dir = tmp_path / "job.py", tmp_path / "run"
    script.write_text(JOB)
    job = subprocess.Popen([str(BIN / "lockstep"), "run", "-n", "2", str(script), str(run_dir)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_clean_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(run_dir.glob("checkpoints/step-*"))) < 2:  # one complete, at least
            assert job.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.1)
        os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130
    text = out + err
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert "death signal" not in text
    lines = [line for line in text.replace("\r", "\n").splitlines()
             if line.strip() and not line.startswith("train:")]
    said = [line for line in lines if "interrupted" in line]
    assert len(said) == 1, lines
    assert len(lines) <= 3, lines  # the world's one INFO line, the bar, and ours
    match = re.search(r"interrupted \(Ctrl-C\); the workers were stopped; last checkpoint: "
                      r"(\S+) \(run the same command to resume from it\)", said[0])
    assert match, said[0]
    named = Path(match.group(1))
    assert named.parent == (run_dir / "checkpoints").resolve() and named.is_dir()
    assert (named / "MANIFEST.json").exists() or any(named.iterdir())


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`lockstep ARGV` in this process (argparse ends it with SystemExit)."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return int(stopped.value.code or 0), out, err


def test_bad_launcher_arguments_are_usage_errors_not_tracebacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    cases = {("-n", "0"): "needs at least 1 worker",
             ("-n", "two"): "expected a whole number, got 'two'",
             ("--nnodes", "2"): "--nnodes 2 needs --rdzv-endpoint",
             ("--nnodes", "3:2"): "expected N or MIN:MAX",
             ("--max-restarts", "-1"): "must be 0 or more"}
    for args, expected in cases.items():
        code, out, err = _cli(capsys, "run", *args, str(script))
        assert code == 2, (args, err)
        assert "usage: lockstep run" in err and expected in err, (args, err)
        assert "never run" not in out


def test_version_and_every_option_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(capsys, "--version")[:2] == (0, f"lockstep {lockstep.__version__}\n")
    for command in ("run", "demo", "cluster", "env"):
        code, shown, _ = _cli(capsys, command, "-h")
        assert code == 0 and "usage: lockstep" in shown
        assert not _without_help(shown), f"lockstep {command}: {_without_help(shown)}"


def _without_help(shown: str) -> list[str]:
    """Options in argparse's help output with no help text: neither on their own line
    (after two spaces) nor on the indented line below."""
    lines = shown.splitlines() + [""]
    return [line.strip() for line, below in itertools.pairwise(lines)
            if re.match(r"^  -", line) and not re.match(r"^  \S.*?\s{2,}\S", line)
            and not re.match(r"^ {10,}\S", below)]


def test_env_reports_versions_backends_and_the_torchrun_environment(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("MASTER_PORT", "29512")
    assert cli.main(["env"]) == 0
    shown = capsys.readouterr().out
    assert f"lockstep: {lockstep.__version__}" in shown and f"torch: {torch.__version__}" in shown
    assert "distributed backends built: gloo" in shown and "cores usable: " in shown
    assert "  MASTER_PORT=29512" in shown and "  tqdm: " in shown


def test_a_new_checkpoint_note_replaces_the_old_one_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher reads the note at Ctrl-C, the moment a worker may be writing it: the
    note is renamed into place, never truncated and rewritten (CI once read it empty)."""
    note = tmp_path / "note"
    monkeypatch.setenv(jobnote.ENV, str(note))
    jobnote.checkpoint_written(tmp_path / "step-5", resumes=True)
    with note.open() as reader_of_the_old_note:
        jobnote.checkpoint_written(tmp_path / "step-10", resumes=False)
        assert reader_of_the_old_note.read() == f"1 {(tmp_path / 'step-5').resolve()}"
    assert jobnote.last_checkpoint(note) == (str((tmp_path / "step-10").resolve()), False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["note"]
