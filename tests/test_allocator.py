"""CPU memory freed by a step is kept for the next one (comm/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import resource, torch, lockstep
from torch import nn
lockstep.init()
torch.manual_seed(0)
net = lockstep.shard(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]), 2)
opt = net.make_optimizer(torch.optim.AdamW, lr=1e-4)
x = torch.randn(32, 1024)
def steps(n):
    for _ in range(n):
        opt.zero_grad(); net(x).square().mean().backward(); opt.step()
steps(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps(5)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def faults_per_step(**env: str) -> float:
    """Minor page faults per ZeRO-2 step of an 8.4M-parameter MLP, in a fresh process."""
    mine = {k: v for k, v in os.environ.items()  # this machine's own malloc choices out
            if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "LOCKSTEP_MALLOC")
            and not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={**mine, **env}, timeout=120, check=True)
    return float(done.stdout.split()[-1])


def test_a_step_reuses_the_memory_the_last_one_freed() -> None:
    """ZeRO frees its gradient buckets every step; glibc's default thresholds hand such
    blocks back to the kernel, so each step faults them in again. lockstep.init() keeps
    them (a person's choice wins: LOCKSTEP_MALLOC=system)."""
    kept, system = faults_per_step(), faults_per_step(LOCKSTEP_MALLOC="system")
    assert system > 2000, f"glibc's default no longer faults here ({system:.0f}/step)"
    assert kept < system / 3, (kept, system)
    chosen = faults_per_step(MALLOC_TRIM_THRESHOLD_="131072")  # a person's own setting
    assert chosen > kept * 2, (chosen, kept)
