"""Packages whose modules load on first use (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def submodules_on_demand(package: str) -> Callable[[str], object]:
    """A package's module `__getattr__` that imports `package.<name>` when first asked for
    it, so `lockstep.training.checkpoint` works after a bare `import lockstep`."""
    def __getattr__(name: str) -> object:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return __getattr__
