"""What a wrapper owns: one live wrapper per parameter, and everything it made, given back.

Two live wrappers of one module would each scale a gradient by 1/N in the same bucket
slot, so the newest takes over (replica.py closes the older). What a wrapper registers --
its reducer's hooks, its reduction's threads and groups, ZeRO's gather hooks -- is kept in
an `Owned`, released by `close()` or by a finalizer once the wrapper is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lockstep.comm.world import before_exit
from lockstep.replication.reducer import Reducer
from lockstep.replication.reduction import Reduction


class Owned:
    """What a wrapper gives back when closed or collected: its reducer's hooks, its
    reduction's threads and groups, then whatever else it registered (ZeRO's gather
    hooks). It holds no reference to the wrapper, so the wrapper can be collected while
    this waits in its finalizer."""

    def __init__(self) -> None:
        self.reducer: Reducer | None = None
        self.reduction: Reduction | None = None
        self._releases: list[Callable[[], None]] = []

    def add(self, release: Callable[[], None]) -> None:
        self._releases.append(release)

    def release(self) -> None:
        if self.reducer is not None:
            self.reducer.detach()
        if self.reduction is not None:
            self.reduction.close()
        for release in self._releases:
            release()


# Wrappers that claimed parameters (weakly): at exit each one not yet closed gives back its
# threads and groups before the process group goes -- as its finalizer would, but while
# the interpreter is whole and the groups can still end their Gloo threads (comm/world.py).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()

# Which live wrapper reduces each parameter's gradient (weakly: a dropped wrapper is
# collected, and its entries go with it).
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def claim(param: torch.Tensor, wrapper: Any) -> None:
    _OWNERS[param] = weakref.ref(wrapper)
    _LIVE.add(wrapper)


def owner_of(param: torch.Tensor) -> Any:
    """The live (not closed) wrapper that reduces `param`'s gradient, or None."""
    ref = _OWNERS.get(param)
    wrapper = ref() if ref is not None else None
    return wrapper if wrapper is not None and wrapper._release.alive else None


def _release_live() -> None:
    for wrapper in list(_LIVE):
        release = getattr(wrapper, "_release", None)  # None: its construction failed
        if release is not None:
            release()  # the finalizer: runs once, a no-op for a closed wrapper


before_exit(_release_live)
