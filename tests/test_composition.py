"""Features combined: every parallel mode x every feature, each cell a few steps of a tiny
model on 2 ranks (issue 28's composition matrix; benchmarks/composition.py sweeps pairs).

Every cell must end one of three ways:
- exact: the final weights match a single-process reference to float64 tolerance -- one
  model on the global batch for the synchronous modes; for local SGD and DiLoCo, whose
  replicas differ between rounds by design, the replicas simulated one by one;
- approximate (compression, 16-bit precision): it runs, every replica ends identical, and
  the loss goes down;
- refused before training starts -- when the config is built, or when the model is wrapped
  or join() entered -- with an error that says why.
Nothing else: no crash, no hang, no silent difference.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.comm.ledger import HISTORY, ledger, mismatches
from lockstep.replication.choices import ALGORITHMS
from lockstep.replication.precision import autocast
from lockstep.testing import World

MODES = (*ALGORITHMS, "zero1", "zero2", "zero3", "localsgd", "diloco")
FEATURES = ("plain", "wire-bf16", "powersgd", "topk", "precision-bf16", "precision-fp16",
            "accumulate", "clip", "syncbn", "join", "driftcheck", "compile", "compile-outer",
            "frozen")
# Pairs that once broke (issue 28's sweep, benchmarks/composition.py): the loop's own
# collectives under join (a loss scaler's overflow vote, a drift check); ZeRO-3's frozen
# parameters, whole on every rank, are what its drift check compares.
PAIRS = (("native", "join+precision-fp16"), ("native", "join+driftcheck"),
         ("zero3", "frozen+driftcheck"))
COMPRESSORS = {"wire-bf16": lambda: "bf16",
               "powersgd": lambda: lockstep.PowerSGD(rank=1, warmup_steps=1),
               "topk": lambda: lockstep.TopK(0.5)}
STEPS, EVERY, PER_RANK, LR, CLIP = 4, 2, 4, 0.05, 0.5  # EVERY: local SGD / DiLoCo's H
# aot_eager traces as the default backend does (Dynamo, then AOTAutograd) without the C++
# compiles inductor spends minutes on here; LOCKSTEP_COMPILE_BACKEND=inductor to check it.
BACKEND = os.environ.get("LOCKSTEP_COMPILE_BACKEND", "aot_eager")

def is_local(mode: str) -> bool:
    return mode in ("localsgd", "diloco")


def has(feature: str, name: str) -> bool:
    """Whether a cell's `feature` -- one, or several joined by "+" -- includes `name`."""
    return name in feature.split("+")


def compressor_of(feature: str) -> str | None:
    return next((f for f in feature.split("+") if f in COMPRESSORS), None)


def precision_of(feature: str) -> str:
    return next((f.split("-")[1] for f in feature.split("+") if f.startswith("precision")),
                "fp32")


def expectation(mode: str, feature: str) -> tuple[str, str]:
    """What a cell must do: ("exact" | "approximate" | "refused", where it is refused)."""
    compressor = compressor_of(feature)
    if compressor is not None and (mode not in ALGORITHMS or mode == "shm" or
                                   (mode == "hierarchical" and compressor != "wire-bf16")):
        return "refused", "config"
    if has(feature, "driftcheck") and mode == "zero3" and not has(feature, "frozen"):
        return "refused", "wrap"  # a parameter is only its shards: no replica to compare
    if has(feature, "join") and (mode not in ALGORITHMS or has(feature, "syncbn")):
        return "refused", "wrap"  # ZeRO's, the rounds' and SyncBN's collectives: no shadow
    if compressor is not None or precision_of(feature) != "fp32":
        return "approximate", ""
    if has(feature, "syncbn") and is_local(mode):
        return "approximate", ""  # statistics shared every step, weights every round
    return "exact", ""


def build_config(mode: str, feature: str) -> Any:
    compressor = compressor_of(feature)
    extra = {"compress": COMPRESSORS[compressor]()} if compressor is not None else {}
    if mode in ALGORITHMS:
        return lockstep.SyncConfig(algorithm=mode, **extra)
    if mode.startswith("zero"):
        return lockstep.ShardConfig(stage=int(mode[-1]), **extra)
    if mode == "localsgd":
        return lockstep.LocalSGDConfig(sync_every=EVERY, **extra)
    # Outer lr 1 without momentum: the outer step lands on the replicas' average, which
    # is local SGD's, so the same reference holds.
    return lockstep.DiLoCoConfig(sync_every=EVERY, outer_lr=1.0, outer_momentum=0.0, **extra)


# ---- the model, the data and the single-process reference ----------------------------------


def tiny(feature: str) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(16)] if has(feature, "syncbn") else []
    net = nn.Sequential(nn.Linear(8, 16), *norm, nn.Tanh(), nn.Linear(16, 2))
    if has(feature, "frozen"):  # beside a trainable weight in the same layer
        net[0].bias.requires_grad_(False)
    return net.to(torch.float64 if precision_of(feature) == "fp32" else torch.float32)


def data(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of global batch `step`: a linear target plus a little noise."""
    truth = torch.randn(8, 2, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(PER_RANK, 8, generator=generator, dtype=torch.float64)
    y = x @ truth + 0.1 * torch.randn(PER_RANK, 2, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def steps_of(rank: int, feature: str) -> int:
    return STEPS - 1 if has(feature, "join") and rank == 1 else STEPS  # uneven under join


def make_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(mode: str, feature: str, world_size: int) -> list[torch.Tensor]:
    """The same training in one process: one model on the global batch (synchronous modes),
    or each replica stepped alone and averaged every EVERY steps (local SGD, DiLoCo)."""
    count = world_size if is_local(mode) else 1
    nets = [tiny(feature) for _ in range(count)]
    opts = [make_sgd(net.parameters()) for net in nets]
    dtype = next(nets[0].parameters()).dtype
    micro = 2 if has(feature, "accumulate") else 1
    for step in range(STEPS):
        active = [r for r in range(world_size) if step < steps_of(r, feature)]
        for k, (net, opt) in enumerate(zip(nets, opts, strict=True)):
            ranks = [k] if is_local(mode) else active
            for m in range(micro):  # each micro-batch spans the ranks (BatchNorm sees it so)
                x = torch.cat([data(step, r, dtype)[0].chunk(micro)[m] for r in ranks])
                y = torch.cat([data(step, r, dtype)[1].chunk(micro)[m] for r in ranks])
                (nn.functional.mse_loss(net(x), y) / micro).backward()
            if has(feature, "clip"):
                nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if is_local(mode) and (step + 1) % EVERY == 0:
            with torch.no_grad():
                for tensors in zip(*(net.state_dict().values() for net in nets), strict=True):
                    if tensors[0].is_floating_point():
                        average = torch.stack(tensors).mean(0)
                        for t in tensors:
                            t.copy_(average)
    return [t.detach().clone() for t in nets[0].state_dict().values()]


def eval_loss(feature: str, values: list[torch.Tensor]) -> float:
    net = tiny(feature)
    with torch.no_grad():
        for t, v in zip(net.state_dict().values(), values, strict=True):
            t.copy_(v)
    net.eval()
    dtype = next(net.parameters()).dtype
    x, y = data(10_000, 0, dtype)
    with torch.no_grad():
        return float(nn.functional.mse_loss(net(x), y))


# ---- one cell, on every rank -----------------------------------------------------------------


def run_cell(mode: str, feature: str) -> dict[str, Any]:
    """Train one cell; report where it was refused, or its gap to the reference, its
    digest and its loss before and after."""
    world = lockstep.init()
    torch._dynamo.reset()
    numbered = ledger.counts.get(ledger.world_key, 0)  # the world's collectives so far
    try:
        config = build_config(mode, feature)
    except ValueError as error:
        return {"refused": "config", "why": f"{type(error).__name__}: {error}"}
    net = tiny(feature)
    if has(feature, "syncbn"):
        net = lockstep.convert_sync_batchnorm(net)
    if has(feature, "compile"):  # the model compiled, then wrapped
        net = torch.compile(net, backend=BACKEND)  # type: ignore[assignment]
    with contextlib.ExitStack() as stack:
        try:
            model = config.build(net)
            stack.callback(model.close)
            optimizer = model.make_optimizer(make_sgd)
            drift = lockstep.DriftCheck(model, every=1) if has(feature, "driftcheck") else None
            scaler = lockstep.LossScaler(group=model.group) \
                if precision_of(feature) == "fp16" else None
            if has(feature, "join"):  # a loss scaler's vote is answered by a rank out of data
                stack.enter_context(model.join([optimizer, *([scaler] if scaler else [])],
                                                divide_by_initial_world_size=False))
        except (ValueError, RuntimeError) as error:
            return {"refused": "wrap", "why": f"{type(error).__name__}: {error}"}
        # compile-outer: the wrapper compiled (its forward's collectives stay out of the graph)
        outer = has(feature, "compile-outer")
        forward = torch.compile(model, backend=BACKEND) if outer else model
        train(model, forward, optimizer, scaler, drift, feature, world.rank, mode)
        stack.pop_all().close()  # leave join (its shadow steps) before reading the weights
        model.finish()
        values = list(model.full_state_dict().values())
        model.close()
    torch._dynamo.reset()
    expected = reference(mode, feature, world.world_size)
    gap = max(float((a - b).abs().max() / (b.abs().max() + 1e-12))
              for a, b in zip(values, expected, strict=True))
    digest = hashlib.sha256(b"".join(v.double().numpy().tobytes() for v in values))
    issued = [e for e in ledger.recent(ledger.world_key, HISTORY) if e[0] > numbered] \
        if ledger.enabled else None  # the ledger is off with the watchdog (stall_after=0)
    return {"gap": gap, "digest": digest.hexdigest()[:16], "issued": issued,
            "before": eval_loss(feature, list(tiny(feature).state_dict().values())),
            "after": eval_loss(feature, values)}


def train(model: Any, forward: Any, optimizer: Any, scaler: Any, drift: Any, feature: str,
          rank: int, mode: str) -> None:
    """The Trainer's step (trainer.py), feature by feature; `forward` is the model, or the
    model compiled."""
    precision = precision_of(feature)
    micro = 2 if has(feature, "accumulate") else 1
    dtype = torch.float32 if precision != "fp32" else torch.float64
    for step in range(steps_of(rank, feature)):
        x, y = data(step, rank, dtype)
        for m, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            with contextlib.nullcontext() if m == micro - 1 else model.no_sync():
                with autocast(precision, torch.device("cpu")):
                    loss = nn.functional.mse_loss(forward(xs), ys) / micro
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if has(feature, "clip"):
            if hasattr(optimizer, "clip_grad_norm_"):
                optimizer.clip_grad_norm_(CLIP)
            else:
                nn.utils.clip_grad_norm_(model.module.parameters(), CLIP)
        scaler.step(optimizer) if scaler is not None else optimizer.step()
        model.after_step()
        optimizer.zero_grad(set_to_none=True)
        if drift is not None:
            if step == 1 and rank == 1 and not is_local(mode):  # a replica goes astray
                with torch.no_grad():  # where replicas are compared (ZeRO-3: what is frozen)
                    next(iter(model.replicated_tensors().values())).add_(1e-3)
            drift.check_and_repair(step + 1, [optimizer])


# ---- the matrix --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cells_world() -> Iterator[World]:
    with World(2) as world:  # a world of its own: compiling leaves process-wide state
        yield world


def _cells() -> list[Any]:
    return [pytest.param(mode, feature, id=f"{mode}-{feature}")
            for mode, feature in [*((m, f) for m in MODES for f in FEATURES), *PAIRS]]


def assert_says_why(message: str) -> None:
    assert "unexpected keyword" not in message and "has no attribute" not in message, message
    assert len(message) > 60, f"a refusal must say why: {message}"


@pytest.mark.parametrize(("mode", "feature"), _cells())
def test_every_combination_works_or_is_refused_up_front(cells_world: World, mode: str,
                                                        feature: str) -> None:
    outcome, where = expectation(mode, feature)
    if where == "config":  # refused here, in the launching process: before any worker
        with pytest.raises(ValueError) as refused:
            build_config(mode, feature)
        assert_says_why(str(refused.value))
        return
    results = cells_world.run(run_cell, mode, feature, deadline_s=240)
    if outcome == "refused":
        for rank, result in enumerate(results):
            assert result.get("refused") == where, result
            assert_says_why(result["why"])
            assert f"rank {rank}" in result["why"], result["why"]
        return
    assert all("refused" not in r for r in results), results
    assert len({r["digest"] for r in results}) == 1, "replicas differ"
    # Every rank issued the same collectives at the same steps: no desync, real or seen
    # by the watchdog (whose ledger this is), e.g. in a joined rank's shadow steps.
    if results[0]["issued"] is not None:
        assert not mismatches(results[0]["issued"], results[1]["issued"])
    if outcome == "exact":
        assert results[0]["gap"] < 1e-9, results[0]
    else:
        assert results[0]["after"] < results[0]["before"], results[0]


# ---- resuming, through the Trainer ---------------------------------------------------------

RESUMED = [("native", "plain"), ("zero3", "plain"),
           ("native", "powersgd"), ("native", "topk"), ("localsgd", "plain"),
           ("diloco", "plain")]

def fit(mode: str, feature: str, run_dir: str, max_steps: int, resume: str) -> str:
    """Train with the Trainer (checkpoints every 2 steps); the final weights' digest."""
    from torch.utils.data import TensorDataset

    lockstep.init()
    batches = [data(step, rank, torch.float64) for step in range(8) for rank in range(2)]
    dataset = TensorDataset(torch.cat([x for x, _ in batches]),
                            torch.cat([y for _, y in batches]))
    config = lockstep.TrainConfig(
        global_batch_size=2 * PER_RANK, max_steps=max_steps, run_dir=run_dir, progress=False,
        trackers=(), parallel=build_config(mode, feature),
        checkpoint=lockstep.CheckpointConfig(every_steps=2, resume=resume))
    trainer = lockstep.Trainer(tiny(feature), make_sgd, dataset, loss_fn=nn.functional.mse_loss,
                               config=config)
    trainer.fit()
    values = trainer.model.full_state_dict().values()
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in values)).hexdigest()[:16]


@pytest.mark.parametrize(("mode", "feature"), [
    pytest.param(mode, feature, id=f"{mode}-{feature}") for mode, feature in RESUMED])
def test_resuming_continues_bitwise(cells_world: World, tmp_path: Path, mode: str,
                                    feature: str) -> None:
    """Stopped after 2 steps and resumed to 4, every combination lands on the bits of an
    uninterrupted run: every piece of state that decides the next step is checkpointed."""
    whole = cells_world.run(fit, mode, feature, str(tmp_path / "whole"), 4, "never")
    part = str(tmp_path / "part")
    cells_world.run(fit, mode, feature, part, 2, "never")
    resumed = cells_world.run(fit, mode, feature, part, 4, "auto")
    assert resumed == whole


# ---- asynchronous training -----------------------------------------------------------------


def test_async_training_refuses_syncbn_up_front(cells_world: World, tmp_path: Path) -> None:
    results = cells_world.run(fit_async_syncbn, str(tmp_path), deadline_s=120)
    for result in results:
        assert "SyncBatchNorm" in result, result


def fit_async_syncbn(run_dir: str) -> str:
    """AsyncTrainer with SyncBatchNorm: refused before training, with the reason."""
    from torch.utils.data import TensorDataset

    lockstep.init()
    x, y = data(0, 0, torch.float64)
    config = lockstep.TrainConfig(global_batch_size=2, max_steps=2, run_dir=run_dir,
                                  progress=False, trackers=(), parallel=lockstep.AsyncConfig())
    try:
        lockstep.AsyncTrainer(lockstep.convert_sync_batchnorm(tiny("syncbn")), make_sgd,
                              TensorDataset(x, y), loss_fn=nn.functional.mse_loss,
                              config=config).fit()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "trained"
