"""`lockstep run`: start workers through torchrun's own machinery (torch.distributed.run).

What it adds to plain torchrun: the script is checked (exists, parses) before any worker
starts; OMP_NUM_THREADS is set to cores / local workers (so N workers do not fight over the
cores); and on failure, after torchrun has stopped the others, one summary: which worker
failed first, its traceback once, and one line on how each other worker ended. A script
written for lockstep also runs unchanged under plain `torchrun`, and vice versa.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.cores import threads_per_worker
from lockstep.training import jobnote

RECORD = "lockstep"  # the key, inside torchrun's extraInfo, of what a worker's entry records


@dataclass
class LaunchSpec:
    """One `lockstep run` invocation."""

    nproc: int
    """Workers on this host."""
    target: str
    """The script path, or the module name when `module` is set."""
    args: list[str] = field(default_factory=list)
    module: bool = False
    nnodes: str = "1"
    """Number of hosts (or MIN:MAX)."""
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous, for jobs across hosts."""
    rdzv_id: str | None = None
    local_addr: str | None = None
    """This host's address as the others reach it (default: torchrun looks it up)."""
    max_restarts: int = 0

    def multi_host(self) -> bool:
        return self.nnodes not in ("1", "1:1") or self.rdzv_endpoint is not None


def torchrun_argv(spec: LaunchSpec, log_dir: str | None = None) -> list[str]:
    """The equivalent torchrun command line (without the `torchrun` itself). `log_dir`:
    where torchrun keeps its per-worker files (else a torchelastic_* folder of its own)."""
    argv = [f"--nproc-per-node={spec.nproc}", f"--max-restarts={spec.max_restarts}"]
    if log_dir is not None:
        argv.append(f"--log-dir={log_dir}")
    if spec.multi_host():
        if spec.rdzv_endpoint is None:
            raise ValueError("lockstep run: --nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        argv += [f"--nnodes={spec.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={spec.rdzv_endpoint}",
                 f"--rdzv-id={spec.rdzv_id or 'lockstep'}"]
        if spec.node_rank is not None:
            # Node 0 hosts the rendezvous store. torchrun otherwise guesses by matching the
            # endpoint against this machine's names, which fails behind NAT or namespaces.
            # (Not as torchrun's --node-rank: c10d's rendezvous numbers the hosts itself,
            # and torchrun warns that it ignores the flag.)
            argv.append(f"--rdzv-conf=is_host={int(spec.node_rank == 0)}")
        if spec.local_addr is not None:
            argv.append(f"--local-addr={spec.local_addr}")
    else:
        argv += ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
                 f"--rdzv-id={uuid.uuid4()}"]
    # Every worker starts in lockstep.launch.entry, which records its traceback for the summary.
    argv += ["-m", "lockstep.launch.entry", "--module" if spec.module else "--script", spec.target]
    return argv + list(spec.args)


def run(spec: LaunchSpec) -> int:
    """Launch and wait. Returns 0, or the failed worker's exit code after printing why."""
    if refused(spec):
        return 2
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun's own process-management log repeats what the summary below says, better.
    logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.run"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropDeathSignalNotice) for f in logger.filters):
            logger.addFilter(_DropDeathSignalNotice())
    user_threads = os.environ.get("OMP_NUM_THREADS")  # the user's choice wins
    os.environ["OMP_NUM_THREADS"] = user_threads or str(threads_per_worker(spec.nproc))
    note = _checkpoint_note()
    # torchrun's per-worker folders (error files) go in a folder of this launch's own,
    # removed at the end: left to itself, torchrun leaves a torchelastic_* folder behind.
    logs = tempfile.mkdtemp(prefix="lockstep-run-")
    try:
        torchrun.run(torchrun.parse_args(torchrun_argv(spec, logs)))
    except ChildFailedError as failed:
        alone = spec.nnodes in ("1", "1:1")  # (else other hosts' ranks are not seen here)
        print(failure_summary(failed, spec.nproc if alone else None), file=sys.stderr)
        return exit_status(failed)
    except (KeyboardInterrupt, SignalException) as stop:
        print(interrupted(stop, jobnote.last_checkpoint(note)), file=sys.stderr, flush=True)
        return 128 + int(getattr(stop, "sigval", signal.SIGINT))  # the shell's convention
    finally:  # a later launch from this process computes its own
        if user_threads is None:
            del os.environ["OMP_NUM_THREADS"]
        os.environ.pop(jobnote.ENV, None)
        for ours in (note, *note.parent.glob(f"{note.name}.*")):  # and a killed writer's
            ours.unlink(missing_ok=True)
        shutil.rmtree(logs, ignore_errors=True)  # made above, by and for this launch only
    return 0


def _checkpoint_note() -> Path:
    """A file for the workers' rank 0 to name its newest checkpoint in (see jobnote)."""
    handle, path = tempfile.mkstemp(prefix="lockstep-run-", suffix=".checkpoint")
    os.close(handle)
    os.environ[jobnote.ENV] = path
    return Path(path)


def interrupted(stop: BaseException, checkpoint: tuple[str, bool] | None) -> str:
    """The one line a user who pressed Ctrl-C (or sent SIGTERM) is shown."""
    sig = int(getattr(stop, "sigval", signal.SIGINT))  # torchrun's SignalException has one
    how = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
    where = "no checkpoint was written"
    if checkpoint is not None:
        folder, resumes = checkpoint
        where = f"last checkpoint: {folder}" + (
            " (run the same command to resume from it)" if resumes else "")
    return f"\nlockstep run: interrupted ({how}); the workers were stopped; {where}"


class _DropDeathSignalNotice(logging.Filter):
    """torchrun's agent warns "Received 2 death signal, shutting down workers"; the launcher
    says it once, in its own words, with the checkpoint to resume from."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in record.getMessage() and \
            "Got termination signal" not in record.getMessage()


def _record(failure: Any) -> dict[str, Any]:
    """What lockstep.launch.entry recorded for this worker ({} if nothing): kind ("exit",
    "exception" or "finished"), exit code, and the precise time of the failure."""
    message = failure.message
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    found = extra.get(RECORD) if isinstance(extra, dict) else None
    return found if isinstance(found, dict) else {}


def _is_knock_on(failure: Any) -> bool:
    """A failure caused by another one: a collective that lost its partner, or (for a
    worker that recorded nothing) the SIGTERM torchrun sends the survivors. A worker that
    raised or exited is judged by what it recorded, even if the SIGTERM caught it on the
    way out (its exit code is then -15, not what it exited with)."""
    if _record(failure).get("kind") in ("exit", "finished"):
        return False
    message = failure.message
    if isinstance(message, dict):
        text = str(message)
        return "CollectiveError" in text or "Connection closed by peer" in text or \
            "Connection reset by peer" in text
    return bool(failure.exitcode == -signal.SIGTERM)


def _when(failure: Any) -> float:
    """When it failed: lockstep's precise record, else torchrun's whole-second timestamp
    (for a worker without an error file, the moment torchrun looked: later than any
    record, which is why knock-on errors are set aside first)."""
    return float(_record(failure).get("time", failure.timestamp))


def root_cause(failed: Any) -> tuple[int, Any]:
    """The failure that started it all: a worker the others waited for until they timed
    out (see `stalled_worker`), else the earliest failure that is not a knock-on error (if
    every failure is one, the earliest)."""
    stalled = stalled_worker(failed)
    if stalled is not None:
        return stalled[0], failed.failures[stalled[0]]
    by_time = sorted(failed.failures.items(), key=lambda item: (_when(item[1]), item[0]))
    failures = [item for item in by_time if not _finished(item[1])] or by_time
    primary = [item for item in failures if not _is_knock_on(item[1])]
    return (primary or failures)[0]


def _finished(failure: Any) -> bool:
    """It had finished its script when the launcher stopped it on its way out."""
    return _record(failure).get("kind") == "finished"


def stalled_worker(failed: Any) -> tuple[int, int] | None:
    """(culprit, waiter): a worker that another one waited for until its collective timed
    out, and that recorded no failure of its own -- it was stopped by the launcher after
    the timeout (a worker that ignores SIGTERM, as a stopped one does, ends by SIGKILL).
    Without this, that SIGKILL would be reported as the cause."""
    by_time = sorted(failed.failures.items(), key=lambda item: (_when(item[1]), item[0]))
    for rank, failure in by_time:
        found = _record(failure)
        for culprit in found.get("culprits", []) if found.get("stalled") else []:
            if culprit in failed.failures and not _record(failed.failures[culprit]):
                return culprit, rank
    return None


def _traceback(failure: Any) -> str | None:
    message = failure.message
    if not isinstance(message, dict) or _record(failure).get("kind") == "exit":
        return None
    return _user_frames(str(message.get("extraInfo", {}).get("py_callstack")
                            or message.get("message")))


def _user_frames(traceback: str) -> str:
    """Drop the frames of lockstep's worker entry and runpy: they are the same every time
    and stand between the user and their own code."""
    kept, skipping = [], False
    for line in traceback.splitlines():
        if line.startswith('  File "'):
            skipping = "lockstep/launch/entry.py" in line or "<frozen runpy>" in line
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _outcome(failure: Any) -> str:
    """One line on how a worker ended."""
    message = failure.message
    if isinstance(message, dict):
        return str(message.get("message", "")).strip().splitlines()[0][:300]
    if failure.exitcode == -signal.SIGTERM:
        return "stopped by the launcher"
    if failure.exitcode < 0:
        return f"killed by {message}"
    return f"exited with code {failure.exitcode}"


def _stall_story(failed: Any, culprit: int, waiter: int) -> tuple[str, str | None]:
    """How a stalled worker's end is told, and what the worker that waited for it saw."""
    failure = failed.failures[culprit]
    if failure.exitcode == -signal.SIGKILL:
        end = "the launcher then killed it (SIGKILL: it did not stop on SIGTERM)"
    elif failure.exitcode == -signal.SIGTERM:
        end = "the launcher then stopped it (SIGTERM)"
    else:
        end = f"it then ended: {_outcome(failure)}"
    how = f"stalled: rank {waiter} waited for it until its collective timed out; {end}"
    seen = _traceback(failed.failures[waiter])
    return how, None if seen is None else f"what rank {waiter} saw:\n{seen.rstrip()}"


def failure_summary(failed: Any, nproc: int | None = None) -> str:
    """What went wrong, for the user: the worker that failed first and why, and the others.
    `nproc`: the job's workers, where they are all on this host."""
    rank, failure = root_cause(failed)
    traceback = _traceback(failure)
    # A worker that raised may still be SIGTERMed by torchrun while it exits, so its exit
    # code is not the story; the recorded exception is.
    how = "raised an exception" if traceback is not None else _outcome(failure)
    stalled = stalled_worker(failed)
    if stalled is not None:
        how, traceback = _stall_story(failed, *stalled)
    lines = [f"lockstep run: worker rank {rank} (local rank {failure.local_rank}, pid "
             f"{failure.pid}) {how}; the job was stopped."]
    if stalled is None and (early := _finished_early(failed, nproc)) is not None:
        lines.append(early)
    if traceback is not None:
        lines.append(traceback.rstrip())
    others = sorted(r for r in failed.failures if r != rank)
    if others:
        lines.append("the other workers:")
        lines += _endings(failed, others, _outcome(failure))
    return "\n".join(lines)


def _endings(failed: Any, ranks: list[int], first: str) -> list[str]:
    """One line per distinct way the other workers ended, naming their ranks (a config
    error raised on every one of 8 workers is one line, not 7)."""
    endings: dict[str, list[str]] = {}
    for r in ranks:
        endings.setdefault(_outcome(failed.failures[r]), []).append(str(r))
    return [f"  rank{'s' if len(who) > 1 else ''} {', '.join(who)}: "
            f"{'the same error' if text == first else text}" for text, who in endings.items()]


def _finished_early(failed: Any, nproc: int | None) -> str | None:
    """Where every failure is a knock-on (a collective that lost its partner) and some
    workers are not among them: those had exited cleanly, and the others were left waiting
    in a collective they never joined."""
    failures = [f for f in failed.failures.values() if not _finished(f)]
    if nproc is None or not all(_is_knock_on(f) for f in failures):
        return None
    finished = [str(r) for r in range(nproc)
                if r not in failed.failures or _finished(failed.failures[r])]
    if not finished:
        return None
    return (f"no worker failed on its own: rank(s) {', '.join(finished)} had finished (exit "
            "code 0) while the others waited in a collective they never joined -- they ran "
            "fewer collectives (a skipped backward, fewer batches, a collective only some "
            "ranks call; see the desync warning above, if any).")


def exit_status(failed: Any) -> int:
    """The exit code of the worker that failed first: what it passed to sys.exit, 1 if it
    raised, its own code otherwise (1 for a signal)."""
    _, failure = root_cause(failed)
    recorded = _record(failure).get("code")
    if isinstance(recorded, int) and recorded > 0:
        return recorded
    if _traceback(failure) is not None or failure.exitcode <= 0:
        return 1
    return int(failure.exitcode)


def refused(spec: LaunchSpec, command: str = "lockstep run") -> bool:
    """Whether the target cannot run, said before any worker starts -- and before torch
    loads (seconds), so a mistyped path is told at once."""
    problem = check_target(spec)
    if problem is not None:
        print(f"{command}: {problem}", file=sys.stderr)
    return problem is not None


def check_target(spec: LaunchSpec) -> str | None:
    """Why the target cannot run, found before any worker starts (None if it looks fine)."""
    if spec.module:
        try:
            found = importlib.util.find_spec(spec.target)
        except (ImportError, ValueError):
            found = None
        return None if found is not None else f"no module named {spec.target!r}"
    path = Path(spec.target)
    if not path.is_file():
        return f"no such file: {spec.target}"
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as error:
        return (f"{spec.target}, line {error.lineno}: {error.msg}\n"
                f"    {(error.text or '').rstrip()}")
    return None
