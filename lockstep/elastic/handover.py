"""Handing training state from a live peer to the ranks that need it, over the network.

When a worker joins, or a survivor is a step behind its peers, rank 0 of the new
membership sends it everything it needs to continue exactly where the others are: the
model's parameters and buffers, the optimizer's state (momenta, step counts, learning
rates), the wrapper's own tensors (DiLoCo's outer state), the RNG states, and small
objects (the step, the data position, the user's `state_dict()`s). Nothing touches disk.

Called on every rank of the membership. When one rank needs the state (a joiner, the
usual case), rank 0 sends it to that rank alone and the others go on -- over a CPU group
in two messages, its size and then one buffer of everything; otherwise tensors travel as
broadcasts, one per dtype, and ranks that are already level take part but keep their own
state. The layout the tensors need (the optimizer state's shapes, the objects) is pickled
among the ranks -- peers of one job, as with every object lockstep's ranks exchange (sent
to one rank, it is unpickled as data only: comm/packing.py); nothing from outside the job
is unpickled.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.replication.compress import PER_RANK

SOURCE = 0  # membership.decide puts the rank holding the newest state first


class _Slot:
    """Stands for a tensor inside a pickled layout: where it goes and what it is."""

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index, self.shape, self.dtype = index, tuple(tensor.shape), tensor.dtype
        self.device = str(tensor.device)


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with each tensor replaced by a _Slot, the tensors appended to `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, obj)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _slots(obj: Any) -> Iterator[_Slot]:
    if isinstance(obj, _Slot):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _slots(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _slots(v)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _wrapper_tensors(wrapper: Any) -> dict[str, torch.Tensor]:
    """Tensors a wrapper keeps besides the module's (DiLoCo's theta and momenta). Not each
    rank's own (error feedback): a newcomer starts its own from zero."""
    extra = getattr(wrapper, "checkpoint_tensors", None)
    return {k: t for k, t in (extra() if extra is not None else {}).items()
            if not k.startswith(PER_RANK)}


def hand_over(module: nn.Module, optimizer: torch.optim.Optimizer | None, wrapper: Any,
              objects: dict[str, Any], *, behind: list[int], receive_wrapper: bool
              ) -> dict[str, Any]:
    """Send rank 0's state to the ranks `behind`, which load it, and -- with
    `receive_wrapper` (a fresh wrapper on every rank) -- the wrapper's tensors to every
    rank. `objects` is small picklable state (step, data position); rank 0's comes back on
    the ranks that receive it (sent to one rank alone, the others get their own back).
    `optimizer` None: ZeRO, whose parameters and optimizer state every rank received from
    the pool (sharding/recovery.py): only the buffers travel."""
    receive = comm.rank_of() in behind
    if len(behind) == 1 and not (receive_wrapper and _wrapper_tensors(wrapper)):
        return _hand_to_one(module, optimizer, wrapper, objects, behind[0], receive)
    mine = comm.rank_of() == SOURCE
    tensors: list[torch.Tensor] = []
    layout = _layout(module, optimizer, wrapper, objects, tensors) if mine else None
    layout = comm.broadcast_object(layout, SOURCE, "handover: the layout of rank 0's state")
    if not mine:
        tensors = _empty_like_slots(layout)
    comm.broadcast_tensors(tensors, SOURCE, "handover: rank 0's model and optimizer state")
    state = _join(layout, tensors)
    if receive and not mine:
        _load(module, optimizer, state)
    if (receive or receive_wrapper) and not mine:
        _load_into(_wrapper_tensors(wrapper), state["wrapper"])
    return dict(state["objects"])


def _hand_to_one(module: nn.Module, optimizer: torch.optim.Optimizer | None, wrapper: Any,
                 objects: dict[str, Any], to: int, receive: bool) -> dict[str, Any]:
    """Rank 0 sends its state to rank `to` alone (a broadcast made every member receive a
    copy it does not need: N-1 copies of the model for one joiner); the others return.
    Over a CPU group it goes packed in two messages (comm.send_packed), on a joiner's
    path: each message is a round trip between the two."""
    what = "handover: rank 0's model and optimizer state"
    packed = comm.device_of().type == "cpu"
    if comm.rank_of() == SOURCE:
        tensors: list[torch.Tensor] = []
        layout = _layout(module, optimizer, wrapper, objects, tensors)
        if packed:
            comm.send_packed(layout, tensors, to, what)
        else:
            comm.send_object(layout, to, "handover: the layout of rank 0's state")
            comm.send_tensors(tensors, to, what)
        return objects
    if not receive:
        return objects
    if packed:
        layout, tensors = comm.recv_packed(SOURCE, what, allow=(_Slot,))
    else:
        layout = comm.recv_object(SOURCE, "handover: the layout of rank 0's state")
        tensors = _empty_like_slots(layout)
        comm.recv_tensors(tensors, SOURCE, what)
    state = _join(layout, tensors)
    _load(module, optimizer, state)
    _load_into(_wrapper_tensors(wrapper), state["wrapper"])
    return dict(state["objects"])


def _layout(module: nn.Module, optimizer: torch.optim.Optimizer | None, wrapper: Any,
            objects: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    """Rank 0's state with its tensors moved to `tensors` (see _split)."""
    return _split({"model": _module_state(module, whole=optimizer is not None),
                   "optimizer": optimizer.state_dict() if optimizer else None,
                   "wrapper": _wrapper_tensors(wrapper), "rng": _rng_state(),
                   "objects": objects}, tensors)


def _empty_like_slots(layout: Any) -> list[torch.Tensor]:
    return [torch.empty(s.shape, dtype=s.dtype, device=_device(s.device))
            for s in sorted(_slots(layout), key=lambda s: s.index)]


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":  # each rank's own GPU, whichever rank 0 used
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _module_state(module: nn.Module, whole: bool, keep_vars: bool = False
                  ) -> dict[str, torch.Tensor]:
    """Its parameters and buffers, or (ZeRO) its buffers only."""
    if whole:
        return dict(module.state_dict(keep_vars=keep_vars))
    return {name: b if keep_vars else b.detach() for name, b in module.named_buffers()}


def _load(module: nn.Module, optimizer: torch.optim.Optimizer | None,
          state: dict[str, Any]) -> None:
    with torch.no_grad():
        _load_into(_module_state(module, optimizer is not None, keep_vars=True), state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])


def _load_into(targets: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """Copy in place, so tensors others hold (an optimizer's parameters) stay the same."""
    missing = sorted(set(values) ^ set(targets))
    if missing:
        raise RuntimeError(f"rank {comm.rank_of()}: handover: this rank's state and rank 0's "
                           f"differ in {missing[:4]}; every worker must build the same model")
    with torch.no_grad():
        for name, value in values.items():
            targets[name].copy_(value)
