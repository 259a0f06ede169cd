"""Kill -9 a worker mid-epoch, re-run the same command: the run resumes from its last
checkpoint and ends bitwise where an uninterrupted run ends, with no sample of the
interrupted epoch skipped or trained on twice. Real launches, a real SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("resumable_job.py")
LOCKSTEP = Path(sys.executable).parent / "lockstep"
STEPS_PER_EPOCH, GLOBAL_BATCH = 30, 48


def command(run_dir: Path, delay: float) -> list[str]:
    return [str(LOCKSTEP), "run", "-n", "2", str(JOB), str(run_dir), str(delay)]


def fingerprint(output: str) -> str:
    return next(line.split()[1] for line in output.splitlines()
                if line.startswith("FINGERPRINT"))


def effective_samples(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the samples that step trained on, over both ranks. A step re-run after the
    resume overwrites the record its killed first attempt left."""
    per_step: dict[int, dict[int, list[int]]] = {}
    for rank in (0, 1):
        for line in (run_dir / f"samples-rank{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            per_step.setdefault(row["step"], {})[rank] = row["indices"]
    return {step: sorted(i for ids in ranks.values() for i in ids)
            for step, ranks in per_step.items()}


def kill_mid_epoch(run_dir: Path, at_step: int) -> subprocess.CompletedProcess[str]:
    job = subprocess.Popen(command(run_dir, delay=0.15), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    # Generous: only a guard against a hang. Under load the whole test took 100 s; a 60 s
    # wait for step 10 could expire, and the kill then found no pid file.
    deadline = time.monotonic() + 300
    progress = run_dir / "step-rank0"
    try:
        while not (progress.exists() and progress.read_text() and
                   int(progress.read_text()) >= at_step):
            assert job.poll() is None and time.monotonic() < deadline, f"no step {at_step}"
            time.sleep(0.05)
        os.kill(int((run_dir / "pid-rank1").read_text()), signal.SIGKILL)
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


@pytest.mark.timeout(900)  # three launches: 100 s under load; the default is 300 s
def test_kill_9_then_rerun_resumes_exactly(tmp_path: Path) -> None:
    # The uninterrupted run goes alongside the paced one that is killed (its pauses leave
    # the cores to it)
    whole = subprocess.Popen(command(tmp_path / "whole", 0.0), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        crashed = kill_mid_epoch(tmp_path / "crashed", at_step=10)
        out, err = whole.communicate(timeout=240)
    finally:
        if whole.poll() is None:
            whole.kill()
    reference = subprocess.CompletedProcess(whole.args, whole.returncode, out, err)
    assert reference.returncode == 0, reference.stderr
    assert crashed.returncode != 0
    assert "SIGKILL" in crashed.stderr and "worker rank 1" in crashed.stderr
    killed_at = int((tmp_path / "crashed/step-rank0").read_text())
    assert killed_at < STEPS_PER_EPOCH, "the kill must land in the middle of epoch 0"

    resumed = subprocess.run(command(tmp_path / "crashed", 0.0), capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    # The newest checkpoint at or before the kill (every 4 steps; the one at the kill's own
    # step may or may not have been completed when the kill landed).
    resumed_at = int(re.search(r"resumed from .*step-(\d+)", resumed.stdout).group(1))
    assert resumed_at % 4 == 0 and killed_at - 8 < resumed_at <= killed_at
    assert fingerprint(resumed.stdout) == fingerprint(reference.stdout)

    samples = effective_samples(tmp_path / "crashed")
    assert sorted(samples) == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert samples == effective_samples(tmp_path / "whole")
    interrupted_epoch = [i for step in range(1, STEPS_PER_EPOCH + 1) for i in samples[step]]
    assert len(interrupted_epoch) == STEPS_PER_EPOCH * GLOBAL_BATCH
    assert sorted(interrupted_epoch) == list(range(1440))  # every sample exactly once
