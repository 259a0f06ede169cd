"""A quiet exit: a worker that trained successfully exits with 0, whatever lockstep's
threads were doing, and a launch leaves nothing of its own behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The progress thread is inside a store call when the script ends (as it may be on a
# loaded machine), and the call returns while the interpreter is finalizing.
EXIT_DURING_A_STORE_CALL = textwrap.dedent("""
    import threading, time
    from datetime import timedelta
    import torch.distributed as dist
    import lockstep
    from lockstep.comm.diagnostics import reporter

    lockstep.init()
    store = dist.distributed_c10d._get_default_store()
    inside = threading.Event()

    def slow_tick():
        inside.set()
        try:  # longer than the thread used to be waited for at exit (1 s)
            store.wait(["never set"], timedelta(seconds=1.5))
        except Exception:
            pass

    class SlowFinalization:
        def __del__(self):  # runs while the interpreter finalizes, after the atexit hooks
            time.sleep(2.5)

    reporter.ticks.append(slow_tick)
    reporter.start()
    inside.wait(10)
    keep = SlowFinalization()
    print("script done", flush=True)
""")


def test_exit_waits_for_the_progress_thread_to_leave_its_store_call() -> None:
    # Before: the exit waited 1 s for the thread, then the store call returned during
    # finalization and the process aborted (SIGABRT, "terminate called without an active
    # exception") after printing everything: finding 9 and 13 of issue 28.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-c", EXIT_DURING_A_STORE_CALL], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "script done" in done.stdout
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr
