"""Rank-aware logging: every record says which rank wrote it; only rank 0 speaks at INFO."""

from __future__ import annotations

import logging
import os

_ROOT = "lockstep"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def setup_logging(rank: int) -> None:
    """Attach one handler to the `lockstep` logger that prefixes records with the rank.

    Rank 0 logs at INFO, the others at WARNING, unless LOCKSTEP_LOG_LEVEL says otherwise.
    Safe to call again (a second init after shutdown): the rank is updated in place.
    """
    root = logging.getLogger(_ROOT)
    for handler in root.handlers:
        for f in handler.filters:
            if isinstance(f, _RankFilter):
                f.rank = rank
                return
    handler = logging.StreamHandler()
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter("[lockstep rank %(rank)s] %(levelname)s %(message)s"))
    root.addHandler(handler)
    default = "INFO" if rank == 0 else "WARNING"
    root.setLevel(os.environ.get("LOCKSTEP_LOG_LEVEL", default).upper())
    root.propagate = False

