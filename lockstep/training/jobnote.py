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
    if not path:
        return
    # Written aside and renamed over the note: a SIGINT that lands mid-write (Ctrl-C is
    # exactly when the launcher reads it) must leave the previous note whole, not an
    # empty file truncated in place.
    aside = Path(f"{path}.{os.getpid()}")
    aside.write_text(f"{int(resumes)} {folder.resolve()}")
    os.replace(aside, path)


def last_checkpoint(note: Path) -> tuple[str, bool] | None:
    """(folder, whether the same command resumes from it) of the newest, if any was written."""
    try:
        resumes, _, folder = note.read_text().strip().partition(" ")
    except FileNotFoundError:
        return None
    return (folder, resumes == "1") if folder else None
