"""torch DistributedDataParallel's constructor arguments, read as DataParallel's.

A script written for DDP switches to lockstep by changing the import and the wrapper's
name. Its keywords are taken where they mean something here and refused, with the reason,
where they do not -- never silently ignored when ignoring them would change the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep import comm

# Accepted and without effect: what they tune is how lockstep always works.
_NO_EFFECT = {
    "check_reduction": "deprecated in torch, and without effect there too",
    "gradient_as_bucket_view": ".grad is always a view of its bucket here",
    "static_graph": "the reducer handles a fixed graph without being told",
    "batched_grad_copy": "gradients are copied into buckets as they arrive",
}
# Refused unless left at their defaults: honouring them needs machinery lockstep lacks.
_UNSUPPORTED = {
    "mixed_precision": "use TrainConfig(precision=...) or torch.autocast",
    "device_mesh": "pass the process group as process_group= (or group=)",
    "delay_all_reduce_named_params": "every gradient is reduced in the backward pass",
    "param_to_hook_all_reduce": "every gradient is reduced in the backward pass",
    "skip_all_reduce_unused_params": "use find_unused_parameters=True",
    "bucket_cap_mb_list": "use bucket_cap_mb (one cap) and first_bucket_mb",
}


@dataclass
class DDPOptions:
    """DDP's keywords that map onto DataParallel's own (None: not given)."""

    group: comm.Group = None
    bucket_mb: float | None = None
    find_unused: bool | None = None
    broadcast_buffers: bool | None = None
    init_sync: bool = True


def read_ddp_arguments(module: nn.Module, kwargs: dict[str, Any]) -> DDPOptions:
    """Translate DDP's keyword arguments; raise TypeError/ValueError for the rest."""
    options = DDPOptions()
    given = dict(kwargs)
    _check_devices(module, given.pop("device_ids", None), given.pop("output_device", None))
    if given.pop("dim", 0) != 0:
        raise ValueError("DataParallel: dim only matters when DDP scatters inputs over "
                         "several devices per process; lockstep runs one device per process")
    options.group = given.pop("process_group", None)
    options.bucket_mb = given.pop("bucket_cap_mb", None)
    options.find_unused = given.pop("find_unused_parameters", None)
    options.broadcast_buffers = given.pop("forward_sync_buffers", None)
    options.init_sync = bool(given.pop("init_sync", True))
    for name in list(given):
        if name in _NO_EFFECT or (name in _UNSUPPORTED and given[name] in (None, False)):
            given.pop(name)
        elif name in _UNSUPPORTED:
            raise ValueError(f"DataParallel does not support DDP's {name}=: "
                             f"{_UNSUPPORTED[name]}")
    if given:
        raise TypeError(f"DataParallel got unexpected keyword argument(s) "
                        f"{', '.join(sorted(given))}")
    return options


def _check_devices(module: nn.Module, device_ids: Any, output_device: Any) -> None:
    """DDP's rule: CPU modules take no device ids; a GPU module takes the one device it
    lives on (one device per process)."""
    if device_ids is None and output_device is None:
        return
    devices = {p.device for p in module.parameters()}
    if any(d.type == "cpu" for d in devices):
        raise ValueError(f"DataParallel: device_ids={device_ids} and output_device="
                         f"{output_device} are for modules on one GPU, but this module is on "
                         "the CPU; leave them out (as DDP requires)")
    wanted = [_index(d) for d in (device_ids or [])] + (
        [_index(output_device)] if output_device is not None else [])
    have = {d.index for d in devices}
    if len(set(wanted)) > 1 or not set(wanted) <= have:
        raise ValueError(f"DataParallel: device_ids={device_ids}, output_device="
                         f"{output_device} do not name the one device the module is on "
                         f"({sorted(have)}); lockstep runs one device per process")


def _index(device: Any) -> int | None:
    if isinstance(device, int):
        return device
    return torch.device(device).index


def pick(name: str, value: Any, ddp_name: str, ddp_value: Any, default: Any) -> Any:
    if value is not None and ddp_value is not None:
        raise TypeError(f"DataParallel got both {name}= and DDP's {ddp_name}=; pass one")
    return value if value is not None else ddp_value if ddp_value is not None else default


class NothingToTrainError(RuntimeError, ValueError):
    """The module has no parameter that requires a gradient. A RuntimeError, as DDP's
    refusal is (code that catches DDP's error catches this one); a ValueError too, as
    lockstep's was before."""


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters that need reducing: those with requires_grad, each once (tied weights
    share one entry), in registration order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def requires_grad_mask(module: nn.Module) -> tuple[bool, ...]:
    """Which parameters train, for noticing when that changes between steps."""
    return tuple(p.requires_grad for p in module.parameters())


def check_trainable(module: nn.Module) -> None:
    if not any(p.requires_grad for p in module.parameters()):
        raise NothingToTrainError("DataParallel: the module has no parameter that requires "
                                  "a gradient, so there is nothing to average across ranks "
                                  "(as DDP, this is refused); run it without a wrapper")
