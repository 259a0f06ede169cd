"""Checkpoints that resume exactly, survive crashes, and never unpickle arbitrary objects.

One checkpoint is one folder, `step-00000120/`:

    .metadata, *.distcp   model and optimizer tensors, by torch.distributed.checkpoint
    state.json            step, epoch, sampler position, scheduler and other plain state
    rng-rank{r}.json      each rank's RNG states (torch, numpy, python, cuda)
    MANIFEST.json         size and sha256 of every file above; written last

It is written into a temporary folder and renamed into place once complete, so a crash
mid-write leaves no half checkpoint under a real name. Loading verifies the manifest first:
a truncated or corrupted checkpoint is skipped with a warning and the previous valid one is
used. DCP's metadata is read with an unpickler that admits only DCP's own metadata classes;
everything else is JSON or raw tensor bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lockstep import comm, reshard
from lockstep.logs import get_logger

log = get_logger(__name__)

MANIFEST = "MANIFEST.json"
STATE = "state.json"
_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """No valid checkpoint could be loaded."""


# ---- safe reading of DCP metadata --------------------------------------------------------

_ALLOWED_GLOBALS = {
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch sizes and dtypes -- nothing that runs code."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED_GLOBALS or \
            module == "torch.distributed.checkpoint.metadata" or \
            (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, "
                                         "which is not DCP metadata; refusing to load it")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata unpickled through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(str(self.path)) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- RNG state as JSON ---------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
    }
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state["numpy"] = [kind, np.asarray(keys).tolist(), pos, has_gauss, gauss]
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                         for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch_bytes = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)),
                                                       dtype=torch.uint8) for s in state["cuda"]])


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


# ---- manifest --------------------------------------------------------------------------------


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _digest(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    _write_json(folder / MANIFEST, {"files": files})


def verify(folder: Path) -> str | None:
    """None if `folder` is a complete, intact checkpoint; otherwise what is wrong with it."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return "its manifest is missing or unreadable"
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} is truncated ({path.stat().st_size} of {expected['bytes']} bytes)"
        if _digest(path) != expected["sha256"]:
            return f"{name} is corrupt (checksum mismatch)"
    return None


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def fingerprint(model: nn.Module) -> str:
    """A short hash of the model's weights and buffers: equal fingerprints, equal models."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


# ---- save / find / load ------------------------------------------------------------------


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
    """What DCP saves and loads. A DataParallel model (any ZeRO stage) uses the layout of
    lockstep.reshard, which loads at any stage and world size; a plain module uses torch's
    own state-dict helpers."""
    if hasattr(model, "reducer"):
        return reshard.state_dict(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         state: dict[str, Any], keep: int = 3,
         extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a checkpoint of `model`, `optimizer`, any `extra` named tensors, and the
    JSON-able `state`, from every rank. Collective: every rank must call it. Returns the
    checkpoint folder.
    """
    root = Path(root)
    rank = dist.get_rank()
    temporary = comm.broadcast_object(str(root / f".tmp-{_PREFIX}{step:08d}-{uuid.uuid4().hex}"),
                                      0, "checkpoint: agree on a folder")
    tmp = Path(temporary)
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    comm.barrier(f"checkpoint: rank 0 creating {tmp}")
    dcp.save({**_tensors(model, optimizer), "extra": dict(extra or {})},
             storage_writer=FileSystemWriter(tmp, sync_files=True))
    _write_json(tmp / f"rng-rank{rank}.json", rng_state())
    if rank == 0:
        _write_json(tmp / STATE, {**state, "step": step, "world_size": dist.get_world_size()})
    comm.barrier("checkpoint: every rank's files written")
    final = step_folder(root, step)
    if rank == 0:
        _write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: the checkpoint appears complete or not at all
        _prune(root, keep, step)
    comm.barrier(f"checkpoint: rank 0 publishing {final}")
    return final


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
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f".tmp-{_PREFIX}*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)


def latest_valid(root: str | Path) -> Path | None:
    """The newest checkpoint that passes verification, warning about each one skipped.
    Rank 0 decides and tells the others, so every rank loads the same one."""
    choice = None
    if dist.get_rank() == 0:
        found = list_checkpoints(Path(root))
        for folder in found:
            problem = verify(folder)
            if problem is None:
                choice = str(folder)
                break
            log.warning("skipping checkpoint %s: %s", folder, problem)
        if found and choice is None:
            choice = f"!none of the {len(found)} checkpoint(s) in {root} is valid"
    choice = comm.broadcast_object(choice, 0, "checkpoint: agree on which to load")
    if choice is not None and choice.startswith("!"):
        raise CheckpointError(f"rank {dist.get_rank()}: {choice[1:]}; remove them or "
                              "resume from another folder")
    return Path(choice) if choice else None


def load(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, torch.Tensor] | None = None, verified: bool = False
         ) -> dict[str, Any]:
    """Verify a checkpoint (unless `verified`: latest_valid just chose it), load it into
    `model` and `optimizer` (on every rank) and restore this rank's RNG state when the
    checkpoint has one for it. Returns the JSON state."""
    folder = Path(folder)
    if not verified:  # hashing every file is a full read of the checkpoint: do it once
        problem = verify(folder) if dist.get_rank() == 0 else None
        problem = comm.broadcast_object(problem, 0, "checkpoint: verifying before loading")
        if problem is not None:
            raise CheckpointError(f"rank {dist.get_rank()}: checkpoint {folder} is not "
                                  f"valid: {problem}")
    bundle = _tensors(model, optimizer)
    try:
        if extra:
            bundle["extra"] = extra  # loaded in place
        dcp.load(bundle, storage_reader=SafeReader(folder))
    except CheckpointException as error:  # a BaseException: wraps each rank's real failure
        cause = next(iter(error.failures.values()))[0]
        raise CheckpointError(f"rank {dist.get_rank()}: cannot load checkpoint {folder}: "
                              f"{type(cause).__name__}: {cause}") from cause
    if "model" in bundle:  # a plain module, through torch's own state-dict helpers
        set_state_dict(model, optimizer, model_state_dict=bundle["model"],
                       optim_state_dict=bundle["optim"])
    else:
        reshard.after_load(model, optimizer, bundle)
    rng_file = folder / f"rng-rank{dist.get_rank()}.json"
    if rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    return dict(json.loads((folder / STATE).read_text()))
