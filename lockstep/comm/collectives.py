"""The one module that calls torch.distributed collectives.

Everything above it says *what* to communicate; this says *how*, and turns every failure
into an error that names the rank, what it was waiting for, and who is behind.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lockstep.comm import packing, stophook, waits
from lockstep.comm.failures import CollectiveError, explain_failure
from lockstep.comm.ledger import ledger

Group = dist.ProcessGroup | None


def rank_of(group: Group = None) -> int:
    return dist.get_rank(group)


def size_of(group: Group = None) -> int:
    return dist.get_world_size(group)


def device_of(group: Group = None) -> torch.device:
    """Where the group's collective inputs must live: this rank's GPU under NCCL, which
    takes no CPU tensors, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_tensor(values: Sequence[float] | Sequence[int], group: Group = None,
                   dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A small tensor of flags, counts or norms to agree on through a collective, made on
    the group's device (see device_of)."""
    return torch.tensor(list(values), dtype=dtype, device=device_of(group))


class Pending:
    """An asynchronous collective and what it is, for the error message if it fails."""

    __slots__ = ("collective", "record", "started", "what", "works")

    def __init__(self, work: dist.Work | Sequence[dist.Work], what: str,
                 collective: bool = True) -> None:
        self.works = list(work) if isinstance(work, Sequence) else [work]
        self.what, self.started = what, time.monotonic()
        self.collective = collective  # (a send or receive is waited on whole: waits.py)
        last = ledger.last  # what _run just issued for it, if the watchdog is on
        self.record = last if last is not None and last.label == what else None

    def wait(self) -> None:
        try:
            for work in self.works:
                if self.collective:
                    waits.wait(work, self.what, self.started, self.record)
                else:
                    work.wait()
        except waits.Abandoned as error:  # (it says why; a stall report would not)
            raise CollectiveError(str(error)) from None
        except Exception as error:
            raise explain_failure(self.what, error, self.started, self.record) from error


_POINT_TO_POINT = (dist.isend, dist.irecv, dist.send_object_list, dist.recv_object_list)
# (not numbered: ranks send different counts; args[1] is the partner)


def _run(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    partner = args[1] if fn in _POINT_TO_POINT else None
    if stophook.armed is not None and partner is None and kwargs.get("group") is None:
        stophook.run_armed()
    record = ledger.issue(what, kwargs.get("group"), partner)
    started = time.monotonic()
    try:
        result = fn(*args, **kwargs)
    except CollectiveError:
        raise
    except Exception as error:
        raise explain_failure(what, error, started, record) from error
    ledger.launched(record, result)
    return result


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: Group) -> dist.Work:
    """`dist.all_reduce(tensor, op, group, async_op=True)`, straight to the process group,
    as torch's DDP launches its buckets from C++. Of what torch's Python does before the
    same call, only the complex case applies to what lockstep sums (a complex model's
    buckets: NCCL has no complex type, so their real view is summed); the rest -- a
    torch-function dispatch, the checks for a non-tensor, a rank outside the group, a
    coalescing context -- cannot, on lockstep's own tensors and groups, and it cost
    ~50-90 us a call on this machine."""
    if tensor.is_complex():  # (SUM only: a complex number has no max)
        tensor = torch.view_as_real(tensor)
    options = dist.AllreduceOptions()
    options.reduceOp = op  # type: ignore[assignment]  # (torch assigns it so too)
    options.asyncOp = True
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg.allreduce([tensor], options)


def all_reduce_async(tensor: torch.Tensor, what: str, group: Group = None) -> Pending:
    """Start summing `tensor` in place across the group; `.wait()` on the result."""
    return Pending(_run(what, _all_reduce, tensor, dist.ReduceOp.SUM, group=group), what)


def all_reduce(tensor: torch.Tensor, what: str, group: Group = None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    Pending(_run(what, _all_reduce, tensor, op, group=group), what).wait()
    return tensor


def _global(rank_in_group: int, group: Group) -> int:
    """torch's broadcast takes its source as a global rank; lockstep passes group ranks."""
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


def broadcast(tensor: torch.Tensor, src: int, what: str, group: Group = None) -> torch.Tensor:
    """Overwrite `tensor` with that of rank `src` (a rank within `group`)."""
    work = _run(what, dist.broadcast, tensor, src=_global(src, group), group=group,
                async_op=True)
    Pending(work, what).wait()
    return tensor


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, what: str,
                      group: Group = None) -> None:
    """Overwrite `tensors` with rank `src`'s values: one broadcast per dtype, not per tensor."""
    for same_dtype in _by_dtype(tensors):
        flat = _flatten_dense_tensors([t.detach() for t in same_dtype])
        broadcast(flat, src, what, group)
        _copy_back(flat, same_dtype)


def send_tensors(tensors: Sequence[torch.Tensor], dst: int, what: str) -> None:
    """Send `tensors` to rank `dst` alone, one message per dtype; `dst` calls recv_tensors
    with tensors of the same shapes and dtypes, in the same order."""
    for same_dtype in _by_dtype(tensors):
        send(_flatten_dense_tensors([t.detach() for t in same_dtype]), dst, what)


def recv_tensors(tensors: Sequence[torch.Tensor], src: int, what: str) -> None:
    """Overwrite `tensors` with what rank `src` sent with send_tensors."""
    for same_dtype in _by_dtype(tensors):
        flat = _flatten_dense_tensors([t.detach() for t in same_dtype])  # (its size, dtype)
        recv(flat, src, what)
        _copy_back(flat, same_dtype)


def send_packed(obj: Any, tensors: Sequence[torch.Tensor], dst: int, what: str) -> None:
    """Send picklable `obj` and `tensors` (on any device) to rank `dst` alone, through a
    CPU group, in two messages -- their size, then one buffer of both (packing.py) --
    where send_object and send_tensors make two and one per dtype, each a round trip with
    the receiver. `dst` calls recv_packed."""
    sizes, payload = packing.pack(obj, tensors)
    works = [isend(sizes, dst, what), isend(payload, dst, what)]  # (no wait in between)
    for work in works:
        work.wait()


def recv_packed(src: int, what: str, allow: Sequence[type] = ()
                ) -> tuple[Any, list[torch.Tensor]]:
    """`obj` and the tensors (on the CPU) that rank `src` sent with send_packed; `obj`
    unpickled as data only, and instances of the classes in `allow` (packing.py)."""
    sizes = packing.sizes_buffer()
    recv(sizes, src, what)
    payload = packing.payload_buffer(sizes)
    recv(payload, src, what)
    return packing.unpack(sizes, payload, allow)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by dtype and device, in first-seen order (alike on every rank)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, value in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            t.copy_(value)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, what: str,
                    group: Group = None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0 into `output`, in rank order."""
    all_gather_async(output, tensor, what, group).wait()
    return output


def all_gather_ints(values: Sequence[int], what: str, group: Group = None) -> list[list[int]]:
    """Every rank's `values` (as many on every rank), in rank order: one all-gather of a
    small tensor, where all_gather_object pickles and makes two (its sizes, then its
    bytes) -- a few milliseconds apiece that a wrapper's setup pays several times."""
    mine = control_tensor(values, group, torch.int64)
    every = mine.new_empty(size_of(group) * len(mine))
    all_gather_into(every, mine, what, group)
    return every.view(size_of(group), len(mine)).tolist()


def all_gather_object(obj: Any, what: str, group: Group = None) -> list[Any]:
    """Every rank's `obj`, in rank order. For small metadata only (it pickles)."""
    gathered: list[Any] = [None] * size_of(group)
    _run(what, dist.all_gather_object, gathered, obj, group=group)
    return gathered


def broadcast_object(obj: Any, src: int, what: str, group: Group = None) -> Any:
    """Rank `src`'s `obj` (src a rank within `group`). Small, trusted metadata: it pickles."""
    box = [obj]
    _run(what, dist.broadcast_object_list, box, src=_global(src, group), group=group)
    return box[0]


def send_object(obj: Any, dst: int, what: str) -> None:
    """Send `obj` to rank `dst` alone (small, trusted metadata among the job's ranks: it
    pickles); `dst` calls recv_object."""
    _run(what, dist.send_object_list, [obj], dst)


def recv_object(src: int, what: str) -> Any:
    box = [None]
    _run(what, dist.recv_object_list, box, src)
    return box[0]


def new_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """A process group of `ranks` on the default backend, with the default group's timeout.
    Collective: every rank of the world must call it, in the same order, even those not in
    `ranks`."""
    group = dist.new_group(ranks=list(ranks), timeout=default_timeout())
    assert group is not None
    if dist.get_rank() in ranks and len(ranks) > 1:
        # Gloo connects a group's pairs as each rank gets to them: a rank done connecting
        # could go on and destroy the group (a wrapper built and closed at once) while a
        # slower peer still connects, which then fails ("Connection closed by peer").
        barrier("every rank of a new process group connected", group)
    return group


def default_timeout() -> timedelta | None:
    """The timeout the job gave its default group. torch gives a new group its backend's
    default instead (30 minutes): a hierarchical reduction's cross-host group would wait
    that long for a host that vanished, whatever timeout the job chose."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(device_of())
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):  # private API: fall back to torch's
        return None


def destroy_group(group: Group) -> None:
    """Give back a group from `new_group` once nothing will use it again (local: each rank
    drops its own end). The default group is the world's, not ours to destroy."""
    if group is not None and dist.is_initialized() and \
            group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)


def barrier(what: str, group: Group = None) -> None:
    _run(what, dist.barrier, group=group)


def isend(tensor: torch.Tensor, dst: int, what: str, group: Group = None) -> Pending:
    return Pending(_run(what, dist.isend, tensor, dst, group=group), what, collective=False)


def irecv(tensor: torch.Tensor, src: int, what: str, group: Group = None) -> Pending:
    return Pending(_run(what, dist.irecv, tensor, src, group=group), what, collective=False)


def send(tensor: torch.Tensor, dst: int, what: str, group: Group = None) -> None:
    isend(tensor, dst, what, group).wait()


def recv(tensor: torch.Tensor, src: int, what: str, group: Group = None) -> None:
    irecv(tensor, src, what, group).wait()


def group_ranks(group: Group = None) -> list[int]:
    """The global ranks in `group`, in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def all_gather_async(output: torch.Tensor, tensor: torch.Tensor, what: str,
                     group: Group = None) -> Pending:
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # newer name
    return Pending(_run(what, gather, output, tensor, group=group, async_op=True), what)


def gather_shards_async(flat: torch.Tensor, what: str, group: Group = None) -> Pending:
    """Fill every rank's 1/N slice of `flat` from that rank, in place: this rank's slice
    already holds its own. On Gloo as one broadcast per owner -- its all-gather stages the
    whole output in a fresh buffer and copies it back, which measured 2-2.5x slower here;
    elsewhere the backend's all-gather (its input may alias its own slot)."""
    size, rank = size_of(group), rank_of(group)
    shard = flat.numel() // size
    if dist.get_backend(group) != "gloo":
        return all_gather_async(flat, flat[rank * shard:(rank + 1) * shard], what, group)
    works = [_run(what, dist.broadcast, flat[k * shard:(k + 1) * shard], src=_global(k, group),
                  group=group, async_op=True) for k in range(size)]
    return Pending(works, what)


def all_to_all(output: torch.Tensor, tensor: torch.Tensor, what: str,
               group: Group = None) -> torch.Tensor:
    """Split `tensor` in N equal chunks, send chunk k to rank k; `output` gets every rank's
    chunk for this rank, in rank order."""
    work = _run(what, dist.all_to_all_single, output, tensor, group=group, async_op=True)
    Pending(work, what).wait()
    return output


def reduce_scatter_async(output: torch.Tensor, tensor: torch.Tensor, what: str,
                         group: Group = None) -> Pending | PendingSum:
    """Start summing `tensor` across ranks into this rank's 1/N slice, `output`; it holds
    the sum once `.wait()` returns. On Gloo as an all-to-all and a sum in rank order when
    waited for: Gloo's reduce-scatter sends as much as an all-reduce of the whole tensor
    (measured: ZeRO-2 put 10.9 MB a step on the wire for a 7.2 MB model, where a
    reduce-scatter and a gather need 7.2), an all-to-all each rank only the slices the
    others keep."""
    if dist.get_backend(group) == "gloo":
        received = torch.empty_like(tensor)
        work = _run(what, dist.all_to_all_single, received, tensor, group=group, async_op=True)
        return PendingSum(Pending(work, what), received, output, size_of(group))
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # newer name
    return Pending(_run(what, scatter, output, tensor, group=group, async_op=True), what)


class PendingSum:
    """An all-to-all in flight whose N received chunks are summed into `output` on wait."""

    def __init__(self, pending: Pending, received: torch.Tensor, output: torch.Tensor,
                 size: int) -> None:
        self.pending: Pending | None = pending
        self.received: torch.Tensor | None = received
        self.output, self.size = output, size

    def wait(self) -> None:
        if self.pending is None or self.received is None:  # landed already
            return
        self.pending.wait()
        torch.sum(self.received.view(self.size, -1), dim=0, out=self.output.view(-1))
        # The backend's handle holds its tensors: both go now, not when this one goes.
        self.pending = self.received = None


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, what: str,
                   group: Group = None) -> torch.Tensor:
    """Sum `tensor` across ranks and keep this rank's 1/N slice of the sum in `output`
    (reduce_scatter_async, waited for)."""
    reduce_scatter_async(output, tensor, what, group).wait()
    return output
