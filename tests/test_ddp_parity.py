"""Where torch's DistributedDataParallel gives the right answer, lockstep gives the same one.

Each check trains lockstep's DataParallel and torch's DDP (or a single process on the global
batch) side by side in the same Gloo world, on the ways DDP's users drive it: re-wrapping,
activation checkpointing, create_graph, a backward that bypasses the wrapper, join with
accumulation, modules with nothing to train, and ZeRO-3's state dicts.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import lockstep
from lockstep.testing import World
from tests.models import batch, loss_of, make_model, make_optimizer

PER_RANK = 6


def _mine(x: torch.Tensor, world: lockstep.World) -> torch.Tensor:
    return x[world.rank * PER_RANK:(world.rank + 1) * PER_RANK]


def _grad_gap(a: nn.Module, b: nn.Module) -> float:
    return max((p.grad - q.grad).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True) if p.requires_grad)


def _param_gap(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in
               zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# ---- finding 1: re-wrapping ------------------------------------------------------------------


def check_rewrap() -> dict[str, float | bool]:
    """Drop a wrapper without close(), wrap the same module again: the gradients are
    averaged once, and the dropped wrapper is freed. Wrap again while the first is alive:
    the new one takes over, the old one refuses to run."""
    world = lockstep.init()
    net, reference = make_model("mlp"), make_model("mlp")
    x, y = batch("mlp", 0, PER_RANK * world.world_size)
    first = lockstep.DataParallel(net, bucket_mb=0.004)
    loss_of("mlp", first, _mine(x, world), _mine(y, world)).backward()
    gone = weakref.ref(first)
    del first
    gc.collect()
    net.zero_grad()
    second = lockstep.DataParallel(net, bucket_mb=0.004)
    loss_of("mlp", second, _mine(x, world), _mine(y, world)).backward()
    loss_of("mlp", reference, x, y).backward()
    dropped_gap = _grad_gap(net, reference)
    third = lockstep.DataParallel(net, bucket_mb=0.004)  # `second` is still referenced
    net.zero_grad()
    loss_of("mlp", third, _mine(x, world), _mine(y, world)).backward()
    live_gap = _grad_gap(net, reference)
    try:
        second(x)
        old_refused = False
    except RuntimeError as error:
        old_refused = "superseded" in str(error)
    return {"freed": gone() is None, "dropped_gap": dropped_gap, "live_gap": live_gap,
            "old_refused": old_refused}


def test_rewrapping_averages_once_and_frees_the_old_wrapper(world: World) -> None:
    for result in world.run(check_rewrap):
        assert result["freed"], "a dropped DataParallel was kept alive"
        assert result["dropped_gap"] < 1e-6 and result["live_gap"] < 1e-6, result
        assert result["old_refused"]


# ---- finding 2: SyncBatchNorm ----------------------------------------------------------------


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.bn, self.out = nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


def check_syncbn_empty_batch() -> tuple[bool, float]:
    """Rank 0 holds the whole batch, the others none: statistics and gradients are those
    of one process on that batch (the loss is a sum, so an empty batch adds nothing)."""
    world = lockstep.init()
    net, reference = BNNet(), BNNet()
    model = lockstep.DataParallel(lockstep.convert_sync_batchnorm(net))
    x, y = batch("mlp", 3, 8)
    mine = (x, y) if world.rank == 0 else (x[:0], y[:0])
    out = model(mine[0])
    F.cross_entropy(out, mine[1], reduction="sum").backward()
    (F.cross_entropy(reference(x), y, reduction="sum") / world.world_size).backward()
    finite = bool(torch.isfinite(out).all()) and all(
        bool(torch.isfinite(p.grad).all()) for p in net.parameters())
    return finite, _grad_gap(net, reference)


def check_convert_after_wrapping() -> float:
    """torch's converter may run after wrapping: the SyncBatchNorm layers keep the same
    parameters, so the wrapper still reduces them."""
    world = lockstep.init()
    net, reference = BNNet(), BNNet()
    model = lockstep.DataParallel(net)
    lockstep.convert_sync_batchnorm(net)
    x, y = batch("mlp", 4, PER_RANK * world.world_size)
    loss_of("mlp", model, _mine(x, world), _mine(y, world)).backward()
    loss_of("mlp", reference, x, y).backward()
    return _grad_gap(net, reference)


def test_syncbn_empty_batch_and_conversion_after_wrapping(world: World) -> None:
    for finite, gap in world.run(check_syncbn_empty_batch):
        assert finite and gap < 1e-5, gap
    assert max(world.run(check_convert_after_wrapping)) < 1e-5


# ---- findings 3, 4, 9: create_graph and reentrant checkpointing ------------------------------


class Checkpointed(nn.Module):
    """`where` says which part runs under reentrant checkpointing: the last layer, or every
    trainable layer (with frozen input and output layers, as in a LoRA-style fine-tune
    after Hugging Face's enable_input_require_grads)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.where = where
        self.a, self.b, self.c = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)
        if where == "all":
            self.a.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.where == "all":
            h.requires_grad_(True)  # enable_input_require_grads
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
            return checkpoint(self.c, h, use_reentrant=True)
        h = torch.tanh(self.b(h))
        return checkpoint(self.c, h, use_reentrant=True)


def check_backward_variants() -> dict[str, float]:
    world = lockstep.init()
    x, y = batch("mlp", 5, PER_RANK * world.world_size)
    gaps = {}
    for case in ("checkpoint-last", "checkpoint-all", "create_graph"):
        make = (lambda c=case: Checkpointed(c.split("-")[1])) if "checkpoint" in case \
            else (lambda: make_model("mlp"))
        net, reference = make(), make()
        model = lockstep.DataParallel(net, bucket_mb=0.004)
        create_graph = case == "create_graph"
        for _ in range(2):  # the second step runs on the plan rebuilt in arrival order
            net.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            loss_of("mlp", model, _mine(x, world), _mine(y, world)).backward(
                create_graph=create_graph)
            loss_of("mlp", reference, x, y).backward(create_graph=create_graph)
        gaps[case] = _grad_gap(net, reference)
        model.close()
    return gaps


def test_create_graph_and_reentrant_checkpointing_match_one_process(world: World) -> None:
    for gaps in world.run(check_backward_variants):
        assert all(gap < 1e-6 for gap in gaps.values()), gaps


# ---- finding 5: a backward that bypasses the wrapper -----------------------------------------


def check_bypass(wrapper: str) -> list[float]:
    """Rank 1 adds a loss through `.module` alone: no collective (no hang), and its
    gradient joins the next synchronised step, as in DDP."""
    world = lockstep.init()
    net = make_model("mlp")
    model = DDP(net) if wrapper == "ddp" else lockstep.DataParallel(net)
    x, y = batch("mlp", 6, PER_RANK * world.world_size)
    if world.rank == 1:
        loss_of("mlp", model.module, x[:3], y[:3]).backward()
    loss_of("mlp", model, _mine(x, world), _mine(y, world)).backward()
    return [p.grad.sum().item() for p in net.parameters()]


def test_a_backward_through_module_alone_does_not_reduce(world: World) -> None:
    lockstep_grads = world.run(check_bypass, "lockstep", deadline_s=60)
    ddp_grads = world.run(check_bypass, "ddp")
    for ours, theirs in zip(lockstep_grads, ddp_grads):
        assert ours == pytest.approx(theirs, abs=1e-6)


# ---- finding 6: join, with accumulation, buffers and both divisors --------------------------

JOIN_PATTERNS = list(itertools.product(
    ["short-first", "short-last", "even"],  # which ranks run out early
    [1, 2],                                  # accumulation steps (2: some run out mid-window)
    [True, False],                           # broadcast_buffers
    [True, False],                           # divide_by_initial_world_size
))


def _join_batches(shape: str, rank: int, n: int) -> int:
    counts = {"short-first": [2, 5, 4], "short-last": [5, 4, 1], "even": [3, 3, 3]}[shape]
    return counts[rank] if n == 3 else counts[rank * 2 if rank else 0]


def _train_under_join(wrapper: str, shape: str, accumulate: int, buffers: bool,
                      divide_initial: bool) -> nn.Module:
    world = lockstep.init()
    net = make_model("bn")
    model: nn.Module = DDP(net, broadcast_buffers=buffers) if wrapper == "ddp" else \
        lockstep.DataParallel(net, broadcast_buffers=buffers)
    opt = make_optimizer("sgd", net.parameters())
    with model.join(divide_by_initial_world_size=divide_initial):  # type: ignore[operator]
        for i in range(_join_batches(shape, world.rank, world.world_size)):
            syncs = (i + 1) % accumulate == 0
            with nullcontext() if syncs else model.no_sync():  # type: ignore[operator]
                x, y = batch("bn", 100 * i + world.rank, 5)
                (loss_of("bn", model, x, y) / accumulate).backward()
            if syncs:
                opt.step()
                opt.zero_grad()
    return net


def check_join_patterns() -> list[float]:
    gaps = []
    for pattern in JOIN_PATTERNS:
        ours, theirs = _train_under_join("lockstep", *pattern), _train_under_join("ddp", *pattern)
        gaps.append(_param_gap(ours, theirs))
    return gaps


def test_join_matches_ddp_on_every_pattern(world: World) -> None:
    per_rank = world.run(check_join_patterns, deadline_s=240)
    for index, pattern in enumerate(JOIN_PATTERNS):
        worst = max(gaps[index] for gaps in per_rank)
        assert worst < 1e-6, f"{pattern}: lockstep differs from DDP by {worst:.2e}"


# ---- finding 7: nothing to train -------------------------------------------------------------


def test_a_module_without_trainable_parameters_is_refused() -> None:
    lockstep.init()
    frozen = nn.Linear(4, 4).requires_grad_(False)
    for module in (frozen, nn.ReLU()):
        with pytest.raises(RuntimeError, match="no parameter that requires a gradient"):
            lockstep.DataParallel(module)  # DDP's error type (issue 28, finding 7)
        with pytest.raises(ValueError, match="no parameter that requires a gradient"):
            lockstep.DataParallel(module)  # and the type lockstep raised before


# ---- finding 8: ZeRO-3's state dicts ---------------------------------------------------------


def check_zero3_state_dicts() -> dict[str, object]:
    world = lockstep.init()
    net, plain = make_model("mlp"), make_model("mlp")
    model = lockstep.shard(net, 3)
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    plain_model = lockstep.DataParallel(plain)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = batch("mlp", 7, PER_RANK * world.world_size)
    for m, o in ((model, opt), (plain_model, plain_opt)):
        loss_of("mlp", m, _mine(x, world), _mine(y, world)).backward()
        o.step()
    refusals = []
    for read in (lambda: net.state_dict(), lambda: model.state_dict(),
                 lambda: net[0].state_dict()):
        try:
            read()
            refusals.append("")
        except RuntimeError as error:
            refusals.append(str(error))
    full = model.full_state_dict()
    gap = max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    model.close()  # gives the module its full parameters back
    after_close = max((net.state_dict()[k] - v).abs().max().item()
                      for k, v in plain.state_dict().items())
    dropped = make_model("mlp")
    lockstep.shard(dropped, 3)  # dropped at once, without close()
    gc.collect()
    try:
        dropped(x)
        orphan = ""
    except RuntimeError as error:
        orphan = str(error)
    return {"refusals": refusals, "full_gap": gap, "after_close": after_close,
            "orphan": orphan, "keys": sorted(full) == sorted(plain.state_dict())}


def test_zero3_state_dicts_hold_values_or_say_what_to_call(world: World) -> None:
    for rank, result in enumerate(world.run(check_zero3_state_dicts)):
        for message in result["refusals"]:  # type: ignore[attr-defined]
            assert f"rank {rank}:" in message and "full_state_dict()" in message
        assert result["keys"] and result["full_gap"] < 1e-6 and result["after_close"] < 1e-6
        assert "dropped without close()" in result["orphan"]  # type: ignore[operator]


# ---- finding 1: a dropped wrapper gives back everything it made -------------------------------

LIFETIME_CONFIGS = [{"algorithm": a} for a in ("native", "ring", "tree", "shm", "hierarchical")] \
    + [{"compress": c} for c in ("bf16", "PowerSGD", "TopK")] \
    + [{"zero": z} for z in (1, 2, 3)]


def _live_tensor_bytes() -> int:
    """Bytes of every storage some live tensor in this process uses."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, nn.Parameter):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _wrap_train_drop(config: dict[str, object]) -> weakref.ref[lockstep.DataParallel]:
    world = lockstep.init()
    options = dict(config)
    if options.get("compress") == "PowerSGD":
        options["compress"] = lockstep.PowerSGD(rank=2, warmup_steps=1)
    elif options.get("compress") == "TopK":
        options["compress"] = lockstep.TopK(0.1, warmup_steps=1)
    net = make_model("transformer")
    stage = options.pop("zero", 0)
    model = lockstep.shard(net, stage, bucket_mb=0.01) if stage else \
        lockstep.DataParallel(net, bucket_mb=0.01, **options)  # type: ignore[arg-type]
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    for step in range(3):
        x, y = batch("transformer", step * world.world_size + world.rank, 4)
        loss_of("transformer", model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return weakref.ref(model)


def _held() -> tuple[int, int]:
    """Threads and process groups alive in this process."""
    import threading

    import torch.distributed as dist

    return threading.active_count(), len(dist.distributed_c10d._world.pg_map)


def check_dropped_wrappers_are_freed() -> list[str]:
    """Ten rounds of wrap, train, drop for every configuration. After each round the
    wrapper is gone at once (no reference cycle waits for the collector) and no thread or
    process group is left; afterwards the live tensors take exactly the bytes they took
    before. (A heap scan costs ~0.5 s: one before and one after, then one per
    configuration only to name the one that leaked.)"""
    for config in LIFETIME_CONFIGS:
        _wrap_train_drop(config)  # a first round may create lasting process-wide state
    baseline, held = _live_tensor_bytes(), _held()
    problems = []
    for config in LIFETIME_CONFIGS:
        for round_ in range(1, 11):
            if _wrap_train_drop(config)() is not None or _held() != held:
                problems.append(f"{config} round {round_}: wrapper alive, or threads and "
                                f"process groups {_held()} instead of {held}")
    # Whether to look closer is decided together: the look is collective (it wraps again),
    # and a rank that alone saw a transient tensor left its peer waiting in a wrap for 30 s.
    differs = torch.tensor([int(_live_tensor_bytes() != baseline)])
    torch.distributed.all_reduce(differs, op=torch.distributed.ReduceOp.MAX)
    if differs.item():
        for config in LIFETIME_CONFIGS:
            before = _live_tensor_bytes()
            _wrap_train_drop(config)
            if _live_tensor_bytes() != before:
                problems.append(f"{config}: {_live_tensor_bytes() - before} bytes left")
    return problems


def test_wrap_train_drop_ten_times_returns_to_the_baseline(world2: World) -> None:
    for problems in world2.run(check_dropped_wrappers_are_freed, deadline_s=300):
        assert not problems, problems


# ---- a drop-in for DDP scripts: arguments, attributes, state dicts, outputs ----------------


@dataclasses.dataclass
class Output:  # a Hugging Face-style output: a dataclass with the loss and the logits
    loss: torch.Tensor
    logits: torch.Tensor


class OddOutputs(nn.Module):
    """Returns its result in the structure it is asked for."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.body, self.head = kind, nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> object:
        h = torch.tanh(self.body(x))
        logits = self.head(h)
        loss = F.cross_entropy(logits, y)
        return {"tuple": (logits, loss), "dict": {"logits": logits, "loss": loss},
                "dataclass": Output(loss, logits), "nested": [{"out": (loss, [logits])}],
                }[self.kind]


def _loss_from(output: object) -> torch.Tensor:
    if isinstance(output, Output):
        return output.loss
    if isinstance(output, tuple):
        return output[1]
    if isinstance(output, dict):
        return output["loss"]
    return output[0]["out"][0]  # type: ignore[index]


def check_drop_in() -> dict[str, object]:
    world = lockstep.init()
    x, y = batch("mlp", 8 + world.rank, PER_RANK)
    results: dict[str, object] = {}
    # DDP's own keywords, accepted and meaning the same thing.
    ddp_keywords = dict(device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                        process_group=None, bucket_cap_mb=0.01, find_unused_parameters=False,
                        check_reduction=False, gradient_as_bucket_view=True,
                        static_graph=False, init_sync=True)
    ours, theirs = make_model("mlp"), make_model("mlp")
    wrapped = lockstep.DataParallel(ours, **ddp_keywords)
    reference = DDP(theirs, **ddp_keywords)
    results["keys"] = list(wrapped.state_dict()) == list(reference.state_dict())
    wrapped.load_state_dict(reference.state_dict())  # a DDP checkpoint loads as it is
    # nanoGPT's accumulation: the flag set before each micro-step's forward.
    spread = []
    for model, net in ((wrapped, ours), (reference, theirs)):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for micro in range(4):
            model.require_backward_grad_sync = micro % 2 == 1
            loss_of("mlp", model, x[micro:micro + 3], y[micro:micro + 3]).backward()
            if micro % 2 == 0:  # local only: ranks hold different gradients now
                spread.append(_spread(net.parameters().__next__().grad))
            else:
                opt.step()
                opt.zero_grad()
    results["accumulation_gap"] = _param_gap(ours, theirs)
    results["unsynced_spread"] = min(spread)
    for kind in ("tuple", "dict", "dataclass", "nested"):
        a, b = OddOutputs(kind), OddOutputs(kind)
        out_a, out_b = lockstep.DataParallel(a)(x, y), DDP(b)(x, y)
        _loss_from(out_a).backward()
        _loss_from(out_b).backward()
        results[kind] = (type(out_a) is type(out_b), _grad_gap(a, b))
    return results


def _spread(grad: torch.Tensor) -> float:
    """How far this rank's tensor is from rank 0's (0 once averaged)."""
    everyone = [torch.zeros_like(grad) for _ in range(lockstep.init().world_size)]
    torch.distributed.all_gather(everyone, grad.contiguous())
    return max((g - everyone[0]).abs().max().item() for g in everyone)


def test_a_ddp_script_runs_unchanged(world: World) -> None:
    for result in world.run(check_drop_in):
        assert result["keys"], "state_dict keys differ from DDP's"
        assert result["accumulation_gap"] < 1e-6, result
        assert result["unsynced_spread"] > 0, "require_backward_grad_sync=False still reduced"
        for kind in ("tuple", "dict", "dataclass", "nested"):
            same_type, gap = result[kind]  # type: ignore[misc]
            assert same_type and gap < 1e-6, (kind, result[kind])


def test_ddp_arguments_without_a_meaning_here_are_refused() -> None:
    lockstep.init()
    with pytest.raises(ValueError, match=r"device_ids=\[0\].*on the CPU"):
        lockstep.DataParallel(nn.Linear(2, 2), device_ids=[0])
    with pytest.raises(ValueError, match="mixed_precision"):
        lockstep.DataParallel(nn.Linear(2, 2), mixed_precision=object())
    with pytest.raises(TypeError, match="bucket_cap_mbs"):
        lockstep.DataParallel(nn.Linear(2, 2), bucket_cap_mbs=1)
    with pytest.raises(TypeError, match="both bucket_mb= and DDP's bucket_cap_mb="):
        lockstep.DataParallel(nn.Linear(2, 2), 1.0, bucket_cap_mb=2)


# ---- torch.compile, in both orders ------------------------------------------------------------


def check_compiled(order: str) -> tuple[list[float], list[str]]:
    """aot_eager traces like the default backend (Dynamo, then AOTAutograd) without the
    minutes of C++ compilation inductor takes on these CPUs."""
    import warnings

    world = lockstep.init()
    torch._dynamo.reset()
    net = make_model("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order == "wrap-then-compile":
            model = torch.compile(lockstep.DataParallel(net), backend="aot_eager")
        elif order == "compile-then-wrap":
            model = lockstep.DataParallel(torch.compile(net, backend="aot_eager"))
        else:
            model = lockstep.DataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = []
        for step in range(4):
            x, y = batch("mlp", step * world.world_size + world.rank, 8)
            loss = loss_of("mlp", model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    torch._dynamo.reset()  # Dynamo's caches hold fake tensors that later checks trip on
    return losses, [str(w.message).splitlines()[0] for w in caught]


def test_torch_compile_in_both_orders() -> None:
    with World(2) as world:  # a world of its own: compiling leaves process-wide state
        plain = world.run(check_compiled, "plain")
        for order in ("wrap-then-compile", "compile-then-wrap"):
            for (losses, caught), (expected, _) in zip(world.run(check_compiled, order,
                                                                 deadline_s=300), plain):
                assert losses == pytest.approx(expected, abs=1e-5), order
                assert not caught, f"{order}: warnings {caught}"


# ---- issue 28, finding 4: a forward arms exactly one backward -------------------------------


def check_eval_backward_on_one_rank(wrapper: str) -> list[float]:
    """torch's test_ddp_sync_bn_training_vs_eval: after synchronised steps, rank 0 alone
    evaluates with gradients through `model.module` in eval mode. Those backwards launch
    nothing (the last forward through the wrapper armed one backward, now spent), and what
    they accumulated joins the next synchronised step, as in DDP."""
    world = lockstep.init()
    net = BNNet()
    if wrapper == "lockstep-syncbn":
        lockstep.convert_sync_batchnorm(net)
    model = DDP(net) if wrapper == "ddp" else lockstep.DataParallel(net)
    for step in range(3):
        x, y = batch("mlp", 20 + step * world.world_size + world.rank, PER_RANK)
        loss_of("mlp", model, x, y).backward()
    if world.rank == 0:
        model.module.eval()
        for step in range(2):
            loss_of("mlp", model.module, *batch("mlp", 40 + step, PER_RANK)).backward()
        model.module.train()
    loss_of("mlp", model, *batch("mlp", 50 + world.rank, PER_RANK)).backward()
    return [p.grad.sum().item() for p in net.parameters()]


def test_a_backward_through_module_after_a_synchronised_step_launches_nothing(
        world: World) -> None:
    ours = world.run(check_eval_backward_on_one_rank, "lockstep", deadline_s=60)
    theirs = world.run(check_eval_backward_on_one_rank, "ddp")
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(reference, abs=1e-5)
    synced = world.run(check_eval_backward_on_one_rank, "lockstep-syncbn", deadline_s=60)
    assert all(grads == synced[0] for grads in synced)  # every rank took the same average


# ---- issue 28, finding 5: the whole wrapped model under non-reentrant checkpointing ---------


def _tied() -> nn.Module:
    torch.manual_seed(31415)
    first, second = nn.Linear(20, 20), nn.Linear(20, 20)
    first.weight = second.weight
    return nn.Sequential(first, second)


def check_checkpointed_wrapper(wrapper: str) -> dict[str, float]:
    """torch's test_ddp_checkpointing_weight_sharing: checkpoint(wrapped model) with shared
    weights. Backward recomputes the forward through the wrapper; the step still averages
    each gradient once: one process's gradients on the global batch."""
    world = lockstep.init()
    generator = torch.Generator().manual_seed(7)
    x = torch.rand(8 * world.world_size, 20, generator=generator)
    target = torch.randn(8 * world.world_size, 20, generator=generator)
    mine = slice(8 * world.rank, 8 * (world.rank + 1))
    gaps = {}
    for reentrant in (False, True):
        net, reference = _tied(), _tied()
        model = DDP(net) if wrapper == "ddp" else lockstep.DataParallel(net)
        for _ in range(3):
            net.zero_grad(set_to_none=False)
            reference.zero_grad(set_to_none=False)
            out = checkpoint(model, x[mine].requires_grad_(), use_reentrant=reentrant)
            F.mse_loss(out, target[mine]).backward()
            F.mse_loss(checkpoint(reference, x.requires_grad_(), use_reentrant=reentrant),
                       target).backward()
        gaps["reentrant" if reentrant else "non-reentrant"] = _grad_gap(net, reference)
    return gaps


def test_checkpointing_the_whole_wrapped_model_with_shared_weights(world: World) -> None:
    for wrapper in ("ddp", "lockstep"):
        for gaps in world.run(check_checkpointed_wrapper, wrapper, deadline_s=60):
            assert all(gap < 1e-6 for gap in gaps.values()), (wrapper, gaps)


# ---- issue 28, finding 7: join's default divisor, as DDP's -----------------------------------


def train_joined(model: nn.Module, net: nn.Module, pattern: str) -> nn.Module:
    """The MLP trained under `model.join()` (lockstep's or DDP's) on uneven inputs."""
    world = lockstep.init()
    opt = make_optimizer("sgd", net.parameters())
    with model.join():  # type: ignore[operator]
        for i in range(_join_batches(pattern, world.rank, world.world_size)):
            loss_of("mlp", model, *batch("mlp", 100 * i + world.rank, 5)).backward()
            opt.step()
            opt.zero_grad()
    return net


def check_join_default(wrapper: str) -> nn.Module:
    """join() without arguments: the finished ranks count as zeros (DDP's default)."""
    lockstep.init()
    net = make_model("mlp")
    model: nn.Module = DDP(net) if wrapper == "ddp" else lockstep.DataParallel(net)
    return train_joined(model, net, "short-first")


def test_join_divides_by_the_initial_world_size_by_default(world: World) -> None:
    ours, theirs = world.run(check_join_default, "lockstep"), world.run(check_join_default, "ddp")
    for mine, reference in zip(ours, theirs, strict=True):
        assert _param_gap(mine, reference) < 1e-6


# ---- issue 28, finding 15: a world of one sends nothing --------------------------------------


def test_a_world_of_one_reports_nothing_sent() -> None:
    world = lockstep.init()
    assert world.world_size == 1  # the test process's own world
    for model in (lockstep.DataParallel(make_model("mlp")),
                  lockstep.shard(make_model("mlp"), 1),
                  lockstep.LocalSGD(make_model("mlp"), every=1)):
        loss_of("mlp", model, *batch("mlp", 0, PER_RANK)).backward()
        model.after_step()
        stats = model.comm_stats()
        assert stats["bytes_sent"] == 0 and stats["compression_ratio"] == 1.0, stats


# ---- issue 28, finding 8: a sharded wrapper alive at exit leaves stderr clean ----------------

_EXIT_SCRIPT = """
import sys, torch, torch.distributed as dist
import lockstep
from torch import nn
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
lockstep.init()
kept = []
for stage in (1, 2, 3):
    model = lockstep.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), stage)
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    kept.append(model)  # still referenced at exit: its finalizer runs at shutdown
for options in ({"algorithm": "ring"}, {"algorithm": "shm"},
                {"compress": lockstep.PowerSGD(rank=1)}):
    kept.append(lockstep.DataParallel(nn.Linear(4, 4), **options))
dist.destroy_process_group()
print("done", flush=True)
"""


def test_wrappers_alive_at_exit_after_the_group_is_destroyed_exit_quietly(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit_job.py"
    script.write_text(_EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    workers = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env) for rank in range(2)]
    for rank, worker in enumerate(workers):
        out, err = worker.communicate(timeout=120)
        noise = [line for line in err.splitlines() if "INFO" not in line]
        assert worker.returncode == 0 and out.strip() == "done", (rank, out, err)
        assert not noise, f"rank {rank} wrote to stderr at exit:\n{err}"


# ---- issue 28, finding 6: DDP's communication hooks, run unchanged ---------------------------


def _bf16_under_another_name(state, bucket):  # type: ignore[no-untyped-def]  # as _users_hook
    """torch's bf16 hook: DDP refuses it by name off CUDA, so DDP runs it through this."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _users_hook(state, bucket):  # type: ignore[no-untyped-def]  # unannotated, as DDP needs here
    """A user's hook: the sum of every rank's gradients times state["scale"], checking on
    the way that the bucket offers what DDP's GradBucket does."""
    buffer = bucket.buffer()
    views = bucket.gradients()
    assert len(views) == len(bucket.parameters()) and isinstance(bucket.index(), int)
    assert sum(v.numel() for v in views) == buffer.numel()
    state["last"] += int(bucket.is_last())
    future = torch.distributed.all_reduce(buffer, async_op=True).get_future()
    return future.then(lambda done: done.value()[0].mul_(state["scale"]))


def _comm_hook(name: str, wrapper: str) -> tuple[object, object]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power

    if name == "powerSGD":  # compression from the third step, on the rebuilt buckets
        return power.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                   random_seed=3), power.powerSGD_hook
    if name == "bf16":
        return None, (default_hooks.bf16_compress_hook if wrapper == "lockstep"
                      else _bf16_under_another_name)
    if name == "user":
        return {"scale": 0.3, "last": 0}, _users_hook
    return None, {"allreduce": default_hooks.allreduce_hook,
                  "fp16": default_hooks.fp16_compress_hook}[name]


# (hook, lockstep's bucket cap in MiB): one bucket, as DDP's here, for PowerSGD, whose
# random projections follow the bucket layout; several for the layout-free ones.
COMM_HOOKS = [("allreduce", 0.01), ("fp16", 25.0), ("bf16", 25.0), ("powerSGD", 25.0),
              ("user", 0.01)]


def _train_with_hook(wrapper: str, name: str, bucket_mb: float) -> tuple[nn.Module, object]:
    world = lockstep.init()
    net = make_model("mlp")
    model = DDP(net) if wrapper == "ddp" else lockstep.DataParallel(net, bucket_mb=bucket_mb)
    state, hook = _comm_hook(name, wrapper)
    model.register_comm_hook(state, hook)  # type: ignore[arg-type]
    opt = make_optimizer("sgd", net.parameters())
    for step in range(5):
        x, y = batch("mlp", 60 + step * world.world_size + world.rank, PER_RANK)
        loss_of("mlp", model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return net, state


def check_comm_hooks() -> dict[str, float]:
    """How far lockstep's weights are from DDP's with the same hook; for a 16-bit hook,
    also how far 16-bit rounding moves DDP's own weights from fp32's. At 3 ranks the
    rounding of a 16-bit sum depends on where an element sits in its bucket (Gloo's ring
    starts each chunk at another rank), and DDP's first step lays its bucket out in
    registration order, lockstep's in reverse (two lockstep layouts differ as much)."""
    gaps, ddp = {}, {}
    for name, bucket_mb in COMM_HOOKS:
        (ours, state), (ddp[name], _) = _train_with_hook("lockstep", name, bucket_mb), \
            _train_with_hook("ddp", name, bucket_mb)
        gaps[name] = _param_gap(ours, ddp[name])
        if name in ("fp16", "bf16"):  # what 16 bits move DDP's weights by
            gaps[f"{name} rounding"] = _param_gap(ddp[name], ddp["allreduce"])
        if name == "user":
            gaps["is_last once a step"] = abs(state["last"] - 5)  # type: ignore[index]
    gaps["join"] = _param_gap(_join_with_hook("lockstep"), _join_with_hook("ddp"))
    return gaps


def _join_with_hook(wrapper: str) -> nn.Module:
    """Under join, a rank out of data runs the hook on zeros, as DDP's does."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    lockstep.init()
    net = make_model("mlp")
    model = DDP(net) if wrapper == "ddp" else lockstep.DataParallel(net, bucket_mb=0.01)
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # type: ignore[operator]
    return train_joined(model, net, "short-last")


def test_comm_hooks_give_ddps_gradients(world: World) -> None:
    for gaps in world.run(check_comm_hooks, deadline_s=120):
        for name in ("fp16", "bf16"):  # exact at 2 ranks (a sum of two rounds one way)
            rounding = gaps.pop(f"{name} rounding")
            limit = 1e-6 if world.world_size == 2 else rounding
            assert gaps.pop(name) <= limit, (name, gaps, rounding)
        assert all(gap < 1e-6 for gap in gaps.values()), gaps


def _error_of(wrapper: str, hook: object, model: nn.Module | None = None) -> str:
    """The type of the error registering `hook` raises ("accepted" if none)."""
    if model is None:
        model = DDP(make_model("mlp")) if wrapper == "ddp" else \
            lockstep.DataParallel(make_model("mlp"))
    try:
        model.register_comm_hook(None, hook)  # type: ignore[operator]
    except Exception as error:  # the type is what is compared
        return type(error).__name__
    return "accepted"


def _wrong_return(state, bucket) -> int:  # type: ignore[no-untyped-def]
    return 0


def check_comm_hook_errors() -> dict[str, list[str]]:
    """Wrong hooks are refused as DDP refuses them; a second hook, or one after the first
    backward, too."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    allreduce = default_hooks.allreduce_hook
    found: dict[str, list[str]] = {}
    for wrapper in ("lockstep", "ddp"):
        twice = DDP(make_model("mlp")) if wrapper == "ddp" else \
            lockstep.DataParallel(make_model("mlp"))
        twice.register_comm_hook(None, allreduce)  # type: ignore[operator]
        found[wrapper] = [_error_of(wrapper, "hook"), _error_of(wrapper, _wrong_return),
                          _error_of(wrapper, allreduce, twice)]
    trained = lockstep.DataParallel(make_model("mlp"))
    loss_of("mlp", trained, *batch("mlp", 0, PER_RANK)).backward()
    found["after backward"] = [_error_of("lockstep", allreduce, trained)]
    found["sharded"] = [_error_of("lockstep", allreduce, lockstep.shard(make_model("mlp"), 1))]
    return found


def test_comm_hooks_are_refused_as_ddp_refuses_them(world2: World) -> None:
    for found in world2.run(check_comm_hook_errors):
        assert found["lockstep"] == found["ddp"] == ["TypeError", "ValueError", "RuntimeError"]
        assert found["after backward"] == ["RuntimeError"]
        assert found["sharded"] == ["ValueError"]
