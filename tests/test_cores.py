"""A host's cores shared among the job's workers on it (lockstep/cores.py), and who decides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lockstep.cores import AUTO_THREADS, HOST_CORES
from lockstep.launch.elastic import worker_env
from lockstep.launch.run import LaunchSpec

# In a process of its own: torch's thread count is the process's.
SHARING = """
import torch
from lockstep import cores
seen = []
for workers in (3, 2):
    cores.share_cores(workers)
    seen.append(torch.get_num_threads())
torch.set_num_threads(1)  # the script's own choice
cores.share_cores(3)
seen.append(torch.get_num_threads())
print(*seen)
"""


def shared(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (AUTO_THREADS, "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", SHARING], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_worker_takes_its_share_again_but_keeps_a_scripts_own_choice() -> None:
    """6 cores: 2 threads each of 3 workers, 3 each of 2; once the script set its own (1),
    a later change of membership leaves it."""
    assert shared({HOST_CORES: "6", "OMP_NUM_THREADS": "1", AUTO_THREADS: "1"}) == "2 3 1"


def test_threads_the_user_chose_are_never_shared_again() -> None:
    assert shared({HOST_CORES: "6", "OMP_NUM_THREADS": "1"}) == "1 1 1"


@pytest.mark.parametrize("user", [None, "", "3"])
def test_the_elastic_launcher_says_when_the_threads_are_its_choice(
        user: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_CORES, "8")
    monkeypatch.setenv(AUTO_THREADS, "5")  # inherited (a launch from a worker): not ours
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    env = worker_env(LaunchSpec(nproc=2, target="train.py"), "127.0.0.1:1", "host", 0)
    if user == "3":
        assert env["OMP_NUM_THREADS"] == "3" and AUTO_THREADS not in env
    else:
        assert env["OMP_NUM_THREADS"] == env[AUTO_THREADS] == "4"
