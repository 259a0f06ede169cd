"""Commands running side by side, one per emulated host, as one job: wait for all of them,
and when one fails (or time runs out) stop the rest -- a job cannot finish without a host.
Their output is collected, or printed as it comes with each line prefixed by its host."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import IO


def wait_all(procs: list[subprocess.Popen[str]], timeout: float
             ) -> list[subprocess.CompletedProcess[str]]:
    """Each process's exit code and output, once all have exited (the rest stopped once one
    failed)."""
    try:
        _supervise(procs, timeout)
        outputs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, outputs, strict=True)]


def stream_all(procs: list[subprocess.Popen[str]], prefixes: list[str], timeout: float
               ) -> list[int]:
    """Print each process's lines as they come, prefixed (stdout to stdout, stderr to
    stderr; processes interleave by line, never mid-line); the exit codes once all have
    exited (the rest stopped once one failed)."""
    lock = threading.Lock()
    pumps = [threading.Thread(target=_pump, args=(pipe, prefix, sink, lock), daemon=True)
             for p, prefix in zip(procs, prefixes, strict=True)
             for pipe, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
    for pump in pumps:
        pump.start()
    try:
        _supervise(procs, timeout)
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for pump in pumps:
            pump.join(timeout=5)
    return [p.returncode for p in procs]


def _supervise(procs: list[subprocess.Popen[str]], timeout: float) -> None:
    """Wait until all have exited; when one fails or time runs out, stop the rest."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            return
        time.sleep(0.05)


def _pump(pipe: IO[str] | None, prefix: str, sink: IO[str], lock: threading.Lock) -> None:
    assert pipe is not None
    for line in pipe:
        with lock:
            sink.write(prefix + line)
            sink.flush()
