"""Is a checkpoint folder intact, and is it safe to read? Both are checked before loading.

Intact: every file the manifest lists has its size and SHA-256. The manifest is a checksum,
not a signature -- whoever can write the folder can recompute it -- so the format is checked
too: only lockstep's own file names, every tensor file's header (lockstep.training.tensorfile) and
the pieces they describe (lockstep.training.checkpoint_files), and every JSON file parses as an
object. Nothing is unpickled, ever; a pickle found in a checkpoint is refused and described
by the globals it names, read from its opcodes.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickletools
import re
from pathlib import Path
from typing import Any

from lockstep.training import checkpoint_files
from lockstep.training.tensorfile import FormatError, no_duplicates

MANIFEST = "MANIFEST.json"
STATE = "state.json"
_FILES = re.compile(r"MANIFEST\.json|state\.json|rng-rank\d+\.json|tensors-rank\d+\.safetensors")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_of(folder: Path) -> dict[str, Any]:
    """The manifest of every file in `folder` (but itself)."""
    return {"files": {p.name: {"bytes": p.stat().st_size, "sha256": _digest(p)}
                      for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}}


def verify(folder: Path) -> str | None:
    """None if `folder` is a complete, intact checkpoint that lockstep can read safely;
    otherwise what is wrong with it. The manifest is a checksum, not a signature (whoever
    can write the folder can recompute it), so the format is checked as well."""
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        return manifest
    for name in manifest:  # checked before any file is opened: a name is not a path
        if not _FILES.fullmatch(name):
            return _foreign(folder / name) if "/" not in name and name not in ("", ".", "..") \
                else f"its manifest names {name!r}, which is not a file of a checkpoint"
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} is truncated ({path.stat().st_size} of {expected['bytes']} bytes)"
        if _digest(path) != expected["sha256"]:
            return f"{name} is corrupt (checksum mismatch)"
    return _refusal(folder, set(manifest))


def _read_manifest(folder: Path) -> dict[str, dict[str, Any]] | str:
    try:
        files = json.loads((folder / MANIFEST).read_text(), object_pairs_hook=no_duplicates)
        files = files["files"]
        if all(isinstance(e, dict) and isinstance(e.get("bytes"), int)
               and isinstance(e.get("sha256"), str) for e in files.values()):
            return dict(files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass
    return "its manifest is missing or unreadable"


def _refusal(folder: Path, names: set[str]) -> str | None:
    """Why lockstep will not read this checkpoint, or None: every header and JSON file is
    checked here, on rank 0, so that a crafted one is skipped like a corrupt one."""
    for required in (STATE, checkpoint_files.TENSORS.format(0)):
        if required not in names:
            return f"{required} is missing"
    try:
        checkpoint_files.catalog(folder)
        for name in sorted(n for n in names if n.endswith(".json") and n != MANIFEST):
            read_json(folder / name)
    except FormatError as error:
        return f"refused to read {error}"
    return None


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise FormatError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: not a JSON object")
    return value


def _foreign(path: Path) -> str:
    """What a file that lockstep does not write is, for the refusal message. A pickle is
    described by the globals it names, read from its opcodes -- never by loading it."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError:
        head = b""
    if not (head.startswith(b"\x80") or path.name == ".metadata"):
        return f"refused to read {path}: lockstep does not write such a file in a checkpoint"
    names = pickle_globals(head)
    odd = [n for n in names if not n.startswith(("torch.", "pathlib.", "collections."))]
    what = f"a pickle naming {', '.join(names)}" if names else "a pickle"
    if odd:
        what += ", which is not DCP metadata"
    return (f"refused to read {path}: it is {what}. A pickle can run code, and lockstep's "
            "checkpoints hold none (torch.distributed.checkpoint's format, which earlier "
            "versions wrote, is refused too)")


def pickle_globals(data: bytes) -> list[str]:
    """The module.name globals a pickle refers to, read statically with pickletools."""
    names: list[str] = []
    strings: list[str] = []
    memo: dict[int, str] = {}
    pushed: str | None = None
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif op.name == "MEMOIZE" and pushed is not None:
                memo[len(memo)] = pushed
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT") and pushed is not None:
                memo[int(str(arg))] = pushed
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and int(str(arg)) in memo:
                strings.append(memo[int(str(arg))])
            pushed = arg if isinstance(arg, str) and "UNICODE" in op.name else None
            if pushed is not None:
                strings.append(pushed)
    except Exception:  # truncated or malformed: what was read is enough for a message
        pass
    return sorted(set(names))
