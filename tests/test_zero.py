"""ZeRO stages 1-3: the same training as one process, the promised memory, clear refusals."""

from __future__ import annotations

import itertools
import time
from contextlib import nullcontext

import pytest
import torch

import lockstep
from lockstep.replication.nonfinite import NonFiniteGradientError
from lockstep.sharding.staging import Staging
from lockstep.sharding.zero import padded, plan_units, shard_range
from lockstep.testing import World, collectives_issued
from tests.models import batch, digest, loss_of, make_model

STEPS, PER_RANK = 15, 8
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}


def train_stage(kind: str, stage: int, optimizer: str, accumulate: int,
                clip: float | None = None, algorithm: str = "native") -> tuple[float, str]:
    world = lockstep.init()
    rank, n = world.rank, world.world_size
    net, reference = make_model(kind), make_model(kind)
    model = lockstep.shard(net, stage, bucket_mb=0.004, first_bucket_mb=0.004,
                           algorithm=algorithm) if stage \
        else lockstep.DataParallel(net, bucket_mb=0.004, first_bucket_mb=0.004)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt, ref_opt = model.make_optimizer(cls, **kwargs), cls(reference.parameters(), **kwargs)
    if stage:  # shards of a few hundred elements: stepped in pieces (pieces.py)
        opt.stepping.piece_numel = 128
    if algorithm == "shm":
        reduce_in_pieces_read_late(model.zero_groups[0].host.staging, rank == n - 1)
    for step in range(STEPS):
        x, y = batch(kind, step, PER_RANK * n)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        for i, (mx, my) in enumerate(zip(x[mine].chunk(accumulate), y[mine].chunk(accumulate))):
            with nullcontext() if i == accumulate - 1 else model.no_sync():
                (loss_of(kind, model, mx, my) / accumulate).backward()
        if clip is not None:
            if stage:
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if algorithm == "shm" and rank == n - 1:  # a late writer: the others must wait for
            time.sleep(0.02)                      # its shards before gathering them
        opt.step()
        ref_opt.zero_grad()
        loss_of(kind, reference, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
    gaps = []
    for g in getattr(model, "zero_groups", []):  # stage 3: gather to compare the parameters
        g.materialize()
        lockstep.comm.all_gather_into(g.flat, g.shard_param.detach().clone(), "test gather")
    for p, q in zip(net.parameters(), reference.parameters()):
        gaps.append((p - q).abs().max().item())
    return max(gaps), digest(net, parameters_only=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_like_one_process(world: World, stage: int) -> None:
    for optimizer in OPTIMIZERS:
        for accumulate in (1, 2):
            results = world.run(train_stage, "transformer", stage, optimizer, accumulate)
            worst = max(r[0] for r in results)
            assert worst < 5e-5, f"stage {stage} {optimizer} x{accumulate}: {worst:.2e}"
            assert len({r[1] for r in results}) == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shards_gathered_through_host_memory_train_like_one_process(world: World,
                                                                    stage: int) -> None:
    """algorithm="shm": every gather a copy from the host's shared shards, read only once
    every rank has written them (the step is bracketed by host barriers)."""
    for optimizer, accumulate in (("adamw", 1), ("sgd", 2)):
        results = world.run(train_stage, "transformer", stage, optimizer, accumulate,
                            None, "shm")
        worst = max(r[0] for r in results)
        assert worst < 5e-5, f"stage {stage} {optimizer} x{accumulate}: {worst:.2e}"
        assert len({r[1] for r in results}) == 1


def reduce_in_pieces_read_late(staging: Staging, late: bool) -> None:
    """Gradients summed through host memory in pieces of 40 elements, so that a bucket
    takes several and the slots are reused within it; on the `late` rank every third
    barrier returns 2 ms late, so its peers write their next piece while it has yet to read
    this one (one slot, or a missing barrier, would have them overwrite what it reads)."""
    staging.piece = dict.fromkeys(staging.piece, 40)
    if not late:
        return
    wait, calls = staging.barrier.wait, itertools.count()

    def wait_then_dawdle(what: str, in_backward: bool = False) -> None:
        wait(what, in_backward)
        if next(calls) % 3 == 0:
            time.sleep(0.002)
    staging.barrier.wait = wait_then_dawdle  # type: ignore[method-assign]


class Mixed(torch.nn.Module):
    """A float64 layer and a float32 one, each with a loss of its own (so the float64
    gradients owe nothing to float32 arithmetic): ZeRO's groups come in two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x.double()).square().mean() + self.head(x).square().mean().double()


def train_mixed(stage: int) -> list[float]:
    """Three SGD steps through host memory, against one process on the global batch:
    each parameter's largest difference, relative to its dtype's epsilon."""
    world = lockstep.init()
    net, reference = Mixed(), Mixed()
    model = lockstep.shard(net, stage, algorithm="shm")
    opt = model.make_optimizer(torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    x = torch.randn(4 * world.world_size, 8, generator=torch.Generator().manual_seed(1))
    mine = x[world.rank * 4:(world.rank + 1) * 4]
    for _ in range(3):
        opt.zero_grad()
        model(mine).backward()
        opt.step()
        ref_opt.zero_grad()
        reference(x).backward()
        ref_opt.step()
    whole = model.full_state_dict()
    return [((whole[name] - q).abs().max() / torch.finfo(q.dtype).eps).item()
            for name, q in reference.state_dict().items()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_of_each_dtype_are_summed_in_their_own(world2: World, stage: int) -> None:
    """Through host memory each dtype has slots of its own: a float64 gradient is never
    rounded to float32 on its way (it was, when the slots took the first group's dtype)."""
    for gaps in world2.run(train_mixed, stage):
        assert max(gaps) < 64, gaps


def load_then_evaluate() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Stage 3, algorithm="shm": the last rank writes its shards late, as a checkpoint's
    load does (bracketed), then every rank evaluates."""
    from lockstep.sharding.hostshards import writing_shards

    world = lockstep.init()
    model = lockstep.shard(make_model("mlp"), 3, algorithm="shm")
    x, _ = batch("mlp", 0, 4)
    with torch.no_grad():
        before = model(x)
        with writing_shards(model.zero_groups, "a test's load"):
            if world.rank == world.world_size - 1:
                time.sleep(0.05)
            for g in model.zero_groups:
                g.shard_param.mul_(0.5)
        after = model(x)
    refused = []
    for kwargs in ({"wire": "int8"}, {"algorithm": "ring"}):
        try:
            lockstep.shard(make_model("mlp"), 2, **{"algorithm": "shm", **kwargs})
        except ValueError as error:
            refused.append(str(error))
    return before, after, refused


def test_a_forward_after_a_load_reads_every_ranks_new_shards(world: World) -> None:
    results = world.run(load_then_evaluate)
    for before, after, _ in results:
        assert torch.equal(before, results[0][0])
        assert torch.equal(after, results[0][1])  # every rank computed with the new weights
        assert not torch.equal(after, before)
    refused = results[0][2]
    assert len(refused) == 2
    assert "wire='int8': nothing crosses a network" in refused[0]
    assert "algorithm= is 'auto', 'native' or 'shm'" in refused[1] and "'ring'" in refused[1]


def steps_on_one_host(stage: int, algorithm: str = "shm") -> tuple[list[str], str]:
    """What the second step waited on (the ledger records every collective and host
    barrier), and the error of the third, whose input holds a NaN on the last rank."""
    world = lockstep.init()
    model = lockstep.shard(make_model("mlp"), stage, algorithm=algorithm, bucket_mb=0.004,
                           first_bucket_mb=0.004)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-2)
    labels: list[str] = []
    for step in range(1, 4):
        x, y = batch("mlp", step * world.world_size + world.rank, 8)
        if step == 3 and world.rank == world.world_size - 1:
            x[0, 0] = float("nan")
        with collectives_issued() as issued:
            try:
                loss_of("mlp", model, x, y).backward()
            except NonFiniteGradientError as caught:
                return labels, str(caught)
            opt.step()
            opt.zero_grad()
        if step == 2:  # (the first step also builds the optimizer's state)
            labels = issued
    return labels, ""


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_one_host_a_step_waits_on_no_socket_and_a_nan_still_stops_it(world2: World,
                                                                         stage: int) -> None:
    """Gradients and the non-finite flags are summed through host memory: a step waits only at
    barriers there (each named for what it waits for), and a NaN on one rank still stops
    every rank at that step, naming the rank."""
    for rank, (labels, error) in enumerate(world2.run(steps_on_one_host, stage)):
        assert labels and all(label.startswith("ZeRO (shm): ") for label in labels), \
            [label for label in labels if not label.startswith("ZeRO (shm): ")]
        assert sum("before its " in label for label in labels) >= 3  # reduce-scatter/all-reduce
        assert f"rank {rank}: synchronised backward 3:" in error and "rank(s) [1]" in error


@pytest.mark.parametrize("stage", [1, 2])
def test_over_sockets_stage_1_carries_the_flags_in_its_last_bucket(world2: World,
                                                                    stage: int) -> None:
    """Stage 1 all-reduces whole buckets, so the flags ride in the last one (an exchange of
    their own cost 1 ms a step); stage 2's reduce-scatter sums only shards: they need one.
    Either way a NaN on one rank stops every rank, naming it."""
    for rank, (labels, error) in enumerate(world2.run(steps_on_one_host, stage, "native")):
        exchanges = [label for label in labels if "non-finite gradient flags" in label]
        assert len(exchanges) == (0 if stage == 1 else 1), labels
        assert f"rank {rank}: synchronised backward 3:" in error and "rank(s) [1]" in error


def write_after_step(stage: int) -> str:
    """Stages 1-2, algorithm="shm", where the shared memory is the parameters: each rank
    writes them in place right after the step (as clamping or an EMA swap does) while the
    last rank is slow to copy the others' shards."""
    world = lockstep.init()
    rank, n = world.rank, world.world_size
    model = lockstep.shard(make_model("mlp"), stage, algorithm="shm")
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    if rank == n - 1:
        host = model.zero_groups[0].host
        copy = host.gather
        host.gather = lambda g: (time.sleep(0.02), copy(g))
    for step in range(4):
        x, y = batch("mlp", step, 4 * n)
        opt.zero_grad()
        loss_of("mlp", model, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
        with torch.no_grad():
            for p in model.module.parameters():
                p.mul_(0.9)
    return digest(model.module, parameters_only=True)


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_written_after_the_step_stay_alike_with_shared_shards(world2: World,
                                                                        stage: int) -> None:
    assert len(set(world2.run(write_after_step, stage))) == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_by_the_global_norm_is_exact_when_sharded(world3: World, stage: int) -> None:
    results = world3.run(train_stage, "mlp", stage, "sgd", 1, 0.5)  # 0.5: it clips
    assert max(r[0] for r in results) < 5e-5


def test_shard_arithmetic_pads_for_any_world_size() -> None:
    for numel in (1, 7, 10, 12):
        for n in (1, 2, 3, 4):
            full = padded(numel, n)
            assert full % n == 0 and 0 <= full - numel < n
            covered = [i for r in range(n) for i in range(full)[shard_range(full, r, n)]]
            assert covered == list(range(full))


def test_units_are_layers_and_tied_weights_have_one_owner() -> None:
    units = plan_units(make_model("transformer"))
    names = [n for unit in units for n in unit]
    assert len(names) == len(set(names))  # each parameter once
    assert ["embed.weight"] in units      # tied to head.weight: owned by the embedding
    assert not any("head" in n or "position" in n for n in names)  # tied, and frozen


def check_needs_whole_tensors() -> str:
    lockstep.init()
    model = lockstep.shard(make_model("mlp"), 1)
    try:
        model.make_optimizer(lockstep.LAMB, lr=1e-3)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_lamb_and_lars_are_refused_under_zero(world2: World) -> None:
    for rank, message in enumerate(world2.run(check_needs_whole_tensors)):
        assert f"rank {rank}: LAMB needs each parameter whole" in message


def live_tensor_bytes() -> int:
    """Every tensor storage alive in this process, each counted once -- less the other
    ranks' shards mapped here (ZeRO's default on one host shares them: theirs to count)."""
    import gc

    from lockstep.comm.shm import peers_storages

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    peers = peers_storages()
    return sum(n for ptr, n in storages.items() if ptr not in peers)


def check_memory(stage: int) -> tuple[dict[str, int], int, int]:
    """Model state after one AdamW step on a 10M-parameter model: by memory_report, and by
    counting live storages (less those that existed before the model)."""
    world = lockstep.init()
    import gc

    gc.collect()
    before = live_tensor_bytes()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1000, 1000) for _ in range(10)])
    model = lockstep.shard(net, stage) if stage else lockstep.DataParallel(net)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    x = torch.randn(4, 1000)
    model(x).square().mean().backward()
    opt.step()
    del x
    gc.collect()
    report = lockstep.memory_report(model, opt)
    counted = live_tensor_bytes() - before
    params = sum(p.numel() for p in net.parameters())
    model.close()
    return report, counted, params * world.world_size  # params x N: for the formula


# Between steps: stage 1 holds no gradient (its buckets are freed once the step has taken its
# shard), stage 2 its shard of the gradient, stage 3 every part of model state in shards.
FORMULAS = {1: lambda n: 4 + 8 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 16 / n}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_model_state_memory_matches_the_zero_formulas(size: int, stage: int,
                                                      request: pytest.FixtureRequest) -> None:
    world = request.getfixturevalue(f"world{size}")
    for report, counted, params_times_n in world.run(check_memory, stage):
        expected = FORMULAS[stage](size) * params_times_n / size
        assert sum(report.values()) == pytest.approx(expected, rel=0.05), report
        assert counted == pytest.approx(expected, rel=0.05)


def train_and_checkpoint(stage: int, root: str, save_after: int | None, load: bool,
                         steps: int, algorithm: str = "native") -> list[torch.Tensor]:
    """Train the transformer; save after `save_after` steps or start from the checkpoint;
    return the parameters' fingerprint after each step that follows."""
    world = lockstep.init()
    rank, n = world.rank, world.world_size
    buckets = {"bucket_mb": 0.004, "first_bucket_mb": 0.004}
    net = make_model("transformer")
    model = lockstep.shard(net, stage, algorithm=algorithm, **buckets) if stage else \
        lockstep.DataParallel(net, **buckets)  # type: ignore[arg-type]
    opt = model.make_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    start = 0
    if load:
        folder = lockstep.training.checkpoint.latest_valid(root)
        start = lockstep.training.checkpoint.load(folder, model, opt)["step"]
    prints = []
    for step in range(start, start + steps):
        x, y = batch("transformer", step, 24)  # a global batch of 24 at any world size
        share = 24 // n
        opt.zero_grad()
        loss_of("transformer", model, x[rank * share:(rank + 1) * share],
                y[rank * share:(rank + 1) * share]).backward()
        opt.step()
        if save_after is not None and step + 1 == save_after:
            lockstep.training.checkpoint.save(root, step + 1, model, opt, {})
        if step + 1 > (save_after or start):
            prints.append(_whole_parameters(model))
    return prints


def _whole_parameters(model: lockstep.DataParallel) -> torch.Tensor:
    """The whole parameters, flattened (gathered first at stage 3)."""
    for g in getattr(model, "zero_groups", []):
        if model.stage == 3:
            g.materialize()
            lockstep.comm.all_gather_into(g.flat, g.shard_param.detach().clone(), "gather")
    values = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()
                        if p.requires_grad])
    for g in getattr(model, "zero_groups", []):
        if model.stage == 3:
            g.release()
    return values.clone()


def test_a_stage3_checkpoint_from_3_ranks_continues_at_stage1_on_2(world2: World,
                                                                   world3: World,
                                                                   tmp_path) -> None:
    root = str(tmp_path / "ck")
    original = world3.run(train_and_checkpoint, 3, root, 5, False, 8)[0]  # steps 6, 7, 8
    for stage, algorithm in ((1, "native"), (0, "native"), (2, "native"), (3, "shm")):
        moved = world2.run(train_and_checkpoint, stage, root, None, True, 3, algorithm)[0]
        for after, expected in zip(moved, original, strict=True):  # each of the 3 steps
            gap = (after - expected).abs().max().item()
            assert gap < 5e-5, \
                f"stage 3 on 3 ranks -> stage {stage} ({algorithm}) on 2: {gap:.1e}"


def check_trainer_sharded(run_dir: str, stage: int) -> tuple[str, list[torch.Tensor]]:
    """The Trainer with ShardConfig: its summary's fingerprint comes from the whole weights
    (gathered at stage 3, where the module alone holds none)."""
    from tests.test_trainer import config, digit_sets, sgd

    train_set, test_set = digit_sets()
    parallel = lockstep.ShardConfig(stage=stage) if stage else lockstep.SyncConfig()
    trainer = lockstep.Trainer(make_model("mlp"), sgd, train_set, test_set,
                               config=config(run_dir, max_steps=6, parallel=parallel))
    summary = trainer.fit()
    whole = trainer.model.full_state_dict()
    assert summary["fingerprint"] == lockstep.fingerprint(whole)
    return summary["fingerprint"], list(whole.values())


def test_the_trainer_shards_from_its_config(world2: World, tmp_path) -> None:
    _, plain = world2.run(check_trainer_sharded, str(tmp_path / "plain"), 0)[0]
    for stage in (1, 3):
        _, sharded = world2.run(check_trainer_sharded, str(tmp_path / f"s{stage}"), stage)[0]
        assert max((a - b).abs().max().item() for a, b in zip(plain, sharded)) < 5e-5


def train_frozen(stage: int) -> tuple[float, bool]:
    """A layer with a frozen bias beside its trainable weight, and a wholly frozen layer:
    the rest trains as one process would, the frozen parameters stay as they were."""
    world = lockstep.init()
    rank, n = world.rank, world.world_size
    net, reference = make_model("mlp"), make_model("mlp")
    for m in (net, reference):
        m[0].bias.requires_grad_(False)
        m[2].requires_grad_(False)
    frozen = {k: v.clone() for k, v in net.state_dict().items() if k in ("0.bias", "2.weight")}
    model = lockstep.shard(net, stage, bucket_mb=0.004, first_bucket_mb=0.004)
    cls, kwargs = OPTIMIZERS["sgd"]
    opt, ref_opt = model.make_optimizer(cls, **kwargs), cls(reference.parameters(), **kwargs)
    for step in range(5):
        x, y = batch("mlp", step, PER_RANK * n)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        loss_of("mlp", model, x[mine], y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of("mlp", reference, x, y).backward()
        ref_opt.step()
    state = model.full_state_dict()
    model.close()
    gap = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return gap, all(torch.equal(state[k], v) for k, v in frozen.items())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_parameters_stay_and_the_rest_trains_like_one_process(world: World,
                                                                      stage: int) -> None:
    """Before, stage 3 failed when sharding: KeyError for the frozen bias (gather.py)."""
    for gap, unchanged in world.run(train_frozen, stage):
        assert gap < 5e-5 and unchanged


class WithTemperature(torch.nn.Module):
    """A layer and a learned scalar (shape []): its optimizer state is one element too."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(6, 5)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) / self.temperature


def consolidate_round_trip(stage: int) -> float:
    """Save the optimizer whole, load it back, save it again: the largest difference. Rank 1
    holds its state's keys in the reverse order (a dict's order is this process's history):
    every gather must still pair like with like."""
    from lockstep.sharding.consolidate import load_whole_state_dict, whole_state_dict

    world = lockstep.init()
    torch.manual_seed(0)
    net = WithTemperature()
    model = lockstep.shard(net, stage)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = list(net.parameters())
    saved = whole_state_dict(optimizer, params)
    for state in optimizer.inner.state.values():  # emptied, then refilled by the load
        state.clear()
    load_whole_state_dict(optimizer, params, saved)
    if world.rank == 1:
        for p, state in list(optimizer.inner.state.items()):
            optimizer.inner.state[p] = dict(reversed(list(state.items())))
    again = whole_state_dict(optimizer, params)
    model.close()
    return max((saved["state"][i][k] - again["state"][i][k]).abs().max().item()
               for i in saved["state"] for k in saved["state"][i])


@pytest.mark.parametrize("stage", [2, 3])
def test_the_whole_optimizer_state_survives_a_round_trip(world2: World, stage: int) -> None:
    """sharding/consolidate.py (Lightning's checkpoints under ZeRO): exact, the scalar
    parameter's momenta included."""
    assert world2.run(consolidate_round_trip, stage) == [0.0, 0.0]


def reduce_scatter_landing() -> tuple[list[float], bool, list[float]]:
    world = lockstep.init()
    whole = torch.arange(8, dtype=torch.float64) * (world.rank + 1)
    mine = torch.empty(4, dtype=torch.float64)
    handle = lockstep.comm.reduce_scatter_async(mine, whole, "test reduce-scatter")
    handle.wait()
    landed = mine.tolist()
    released = getattr(handle, "received", None) is None and \
        getattr(handle, "pending", None) is None
    mine.zero_()
    handle.wait()  # again: nothing is summed into `mine` a second time
    return landed, released, mine.tolist()


def test_an_asynchronous_reduce_scatter_lands_once_and_lets_go_of_its_buffers(
        world2: World) -> None:
    """ZeRO-2/3 keep a bucket's handle until backward's end; on Gloo the backend's handle
    holds the whole bucket and the received chunks, so landing must drop it (else every
    bucket's buffers live through backward: a whole gradient again)."""
    results = world2.run(reduce_scatter_landing)
    assert results[0][0] == [0.0, 3.0, 6.0, 9.0] and results[1][0] == [12.0, 15.0, 18.0, 21.0]
    assert all(released and again == [0.0] * 4 for _, released, again in results)
