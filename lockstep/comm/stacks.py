"""What a rank is doing right now, asked for through the store.

A rank that waits too long on a collective asks the ranks that have not reached it for
their Python stack. Each rank's watchdog thread (watchdog.py) looks for requests addressed
to it twice a second and answers with the stack of its training thread, so a rank stuck in
Python code, a data loader or a `time.sleep` is shown where it stands -- without py-spy or
a debugger. A rank that cannot answer (stopped by SIGSTOP, or stuck in native code that
holds the GIL) is reported as not answering, with its last published progress.

Keys: the requester takes a number n from the counter `asked/R` and creates `ask/R/n`; rank
R answers every request up to the newest at once, in `answer/R` as "n\\n<stack>".
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import torch.distributed as dist

_PREFIX = "lockstep/stack/"
_POLL_S = 0.05
MAX_FRAMES = 12
# The worker's entry (lockstep.launch.entry) and runpy's frames are the same in every
# stack and stand before the user's own: dropped.
_NOISE = ("lockstep/launch/entry.py", "<frozen runpy>", "/runpy.py")


def stack_of(thread_id: int | None = None) -> str:
    """The innermost frames of a thread (the main thread if `thread_id` is gone), as
    traceback prints them."""
    frames = sys._current_frames()
    frame = frames.get(thread_id) if thread_id is not None else None
    if frame is None:
        frame = frames.get(threading.main_thread().ident or -1)
    if frame is None:
        return "(no Python stack)"
    entries = [e for e in traceback.format_stack(frame) if not any(n in e for n in _NOISE)]
    return "".join(entries[-MAX_FRAMES:]).rstrip()


class Responder:
    """Answers the stack requests addressed to one rank (called from its watchdog thread)."""

    def __init__(self) -> None:
        self.answered = 0

    def answer(self, store: dist.Store, rank: int, thread_id: int | None) -> None:
        newest = self.answered
        while store.check([f"{_PREFIX}ask/{rank}/{newest + 1}"]):
            newest += 1
        if newest > self.answered:
            store.set(f"{_PREFIX}answer/{rank}", f"{newest}\n{stack_of(thread_id)}")
            self.answered = newest


def request(store: dist.Store, ranks: list[int], wait_s: float) -> dict[int, str]:
    """Ask `ranks` for their stacks; the answers that came within `wait_s`, by rank."""
    numbers: dict[int, int] = {}
    for rank in ranks:
        numbers[rank] = store.add(f"{_PREFIX}asked/{rank}", 1)
        store.set(f"{_PREFIX}ask/{rank}/{numbers[rank]}", "")
    answers: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while len(answers) < len(numbers) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        for rank in numbers.keys() - answers.keys():
            key = f"{_PREFIX}answer/{rank}"
            if store.check([key]):
                number, _, stack = store.get(key).decode().partition("\n")
                if int(number) >= numbers[rank]:
                    answers[rank] = stack
    return answers
