"""The trained weights alone, for inference: no optimizer, no wrapper, no lockstep needed.

    lockstep.export_weights(trainer.model, "model.safetensors")   # or "model.pt"
    net = lockstep.load_weights(small_cnn(), "model.safetensors")  # a plain nn.Module

".safetensors" files need the `safetensors` package (pip install safetensors); any other
name is a plain state dict of tensors that `torch.load(path, weights_only=True)` reads.
Nothing is unpickled but tensors, so a weights file from elsewhere runs no code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep import comm
from lockstep.training.optional import available

_NO_SAFETENSORS = ("{path}: .safetensors files need the safetensors package, which is not "
                   "installed: pip install safetensors (or pip install 'lockstep[export]'), "
                   "or give the file a .pt name")


def _need_safetensors(path: Path) -> None:
    if path.suffix == ".safetensors" and not available("safetensors"):
        raise ModuleNotFoundError(_NO_SAFETENSORS.format(path=path), name="safetensors")


def export_weights(model: Any, path: str | Path) -> Path | None:
    """Save `model`'s weights and buffers (a DataParallel or a sharded one, LocalSGD, DiLoCo
    or a plain module). Call on every rank of a job: a ZeRO-3 model gathers its shards
    (`full_state_dict`, a collective). Rank 0 writes and returns the path, the others None."""
    path = Path(path)
    _need_safetensors(path)  # before a ZeRO-3 gather, on every rank
    whole = model.full_state_dict() if hasattr(model, "full_state_dict") else \
        {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {k: v.cpu().contiguous() for k, v in whole.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


def load_weights(module: nn.Module, path: str | Path) -> nn.Module:
    """Load a file from `export_weights` into a plain (unwrapped) module; returns it. A
    tensor whose dtype differs from the module's is refused, not converted."""
    path = Path(path)
    _need_safetensors(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    own = module.state_dict()
    for key, value in state.items():
        if key in own and isinstance(value, torch.Tensor) and value.dtype != own[key].dtype:
            raise ValueError(f"{path}: {key} is stored as {value.dtype}, the module holds "
                             f"{own[key].dtype}; convert the module (e.g. .double()) or the "
                             "file if that is meant, lockstep does not convert weights")
    module.load_state_dict(state)
    return module


def export_run(model: Any, path: str | Path, finished_before: bool) -> Path | None:
    """Trainer.export: the weights to `path` -- except after a fit() that found the run
    already finished, where a file already at `path` holds the same weights and is left
    as it is (remove it to write it again)."""
    if finished_before and comm.broadcast_object(  # one answer: ZeRO-3 gathers
            Path(path).is_file(), 0, "trainer: is the finished run's export there"):
        if comm.rank_of() == 0:
            print(f"{path} exists and this run had already finished: left as it is "
                  "(remove it to export again)", flush=True)
        return Path(path) if comm.rank_of() == 0 else None
    return export_weights(model, path)
