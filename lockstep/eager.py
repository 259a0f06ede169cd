"""Methods kept out of torch.compile's graphs, without loading the compiler in every process.

A wrapper's hooks run collectives and swap storage in and out; a compiled graph must not
trace them (it would replay them against storage that is no longer there), so they are
`torch.compiler.disable`d. But that decorator imports torch._dynamo, 2.3 s of CPU -- more
than a third of a worker's start (measured: `import lockstep` and its wrappers 3.4 s with
it, 0.3 s without; torch itself 2.2 s) -- in every process, compiling or not.

`@eager` marks a method instead. It stays the plain function until torch._dynamo is loaded
(by torch.compile, or by anything else), and becomes its disabled form the moment that
import completes: before any graph can be traced, whichever comes first, wrapping or
compiling. Callers look the method up at call time (a hook calls `self._method(...)`, it
does not hold the function), so they always reach the current form.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar, cast

import torch

COMPILER = "torch._dynamo"

_marked: list[tuple[type, str, Callable[..., Any]]] = []
_lock = threading.Lock()


F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """Decorator: keep this method out of compiled graphs (torch.compiler.disable), applied
    once torch._dynamo is loaded."""
    return cast(F, _Eager(fn))


class _Eager:
    """Stands in the class body until the class exists, then registers the method."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        with _lock:
            _marked.append((owner, name, self.fn))
            loaded = COMPILER in sys.modules
        setattr(owner, name, torch.compiler.disable(self.fn) if loaded else self.fn)


def _disable_marked() -> None:
    with _lock:
        for owner, name, fn in _marked:
            setattr(owner, name, torch.compiler.disable(fn))


class _WhenCompilerLoads(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo as the other finders do, and runs `_disable_marked` right after
    the module has executed (a post-import hook)."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != COMPILER:
            return None
        sys.meta_path.remove(self)  # once; and not asked again by the lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, execute = spec.loader, spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _disable_marked()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if COMPILER not in sys.modules:
    sys.meta_path.insert(0, _WhenCompilerLoads())
