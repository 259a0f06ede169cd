"""A note from the workers to their launcher: where the newest checkpoint is.

`lockstep run` sets LOCKSTEP_CHECKPOINT_NOTE to a file of its own; the Trainer's rank 0
writes each checkpoint's folder there once the checkpoint is complete. When the job is
interrupted, the launcher's one line can then say where to resume from. Outside
`lockstep run` (plain torchrun, no launcher) nothing is written.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "LOCKSTEP_CHECKPOINT_NOTE"


def checkpoint_written(folder: Path) -> None:
    path = os.environ.get(ENV)
    if path:
        Path(path).write_text(str(folder.resolve()))


def last_checkpoint(note: Path) -> str | None:
    """The folder written last, if any was."""
    try:
        return note.read_text().strip() or None
    except FileNotFoundError:
        return None
