"""Test worlds: started once per session, shared by every multi-process check."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockstep.testing import World

# Worker processes unpickle check functions by module name (tests.test_x): make the
# repository root importable for them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# No training.png at the end of each of the suite's few hundred Trainer runs (up to a second
# each, on rank 0, which the other ranks wait for): the tests of the picture ask for it.
os.environ.setdefault("LOCKSTEP_PLOT", "0")


@pytest.fixture(scope="session")
def world2() -> Iterator[World]:
    with World(2) as world:
        yield world


@pytest.fixture(scope="session")
def world3() -> Iterator[World]:
    with World(3) as world:
        yield world


@pytest.fixture(scope="session")
def world4() -> Iterator[World]:
    with World(4) as world:
        yield world


@pytest.fixture(params=[2, 3], ids=["world2", "world3"])
def world(request: pytest.FixtureRequest) -> World:
    return request.getfixturevalue(f"world{request.param}")


# The suite's longest launches (30-80 s each in `make test`), longest first. xdist's
# worksteal hands each worker a contiguous half of the collection and lets an idle worker
# steal from the end of the other's queue, so a long test collected late can leave one core
# idle at the end while it runs alone. Dealt alternately to the heads of the two halves,
# they start first on both workers and the suite ends on short tests.
LONGEST_FIRST = (
    "tests/test_resume.py::test_kill_9_then_rerun_resumes_exactly",
    "tests/test_timeline.py::test_a_rank_behind_a_slow_link_is_named_with_its_link_as_the_cause",
    "tests/test_elastic_trainer.py::test_a_worker_stopped_past_the_timeout_is_left_out",
    "tests/test_cluster.py::test_two_hosts_of_two_train_like_one_process",
    "tests/test_demo.py::test_demo_trains_at_1_and_2_workers_and_reports",
    "tests/test_elastic_trainer.py::test_the_trainer_goes_on_through_a_kill_and_lets_a_worker",
    "tests/test_etcd_store.py::test_a_job_goes_on_through_a_workers_kill_and_an_etcd_members",
    "tests/test_elastic.py::test_local_rounds_under_elastic_are_checked_only_at_their_ends",
    "tests/test_elastic_trainer.py::test_a_joiner_that_differs_from_the_job_is_refused",
    "tests/test_dropin.py::test_lockstep_gives_ddps_per_step_losses",
    "tests/test_elastic_trainer.py::test_a_job_whose_every_worker_died_resumes",
    "tests/test_elastic.py::test_zero_2_under_elastic_goes_on_through_a_kill_and_a_join",
    "tests/test_elastic_trainer.py::test_zero_3_under_elastic_loses_nothing_to_a_kill",
    "tests/test_elastic.py::test_losing_the_store_host_leaves_training_going_and_says_so",
    "tests/test_elastic.py::test_kill_9_then_rejoin_trains_as_one_process",
)


@pytest.hookimpl(trylast=True)  # after -m's deselection: the halves are of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((k for k, prefix in enumerate(LONGEST_FIRST)
                     if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    longest = sorted((item for item in items if rank(item) < len(LONGEST_FIRST)), key=rank)
    rest = [item for item in items if rank(item) == len(LONGEST_FIRST)]
    first, second = longest[0::2], longest[1::2]
    split = len(items) // 2 - len(first)  # (the first half is len(items) // 2 long)
    if split < 0:  # a selection of little more than these: nothing to balance
        return
    items[:] = first + rest[:split] + second + rest[split:]
