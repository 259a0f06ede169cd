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
