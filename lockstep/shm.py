"""Tensors that every process on a host can read: the memory behind the "shm" reduction.

Each rank backs each of its buckets with an anonymous memory file (memfd) and the other
ranks on the host map it through /proc/<pid>/fd/<n>. Anonymous files have no name to leak:
the memory lives exactly as long as some process maps it, so it is returned on every exit
path, `kill -9` included, and nothing is ever left in /dev/shm.
"""

from __future__ import annotations

import os

import torch

from lockstep import comm


def shm_available() -> str | None:
    """None if shared buckets work here; otherwise why not."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return "shared-memory reduction needs Linux (memfd_create and /proc)"
    return None


class HostMemory:
    """Allocates host-shared tensors. Collective over `group`: the ranks on this host must
    call `allocate` together, with the same sizes, in the same order."""

    def __init__(self, group: comm.Group) -> None:
        reason = shm_available()
        if reason is not None:
            raise RuntimeError(f"rank {comm.rank_of()}: {reason}")
        self.group = group
        self.local_rank = comm.rank_of(group)
        self.pids = comm.all_gather_object(os.getpid(), "shm: exchange process ids", group)
        self.count = 0

    def allocate(self, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """A zeroed tensor of `numel` elements per rank on the host, in local-rank order;
        entry `local_rank` is this rank's own (the others are its peers', mapped)."""
        nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()
        fd = os.memfd_create(f"lockstep-bucket-{self.count}", os.MFD_CLOEXEC)
        self.count += 1
        try:
            os.ftruncate(fd, nbytes)  # fresh pages read as zeros
            fds = comm.all_gather_object(fd, "shm: exchange bucket files", self.group)
            views = [torch.from_file(f"/proc/{pid}/fd/{peer_fd}", shared=True, size=numel,
                                     dtype=dtype) for pid, peer_fd in zip(self.pids, fds,
                                                                          strict=True)]
            comm.barrier("shm: every rank has mapped the new bucket", self.group)
        finally:
            os.close(fd)  # the mappings keep the memory; no name, nothing to clean up
        return views
