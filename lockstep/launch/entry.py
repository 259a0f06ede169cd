"""Where every `lockstep run` worker starts: run the user's script or module as __main__.

A worker that fails records it for the launcher (torchrun's error file) at the moment it
fails: an exception with its traceback, or a `sys.exit(code)` with its code. The record
carries a precise time, written before the worker's exit closes its connections -- the event
its peers then fail on -- so the launcher can tell which worker failed first even when
torchrun stops the failed worker on its way out. A worker that raises also prints a single
line; the launcher's summary shows the traceback once, for the worker that failed first,
instead of every worker's copy interleaved.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from lockstep.launch.run import RECORD


def _run(kind: str, target: str, args: list[str]) -> None:
    sys.argv = [target, *args]
    if kind == "--module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")


FINISHED = "finished its script (exit code 0)"


def exit_code(exit: SystemExit) -> int:
    """The status Python exits with for this SystemExit: sys.exit("why") exits with 1."""
    if exit.code is None:
        return 0
    return exit.code if isinstance(exit.code, int) else 1


def record(kind: str, message: str, code: int, callstack: str | None = None,
           **details: object) -> None:
    """Write torchrun's error file (its own format, so torchrun reads it as usual) with
    lockstep's precise record added: kind ("exit", "exception" or "finished"), exit code,
    time, and `details` (a collective that timed out: the ranks it waited for)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    extra: dict[str, object] = {"timestamp": str(int(now)),
                                RECORD: {"kind": kind, "code": code, "time": now, **details}}
    if callstack is not None:
        extra["py_callstack"] = callstack
    # Written aside and renamed into place: the launcher stops the other workers as soon as
    # one fails, and a worker stopped halfway through writing left an empty file that
    # torchrun's reader (and so the launcher) died on.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": extra}}, f)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):  # stopped before the rename: leave nothing of ours
            os.unlink(partial)


def main() -> None:
    kind, target, *args = sys.argv[1:]
    get_error_handler().initialize()
    try:
        _run(kind, target, args)
    except SystemExit as exit:
        code = exit_code(exit)
        if code != 0:
            record("exit", f"exited with code {code} (sys.exit)", code)
        else:
            record("finished", FINISHED, 0)
        raise
    except KeyboardInterrupt:  # Ctrl-C: the launcher says so once, not every rank's traceback
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            raise
        sys.exit(130)
    except BaseException as error:
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:  # not under a launcher: the usual
            raise
        # A CollectiveError names the ranks it waited for: the launcher blames them.
        waited_for = {k: getattr(error, k) for k in ("culprits", "stalled") if hasattr(error, k)}
        record("exception", f"{type(error).__name__}: {error}", 1, traceback.format_exc(),
               **waited_for)
        first_line = (str(error).strip().splitlines() or [""])[0]
        # One write: workers share the terminal, and print's two writes interleave.
        sys.stderr.write(f"[rank {os.environ.get('RANK', '?')}] {type(error).__name__}: "
                         f"{first_line}\n")
        sys.stderr.flush()
        sys.exit(1)
    else:  # If the launcher stops this process on its way out (another worker failed
        record("finished", FINISHED, 0)  # meanwhile), it still reads as finished


if __name__ == "__main__":
    main()
