"""Where every `lockstep run` worker starts: run the user's script or module as __main__.

A worker that raises records its exception for the launcher (torchrun's error file) and
prints a single line; the launcher's summary then shows the traceback once, for the worker
that failed first, instead of every worker's copy interleaved.
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import get_error_handler


def _run(kind: str, target: str, args: list[str]) -> None:
    sys.argv = [target, *args]
    if kind == "--module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    kind, target, *args = sys.argv[1:]
    handler = get_error_handler()
    handler.initialize()
    try:
        _run(kind, target, args)
    except SystemExit:
        raise
    except KeyboardInterrupt:  # Ctrl-C: the launcher says so once, not every rank's traceback
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            raise
        sys.exit(130)
    except BaseException as error:
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:  # not under a launcher: the usual
            raise
        handler.record_exception(error)
        first_line = (str(error).strip().splitlines() or [""])[0]
        print(f"[rank {os.environ.get('RANK', '?')}] {type(error).__name__}: {first_line}",
              file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
