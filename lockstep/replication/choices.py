"""The reductions users choose by name: an algorithm, maybe wrapped by a compressor."""

from __future__ import annotations

from typing import Any

from lockstep import comm
from lockstep.comm.topology import Topology, check_layout
from lockstep.comm.world import current
from lockstep.replication.algorithms import AllReduce, Native, Ring, Tree
from lockstep.replication.compress import make_compression
from lockstep.replication.hostreduce import Hierarchical, SharedMemory
from lockstep.replication.reduction import Reduction

ALGORITHMS = ("native", "ring", "tree", "shm", "hierarchical")


def make_algorithm(name: str, group: comm.Group, local_world_size: int) -> AllReduce:
    """Build the named algorithm. Collective: creates process groups on every rank."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {name!r}")
    if name == "native":
        return Native(group)
    if name in ("ring", "tree"):
        own = comm.new_group(comm.group_ranks(group))  # its p2p traffic apart from the rest
        return Ring(own) if name == "ring" else Tree(own)
    if group is not None:
        raise ValueError(f"the {name} algorithm spans the whole job; it does not take a group")
    check_layout(comm.size_of(), local_world_size)
    hosts = comm.size_of() // local_world_size
    if name == "shm" and hosts > 1:
        raise ValueError(f"rank {comm.rank_of()}: shm reduces within one host, and this job "
                         f"spans {hosts}; use algorithm='hierarchical' (shm inside hosts, the "
                         "network between them)")
    topology = Topology.build(comm.rank_of(), comm.size_of(), local_world_size)
    timeout_s = current().timeout.total_seconds()
    return SharedMemory(topology, timeout_s) if name == "shm" else \
        Hierarchical(topology, timeout_s)


def make_reduction(algorithm: str, compress: Any, group: comm.Group,
                   local_world_size: int) -> Reduction:
    """The named algorithm, wrapped by the compressor if one is asked for. Collective:
    creates process groups on every rank. Combinations that cannot work are refused here
    (a compressor over an algorithm that sums only its own buffers)."""
    reduction = make_algorithm(algorithm, group, local_world_size)
    compression = make_compression(compress)
    if compression is None:
        return reduction
    try:
        compression.wrap(reduction, comm.size_of(group))
    except ValueError:
        reduction.close()
        raise
    return compression
