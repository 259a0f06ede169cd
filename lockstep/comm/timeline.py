"""A step timeline: where each rank's time went, merged across ranks into one trace file.

    TrainConfig(timeline="runs/x/timeline.json")      # the Trainer records and writes it
    lockstep run --timeline runs/x/timeline.json -n 4 train.py     # the same, from outside

Each rank records spans on its own clock: the Trainer's phases (data, forward, backward,
the wait for communication at the end of backward, optimizer, evaluation, checkpoint) on
one track, and on a second each gradient bucket's all-reduce from launched to done (as
this rank saw it: its wait returned). Bounded: the last `keep_last` steps whole, and every
`every`-th step before them. At the end, rank 0 gathers every rank's spans, moves each
rank's clock onto its own (offsets measured over collectives: `align_clocks`, whose
residual error the file states), and writes one file in the Chrome trace event format --
Perfetto (ui.perfetto.dev) and chrome://tracing open it -- one process per rank.

Recording is a list append per span, cheap enough to leave on; nothing is written until
the end, so training never waits on the disk for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.comm import collectives as comm
from lockstep.comm.topology import this_host

ENV = "LOCKSTEP_TIMELINE"
"""`lockstep run --timeline PATH` sets it: a Trainer without `timeline=` records to PATH."""

TRACKS = {"compute": 0, "comm": 1}


@dataclass
class Step:
    number: int
    spans: list[tuple[str, str, int, int, dict[str, Any]]] = field(default_factory=list)
    """(name, track, start ns, end ns, args) on this rank's clock."""


class Timeline:
    """One rank's spans, kept bounded (see the module docstring)."""

    def __init__(self, path: str | Path, keep_last: int = 100, every: int = 20) -> None:
        if keep_last < 1 or every < 1:
            raise ValueError(f"timeline: keep_last and every must be >= 1, got {keep_last}, "
                             f"{every}")
        self.path, self.keep_last, self.every = Path(path), keep_last, every
        self._recent: deque[Step] = deque()
        self._sampled: list[Step] = []  # every `every`-th step older than the recent ones
        self._current = Step(0)  # spans before the first step (setup) count as step 0

    def begin_step(self, number: int) -> None:
        """Spans from now on belong to step `number`."""
        self._recent.append(self._current)
        if len(self._recent) > self.keep_last:
            old = self._recent.popleft()
            if old.number % self.every == 0:
                self._sampled.append(old)
        self._current = Step(number)

    def add(self, name: str, start_ns: int, end_ns: int, track: str = "compute",
            **args: Any) -> None:
        self._current.spans.append((name, track, start_ns, end_ns, args))

    @contextlib.contextmanager
    def span(self, name: str, track: str = "compute", **args: Any) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        finally:
            self.add(name, start, time.time_ns(), track, **args)

    def steps(self) -> list[Step]:
        """What is kept: the sampled old steps, then the recent ones, then the current."""
        return [*self._sampled, *self._recent, self._current]


_active: Timeline | None = None


def active() -> Timeline | None:
    """The timeline recording in this process, if any."""
    return _active


def activate(timeline: Timeline | None) -> None:
    global _active
    _active = timeline


def span(name: str, track: str = "compute", **args: Any) -> contextlib.AbstractContextManager[None]:
    """A span on the active timeline; nothing when none records."""
    return _active.span(name, track, **args) if _active is not None else contextlib.nullcontext()


@contextlib.contextmanager
def record_timeline(path: str | Path, keep_last: int = 100, every: int = 20
                    ) -> Iterator[Timeline]:
    """The timeline for a script without the Trainer: every rank records while inside, and
    leaving it (collective: every rank leaves) writes the merged trace on rank 0. The
    buckets' all-reduces, ZeRO's gathers and the rounds' syncs are recorded by themselves;
    the script marks its steps and phases:

        with lockstep.record_timeline("runs/x/timeline.json") as recording:
            for step, (x, y) in enumerate(loader, 1):
                recording.begin_step(step)
                with recording.span("forward"):
                    loss = loss_fn(model(x), y)
                with recording.span("backward"):
                    loss.backward()

    Left by an exception, nothing is written (the other ranks may not be there to merge).
    """
    recording = Timeline(path, keep_last, every)
    activate(recording)
    try:
        yield recording
    finally:
        activate(None)
    offsets, error_ns = align_clocks()
    write_merged(recording, offsets, error_ns)


def align_clocks(rounds: int = 9) -> tuple[list[int], int]:
    """Each rank's clock minus rank 0's, in ns, and the residual error of that estimate.
    Collective. Each round, the ranks leave a barrier together and read their clocks; the
    median over rounds is the offset, and half the spread of a rank's readings -- how far
    apart the ranks left the barrier -- bounds the error."""
    readings: list[list[int]] = []
    for _ in range(rounds):
        comm.barrier("timeline: clock alignment")
        now = time.time_ns()
        clocks = comm.all_gather_object(now, "timeline: clock alignment")
        readings.append([c - clocks[0] for c in clocks])
    ranks = range(len(readings[0]))
    offsets = [int(statistics.median(r[rank] for r in readings)) for rank in ranks]
    error = max((max(r[rank] for r in readings) - min(r[rank] for r in readings)) // 2
                for rank in ranks)
    return offsets, error


def write_merged(timeline: Timeline, offsets: list[int], error_ns: int) -> Path | None:
    """Gather every rank's kept spans to rank 0 and write the trace there (collective).
    Returns the path on rank 0, None elsewhere."""
    mine = {"host": this_host(), "pid": os.getpid(),
            "steps": [(s.number, s.spans) for s in timeline.steps()]}
    everyone = comm.all_gather_object(mine, "timeline: gather every rank's spans")
    if comm.rank_of(None) != 0:
        return None
    trace = chrome_trace(everyone, offsets, error_ns)
    timeline.path.parent.mkdir(parents=True, exist_ok=True)
    partial = timeline.path.with_name(timeline.path.name + ".partial")
    partial.write_text(json.dumps(trace))
    os.replace(partial, timeline.path)  # a reader never sees half a file
    return timeline.path


def chrome_trace(ranks: list[dict[str, Any]], offsets: list[int], error_ns: int
                 ) -> dict[str, Any]:
    """The Chrome trace event format: complete events ("X") in microseconds from the first
    span, one process per rank, a thread per track."""
    starts = [start - offsets[rank] for rank, got in enumerate(ranks)
              for _, spans in got["steps"] for _, _, start, _, _ in spans]
    origin = min(starts, default=0)
    events: list[dict[str, Any]] = []
    for rank, got in enumerate(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank} ({got['host']}, pid {got['pid']})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                       "args": {"sort_index": rank}})
        for track, tid in TRACKS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": track}})
        for number, spans in got["steps"]:
            for name, track, start, end, args in spans:
                events.append({"ph": "X", "name": name, "cat": track, "pid": rank,
                               "tid": TRACKS[track],
                               "ts": (start - offsets[rank] - origin) / 1000,
                               "dur": max(end - start, 0) / 1000,
                               "args": {"step": number, **args}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock_alignment_error_us": error_ns / 1000,
                          "clock_offsets_us": [o / 1000 for o in offsets],
                          "ranks": len(ranks)}}
