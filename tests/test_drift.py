"""Replicas that cannot drift silently (drift.py): the check finds a perturbed rank, names
the first differing tensor and the ranks, and the repair makes the replicas identical.
One 3-rank Gloo world runs every check (odd world sizes catch what 2 and 4 hide)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lockstep import comm
from lockstep.replication.drift import DriftCheck, DriftError, checksums, versions_of
from lockstep.testing import World


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))


def _fingerprints(module: nn.Module) -> list[list[int]]:
    """Every rank's checksums, for comparing replicas bitwise."""
    return comm.all_gather_object(checksums(list(module.state_dict().values())).tolist(),
                                  "test: gather checksums")


def _finds_and_repairs() -> dict[str, Any]:
    rank = comm.rank_of()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()  # momentum state to repair too
    check = DriftCheck(model, every=100)
    clean = check.check(step=100)
    if rank == 2:  # one rank mutates one weight by the smallest step a float can take
        with torch.no_grad():
            w = model[2].weight
            w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(2.0))
        optimizer.state[model[2].weight]["momentum_buffer"].add_(1.0)
    drift = check.check(step=200)
    assert drift is not None
    check.repair(drift, [optimizer])
    after = check.check(step=201)
    same = _fingerprints(model)
    momentum = optimizer.state[model[2].weight]["momentum_buffer"].sum().item()
    return {"clean": clean, "drift": str(drift), "first": drift.first,
            "versions": drift.versions, "after": after, "same": all(f == same[0] for f in same),
            "momentum": momentum}


def _buffer_drift_and_no_repair() -> dict[str, Any]:
    rank = comm.rank_of()
    model = _model()
    if rank == 0:  # BatchNorm statistics changed on one rank only (a forward in train mode)
        model(torch.randn(8, 6))
    check = DriftCheck(model, every=5)
    due = [s for s in range(12) if check.due(s)]
    try:
        check.check_and_repair(10, repair=False)
        raised = ""
    except DriftError as error:
        raised = str(error)
    params_only = DriftCheck(model, every=5, buffers=False).check(10)
    return {"due": due, "raised": raised, "params_only": params_only}


@pytest.fixture(scope="module")
def world() -> Any:
    with World(3) as w:
        yield w


def test_a_perturbed_rank_is_named_and_repaired(world: World) -> None:
    results = world.run(_finds_and_repairs)
    for r in results:
        assert r["clean"] is None
        assert r["first"] == "parameter '2.weight'"
        assert r["versions"] == [[0, 1], [2]]
        assert r["drift"] == ("replicas differ at step 200: first in parameter '2.weight'; "
                              "rank(s) [2] hold a different version from rank(s) [0, 1]")
        assert r["after"] is None and r["same"]
    assert len({r["momentum"] for r in results}) == 1  # the optimizer state came along


def test_buffers_count_and_drift_can_be_an_error(world: World) -> None:
    for r in world.run(_buffer_drift_and_no_repair):
        assert r["due"] == [5, 10]
        assert "replicas differ at step 10: first in buffer '1.running_mean' and 2 more; " \
            "rank(s) [0] hold a different version from rank(s) [1, 2]" in r["raised"]
        assert r["params_only"] is None


def test_checksums_see_one_bit_and_versions_pick_the_majority() -> None:
    x = torch.randn(100)
    y = x.clone()
    y[7] = torch.nextafter(y[7], torch.tensor(10.0))
    assert checksums([x]).item() != checksums([y]).item()
    assert checksums([x.bfloat16(), torch.tensor([True, False])]).shape == (2,)
    assert versions_of([[1, 2], [1, 3], [1, 2], [1, 3], [1, 2]]) == [[0, 2, 4], [1, 3]]
    assert versions_of([[5], [6]]) == [[0], [1]]  # no majority: the lowest rank's version


# ---- parallel wrappers: what each one's replicas share, and when ----------------------------


def _zero_run(stage: int, drift_at: int | None) -> tuple[list[str], str]:
    """Six Adam steps under ZeRO `stage`; at `drift_at` rank 1 changes a weight of its
    replica and the check repairs it."""
    import lockstep
    from lockstep.training.checkpoint import fingerprint

    rank = comm.rank_of()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model = lockstep.shard(net, stage)
    optimizer = model.make_optimizer(torch.optim.Adam, lr=0.01)
    check, found = DriftCheck(model, every=2), []
    for step in range(1, 7):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == drift_at and rank == 1:
            with torch.no_grad():
                net[2].weight.add_(0.25)
        if check.due(step) and (drift := check.check_and_repair(step, [optimizer])):
            found.append(f"{drift.step}: {drift.first} on {drift.drifted}")
    return found, fingerprint(model.full_state_dict())


def _zero_drift_is_repaired(stage: int) -> dict[str, Any]:
    found, drifted = _zero_run(stage, drift_at=4)
    clean, undrifted = _zero_run(stage, drift_at=None)
    return {"found": found, "clean": clean, "equal": drifted == undrifted}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_drift_is_found_and_repaired_exactly(world: World, stage: int) -> None:
    """Each rank's optimizer shard stays its own: rank 0's shard loaded on every rank left
    the weights 0.48 off. (BatchNorm's statistics, differing by design, raise no alarm.)"""
    for r in world.run(_zero_drift_is_repaired, stage):
        assert r["found"] == ["4: parameter '2.weight' on [1]"] and r["clean"] == []
        assert r["equal"]  # the repaired run ends bitwise where the undrifted one does


def _zero3_refused() -> str:
    import lockstep

    model = lockstep.shard(_model(), 3)
    try:
        DriftCheck(model.module, every=2).check(2)  # its parameters, released to shards
    except ValueError as error:
        assert "give DriftCheck the sharded model" in str(error)
    try:
        DriftCheck(model, every=2)
        return ""
    except ValueError as error:
        return str(error)
    finally:
        model.close()


def test_zero3_drift_check_is_refused_with_the_reason(world: World) -> None:
    """Before, every rank died of SIGSEGV at the first check (released parameters read)."""
    for rank, said in enumerate(world.run(_zero3_refused)):
        assert said.startswith(f"rank {rank}: DriftCheck compares what replicas hold alike")
        assert "no copy on another rank" in said


def step_drift_and_check(model: Any, net: nn.Module, optimizer: Any, check: Any, step: int,
                         rank: int, drift_at: int, found: list[str], checked: list[int]) -> None:
    """One training step; rank 1's replica goes astray at `drift_at`; the check when due
    (its findings appended to `found`, the steps checked to `checked`)."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    model.after_step()
    if step == drift_at and rank == 1:
        with torch.no_grad():
            net[2].weight.add_(0.25)
    if check is not None and check.due(step):
        checked.append(step)
        if drift := check.check_and_repair(step, [optimizer]):
            found.append(f"{drift.step}: {drift.first} on {drift.drifted}")


def _rounds_run(kind: str, check_every: int | None, drift_at: int | None
                ) -> tuple[list[str], str, list[int]]:
    """Six steps of local rounds (H=2, Adam inside) with a drift check every
    `check_every` steps; at `drift_at` (a round's end) rank 1 changes a weight."""
    from lockstep.lowcomm.rounds import DiLoCo, LocalSGD
    from lockstep.training.checkpoint import fingerprint

    rank = comm.rank_of()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model = LocalSGD(net, every=2) if kind == "local_sgd" else DiLoCo(net, every=2)
    optimizer = model.make_optimizer(torch.optim.Adam, lr=0.01)
    check = DriftCheck(model, every=check_every) if check_every else None
    found, checked = [], []
    for step in range(1, 7):
        step_drift_and_check(model, net, optimizer, check, step, rank, drift_at, found, checked)
    return found, fingerprint(net), checked


def _rounds_compared_at_their_ends(kind: str) -> dict[str, Any]:
    _, plain, _ = _rounds_run(kind, None, None)
    every_step, watched, checked = _rounds_run(kind, 1, None)
    _, _, deferred = _rounds_run(kind, 3, None)
    caught, repaired, _ = _rounds_run(kind, 1, drift_at=4)
    return {"false_alarms": every_step, "checked": checked, "deferred": deferred,
            "same": watched == plain, "caught": caught, "repaired": repaired == plain}


@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_local_rounds_are_compared_only_at_their_ends(world: World, kind: str) -> None:
    """Replicas differ mid-round by design: checking every step at H=2 raised false alarms
    and 'repaired' rank 1's local progress away. A real drift at a round's end is caught."""
    for r in world.run(_rounds_compared_at_their_ends, kind):
        assert r["false_alarms"] == [] and r["same"]
        assert r["checked"] == [2, 4, 6] and r["deferred"] == [4, 6]  # due at 3: at 4
        assert r["caught"] == ["4: parameter '2.weight' on [1]"] and r["repaired"]


def _join_run(counts: list[int], check_every: int | None, drift_at: int | None
              ) -> tuple[list[str], str, list[int]]:
    """DataParallel on uneven inputs under join(), a drift check after each step (as
    `due` says); at `drift_at`, when every rank still has data, rank 1 changes a weight."""
    import lockstep
    from lockstep.training.checkpoint import fingerprint

    rank = comm.rank_of()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model = lockstep.DataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    check = DriftCheck(model, every=check_every) if check_every else None
    found, checked = [], []
    with model.join([optimizer]):
        for step in range(1, counts[rank] + 1):
            step_drift_and_check(model, net, optimizer, check, step, rank, drift_at, found,
                                 checked)
    return found, fingerprint(net), checked


def _join_checked_while_everyone_trains(counts: list[int]) -> dict[str, Any]:
    _, plain, _ = _join_run(counts, None, None)
    clean, watched, checked = _join_run(counts, 1, None)
    caught, repaired, _ = _join_run(counts, 1, drift_at=2)
    return {"clean": clean, "checked": checked, "same": watched == plain, "caught": caught,
            "repaired": repaired == plain}


def test_join_drift_checks_run_while_every_rank_has_data(world: World) -> None:
    """A rank out of data stops stepping until the join ends (its replica differs by
    design), and issues no drift check: before, the others' check met its join handshake
    (gloo: "Received data size doesn't match", SIGABRT). Checks wait for every rank."""
    counts = [5, 3] if world.world_size == 2 else [5, 3, 4]
    for rank, r in enumerate(world.run(_join_checked_while_everyone_trains, counts)):
        assert r["clean"] == [] and r["same"]
        assert r["checked"] == [1, 2, 3][:counts[rank]]
        assert r["caught"] == ["2: parameter '2.weight' on [1]"] and r["repaired"]
