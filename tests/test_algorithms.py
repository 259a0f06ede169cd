"""Every reduction algorithm gives native's averages, at world sizes 2, 3 and 4, on one host
and on emulated hosts (LOCAL_WORLD_SIZE splitting the world), raw and through training; and
the pieces they stand on: host memory's files, a state sent packed to one rank."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import time
from collections.abc import Iterator

import pytest
import torch

import lockstep
from lockstep import comm
from lockstep.comm import shm
from lockstep.comm.topology import check_layout, peers_across_hosts, ranks_on_host
from lockstep.replication.choices import (
    ALGORITHMS,
    fault_tolerant,
    make_algorithm,
    resolve_algorithm,
)
from lockstep.testing import World, collectives_issued
from tests.models import batch, digest, loss_of, make_model, make_optimizer
from tests.test_precision_compression import check_compression

SIZES = (1, 2, 5, 1000, 65_537)  # odd sizes: chunks and slices of unequal length


def usable(world: lockstep.World) -> list[str]:
    one_host = world.local_world_size == world.world_size
    return [a for a in ALGORITHMS if a != "shm" or one_host]


def check_raw_sums() -> dict[str, float]:
    """Sum rank-dependent data of awkward sizes; compare with the exact answer."""
    world = lockstep.init()
    errors = {}
    for name in usable(world):
        algorithm = make_algorithm(name, None, world.local_world_size)
        worst = 0.0
        for numel in SIZES:
            generator = torch.Generator().manual_seed(numel)
            values = torch.randn(world.world_size, numel, generator=generator, dtype=torch.float64)
            flat = algorithm.allocate(numel, torch.float64, torch.device("cpu"))
            flat.copy_(values[world.rank])
            algorithm.all_reduce(flat, f"test bucket of {numel}").wait()
            algorithm.finish([])
            worst = max(worst, (flat - values.sum(0)).abs().max().item())
        algorithm.close()
        errors[name] = worst
    return errors


def check_training() -> dict[str, tuple[float, str]]:
    """Train the transformer with each algorithm; report the gap to native and a digest."""
    world = lockstep.init()
    results: dict[str, tuple[float, str]] = {}
    reference: list[torch.Tensor] = []
    for name in usable(world):
        net = make_model("transformer")
        model = lockstep.DataParallel(net, bucket_mb=0.01, algorithm=name)
        opt = make_optimizer("adamw", model.parameters())
        for step in range(6):
            x, y = batch("transformer", step * world.world_size + world.rank, 8)
            opt.zero_grad()
            if step % 2:  # accumulation composes with every algorithm
                with model.no_sync():
                    loss_of("transformer", model, x[:4], y[:4]).backward()
                loss_of("transformer", model, x[4:], y[4:]).backward()
            else:  # fresh gradients each step: the algorithms' own absorb path
                loss_of("transformer", model, x, y).backward()
            opt.step()
        model.close()
        weights = [t.detach().clone() for t in net.state_dict().values()]
        reference = reference or weights
        gap = max((a - b).abs().max().item() for a, b in zip(weights, reference))
        results[name] = (gap, digest(net))
    return results


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[World]:
    """4 ranks as 2 emulated hosts of 2: hierarchical's cross-host stage is exercised."""
    with World(4, env={"LOCAL_WORLD_SIZE": "2"}) as world:
        yield world


@pytest.fixture(params=["world2", "world3", "world4", "two_hosts"])
def any_world(request: pytest.FixtureRequest) -> World:
    return request.getfixturevalue(request.param)


def test_every_algorithm_sums_exactly(any_world: World) -> None:
    for errors in any_world.run(check_raw_sums):
        assert set(errors) >= {"native", "ring", "tree", "hierarchical"}
        for name, error in errors.items():
            assert error < 1e-12, f"{name}: {error:.2e}"


def test_every_algorithm_trains_like_native(any_world: World) -> None:
    per_rank = any_world.run(check_training)
    for name in per_rank[0]:
        assert max(r[name][0] for r in per_rank) < 1e-5, name
        assert len({r[name][1] for r in per_rank}) == 1, f"{name}: replicas differ"


def check_default_buckets() -> dict[str, list[float]]:
    """Bucket caps left to DataParallel: 25 MB over a network, 4 MB through shared memory
    (cache-sized). Six 2 MB weights, plus the first bucket's 1 MB cap."""
    lockstep.init()
    sizes = {}
    for name in ("native", "shm"):
        net = torch.nn.Sequential(*(torch.nn.Linear(1024, 512, bias=False) for _ in range(6)))
        model = lockstep.DataParallel(net, algorithm=name)
        sizes[name] = model.bucket_sizes_mb()
        model.close()
    return sizes


def test_shm_defaults_to_cache_sized_buckets(world2: World) -> None:
    sizes = world2.run(check_default_buckets)[0]
    assert sizes["native"] == [2.0, 10.0]  # the first bucket, then everything else
    assert sizes["shm"] == [2.0, 4.0, 4.0, 2.0]


def dropped_right_after_allocating(grace_s: float) -> tuple[float, bool]:
    """Rank 1 drops its HostMemory as soon as its allocation returns (a wrapper closed
    right after it was built) while rank 0 is slow to map rank 1's file; then, past the
    grace, a later HostMemory settles. Each rank's reading of the other's memory, and
    whether rank 1's dropped file is closed by then."""
    lockstep.init()
    grace, shm.ORPHAN_GRACE_S = shm.ORPHAN_GRACE_S, grace_s
    try:
        memory = shm.HostMemory(None)
        if comm.rank_of() == 0:
            mapping = memory._map
            memory._map = lambda *args: (time.sleep(0.3), mapping(*args))[1]  # type: ignore[method-assign]
        views = memory.allocate(4, torch.float64)
        views[comm.rank_of()].fill_(comm.rank_of() + 1.0)
        dropped = os.fstat(memory._unsettled[0]).st_ino
        if comm.rank_of() == 1:
            del memory
            gc.collect()
        comm.barrier("both wrote")
        seen = float(views[1 - comm.rank_of()].sum())
        time.sleep(grace_s)
        later = shm.HostMemory(None)
        for _ in range(2):  # the second exchange settles the first (and the orphans due)
            later.allocate(1, torch.int64)
        return seen, dropped not in _open_files()
    finally:
        shm.ORPHAN_GRACE_S = grace  # (the world's processes serve later tests)


def _open_files() -> set[int]:
    """The inodes of this process's open files."""
    found = set()
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed meanwhile by another thread)
            found.add(os.stat(f"/proc/self/fd/{n}").st_ino)
    return found


def test_a_host_memory_dropped_at_once_still_lets_a_slow_peer_map_it_then_closes(
        world2: World) -> None:
    (seen0, _), (seen1, closed1) = world2.run(dropped_right_after_allocating, 0.5)
    assert seen0 == 4 * 2.0 and seen1 == 4 * 1.0  # each read the other's memory
    assert closed1  # the dropped memory's file, closed once the grace had passed


def exchanges_in_a_shm_setup() -> tuple[int, int, bool]:
    """(exchanges of memory files while a shm DataParallel is built, its buckets, whether
    its first step's gradients are the ranks' average)."""
    from lockstep.replication.replica import DataParallel

    lockstep.init()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                 torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    replica = copy.deepcopy(module)  # the same start, summed by plain all-reduces
    with collectives_issued() as labels:
        model = DataParallel(module, bucket_mb=0.01, first_bucket_mb=0.01, algorithm="shm")
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(comm.rank_of()))
    model(x).square().sum().backward()
    replica(x).square().sum().backward()
    expected = [p.grad.clone() for p in replica.parameters()]
    for grad in expected:
        comm.all_reduce(grad, "the reference's gradients")
        grad.div_(comm.size_of())
    averaged = all(torch.allclose(p.grad, e, atol=1e-6)
                   for p, e in zip(module.parameters(), expected, strict=True))
    buckets = len(model.reducer.buckets)
    model.close()
    return labels.count("shm: exchange bucket files"), buckets, averaged


def test_a_shm_wrapper_maps_its_peers_memory_in_one_exchange(world2: World) -> None:
    """Its barrier's flags, the non-finite flags and every bucket: one exchange of memory
    files (one each, before: on a join every member sets up again), and the buckets sum."""
    for exchanges, buckets, averaged in world2.run(exchanges_in_a_shm_setup):
        assert (exchanges, averaged) == (1, True) and buckets >= 3


def odd_tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    grid = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    waves = torch.randn(3, generator=generator, dtype=torch.complex128)
    return [grid.t()[1:3], torch.tensor(5.5), torch.zeros(0), torch.tensor([True, False]),
            torch.arange(7, dtype=torch.int16), waves, waves.conj(),
            torch.arange(10.0)[::2], torch.ones(1).expand(4)]


def sent_packed() -> bool:
    lockstep.init()
    if comm.rank_of() == 0:
        comm.send_packed({"step": 7, "rows": [1, 2]}, odd_tensors(), 1, "a packed state")
        return True
    obj, tensors = comm.recv_packed(0, "a packed state")
    return obj == {"step": 7, "rows": [1, 2]} and all(
        got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        and not got.is_conj() for got, want in zip(tensors, odd_tensors(), strict=True))


def test_state_sent_packed_arrives_whole(world2: World) -> None:
    """A joiner's state in two messages: every dtype, shape and layout (strided and
    expanded views, a scalar, an empty tensor, bools, complex and its conjugate view) bit
    for bit, with the object beside them."""
    assert world2.run(sent_packed) == [True, True]


class _Runs:
    """Unpickled, it would call print: what a crafted state could smuggle in."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return print, ("unpickling ran code",)


def test_a_packed_state_is_unpacked_as_data_only(capsys: pytest.CaptureFixture[str]) -> None:
    """A joiner unpickles rank 0's state as data: numbers, containers, dtypes, an RNG's
    numpy state and the classes it names come back; anything else is refused unrun."""
    import collections
    import pickle
    import random

    import numpy as np

    from lockstep.comm import packing

    state = {"step": 3, "order": collections.OrderedDict(a=1.5), "dtype": torch.float64,
             "python": random.getstate(), "numpy": np.random.get_state(), "at": {2, 3}}
    obj, tensors = packing.unpack(*packing.pack(state, [torch.arange(3.0)]))
    assert obj["step"] == 3 and obj["dtype"] is torch.float64 and obj["at"] == {2, 3}
    assert obj["python"] == state["python"] and np.array_equal(obj["numpy"][1],
                                                              state["numpy"][1])
    assert torch.equal(tensors[0], torch.arange(3.0))
    with pytest.raises(pickle.UnpicklingError, match=r"names builtins\.print"):
        packing.unpack(*packing.pack({"step": 3, "hook": _Runs()}, []))
    assert "unpickling ran code" not in capsys.readouterr().out


def check_shm_across_hosts_is_refused() -> str:
    world = lockstep.init()
    try:
        make_algorithm("shm", None, world.local_world_size)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_shm_across_hosts_is_a_clear_error(two_hosts: World) -> None:
    for rank, message in enumerate(two_hosts.run(check_shm_across_hosts_is_refused)):
        assert f"rank {rank}:" in message and "algorithm='hierarchical'" in message


def zero_default_algorithms() -> list[str]:
    lockstep.init()
    picked = [lockstep.shard(make_model("mlp"), 2).algorithm,
              lockstep.shard(make_model("mlp"), 2, wire="bf16").algorithm]
    with fault_tolerant():  # as fault tolerance builds it
        picked.append(lockstep.shard(make_model("mlp"), 1).algorithm)
    try:
        lockstep.shard(make_model("mlp"), 3, algorithm="shm")
        picked.append("shm accepted")
    except ValueError as error:
        picked.append(str(error))
    return picked


def test_zero_gathers_through_host_memory_by_default_where_the_ranks_share_one(
        world2: World, two_hosts: World) -> None:
    """ZeRO's algorithm="auto": shared memory where every rank is on one host (as NCCL uses
    it inside a node), the backend where a wire is compressed, shards are mirrored for
    fault tolerance, or the job spans hosts -- where "shm" asked for is refused."""
    for picked in world2.run(zero_default_algorithms):
        assert picked == ["shm", "native", "native", "shm accepted"]
    for rank, picked in enumerate(two_hosts.run(zero_default_algorithms)):
        assert picked[:3] == ["native"] * 3
        assert picked[3].startswith(f"rank {rank}: ZeRO with algorithm='shm' (stage 3): it "
                                    "shares shards through one host's memory, and this job "
                                    "spans 2 hosts"), picked[3]


def replica_default_algorithms() -> list[object]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    lockstep.init()
    picked: list[object] = []

    def wrap(**kwargs: object) -> lockstep.DataParallel:
        model = lockstep.DataParallel(make_model("mlp"), **kwargs)
        picked.append(model.algorithm)
        return model

    wrap().close()
    wrap(compress="bf16").close()
    with fault_tolerant():  # as Elastic builds it: shm too, where the job is on one host
        wrap().close()
    wrap(process_group=torch.distributed.group.WORLD).close()  # DDP's keyword, all ranks
    # Parameters off the CPU on one rank only: every rank still picks alike (no hang)
    device = torch.device("meta" if torch.distributed.get_rank() == 1 else "cpu")
    picked.append(resolve_algorithm("auto", None, None, device))
    six = torch.nn.Sequential(*(torch.nn.Linear(1024, 512, bias=False) for _ in range(6)))
    model = lockstep.SyncConfig().build(six)
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # replaces auto's choice
    picked += [model.algorithm, model.bucket_sizes_mb()]
    model.close()
    try:
        wrap(algorithm="shm").register_comm_hook(None, default_hooks.allreduce_hook)
    except ValueError as error:  # the user's own choice is not replaced
        picked.append(str(error))
    return picked


def test_data_parallel_reduces_through_host_memory_by_default_where_the_ranks_share_one(
        world2: World, two_hosts: World) -> None:
    """DataParallel's algorithm="auto", as ZeRO's: shm where every rank is on one host's
    CPU -- a fault-tolerant job's too -- native where a wire is compressed, a process group
    is given, a rank's parameters are off the CPU (every rank then picks native), or the
    job spans hosts. A DDP comm hook replaces auto's choice (with DDP's 25 MB bucket cap),
    not the user's."""
    for picked in world2.run(replica_default_algorithms):
        assert picked[:7] == ["shm", "native", "shm", "native", "native", "comm hook",
                              [2.0, 10.0]], picked
        assert "already has a way (shm" in str(picked[-1]), picked
    for picked in two_hosts.run(replica_default_algorithms):
        assert picked[:6] == ["native"] * 5 + ["comm hook"], picked
        assert "algorithm='hierarchical'" in str(picked[-1]), picked  # shm refused


def test_hierarchical_compresses_the_cross_host_leg(two_hosts: World) -> None:
    """The README's SyncConfig(algorithm="hierarchical", compress="bf16"): summed exactly
    inside each host, in bf16 between them -- so within bf16's precision of the exact
    average, not equal to it, at half the bytes (issue 28, finding 12: it was refused in
    every worker)."""
    for compress, precision in (("bf16", 2 ** -7), ("fp16", 2 ** -10)):
        for worst, best, ratio in two_hosts.run(check_compression, compress, "hierarchical"):
            assert best > 0 and worst < precision and ratio == 2.0, (compress, worst, best)


def test_combinations_that_cannot_work_are_refused_when_the_config_is_built() -> None:
    """Before any worker starts: SyncConfig validates itself as it is made."""
    assert lockstep.SyncConfig(algorithm="hierarchical", compress="bf16").compress == "bf16"
    with pytest.raises(ValueError, match=r"shm sums through memory.*algorithm='hierarchical'"):
        lockstep.SyncConfig(algorithm="shm", compress="bf16")
    for compressor in (lockstep.PowerSGD(), lockstep.TopK()):
        with pytest.raises(ValueError, match=r"need the whole bucket.*compress='bf16' or 'fp16'"):
            lockstep.SyncConfig(algorithm="hierarchical", compress=compressor)
    with pytest.raises(ValueError, match="one of auto, native, ring, tree, shm, hierarchical"):
        lockstep.SyncConfig(algorithm="butterfly")
    with pytest.raises(ValueError, match="compress must be None, 'bf16'"):
        lockstep.SyncConfig(compress=3)


def check_refused_at_wrap_time() -> str:
    """The same refusal from DataParallel, on every rank, before any group is made."""
    lockstep.init()
    try:
        lockstep.DataParallel(make_model("mlp"), algorithm="shm", compress="fp16")
    except ValueError as error:
        return str(error)
    return "accepted"


def test_refused_combinations_are_refused_at_wrap_time_too(world2: World) -> None:
    assert all("shm sums through memory" in m for m in world2.run(check_refused_at_wrap_time))


def check_group_timeouts() -> tuple[float, list[float]]:
    """The default group's timeout, and that of every group a hierarchical replica made."""
    import torch.distributed as dist

    lockstep.init()
    default = dist.distributed_c10d._get_default_group()
    model = lockstep.DataParallel(make_model("mlp"), algorithm="hierarchical")
    timeouts = sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                       for g in dist.distributed_c10d._world.pg_map if g is not default})
    model.close()
    return default._get_backend(torch.device("cpu")).options._timeout.total_seconds(), timeouts


def test_the_groups_lockstep_makes_keep_the_jobs_timeout(two_hosts: World) -> None:
    """torch gives a new group 30 minutes; a cross-host group must fail at the job's timeout
    when a host vanishes (found with a host cut off the network under elastic training)."""
    for default, made in two_hosts.run(check_group_timeouts):
        assert made == [default] and default < 60, (default, made)


def test_topology_planning() -> None:
    assert ranks_on_host(1, 3) == [3, 4, 5]
    assert peers_across_hosts(1, hosts=3, local_world_size=2) == [1, 3, 5]
    with pytest.raises(ValueError, match="whole number of hosts"):
        check_layout(6, 4)


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError, match="one of auto, native, ring, tree, shm, hierarchical"):
        make_algorithm("butterfly", None, 1)


class Float64Sum(lockstep.AllReduce):
    """A user's own reduction, one class: sum each bucket in float64 on the wire."""

    name = "float64"

    def all_reduce(self, flat: torch.Tensor, label: str) -> lockstep.replication.reduction.Handle:
        wide = flat.double()
        torch.distributed.all_reduce(wide)
        flat.copy_(wide)
        return lockstep.replication.reduction.Done()


def check_user_reduction() -> float:
    world = lockstep.init()
    ours, native = make_model("transformer"), make_model("transformer")
    models = [lockstep.DataParallel(ours, bucket_mb=0.01, reduction=Float64Sum()),
              lockstep.DataParallel(native, bucket_mb=0.01)]
    opts = [make_optimizer("adamw", m.parameters()) for m in models]
    for step in range(4):
        x, y = batch("transformer", step * world.world_size + world.rank, 8)
        for model, opt in zip(models, opts):
            loss_of("transformer", model, x, y).backward()
            opt.step()
            opt.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(ours.parameters(),
                                                          native.parameters()))


def test_a_user_defined_reduction_trains_like_native(world: World) -> None:
    assert max(world.run(check_user_reduction)) < 1e-5
