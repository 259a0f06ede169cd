"""The Trainer's step timeline (lockstep/comm/timeline.py) and its per-window attribution
(attribution.py): started with the run when `TrainConfig(timeline=PATH)` or `lockstep run
--timeline PATH` asks for it; every logged window says where the step time went and who
the others waited for; at the end every rank's spans are merged on rank 0, clocks aligned."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from lockstep import comm
from lockstep.comm import timeline
from lockstep.logs import get_logger
from lockstep.training.attribution import RankWindow, Stragglers, attribute, summarize
from lockstep.training.links import LinkProbe

if TYPE_CHECKING:
    from lockstep.training.protocols import Survival
    from lockstep.training.runlog import RunLog

log = get_logger(__name__)
T = TypeVar("T")


class Tracing:
    """This rank's part: records while the run trains (if asked), reports each window."""

    def __init__(self, path: str | None) -> None:
        path = path or os.environ.get(timeline.ENV)
        self.recording = timeline.Timeline(path) if path else None
        self.stragglers = Stragglers()
        self.links = LinkProbe()
        timeline.activate(self.recording)

    def window(self, survival: Survival, runlog: RunLog, step: int, steps: int,
               bytes_per_step: float) -> None:
        """The logged window that ends at `step` (`steps` long): one line and its metrics,
        and a straggler named once it has been behind long enough (collective)."""
        if self.recording is None or steps == 0:
            return
        mine = summarize(self.recording, step - steps + 1, step)
        everyone = survival.collective(lambda: _gather(mine))
        if everyone is None:  # left out meanwhile: the others reported this window
            return
        found = attribute(everyone, bytes_per_step)
        if found.comm_bound:  # the same verdict on every rank: all of them probe, or none
            slow = survival.collective(self.links.slow_link)
            if slow is not None:
                found = found.blaming(slow)
        runlog.record("timeline", step, **found.record())
        runlog.message(found.line(step))
        named = self.stragglers.observe(found)
        if named is not None:
            runlog.record("straggler", step, rank=found.slowest, cause=found.cause,
                          behind=found.behind)
            runlog.message(named)

    def finish(self, survival: Survival) -> Path | None:
        """Stop recording; align the ranks' clocks and write the merged trace (collective)."""
        timeline.activate(None)
        if self.recording is None:
            return None
        aligned = survival.collective(timeline.align_clocks)
        if aligned is None:  # left out meanwhile: the others wrote it
            return None
        offsets, error_ns = aligned
        recording = self.recording
        written = survival.collective(lambda: timeline.write_merged(recording, offsets,
                                                                    error_ns))
        if written is not None:
            log.info("timeline: %s (%d steps kept per rank, clocks aligned to within %.0f "
                     "us); open it in ui.perfetto.dev or chrome://tracing", written,
                     len(recording.steps()), error_ns / 1000)
        return written


def _gather(mine: RankWindow) -> list[RankWindow]:
    """Every rank's window, in rank order: one all-gather of a few numbers (a pickled
    object's all-gather is two collectives and cost a few percent of a small model's
    steps)."""
    names = [f.name for f in fields(RankWindow)]
    values = comm.control_tensor([float(getattr(mine, n)) for n in names],
                                 dtype=torch.float64)
    out = values.new_empty(comm.size_of() * len(names))
    comm.all_gather_into(out, values, "trainer: every rank's share of the window's time")
    rows = out.view(-1, len(names)).tolist()
    return [RankWindow(**{n: (int(v) if n == "steps" else v) for n, v in zip(names, row,
                                                                              strict=True)})
            for row in rows]


def timed(name: str, read: Callable[[], T]) -> T:
    """`read()` as a span of the active timeline."""
    with timeline.span(name):
        return read()
