"""The errors of failed collectives: what failed, after how long, and -- when the stall
watchdog is on -- who this rank waited for and where they stand, in the words a person (and
the launcher's summary, which shows first lines) can act on. A backend's failure is read
for its cause (a peer's closed connection, this rank's own pause, a timeout); a wait of
lockstep's own (a host barrier) that ran out of time gets the same report (timed_out)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import torch.distributed as dist

from lockstep.comm import watchdog
from lockstep.comm.diagnostics import explain_stall, peer_closed
from lockstep.comm.ledger import Record
from lockstep.comm.stall_report import Diagnosis


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message says which rank waited for what."""

    def __init__(self, message: str, culprits: Sequence[int] = (), stalled: bool = False
                 ) -> None:
        super().__init__(message)
        self.culprits = list(culprits)  # the ranks it waited for (the launcher names them)
        self.stalled = stalled  # it waited at least stall_after: they stalled, not crashed


def _backend_message(error: BaseException) -> str:
    """The backend's words, without its source path and its boilerplate advice."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(error).strip())
    return text.split(" This is typically caused")[0][:300]


_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms")


def _paused_for(text: str, waited: float) -> float | None:
    """Seconds this rank lost beyond a collective's timeout -- it waited far longer than the
    backend's own clock allowed, so it was not running -- or None."""
    found = _TIMED_OUT.search(text)
    limit = int(found.group(1)) / 1000 if found else None
    return waited - limit if limit is not None and waited > 1.5 * limit + 2 else None


def explain_failure(what: str, error: BaseException, started: float,
                    record: Record | None = None) -> CollectiveError:
    """The error for a failed collective. The first line says what failed and, when the
    watchdog is on, who it waited for (the launcher's summary shows first lines only)."""
    rank = dist.get_rank()
    waited = time.monotonic() - started
    head = f"rank {rank}: {what} failed after {waited:.1f}s: {_backend_message(error)}"
    found = watchdog.explain(record)
    if record is not None:
        record.done = True
    paused = _paused_for(str(error), waited)
    if paused is not None:  # the others' ledgers and clocks went on without this rank
        return CollectiveError(f"{head} -- this rank was itself paused for about "
                               f"{paused:.0f}s (stopped, e.g. SIGSTOP, or starved of CPU): "
                               "its peers may have gone on without it")
    if peer_closed(error):
        # A peer's process ended (killed, crashed, or its group torn down). Only a rank
        # that said it exited is named: the ledgers, published once a second, would blame
        # live peers for lagging.
        exited = found.verdict.split("; ")[0] if found is not None and \
            "exited without reaching it" in found.verdict else None
        return CollectiveError(f"{head} -- " + (exited or "a peer closed its connection: "
                               "its process exited or was killed, or its group was torn down"))
    return _with_diagnosis(head, found, waited)


def timed_out(what: str, waited: float, record: Record | None, reason: str) -> CollectiveError:
    """The error for a wait of lockstep's own (a host barrier in shared memory) that ran out
    of time: the same report, culprits and all, as a backend's collective gets."""
    found = watchdog.explain(record)
    if record is not None:
        record.done = True
    return _with_diagnosis(f"rank {dist.get_rank()}: {what} failed after {waited:.1f}s: "
                           f"{reason}", found, waited)


def _with_diagnosis(head: str, found: Diagnosis | None,
                    waited: float) -> CollectiveError:
    rank, size = dist.get_rank(), dist.get_world_size()
    if found is None:
        return CollectiveError(f"{head}\n{explain_stall(rank, size)}")
    lines = [f"{head} -- {found.verdict}", f"  it was {found.collective}", found.details,
             explain_stall(rank, size)]
    return CollectiveError("\n".join(line for line in lines if line), found.culprits,
                           stalled=waited >= watchdog.watchdog.stall_after)
