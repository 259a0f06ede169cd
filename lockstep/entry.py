"""Where every `lockstep run` worker starts: run the user's script or module as __main__,
with torchrun's error recording around it so a crash reaches the launcher's summary with its
traceback."""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    kind, target, *args = sys.argv[1:]
    if kind == "--module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
