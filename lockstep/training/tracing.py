"""The Trainer's step timeline (lockstep/comm/timeline.py): started with the run when
`TrainConfig(timeline=PATH)` or `lockstep run --timeline PATH` asks for it, written at its
end -- every rank's spans merged on rank 0, clocks aligned."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.comm import timeline
from lockstep.logs import get_logger

if TYPE_CHECKING:
    from lockstep.training.protocols import Survival

log = get_logger(__name__)


def start(path: str | None) -> timeline.Timeline | None:
    """This rank's timeline, recording from now, if one is asked for."""
    path = path or os.environ.get(timeline.ENV)
    if not path:
        return None
    recording = timeline.Timeline(path)
    timeline.activate(recording)
    return recording


def finish(recording: timeline.Timeline | None, survival: Survival) -> Path | None:
    """Stop recording; align the ranks' clocks and write the merged trace (collective)."""
    if recording is None:
        return None
    timeline.activate(None)
    aligned = survival.collective(timeline.align_clocks)
    if aligned is None:  # left out meanwhile: the others wrote it
        return None
    offsets, error_ns = aligned
    written = survival.collective(lambda: timeline.write_merged(recording, offsets, error_ns))
    if written is not None:
        kept = len(recording.steps())
        log.info("timeline: %s (%d steps kept per rank, clocks aligned to within %.0f us); "
                 "open it in ui.perfetto.dev or chrome://tracing", written, kept,
                 error_ns / 1000)
    return written
