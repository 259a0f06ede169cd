"""The reductions users choose by name: an algorithm, maybe wrapped by a compressor -- and
which of those choices combine (`check_combination`, asked by SyncConfig.validate when
the config is built and again when a model is wrapped)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from lockstep import comm
from lockstep.comm.shm import peers_mappable, why_not_host_memory
from lockstep.comm.topology import Topology, check_layout
from lockstep.comm.world import current
from lockstep.replication.algorithms import AllReduce, Native, Ring, Tree
from lockstep.replication.compress import Cast, Compression, make_compression
from lockstep.replication.hostreduce import Hierarchical, SharedMemory
from lockstep.replication.reduction import Reduction

ALGORITHMS = ("auto", "native", "ring", "tree", "shm", "hierarchical")

FAULT_TOLERANT: ContextVar[bool] = ContextVar("lockstep_fault_tolerant", default=False)
"""Whether the wrapper built now is a fault-tolerant job's (Elastic sets it around the
`wrap` it is given): ZeRO then mirrors each rank's shard on the next (mirror=None) without
being told. (DataParallel's "auto" picks as in any job: shm's barriers fail at once when a
peer dies or leaves, and give up as the backend's waits do when one left the group alive.)"""


@contextlib.contextmanager
def fault_tolerant() -> Iterator[None]:
    token = FAULT_TOLERANT.set(True)
    try:
        yield
    finally:
        FAULT_TOLERANT.reset(token)


def resolve_algorithm(requested: str, compress: Any, group: comm.Group,
                      device: torch.device | None = None) -> str:
    """The algorithm "auto" (the default) stands for: "shm" where every rank of the job
    shares one host's memory on CPU and nothing asks for a network -- as NCCL carries a
    node's traffic through shared memory, not its sockets: a Gloo all-reduce of a few
    floats takes ~1.4 ms on this machine, a flag in shared memory 0.5 us -- and "native"
    (the backend's all-reduce) wherever a wire is compressed, a process group is given,
    the ranks span hosts, the parameters live on `device` other than the CPU, or the host
    forbids mapping a peer's memory. Collective (one all-gather) unless the job's settings
    alone say native, so every rank picks alike. Under lockstep.Elastic each membership's
    wrapper picks again: a job down to one host's workers takes shm from its next regroup."""
    if requested != "auto":
        return requested
    if compress is not None or group is not None or comm.size_of(group) == 1 \
            or current().num_hosts > 1:  # the job's settings: the same on every rank
        return "native"
    eligible = why_not_host_memory(group, "buckets") is None and \
        (device is None or device.type == "cpu")
    return "shm" if peers_mappable(group, eligible) else "native"


def check_combination(algorithm: str, compress: Any) -> Compression | None:
    """Refuse, with the reason, an algorithm and a compressor that cannot work together;
    return the compressor `compress` names. Pure: no process group is needed, so a config
    is checked when it is built, before any worker starts."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    compression = make_compression(compress)
    if compression is None or algorithm == "auto":  # auto with a compressor is native
        return compression
    if algorithm == "shm":
        raise ValueError(
            f"algorithm='shm' with compress={compress!r}: shm sums through memory the host's "
            "ranks share, so nothing crosses a network for compression to shrink (it would "
            "only round the gradients). Use shm without compress=, or "
            "algorithm='hierarchical' with compress='bf16' or 'fp16' on several hosts: it "
            "compresses the cross-host leg only")
    if algorithm == "hierarchical" and not isinstance(compression, Cast):
        raise ValueError(
            f"algorithm='hierarchical' with compress={compress!r}: hierarchical sends each "
            "bucket between hosts as one slice per local rank, and PowerSGD (which factors "
            "whole matrices) and TopK (which ranks a whole bucket's entries) need the whole "
            "bucket. Use compress='bf16' or 'fp16' with hierarchical (the cross-host leg "
            "travels in 16 bits), or PowerSGD/TopK over algorithm='native', 'ring' or 'tree'")
    return compression


def make_algorithm(name: str, group: comm.Group, local_world_size: int,
                   wire: Cast | None = None) -> AllReduce:
    """Build the named algorithm (hierarchical with `wire`: its cross-host leg cast to
    16 bits). Collective: creates process groups on every rank."""
    check_combination(name, wire)
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
    topology = Topology.build(comm.rank_of(), comm.size_of(), local_world_size,
                              host_only=name == "shm")
    timeout_s = current().timeout.total_seconds()
    if name == "shm":
        return SharedMemory(topology, timeout_s)
    return Hierarchical(topology, timeout_s, wire.dtype if wire is not None else None)


def make_reduction(algorithm: str, compress: Any, group: comm.Group,
                   local_world_size: int) -> Reduction:
    """The named algorithm, wrapped by the compressor if one is asked for. Collective:
    creates process groups on every rank. Combinations that cannot work are refused
    before any group is made (`check_combination`)."""
    compression = check_combination(algorithm, compress)
    algorithm = resolve_algorithm(algorithm, compress, group)
    if algorithm == "hierarchical":  # compression belongs to its cross-host leg alone
        wire = compression if isinstance(compression, Cast) else None
        return make_algorithm(algorithm, group, local_world_size, wire=wire)
    reduction = make_algorithm(algorithm, group, local_world_size)
    if compression is None:
        return reduction
    try:
        compression.wrap(reduction, comm.size_of(group))
    except ValueError:
        reduction.close()
        raise
    return compression


Config = TypeVar("Config", bound=type)


def refusing(**reasons: str) -> Callable[[Config], Config]:
    """A config class decorator: a keyword that other modes take but this one cannot (a
    ShardConfig's compress=) is refused with the reason and what to use instead, rather
    than Python's bare "unexpected keyword argument"."""
    def decorate(cls: Config) -> Config:
        init = vars(cls)["__init__"]  # the dataclass's own

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for name, reason in reasons.items():
                if name in kwargs:
                    raise ValueError(f"{cls.__name__} takes no {name}=: {reason}")
            init(self, *args, **kwargs)

        __init__.__doc__, __init__.__wrapped__ = init.__doc__, init  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[misc]
        return cls
    return decorate
