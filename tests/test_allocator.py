"""CPU memory freed by a step is kept for the next one (comm/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import torch, lockstep
lockstep.init()
block = torch.empty(4 << 20)  # 16 MB, as a gradient bucket or a layer's gradient
where = block.data_ptr()
for line in open("/proc/self/maps"):
    fields = line.split()
    low, high = (int(v, 16) for v in fields[0].split("-"))
    if low <= where < high:
        print(fields[5] if len(fields) > 5 else "a mapping of its own")
"""


def where_a_16mb_block_lives(**env: str) -> str:
    """In a fresh process after lockstep.init(): the memory region holding a new 16 MB
    tensor -- glibc's heap (kept and reused once freed) or a mapping of its own (handed
    back to the kernel when freed, faulted in afresh next time)."""
    mine = {k: v for k, v in os.environ.items()  # this machine's own malloc choices out
            if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "LOCKSTEP_MALLOC")
            and not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={**mine, **env}, timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_blocks_a_step_frees_come_from_the_heap_that_keeps_them() -> None:
    """ZeRO frees its gradient buckets every step; glibc's defaults give such blocks a
    mapping of their own, unmapped when freed, so each step faults them in again (15,600
    faults a step measured for ZeRO-2 of benchmarks/zero.py's MLP; 1 with the heap). After
    lockstep.init() they come from the heap, which keeps freed memory; a person's choice
    wins: LOCKSTEP_MALLOC=system, or glibc's own MALLOC_*_ settings. (Read from the
    process's memory map, not from fault counts: the kernel's own reclaim moves those.)"""
    assert where_a_16mb_block_lives() == "[heap]"
    assert where_a_16mb_block_lives(LOCKSTEP_MALLOC="system") == "a mapping of its own"
    assert where_a_16mb_block_lives(MALLOC_TRIM_THRESHOLD_="131072") == "a mapping of its own"
