"""ZeRO stage 3's parameter lifecycle: whole just in time, sharded at rest.

Every module that owns parameters gathers the units they belong to before its forward and
releases them after; the gathering order seen in the first forward is remembered, so each
gather also prefetches the unit that comes next. In backward a unit is gathered again when
the gradient of its module's output arrives, and released once its gradients are
reduce-scattered (Sharding.on_reduced).

At rest a sharded parameter's memory is empty, so nothing may read it then: the module's
`state_dict()` is refused with what to call instead (`DataParallel.full_state_dict()`, a
collective), and so are its forward and `state_dict()` after its wrapper was dropped without
`close()` (which gives the module its full parameters back) -- reading empty storage would
kill the process without a Python error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lockstep import comm
from lockstep.comm import timeline
from lockstep.eager import eager
from lockstep.replication.outputs import find_tensors
from lockstep.sharding.zero import FlatGroup


class Gatherer:
    """Stage 3's parameter lifecycle, driven by module hooks.

    Every module that owns parameters gathers the units they belong to before its forward
    and releases them after; the gathering order seen in the first forward is remembered,
    so each gather also prefetches the unit that comes next. In backward a unit is gathered
    again when the gradient of its module's output arrives, and released once its
    gradients are reduce-scattered (Sharding.on_reduced)."""

    def __init__(self, module: nn.Module, groups: list[FlatGroup], group: comm.Group) -> None:
        self.groups, self.group = groups, group
        # Known now: a finalizer at interpreter exit may run after the process group is gone.
        self.rank = comm.rank_of()
        unit_of = {id(p): g.index for g in groups for p in g.params}
        self.users = [0] * len(groups)
        self.order: list[int] = []
        self._recording = True
        self.exact = False  # gathers in full precision whatever the wire (all_gathered)
        self._in_backward = [False] * len(groups)
        self.owners = [sub for sub in module.modules()
                       if any(id(p) in unit_of for p in sub.parameters(recurse=False))]
        self._handles = []
        for sub in self.owners:
            # A frozen parameter is in no unit: it stays whole on every rank (as DDP leaves
            # it alone), also beside a trainable one in the same module.
            units = sorted({unit_of[id(p)] for p in sub.parameters(recurse=False)
                            if id(p) in unit_of})
            self._handles += [sub.register_forward_pre_hook(self._before(units)),
                              sub.register_forward_hook(self._after(units)),
                              sub.register_state_dict_pre_hook(self._refuse_state_dict)]

    # The hooks' work is never traced by torch.compile (in either order of compile and
    # shard): it runs collectives and swaps storage in and out, which a compiled graph would
    # replay against storage that is no longer there. Compiled code runs between them. Each
    # hook calls an @eager method by name (eager.py), so it reaches its disabled form even
    # when torch._dynamo was loaded after the hook was registered.
    def _before(self, units: list[int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._acquire_for_forward(units)
        return hook

    def _after(self, units: list[int]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            return self._after_forward(units, output)
        return hook

    def _before_backward(self, units: list[int]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._acquire_for_backward(units)
        return hook

    @eager
    def _acquire_for_forward(self, units: list[int]) -> None:
        for u in units:
            self.acquire(u, backward=False)

    @eager
    def _after_forward(self, units: list[int], output: Any) -> Any:
        for u in units:
            self.users[u] -= 1
            if self.users[u] == 0 and not self._in_backward[u]:
                self.groups[u].release()
        if torch.is_grad_enabled():
            for t in find_tensors(output):
                if t.requires_grad:
                    t.register_hook(self._before_backward(units))
        return output

    @eager
    def _acquire_for_backward(self, units: list[int]) -> None:
        self._recording = False
        for u in units:
            if not self._in_backward[u]:
                self._in_backward[u] = True
                self.acquire(u, backward=True)

    def acquire(self, u: int, backward: bool) -> None:
        """Make unit u whole for use, and start gathering the one expected next: the next
        in forward order, or the previous one in backward."""
        self.users[u] += 1
        self._gather(u)
        if self._recording:  # the first forward teaches the order
            if u not in self.order:
                self.order.append(u)
            return
        if self.exact:  # every unit gathered in turn, each exactly: nothing to prefetch
            return
        if u in self.order:
            j = self.order.index(u) + (-1 if backward else 1)
            if 0 <= j < len(self.order):
                self._prefetch(self.order[j])

    def _gather(self, u: int) -> None:
        group = self.groups[u]
        if group.pending is not None:
            group.finish_prefetch()
        elif not group.gathered:
            with timeline.span(f"gather of parameter unit {u}", "comm"):
                group.start_gather(f"gather of parameter unit {u}", self.group,
                                   exact=self.exact).wait()
        group.gathered = True

    def _prefetch(self, u: int) -> None:
        group = self.groups[u]
        if group.gathered or group.pending is not None:
            return
        group.pending = group.start_gather(f"prefetch of parameter unit {u}", self.group)

    def reduced(self, u: int) -> None:
        """Unit u's gradients are reduce-scattered: its parameters can go."""
        self._in_backward[u] = False
        self.users[u] = max(0, self.users[u] - 1)
        if self.users[u] == 0:
            self.groups[u].release()

    def end_of_step(self) -> None:
        """After backward: every unit released (a prefetch may still be in flight)."""
        self._recording = False
        for u, group in enumerate(self.groups):
            if group.pending is not None:
                group.finish_prefetch()  # gathered now, so released below
            self._in_backward[u] = False
            self.users[u] = 0
            if group.gathered:
                group.release()

    def _refuse_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if all(g.gathered for g in self.groups):
            return
        raise RuntimeError(
            f"rank {comm.rank_of(self.group)}: state_dict() of a ZeRO stage-3 model: its "
            "parameters are sharded across ranks and not held whole here. Call "
            "model.full_state_dict() on every rank (it gathers them), or model.close() to "
            "give the module its full parameters back; lockstep's checkpoints save the shards "
            "directly.")

    @contextmanager
    def all_gathered(self, exact: bool = False) -> Iterator[None]:
        """Every unit whole, for the duration (collective: every rank must enter); with
        `exact`, the masters themselves even where the wire is compressed."""
        # Not a forward: the order it gathers in is not the forward's (were it recorded,
        # a state dict taken before the first forward would have every prefetch wrong)
        self.exact, recording, self._recording = exact, self._recording, False
        try:
            for u in range(len(self.groups)):
                self.acquire(u, backward=False)
        finally:
            self.exact, self._recording = False, recording
        try:
            yield
        finally:
            for u in range(len(self.groups)):
                self.reduced(u)

    def give_back(self) -> None:
        """Collective: gather every unit and give each parameter its own full memory, so
        the module works alone again; then stop managing it."""
        with self.all_gathered(exact=True):
            for g in self.groups:
                for p in g.params:
                    p.data = p.detach().clone()
        self.remove_hooks()

    @property
    def managing(self) -> bool:
        """Whether its hooks still manage the module (not given back or removed)."""
        return bool(self._handles)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def gather_all(groups: Sequence[FlatGroup], what: str, process_group: comm.Group,
               exact: bool = False) -> None:
    """Make every group's full buffer whole from the shards (decoded where the wire is
    compressed, unless `exact`): all gathers launched, then waited, so the backend may run
    them side by side. (At stages 1-2 a shard is its slice of the buffer already: copying
    it in is a copy onto itself, which torch skips.)"""
    gathers = [g.start_gather(f"{what} of parameter group {g.index}", process_group, exact)
               for g in groups]
    for work in gathers:
        work.wait()


def guard_orphans(owners: list[nn.Module], groups: list[FlatGroup], rank: int) -> None:
    """The wrapper was dropped without close(): its shards are gone, and the module's
    parameters have no values. Make every use of them an error instead of a crash. Asks
    nothing of the process group (`rank` is the caller's): this runs from a finalizer,
    also at interpreter exit, when the group may be destroyed already."""
    names = [n for g in groups for n in g.names]
    message = (f"rank {rank}: the parameters of this module ({', '.join(names[:4])}"
               f"{', ...' if len(names) > 4 else ''}) were sharded by a ZeRO stage-3 wrapper "
               "(lockstep.shard) that was dropped without close(); their values are gone. Call "
               "model.close() (which gives the module its full parameters back) or save "
               "model.full_state_dict() before dropping the wrapper.")

    def refuse(*args: Any) -> None:
        raise RuntimeError(message)

    for module in owners:
        module.register_forward_pre_hook(refuse)
        module.register_state_dict_pre_hook(refuse)
