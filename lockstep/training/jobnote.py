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


def checkpoint_written(folder: Path, resumes: bool) -> None:
    """Rank 0: `folder` is complete; `resumes` says whether re-running the same command
    continues from it (resume="auto") or starts afresh."""
    path = os.environ.get(ENV)
    if path:
        Path(path).write_text(f"{int(resumes)} {folder.resolve()}")


def last_checkpoint(note: Path) -> tuple[str, bool] | None:
    """(folder, whether the same command resumes from it) of the newest, if any was written."""
    try:
        resumes, _, folder = note.read_text().strip().partition(" ")
    except FileNotFoundError:
        return None
    return (folder, resumes == "1") if folder else None
