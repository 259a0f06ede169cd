"""Freed memory kept for reuse on the CPU, as a GPU's caching allocator keeps it.

lockstep frees memory every step by design -- ZeRO's gradient buckets once reduce-
scattered, stage 3's gathered parameters once used, stage 1's gradients after the step --
and autograd makes every gradient afresh. On CUDA the caching allocator hands the same
memory back the next time. On the CPU torch allocates from the C library, and glibc's
malloc serves each block above its mmap threshold (128 KB at start, raised as such blocks
are freed, to 32 MB at most) with fresh pages from the kernel and unmaps it when freed, so
every step faults its tens of megabytes in again: measured on the 8.4M-parameter MLP of
benchmarks/zero.py (2 ranks), 15,000-16,000 minor faults a step (61-64 MB) with
DataParallel and ZeRO-2, none with the thresholds below.

`keep_freed_memory()` asks glibc to serve blocks up to 32 MB from its heap and to give
the heap's top back to the kernel only past 1 GB free: the process's resident size then
stays near its peak (up to a GB of freed memory per malloc arena is kept), as a GPU
caching allocator's reservation does; processes it forks afterwards (DataLoader workers)
inherit the setting. It leaves alone a process whose allocation a person chose: malloc
settings in GLIBC_TUNABLES or MALLOC_*_ variables, an allocator preloaded (jemalloc,
tcmalloc, mimalloc), or LOCKSTEP_MALLOC=system.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> str:
    """Set glibc's thresholds (process-wide) unless someone chose otherwise. Returns what
    was done, for the log."""
    if os.environ.get("LOCKSTEP_MALLOC", "").lower() == "system":
        return "left as the system's (LOCKSTEP_MALLOC=system)"
    if "malloc" in os.environ.get("GLIBC_TUNABLES", "") or \
            any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return "left as GLIBC_TUNABLES or MALLOC_*_ sets it"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc...
        return "left to the preloaded allocator"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (musl, macOS do not)
    except (OSError, AttributeError, TypeError):  # (TypeError: Windows has no CDLL(None))
        return "left as it is (not glibc)"
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "left as it is (glibc refused the thresholds)"
    return "freed blocks up to 32 MB kept for reuse (LOCKSTEP_MALLOC=system: glibc's default)"
