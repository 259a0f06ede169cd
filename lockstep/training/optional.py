"""Optional pieces (matplotlib, TensorBoard, MLflow, ...): when one is missing, say once what
was skipped and what to install, instead of leaving a user to wonder where the plot went."""

from __future__ import annotations

import importlib.util

from lockstep.logs import get_logger

log = get_logger(__name__)
_reported: set[str] = set()  # once per process: a message per log line would drown the run


def available(module: str) -> bool:
    """Whether `module` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def report_missing(skipped: str, install: str) -> None:
    """Log (once per process) that `skipped` did not happen and how to get it."""
    if skipped in _reported:
        return
    _reported.add(skipped)
    log.warning("skipped %s: %s", skipped, install)
