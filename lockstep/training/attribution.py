"""Where a logged window's step time went, and who the others waited for: read from the step
timeline's spans (lockstep/comm/timeline.py) every logged window while it records.

Each rank sums its own spans over the window (`summarize`); the ranks swap those sums (one
small all-gather per window), and every rank reads the same answer (`attribute`):

- step time, and how much of the communication was hidden behind backward: the buckets'
  time from launched to done against what backward's end still waited for;
- the slowest rank -- the one whose own work (data loading, forward and backward compute,
  the optimizer) took longest -- how far behind the others it was, and why: the phase
  that exceeds the others' most;
- bytes on the wire per step and the bus bandwidth they achieved.

When waiting for communication takes a quarter of the step or more and the job spans
three hosts or more, a probe of the hosts' links (links.py) may find the cause there: the
first rank of the host whose link is slow is then the one the others waited for.

A rank more than `behind` (10%) behind in `windows` (3) windows in a row is named as a
straggler with its cause (`Stragglers`).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from lockstep.comm.timeline import Timeline
from lockstep.training.links import SlowLink

COMM_BOUND = 0.25  # waiting for communication this share of a step or more: probe the links
OWN_WORK = ("data", "forward", "compute in backward", "optimizer", "between steps")
"""A rank's own work, each phase's excess over the others' naming why it was slow."""
CAUSES = {"data": "its data loading", "forward": "its compute (forward)",
          "compute in backward": "its compute (backward)", "optimizer": "its optimizer step",
          "between steps": "its own code between steps (callbacks, logging)"}


@dataclass
class RankWindow:
    """One rank's seconds per step in a window, by phase (see OWN_WORK), and its comm."""

    steps: int
    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    wait: float = 0.0  # backward's end, waiting for communication
    optimizer: float = 0.0
    comm: float = 0.0  # the buckets' time in flight, launched to done (overlapping merged)
    between: float = 0.0  # from one step's last span to the next one's first: the loop's own

    @property
    def own_work(self) -> dict[str, float]:
        return {"data": self.data, "forward": self.forward,
                "compute in backward": self.backward - self.wait, "optimizer": self.optimizer,
                "between steps": self.between}

    @property
    def busy(self) -> float:
        return sum(self.own_work.values())


def summarize(recording: Timeline, first: int, last: int) -> RankWindow:
    """This rank's spans of steps first..last, per step."""
    steps = sorted((s for s in recording.steps() if first <= s.number <= last),
                   key=lambda s: s.number)
    window = RankWindow(steps=len(steps))
    window.between = _between(steps)
    for step in steps:
        in_flight = []
        for name, track, start, end, _ in step.spans:
            seconds = (end - start) / 1e9
            if track == "comm":
                in_flight.append((start, end))
            elif name == "wait for communication":
                window.wait += seconds
            elif name in ("data", "forward", "backward", "optimizer"):
                setattr(window, name, getattr(window, name) + seconds)
        window.comm += _union(in_flight) / 1e9
    if steps:
        for name in ("data", "forward", "backward", "wait", "optimizer", "comm", "between"):
            setattr(window, name, getattr(window, name) / len(steps))
    return window


def _between(steps: list[Any]) -> float:
    """Seconds from each step's last span to the next step's first (consecutive steps): time
    in none of the phases -- a user's callback, the loop's logging. A rank asleep in its
    callback makes the others wait in their next backward; this is where it shows."""
    total, previous = 0, None
    for step in steps:
        spans = [(start, end) for _, track, start, end, _ in step.spans if track != "comm"]
        if not spans:
            continue
        if previous is not None and previous[0] + 1 == step.number:
            total += max(0, min(start for start, _ in spans) - previous[1])
        previous = (step.number, max(end for _, end in spans))
    return total / 1e9


def _union(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


@dataclass
class Attribution:
    step_ms: float
    hidden: float  # share of the communication hidden behind backward, 0..1
    slowest: int
    behind: float  # the slowest rank's own work against the others' median, -1..
    cause: str
    bytes_per_step: float
    bus_gbit: float
    waiting: float  # share of the step backward's end waited for communication

    @property
    def comm_bound(self) -> bool:
        return self.waiting >= COMM_BOUND

    def blaming(self, link: SlowLink) -> Attribution:
        """The same window, with the others waiting on `link`'s host."""
        return replace(self, slowest=link.first_rank, behind=link.behind, cause=link.cause())

    def line(self, step: int) -> str:
        cause = f" ({self.cause})" if self.behind > 0.05 else ""
        wire = f"; {self.bytes_per_step / 1e6:.2f} MB/step on the wire at " \
               f"{self.bus_gbit:.2f} Gbit/s bus bandwidth" if self.bytes_per_step else ""
        return (f"step {step}: {self.step_ms:.1f} ms/step; communication "
                f"{self.hidden:.0%} hidden behind backward; slowest rank {self.slowest}, "
                f"{self.behind:+.0%} against the others{cause}{wire}")

    def record(self) -> dict[str, Any]:
        return {f"timeline_{k}": v for k, v in asdict(self).items()}


def attribute(ranks: list[RankWindow], bytes_per_step: float) -> Attribution:
    """The window's answer from every rank's sums (rank order)."""
    world = len(ranks)
    step = max(r.data + r.forward + r.backward + r.optimizer for r in ranks)
    comm = statistics.median(r.comm for r in ranks)
    exposed = statistics.median(r.wait for r in ranks)
    hidden = 0.0 if comm <= 0 else max(0.0, min(1.0, 1 - exposed / comm))
    slowest = max(range(world), key=lambda r: ranks[r].busy)
    others = [r for i, r in enumerate(ranks) if i != slowest] or ranks
    behind = ranks[slowest].busy / max(statistics.median(r.busy for r in others), 1e-12) - 1
    excess = {phase: ranks[slowest].own_work[phase] -
              statistics.median(r.own_work[phase] for r in others) for phase in OWN_WORK}
    cause = CAUSES[max(excess, key=excess.__getitem__)]
    ring = 2 * (world - 1) / world if world > 1 else 0.0  # what a ring moves per byte
    bus = bytes_per_step * 8 * ring / comm / 1e9 if comm > 0 else 0.0
    waiting = exposed / step if step > 0 else 0.0
    return Attribution(step * 1000, hidden, slowest, behind, cause, bytes_per_step, bus,
                       waiting)


class Stragglers:
    """Names a rank that was more than `behind` behind in `windows` windows in a row."""

    def __init__(self, behind: float = 0.10, windows: int = 3) -> None:
        self.behind, self.windows = behind, windows
        self._run: tuple[int, int] = (-1, 0)  # (rank, windows in a row)

    def observe(self, found: Attribution) -> str | None:
        rank, count = self._run
        if found.behind <= self.behind:
            self._run = (-1, 0)
            return None
        count = count + 1 if found.slowest == rank else 1
        self._run = (found.slowest, count)
        if count == self.windows:  # said once, when it becomes true
            return (f"straggler: rank {found.slowest} has been more than "
                    f"{self.behind:.0%} behind the others for {count} logged windows in a "
                    f"row ({found.behind:+.0%} now): {found.cause}")
        return None
