"""Communication: who this process is in the job (world.py), and the one place that calls
torch.distributed's collectives (collectives.py, whose functions this package re-exports as
`lockstep.comm.all_reduce` and so on), with the diagnostics that name a stalled rank, the
hosts' layout (topology.py) and host-shared memory (shm.py). Depends on nothing else in
lockstep but its logging."""

from lockstep.comm.collectives import (
    CollectiveError,
    Group,
    Pending,
    all_gather_async,
    all_gather_into,
    all_gather_ints,
    all_gather_object,
    all_reduce,
    all_reduce_async,
    all_to_all,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_tensors,
    control_tensor,
    destroy_group,
    device_of,
    gather_shards_async,
    group_ranks,
    irecv,
    isend,
    new_group,
    rank_of,
    recv,
    recv_object,
    recv_tensors,
    reduce_scatter,
    reduce_scatter_async,
    send,
    send_object,
    send_tensors,
    size_of,
)

__all__ = [
    "CollectiveError",
    "Group",
    "Pending",
    "all_gather_async",
    "all_gather_into",
    "all_gather_ints",
    "all_gather_object",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_tensors",
    "control_tensor",
    "destroy_group",
    "device_of",
    "gather_shards_async",
    "group_ranks",
    "irecv",
    "isend",
    "new_group",
    "rank_of",
    "recv",
    "recv_object",
    "recv_tensors",
    "reduce_scatter",
    "reduce_scatter_async",
    "send",
    "send_object",
    "send_tensors",
    "size_of",
]

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
