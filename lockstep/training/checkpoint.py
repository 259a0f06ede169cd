"""Checkpoints that resume exactly, survive crashes and full disks, and hold no code.

One checkpoint is one folder, `step-00000120/`:

    tensors-rank{r}.safetensors  model, optimizer and extra tensors as raw typed bytes
                                 (lockstep.training.checkpoint_files): each rank's shards, and on
                                 rank 0 the whole tensors and plain values
    state.json                   step, epoch, sampler position, scheduler and other plain state
    rng-rank{r}.json             each rank's RNG states (torch, numpy, python, cuda)
    MANIFEST.json                size and sha256 of every file above; written last

Nothing in it is a pickle: loading reads JSON and numbers, and checks every header before it
trusts a byte of it, so a crafted checkpoint can be refused but cannot run code. (Files in
torch.distributed.checkpoint's format, whose `.metadata` is a pickle, are refused too.)

A checkpoint is written into a temporary folder and renamed into place once complete, so a
crash mid-write leaves no half checkpoint under a real name; a write that fails (a full
disk) removes its temporary folder and says which rank failed and why, and temporary
folders that crashed runs left behind are removed at the next start. Loading verifies the
manifest and the format first: a truncated, corrupted or refused checkpoint is skipped with
a warning and the previous valid one is used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep import comm
from lockstep.logs import get_logger
from lockstep.sharding import reshard
from lockstep.sharding.hostshards import writing_shards
from lockstep.training import checkpoint_files, rank_state
from lockstep.training.checkpoint_check import (
    MANIFEST,
    STATE,
    Expected,
    listed_files,
    manifest_of,
    read_json,
    verify,
)
from lockstep.training.rng import rng_state, set_rng_state
from lockstep.training.tensorfile import FormatError

log = get_logger(__name__)

__all__ = ["MANIFEST", "STATE", "CheckpointError", "Expected", "expected", "latest_valid",
           "list_checkpoints", "load", "remove_stale", "save", "verify"]

_PREFIX = "step-"
_TEMPORARY = re.compile(r"\.tmp-step-\d{8,}-[0-9a-f]{32}")  # the only names remove_stale deletes


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no valid checkpoint could be loaded."""


def _write_manifest(folder: Path) -> None:
    _write_json(folder / MANIFEST, manifest_of(folder))


def _write_json(path: Path, value: Any) -> None:
    with _naming(path), open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """A failed write() raises OSError without a file name: give it one for the message."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = str(path)
        raise


def fingerprint(model: nn.Module | dict[str, torch.Tensor]) -> str:
    """A short hash of the model's weights and buffers (or of a state dict): equal
    fingerprints, equal models."""
    h = hashlib.sha256()
    state = model if isinstance(model, dict) else model.state_dict()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


# ---- save ------------------------------------------------------------------------------


def step_folder(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Completed checkpoint folders under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
             and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]), reverse=True)


def _tensors(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What the tensor files hold. A DataParallel model (any ZeRO stage) uses the layout of
    lockstep.sharding.reshard, which loads at any stage and world size; a plain module uses torch's
    own state-dict helpers."""
    if hasattr(model, "reducer"):
        return reshard.state_dict(model, optimizer)
    # (imported here: torch.distributed.checkpoint costs every process 1.4 s of CPU to import)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _shapes(model: nn.Module) -> dict[str, list[int]]:
    """The model's own shapes of the tensors reshard's layout flattens, for messages."""
    if not hasattr(model, "reducer"):
        return {}
    module: nn.Module = model.module  # type: ignore[assignment]
    return {**{f"model.{n}": list(p.shape) for n, p in module.named_parameters()},
            **{f"buffer.{n}": list(b.shape) for n, b in module.named_buffers()}}


def expected(model: nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, torch.Tensor] | None = None,
             state: Callable[[dict[str, Any]], str | None] | None = None,
             own_optimizer: bool = False) -> Expected:
    """What loading into `model`, `optimizer` and `extra` needs of a checkpoint, for
    `verify` and `latest_valid`: every tensor's shape and dtype, and `state`, a check of
    state.json's content (what is wrong with it, or None). Each rank's own state is
    expected under the name this rank's files give it (rank_state): rank 0 verifies, and
    rank 0's own pieces are in every checkpoint, whatever number of ranks wrote it."""
    bundle = rank_state.for_files({**_tensors(model, optimizer), "extra": dict(extra or {})},
                                  own_optimizer)
    tensors = {}
    for leaf in checkpoint_files.leaves(bundle):
        if isinstance(leaf.value, torch.Tensor):  # a ShardedTensor too: its global size
            tensors[leaf.key] = checkpoint_files.whole_shape(leaf.value)
    shapes = {key: tuple(shape) for key, shape in _shapes(model).items()}
    return Expected(tensors, shapes, state)


def save(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         state: dict[str, Any], keep: int = 3,
         extra: dict[str, torch.Tensor] | None = None, own_optimizer: bool = False) -> Path:
    """Write a checkpoint of `model`, `optimizer`, any `extra` named tensors, and the
    JSON-able `state`, from every rank. Collective: every rank must call it. Returns the
    checkpoint folder. Raises CheckpointError on every rank if any rank fails to write (a
    full disk), after removing the partial checkpoint. Each rank's own state is kept per
    rank (rank_state.py): extra tensors named compress.PER_RANK..., and with
    `own_optimizer` the optimizer's.
    """
    root, rank = Path(root), dist.get_rank()
    final = step_folder(root, step)
    tmp = Path(comm.broadcast_object(str(root / f".tmp-{_PREFIX}{step:08d}-{uuid.uuid4().hex}"),
                                     0, "checkpoint: agree on a folder"))
    bundle = rank_state.for_files({**_tensors(model, optimizer), "extra": dict(extra or {})},
                                  own_optimizer)
    _together("create its folder", final, None,
              lambda: _create(root, tmp) if rank == 0 else None)
    _together("write every rank's files", final, tmp,
              lambda: _write_files(tmp, bundle, state, step, _shapes(model)))
    _together("publish it", final, tmp,
              lambda: _publish(tmp, final, keep, step) if rank == 0 else None)
    return final


def _together(what: str, final: Path, tmp: Path | None, action: Callable[[], None]) -> None:
    """Run this rank's part of a step of writing, then agree with every rank on how it
    went: one rank's full disk must stop all of them, with the same error."""
    try:
        action()
        failure = None
    except OSError as error:
        failure = _os_problem(error)
    except Exception as error:  # e.g. a state value JSON cannot hold
        failure = f"{type(error).__name__}: {error}"
    failures = comm.all_gather_object(failure, f"checkpoint: {what}")
    failed = [f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None]
    if not failed:
        return
    if tmp is not None and dist.get_rank() == 0:  # ours: created by _create, uniquely named
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(f"rank {dist.get_rank()}: cannot write checkpoint {final} "
                          f"(failed to {what}): {'; '.join(failed)}. Nothing was left behind "
                          "and earlier checkpoints are untouched.")


def _os_problem(error: OSError) -> str:
    where = f" writing {error.filename}" if error.filename else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device{where} ({error.strerror})"
    return f"{error.strerror or error}{where}"


def _create(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)  # before writing: a crashed run's leftovers may be what filled the disk
    tmp.mkdir()


def _write_files(tmp: Path, bundle: dict[str, Any], state: dict[str, Any], step: int,
                 shapes: dict[str, list[int]]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = tmp / checkpoint_files.TENSORS.format(rank)
    with _naming(path):
        checkpoint_files.write_rank(path, bundle, rank, world_size, shapes)
    _write_json(tmp / f"rng-rank{rank}.json", rng_state())
    if rank == 0:
        _write_json(tmp / STATE, {**state, "step": step, "world_size": world_size})


def _publish(tmp: Path, final: Path, keep: int, step: int) -> None:
    _write_manifest(tmp)
    if final.exists():
        if not _is_ours(final):
            raise OSError(f"{final} exists and is not a lockstep checkpoint (no {MANIFEST}); "
                          "it is left as it is: move it, or use another run_dir")
        shutil.rmtree(final)
    os.replace(tmp, final)  # atomic: the checkpoint appears complete or not at all
    try:
        _prune(final.parent, keep, step)
    except OSError as error:  # the checkpoint is written; tidying up is not worth failing
        log.warning("checkpoint %s written, but pruning older ones failed: %s", final, error)


def remove_stale(root: str | Path) -> list[Path]:
    """Remove the temporary folders that runs which stopped mid-write left under `root`.
    Only folders named as lockstep names them (`.tmp-step-<step>-<32 hex digits>`) are
    touched. Call it when nothing is writing a checkpoint there (save does, rank 0)."""
    root = Path(root)
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if _TEMPORARY.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            log.warning("removing %s, a partial checkpoint an earlier run left behind", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _prune(root: Path, keep: int, written: int) -> None:
    """Keep the `keep` newest checkpoints up to the one just written. Later-numbered ones
    belong to a timeline this run branched away from (it resumed from an earlier one): they
    are renamed aside, not deleted, so `resume="auto"` cannot pick them up by mistake."""
    timeline = []
    for folder in list_checkpoints(root):
        if int(folder.name[len(_PREFIX):]) > written:
            aside = folder.with_name(f"superseded-{folder.name}")
            log.warning("checkpoint %s is later than the one just written (step %d) and "
                        "belongs to an abandoned run; moved to %s", folder, written, aside)
            os.replace(folder, aside)
        else:
            timeline.append(folder)
    for old in timeline[max(1, keep):]:
        if _is_ours(old):  # a folder lockstep did not write is never deleted
            shutil.rmtree(old, ignore_errors=True)


def _is_ours(folder: Path) -> bool:
    """A checkpoint lockstep completed: its manifest, written last, is there."""
    return (folder / MANIFEST).is_file()


# ---- find / load ---------------------------------------------------------------------------


def latest_valid(root: str | Path, fits: Expected | None = None) -> Path | None:
    """The newest checkpoint that passes verification (and fits the model, given `fits`:
    see `expected`), warning about each one skipped. Rank 0 decides and tells the others,
    so every rank loads the same one."""
    choice = None
    if dist.get_rank() == 0:
        found, reasons = list_checkpoints(Path(root)), []
        for folder in found:
            problem = _SYMLINKED if folder.is_symlink() else verify(folder, fits)
            if problem is None:
                choice = str(folder)
                break
            log.warning("skipping checkpoint %s: %s", folder, problem)
            reasons.append(f"{folder.name}: {problem}")
        if found and choice is None:
            choice = (f"!none of the {len(found)} checkpoint(s) in {root} is valid "
                      f"({'; '.join(reasons)})")
    choice = comm.broadcast_object(choice, 0, "checkpoint: agree on which to load")
    if choice is not None and choice.startswith("!"):
        raise CheckpointError(f"rank {dist.get_rank()}: cannot load checkpoint from {root}: "
                              f"{choice[1:]}; remove them or resume from another folder")
    return Path(choice) if choice else None


_SYMLINKED = "it is a symbolic link; lockstep reads only checkpoint folders under the run's"


def load(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, torch.Tensor] | None = None, verified: bool = False,
         check: Callable[[dict[str, Any]], str | None] | None = None,
         own_optimizer: bool = False) -> dict[str, Any]:
    """Verify a checkpoint (unless `verified`: latest_valid just chose it) against the model
    and optimizer (and `check`, of state.json's content, see `expected`), load it
    into `model` and `optimizer` (on every rank) and restore this rank's RNG state when the
    checkpoint has one for it. Returns the JSON state."""
    folder, rank = Path(folder), dist.get_rank()
    if not verified:  # hashing every file is a full read of the checkpoint: do it once
        fits = expected(model, optimizer, extra, check, own_optimizer)  # _tensors may talk
        problem = verify(folder, fits) if rank == 0 else None
        problem = comm.broadcast_object(problem, 0, "checkpoint: verifying before loading")
        if problem is not None:
            raise CheckpointError(f"rank {rank}: checkpoint {folder} is not valid: {problem}")
    live = _tensors(model, optimizer)
    if extra:
        live["extra"] = extra  # loaded in place
    bundle = rank_state.for_files(live, own_optimizer, rank_state.saved_world_size(folder))
    with writing_shards(getattr(model, "zero_groups", []), "loading a checkpoint"):
        failure, state = _read_into(folder, bundle)
    failed = [f"rank {r}: {f}" for r, f in enumerate(
        comm.all_gather_object(failure, "checkpoint: loading")) if f is not None]
    if failed:
        raise CheckpointError(f"rank {rank}: cannot load checkpoint {folder}: "
                              f"{'; '.join(failed)}")
    if "model" in live:  # a plain module, through torch's own state-dict helpers
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=live["model"],
                       optim_state_dict=live["optim"])
    else:
        reshard.after_load(model, optimizer, live)
    return state


def _read_into(folder: Path, bundle: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """This rank's part of a load: its tensors into `bundle`, its RNG state restored.
    Returns (what went wrong or None, the JSON state). Every header is checked again here,
    since each rank reads the files itself."""
    rng_file = folder / f"rng-rank{dist.get_rank()}.json"
    try:
        listed = listed_files(folder)  # every rank reads only what the manifest lists
        checkpoint_files.fill(bundle, checkpoint_files.catalog(folder, listed))
        state = read_json(folder / STATE)
        if rng_file.name in listed:
            try:
                set_rng_state(read_json(rng_file))
            except (KeyError, TypeError, ValueError, RuntimeError) as error:
                raise FormatError(f"{rng_file}: not an RNG state ({error!r})") from None
    except (OSError, ValueError) as error:  # FormatError is a ValueError
        return f"{type(error).__name__}: {error}", {}
    return None, state
