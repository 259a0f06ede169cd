"""Crafted checkpoints cannot run code: each hostile file below is planted in a real
checkpoint with its SHA-256 manifest recomputed, as an attacker who can write the folder
would. Loading it -- by resume="auto" or by name -- must never write the marker file that
its code would write; "auto" skips it with a warning naming the file and falls back to the
previous checkpoint, and naming it explicitly is an error naming the file. Every pickle
payload is first shown to be live: plain pickle.loads does write its marker."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import stat
import struct
import subprocess
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep import comm
from lockstep.testing import World
from lockstep.training import checkpoint, tensorfile
from tests.models import make_model
from tests.test_trainer import sgd, train

# ---- payloads: pickles whose loading would create `marker` -------------------------------


class _Reduce:
    """A pickle that calls fn(*args) when loaded."""

    def __init__(self, fn: Callable[..., object], *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return self.fn, self.args


def _call_by_name(module: str, name: str, *args: object) -> bytes:
    """module.name(*args) by STACK_GLOBAL, so `name` may be a dotted path that pickle walks
    attribute by attribute (how a module-prefix allow-list was escaped)."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()
    return (b"\x80\x04" + text(module) + text(name) + b"\x93"
            + pickle.dumps(args, protocol=2)[2:-1] + b"R.")


def _touch(marker: Path) -> str:
    return f"touch {marker}"


PAYLOADS: dict[str, Callable[[Path], bytes]] = {
    "os.system (plain __reduce__)": lambda m: pickle.dumps(_Reduce(os.system, _touch(m))),
    "a DCP module path walked to os.system": lambda m: _call_by_name(
        "torch.distributed.checkpoint.metadata", "os.system", _touch(m)),
    "builtins.exec": lambda m: pickle.dumps(_Reduce(exec, f"open({str(m)!r}, 'w').close()")),
    "subprocess.call": lambda m: pickle.dumps(_Reduce(subprocess.call, ["touch", str(m)])),
    "functools.partial": lambda m: pickle.dumps(
        _Reduce(functools.partial(os.system, _touch(m)))),
    "torch.load of a nested torch.save": lambda m: pickle.dumps(_Reduce(
        functools.partial(torch.load, weights_only=False), io.BytesIO(_torch_save(m)))),
    "pickle.loads of a nested pickle": lambda m: pickle.dumps(
        _Reduce(pickle.loads, pickle.dumps(_Reduce(os.system, _touch(m))))),
}


def _torch_save(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": _Reduce(os.system, _touch(marker))}, buffer)
    return buffer.getvalue()


# ---- where they are planted (on rank 0, in the newest checkpoint) ------------------------


def _with_entry(path: Path, name: str, dtype: str, payload: bytes, shape: list[int]) -> None:
    """Add a tensor entry to a safetensors file, declared however the attacker likes."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    header[name] = {"dtype": dtype, "shape": shape,
                    "data_offsets": [len(data), len(data) + len(payload)]}
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + data + payload)


def _plant(case: str, folder: Path, marker: Path) -> str:
    """Make `folder` hostile in the way `case` names; return the file planted."""
    tensors = folder / "tensors-rank0.safetensors"
    if case in PAYLOADS:  # where torch.distributed.checkpoint kept its pickled metadata
        (folder / ".metadata").write_bytes(PAYLOADS[case](marker))
        return ".metadata"
    if case == "bytes entry holding a pickle":
        _with_entry(tensors, "extra/blob", "BYTES", PAYLOADS["os.system (plain __reduce__)"](
            marker), [1])
    elif case == "tensor file replaced by torch.save output":
        tensors.write_bytes(_torch_save(marker))
    elif case == "state.json replaced by a pickle":
        (folder / "state.json").write_bytes(PAYLOADS["functools.partial"](marker))
        return "state.json"
    elif case == "rng file replaced by a nested pickle":
        (folder / "rng-rank1.json").write_bytes(PAYLOADS["pickle.loads of a nested pickle"](
            marker))
        return "rng-rank1.json"
    elif case == "huge declared size":  # 4 TiB of float32 in a file of a few KB
        _with_entry(tensors, "extra/huge", "F32", b"", [1 << 40])
    elif case == "huge declared header":
        raw = tensors.read_bytes()
        tensors.write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
    return tensors.name


CASES = [*PAYLOADS, "bytes entry holding a pickle", "tensor file replaced by torch.save output",
         "state.json replaced by a pickle", "rng file replaced by a nested pickle",
         "huge declared size", "huge declared header"]


def forge_manifest(folder: Path, leave_out: tuple[str, ...] = ()) -> None:
    """What an attacker does after editing: recompute every size and SHA-256 (following
    links, as a reader that follows them would). A named pipe or a sparse terabyte cannot be
    hashed in time: its size is right and its checksum made up."""
    files = {}
    for p in sorted(folder.iterdir()):
        if p.name == "MANIFEST.json" or p.name in leave_out:
            continue
        hashable = stat.S_ISREG(p.stat().st_mode) and p.stat().st_size < 1 << 30
        files[p.name] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(
            p.read_bytes() if hashable else b"").hexdigest()}
    (folder / "MANIFEST.json").write_text(json.dumps({"files": files}))


# ---- the checks, on every rank of a real world ---------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def two_checkpoints(root: str) -> tuple[Any, nn.Module, torch.optim.Optimizer, Path, Path]:
    """Checkpoints at steps 1 and 2 of a trained MLP, and a pristine copy of the newest
    (rank 0's), from which each case restores it before planting something."""
    world = lockstep.init()
    model = make_model("mlp")
    opt = sgd(model.parameters())
    model(torch.zeros(2, 64)).sum().backward()
    opt.step()
    checkpoint.save(root, 1, model, opt, {})
    newest = checkpoint.save(root, 2, model, opt, {})
    pristine = Path(root).parent / "pristine"
    if world.is_main:
        shutil.copytree(newest, pristine)
    return world, model, opt, newest, pristine


def check_hostile_checkpoints(root: str, marker: str) -> list[dict[str, object]]:
    world, model, opt, newest, pristine = two_checkpoints(root)
    results = []
    for case in CASES:
        planted = ""
        if world.is_main:
            shutil.rmtree(newest)
            shutil.copytree(pristine, newest)
            planted = _plant(case, newest, Path(marker))
            forge_manifest(newest)
        world.barrier()
        results.append({"case": case, "planted": str(newest / planted),
                        **_try_to_load(root, newest, model, opt)})
    return results


def _try_to_load(root: str, newest: Path, model: torch.nn.Module,
                 opt: torch.optim.Optimizer, fits: object = None) -> dict[str, object]:
    records = _Records()
    logging.getLogger("lockstep.training.checkpoint").addHandler(records)
    try:
        chosen = checkpoint.latest_valid(root, fits)  # type: ignore[arg-type]
    finally:
        logging.getLogger("lockstep.training.checkpoint").removeHandler(records)
    try:
        checkpoint.load(newest, model, opt)
        explicit = "loaded"
    except checkpoint.CheckpointError as error:
        explicit = str(error)
    return {"auto": chosen.name if chosen else None, "warnings": records.lines,
            "explicit": explicit}


def test_payloads_are_live_under_plain_pickle(tmp_path: Path) -> None:
    """The control: without lockstep's care, each payload does run."""
    for i, (name, payload) in enumerate(PAYLOADS.items()):
        marker = tmp_path / f"control-{i}"
        with contextlib.suppress(Exception):
            pickle.loads(payload(marker))  # on purpose: our own bytes, to prove them live
        assert marker.exists(), f"payload {name!r} is not live"


def test_no_crafted_checkpoint_runs_code(world2: World, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    per_rank = world2.run(check_hostile_checkpoints, str(tmp_path / "ck"), str(marker))
    assert not marker.exists()
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == CASES
        for r in results:
            case, planted, explicit = r["case"], str(r["planted"]), str(r["explicit"])
            assert r["auto"] == "step-00000001", case  # skipped like a corrupt one
            assert f"rank {rank}:" in explicit and planted in explicit, (case, explicit)
            assert "refused to read" in explicit, (case, explicit)
            if rank == 0:
                warning = next(w for w in r["warnings"] if "skipping" in w)
                assert planted in warning and "refused to read" in warning, (case, warning)
    by_case = {r["case"]: str(r["explicit"]) for r in per_rank[0]}
    assert "naming posix.system, which is not DCP metadata" in by_case[
        "os.system (plain __reduce__)"]
    assert "torch.distributed.checkpoint.metadata.os.system" in by_case[
        "a DCP module path walked to os.system"]
    assert "builtins.exec" in by_case["builtins.exec"]
    assert "subprocess.call" in by_case["subprocess.call"]
    assert "functools.partial" in by_case["functools.partial"]
    assert "has dtype 'BYTES'" in by_case["bytes entry holding a pickle"]
    assert "needs 4398046511104 bytes, its offsets span 0" in by_case["huge declared size"]


def test_a_huge_declared_size_is_refused_without_allocating_it(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    tensorfile.write(path, {"w": torch.arange(6.0).reshape(2, 3)})
    _with_entry(path, "big", "F32", b"\0" * 16, [1 << 28])       # 1 GiB declared, 16 B there
    raw = path.read_bytes()
    lying = tmp_path / "lying-header.safetensors"
    lying.write_bytes(struct.pack("<Q", 1 << 30) + raw[8:])       # a 1 GiB header
    for hostile, expected in ((path, "needs 1073741824 bytes"),
                              (lying, "declares a header of 1073741824 bytes")):
        tracemalloc.start()
        with pytest.raises(tensorfile.FormatError, match=expected) as refused:
            tensorfile.read_header(hostile)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert str(hostile) in str(refused.value)
        assert peak < 1 << 20, f"{peak} bytes allocated to refuse {hostile.name}"


def test_tensor_files_round_trip_every_dtype_and_read_ranges(tmp_path: Path) -> None:
    tensors = {f"t{i}": t for i, t in enumerate([
        torch.randn(3, 4), torch.randn(5, dtype=torch.float64),
        torch.randn(2, 2).to(torch.bfloat16), torch.randn(7).half(), torch.tensor(3.5),
        torch.arange(10, dtype=torch.int64), torch.tensor([True, False, True]),
        torch.zeros(0, 4), torch.arange(-4, 4, dtype=torch.int8)])}
    path = tmp_path / "all.safetensors"
    tensorfile.write(path, tensors, {"note": "hi"})
    header = tensorfile.read_header(path)
    assert header.metadata == {"note": "hi"}
    with open(path, "rb") as f:
        for name, tensor in tensors.items():
            entry = header.entries[name]
            assert entry.shape == tuple(tensor.shape) and entry.dtype == tensor.dtype
            back = tensorfile.read(f, entry, 0, entry.numel).view(tensor.shape)
            assert torch.equal(back, tensor), name
        middle = tensorfile.read(f, header.entries["t5"], 3, 4)
    assert middle.tolist() == [3, 4, 5, 6]


def check_auto_resume_skips_a_crafted_checkpoint(run_dir: str, marker: str) -> str:
    world = lockstep.init()
    train(run_dir, max_steps=4, checkpoint_every_steps=2)
    newest = Path(run_dir) / "checkpoints" / "step-00000004"
    if world.is_main:
        _plant("a DCP module path walked to os.system", newest, Path(marker))
        forge_manifest(newest)
    world.barrier()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(run_dir, max_steps=4, checkpoint_every_steps=2, resume="auto")
    return printed.getvalue()


def test_resume_auto_falls_back_to_the_previous_checkpoint(world2: World,
                                                           tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    printed = world2.run(check_auto_resume_skips_a_crafted_checkpoint, str(tmp_path / "run"),
                         str(marker))[0]
    assert "resumed from" in printed and "step-00000002 at step 2" in printed
    assert not marker.exists()


def check_folders_lockstep_did_not_write_are_kept(root: str) -> tuple[str, bool, bool, bool]:
    """A user's folders named like checkpoints: saving over one is refused, pruning passes
    them by; lockstep's own older checkpoint is pruned as usual."""
    world = lockstep.init()
    model = make_model("mlp")
    opt = sgd(model.parameters())
    folder = Path(root)
    if world.is_main:
        for step in (1, 2):
            (folder / f"step-{step:08d}").mkdir(parents=True)
            (folder / f"step-{step:08d}" / "mine.txt").write_text("the user's")
    world.barrier()
    try:
        checkpoint.save(root, 2, model, opt, {})
        refused = ""
    except checkpoint.CheckpointError as error:
        refused = str(error)
    checkpoint.save(root, 3, model, opt, {}, keep=1)
    checkpoint.save(root, 4, model, opt, {}, keep=1)
    return (refused, (folder / "step-00000001" / "mine.txt").exists(),
            (folder / "step-00000002" / "mine.txt").exists(),
            (folder / "step-00000003").exists())


def test_folders_lockstep_did_not_write_are_never_deleted(world2: World,
                                                          tmp_path: Path) -> None:
    for refused, kept1, kept2, ours_left in world2.run(
            check_folders_lockstep_did_not_write_are_kept, str(tmp_path / "ckpt")):
        assert "is not a lockstep checkpoint" in refused and "rank 0:" in refused, refused
        assert kept1 and kept2 and not ours_left


# ---- files that never end, sparse terabytes and links: refused at once, never read -------

TiB = 1 << 40
SECRET = (b"SECRET!!" + b"someone else's private bytes. " * 200)[:4093]


def _retyped(path: Path, dtype: torch.dtype) -> str:
    """Rewrite the first float tensor of a tensor file as `dtype`, header and all: a
    well-formed file holding other numbers than the model's. Returns its key."""
    header = tensorfile.read_header(path)
    with open(path, "rb") as f:
        tensors = {k: tensorfile.read(f, e, 0, e.numel).view(e.shape)
                   for k, e in header.entries.items()}
    key = next(k for k, t in tensors.items() if t.is_floating_point() and t.dim() == 2)
    tensors[key] = tensors[key].to(dtype)
    tensorfile.write(path, tensors, header.metadata)
    return key


def _plant_file(case: str, folder: Path, private: Path) -> str:
    """Make `folder` hostile as `case` says, manifest forged; return what the messages must
    name (the file, or the manifest's odd name)."""
    tensors, manifest = folder / "tensors-rank0.safetensors", folder / "MANIFEST.json"
    planted, leave_out = tensors, ()
    if case == "a named pipe listed in the manifest":
        planted = folder / "notes"
        os.mkfifo(planted)
    elif case == "a sparse 1 TiB tensor file":
        os.truncate(tensors, TiB)
    elif case == "a sparse 1 TiB tensor file whose header declares it":
        _with_entry(tensors, "extra/huge", "F32", b"", [TiB // 4])
        os.truncate(tensors, tensors.stat().st_size + TiB)
    elif case == "a tensor file linked to another checkpoint's":
        tensors.unlink()
        tensors.symlink_to(folder.parent / "step-00000001" / tensors.name)
    elif case == "rank 1's tensor file unlisted and linked to a private file":
        planted = folder / "tensors-rank1.safetensors"
        planted.unlink()
        planted.symlink_to(private)
        leave_out = (planted.name,)
    elif case == "a tensor stored as int64 where the model holds float32":
        _retyped(tensors, torch.int64)
    forge_manifest(folder, leave_out)
    if case == "MANIFEST.json is a named pipe":
        manifest.unlink()
        os.mkfifo(manifest)
        planted = manifest
    elif case == "a sparse 1 TiB MANIFEST.json":
        os.truncate(manifest, TiB)
        planted = manifest
    elif case == "a manifest file name with a NUL byte":
        files = json.loads(manifest.read_text())
        files["files"]["a\0b"] = {"bytes": 1, "sha256": "0" * 64}
        manifest.write_text(json.dumps(files))
        return repr("a\0b")
    return str(planted)


FILE_CASES = ["MANIFEST.json is a named pipe", "a named pipe listed in the manifest",
              "a sparse 1 TiB tensor file", "a sparse 1 TiB tensor file whose header declares it",
              "a sparse 1 TiB MANIFEST.json", "a tensor file linked to another checkpoint's",
              "rank 1's tensor file unlisted and linked to a private file",
              "a manifest file name with a NUL byte",
              "a tensor stored as int64 where the model holds float32"]


def check_hostile_files(root: str, private: str) -> list[dict[str, object]]:
    world, model, opt, newest, pristine = two_checkpoints(root)
    results = []
    for case in FILE_CASES:
        planted = ""
        if world.is_main:
            shutil.rmtree(newest)
            shutil.copytree(pristine, newest)
            planted = _plant_file(case, newest, Path(private))
        planted = str(comm.broadcast_object(planted, 0, "test: what was planted"))
        started = time.monotonic()
        found = _try_to_load(root, newest, model, opt, checkpoint.expected(model, opt))
        results.append({"case": case, "planted": planted,
                        "seconds": time.monotonic() - started, **found})
    return results


def test_files_that_never_end_huge_files_and_links_are_refused_at_once(
        world2: World, tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.write_bytes(SECRET)
    per_rank = world2.run(check_hostile_files, str(tmp_path / "ck"), str(private))
    leaks = [str(struct.unpack("<Q", SECRET[:8])[0]), "4093", "SECRET", "private bytes"]
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == FILE_CASES
        for r in results:
            case, planted, explicit = r["case"], str(r["planted"]), str(r["explicit"])
            assert r["auto"] == "step-00000001", (case, r["warnings"])
            assert f"rank {rank}:" in explicit and planted in explicit, (case, explicit)
            assert float(r["seconds"]) < 20, (case, r["seconds"])  # not a timeout waited out
            said = " ".join([explicit, *map(str, r["warnings"])])
            assert not any(leak in said for leak in leaks), (case, said)
            if rank == 0:
                warning = next(w for w in r["warnings"] if "skipping" in w)
                assert planted in warning, (case, warning)
    said = {r["case"]: str(r["explicit"]) for r in per_rank[0]}
    assert "is a named pipe (FIFO), not a regular file" in said["MANIFEST.json is a named pipe"]
    assert "not a regular file" in said["a named pipe listed in the manifest"]
    assert "symbolic link" in said["a tensor file linked to another checkpoint's"]
    assert "not listed in the checkpoint's manifest" in said[
        "rank 1's tensor file unlisted and linked to a private file"]
    assert "more than this model's state could take" in said[
        "a sparse 1 TiB tensor file whose header declares it"]
    assert "is stored as int64, this model holds float32" in said[
        "a tensor stored as int64 where the model holds float32"]


def check_a_linked_checkpoint_folder(root: str, elsewhere: str) -> dict[str, object]:
    """A newer "checkpoint" that is a link to a folder outside the run's: never loaded."""
    world = lockstep.init()
    model = make_model("mlp")
    opt = sgd(model.parameters())
    checkpoint.save(root, 1, model, opt, {})
    if world.is_main:
        shutil.copytree(Path(root) / "step-00000001", elsewhere)
        (Path(root) / "step-00000009").symlink_to(elsewhere)
    world.barrier()
    return _try_to_load(root, Path(root) / "step-00000001", model, opt)


def test_a_checkpoint_folder_that_is_a_link_is_skipped(world2: World, tmp_path: Path) -> None:
    main, _ = world2.run(check_a_linked_checkpoint_folder, str(tmp_path / "ck"),
                         str(tmp_path / "elsewhere"))
    assert main["auto"] == "step-00000001"
    assert any("step-00000009: it is a symbolic link" in w for w in main["warnings"])
