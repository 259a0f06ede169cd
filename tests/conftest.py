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
