"""A full disk while checkpointing: every rank gets the same error, naming the rank, the
cause ("no space left on device") and the file; the partial checkpoint is removed, so a retry
fails the same way instead of filling the disk further; partial checkpoints that crashed
runs left behind are removed at the next start -- and nothing lockstep did not create is.

The full disk is real where the test may mount a tmpfs (it runs as root here); elsewhere the
write is made to fail with ENOSPC, and the test says so in its output."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import lockstep
from lockstep.testing import World
from lockstep.training import checkpoint, tensorfile
from tests.models import make_model
from tests.test_trainer import config, digit_sets, sgd


def _stale_name(step: int) -> str:
    """A temporary folder name as lockstep's save makes them."""
    return f".tmp-step-{step:08d}-{uuid.uuid4().hex}"


def plant_leftovers(root: Path, outside: Path) -> tuple[list[Path], list[Path]]:
    """A crashed run's partial checkpoints (lockstep's), and things that only look like
    them. Returns (what must go, what must stay)."""
    root.mkdir(parents=True, exist_ok=True)
    stale = [root / _stale_name(7), root / _stale_name(8)]
    for folder in stale:
        folder.mkdir()
        (folder / "tensors-rank0.safetensors").write_bytes(b"\0" * (300 << 10))
    (outside / "precious").mkdir(parents=True)
    (outside / "precious" / "data").write_text("keep me")
    decoys = [root / ".tmp-step-00000009-not-a-uuid", root / "notes.txt",
              root / _stale_name(10), root / _stale_name(11)]
    decoys[0].mkdir()
    decoys[1].write_text("mine")
    decoys[2].write_text("a file, not a folder lockstep made")
    decoys[3].symlink_to(outside / "precious")  # a link: never followed, never removed
    return stale, decoys


@contextlib.contextmanager
def full_disk(path: Path, size: str = "2m") -> Iterator[str]:
    """A real disk of `size` at `path` (tmpfs), or a note that ENOSPC will be simulated."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(path)], capture_output=True).returncode == 0
    try:
        yield "tmpfs" if mounted else "simulated"
    finally:
        if mounted and subprocess.run(["umount", str(path)]).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def failing_writes(simulate: bool) -> Iterator[None]:
    """Where no tmpfs can be mounted: tensor files fail as on a full disk, after a part."""
    if not simulate:
        yield
        return
    real = tensorfile.write

    def write(path: Path, *args: Any, **kwargs: Any) -> None:
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    tensorfile.write = write  # type: ignore[assignment]
    try:
        yield
    finally:
        tensorfile.write = real  # type: ignore[assignment]


def check_full_disk(root: str, simulate: bool) -> dict[str, Any]:
    world = lockstep.init()
    big = torch.nn.Linear(600, 600)  # 1.4 MB of weights + 1.4 MB of momentum > 2 MB
    opt = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    big(torch.ones(1, 600)).sum().backward()
    opt.step()
    errors, left = [], []
    for _ in range(2):  # the retry must meet the same disk, not a fuller one
        with failing_writes(simulate):
            try:
                checkpoint.save(root, 1, big, opt, {})
                errors.append("saved")
            except checkpoint.CheckpointError as error:
                errors.append(str(error))
        world.barrier()
        left.append(sorted(p.name for p in Path(root).iterdir()))
    small = make_model("mlp")  # fits only if the failed writes gave their space back
    written = checkpoint.save(root, 2, small, sgd(small.parameters()), {})
    return {"errors": errors, "left": left, "written": written.name}


def test_a_full_disk_fails_cleanly_and_leaves_nothing_behind(world2: World,
                                                              tmp_path: Path) -> None:
    with full_disk(tmp_path / "disk") as how:
        print(f"full disk: {how}")
        root = tmp_path / "disk" / "ck"
        stale, decoys = plant_leftovers(root, tmp_path / "outside")
        results = world2.run(check_full_disk, str(root), how == "simulated")
        for rank, result in enumerate(results):
            for error in result["errors"]:
                assert error.startswith(f"rank {rank}: cannot write checkpoint {root}")
                assert f"rank 0: no space left on device writing {root}/.tmp-step-00000001-" \
                    in error and "tensors-rank0.safetensors" in error, error
            assert result["written"] == "step-00000002"
        kept = sorted(p.name for p in decoys)
        assert results[0]["left"] == [kept, kept]  # the stale ones, and both failed writes, gone
        assert not any(p.exists() for p in stale)
        assert all(p.exists() or p.is_symlink() for p in decoys)
        assert (tmp_path / "outside" / "precious" / "data").read_text() == "keep me"


def check_trainer_start_removes_leftovers(run_dir: str, outside: str) -> list[list[str]]:
    world = lockstep.init()
    root = Path(run_dir) / "checkpoints"
    if world.is_main:
        plant_leftovers(root, Path(outside))
    world.barrier()
    seen: list[list[str]] = []

    def look(trainer: lockstep.Trainer) -> None:  # at step 1, before any checkpoint
        seen.append(sorted(p.name for p in root.iterdir()))

    train_set, _ = digit_sets()
    trainer = lockstep.Trainer(make_model("mlp"), sgd, train_set, callbacks=[look],
                               config=config(run_dir, max_steps=1, resume="auto"))
    trainer.fit()
    return seen


def test_the_next_start_removes_partial_checkpoints_of_a_crash(world2: World,
                                                              tmp_path: Path) -> None:
    seen = world2.run(check_trainer_start_removes_leftovers, str(tmp_path / "run"),
                      str(tmp_path / "outside"))[0]
    assert len(seen[0]) == 4 and not any(name.startswith(".tmp-step-00000007-") or
                                         name.startswith(".tmp-step-00000008-")
                                         for name in seen[0])
    assert (tmp_path / "outside" / "precious" / "data").read_text() == "keep me"
