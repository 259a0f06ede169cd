"""`lockstep run`, plain torchrun, and no launcher at all: real processes, real launches."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys, torch, lockstep
    world = lockstep.init()
    model = lockstep.DataParallel(torch.nn.Linear(4, 2))
    crash_at = int(os.environ.get("CRASH_AT", "-1"))
    for step in range(4):
        if step == crash_at and world.rank == world.world_size - 1:
            if "EXIT_CODE" in os.environ:
                sys.exit(int(os.environ["EXIT_CODE"]))
            raise ValueError(f"bad batch at step {step}")
        model.zero_grad()
        model(torch.full((3, 4), float(world.rank))).sum().backward()
    grad = model.module.weight.grad[0, 0].item()
    print(f"rank {world.rank}/{world.world_size} grad {grad:.2f} "
          f"threads {os.environ.get('OMP_NUM_THREADS')} args {sys.argv[1:]}", flush=True)
""")

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("launch") / "train.py"
    path.write_text(SCRIPT)
    return path


def records(stdout: str) -> list[str]:
    """The script's report lines; workers share one pipe, so lines may arrive run together."""
    return re.findall(r"rank \d+/\d+ grad [\d.]+ threads \w+ args \[[^\]]*\]", stdout)


def leftovers(tmpdir: Path) -> list[str]:
    """What a launch left in its TMPDIR, but for torch's compile cache (kept on purpose)."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))


def launch(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                          "OMP_NUM_THREADS")}
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120,
                          env={**clean, **(env or {})})


def test_lockstep_run_starts_workers_with_args_and_threads(script: Path,
                                                           tmp_path: Path) -> None:
    result = launch(str(BIN / "lockstep"), "run", "-n", "2", str(script), "--lr", "0.1",
                    env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert leftovers(tmp_path) == []  # torchrun left a torchelastic_* folder there
    lines = sorted(records(result.stdout))
    # d(sum of outputs)/dW[0,0] is the sum of 3 inputs equal to the rank: averaged, 3 x 0.5.
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert lines == [f"rank {r}/2 grad 1.50 threads {threads} args ['--lr', '0.1']"
                     for r in range(2)]


def test_an_emulated_hosts_share_of_the_cores_is_what_its_workers_divide(
        script: Path, tmp_path: Path) -> None:
    """lockstep cluster sets LOCKSTEP_HOST_CORES: 6 cores over 2 workers, 3 threads each."""
    result = launch(str(BIN / "lockstep"), "run", "-n", "2", str(script),
                    env={"TMPDIR": str(tmp_path), "LOCKSTEP_HOST_CORES": "6"})
    assert result.returncode == 0, result.stderr
    assert [line.split(" args")[0].split("threads ")[1] for line in records(result.stdout)] \
        == ["3", "3"]


def test_a_failing_worker_stops_the_job_with_its_traceback(script: Path,
                                                           tmp_path: Path) -> None:
    result = launch(str(BIN / "lockstep"), "run", "-n", "2", str(script),
                    env={"CRASH_AT": "2", "TMPDIR": str(tmp_path)})
    assert result.returncode == 1
    assert leftovers(tmp_path) == []  # the error files were read, then removed
    assert "worker rank 1" in result.stderr and "raised an exception" in result.stderr
    assert 'train.py", line' in result.stderr  # the user's own frame
    assert "runpy" not in result.stderr and "entry.py" not in result.stderr  # not ours
    # The traceback once (in the summary), plus the failing worker's own one-line notice.
    assert result.stderr.count("ValueError: bad batch at step 2") == 2
    assert "the other workers:\n  rank 0: CollectiveError" in result.stderr


def test_a_worker_that_exits_is_named_with_its_exit_code(script: Path) -> None:
    # The exiting worker's sockets close while its peer waits in a collective; the peer's
    # error used to be recorded first, and torchrun then stopped the exiting worker (-15)
    # in its atexit teardown: "rank 0 raised an exception", code 1, about one run in five.
    result = launch(str(BIN / "lockstep"), "run", "-n", "2", str(script),
                    env={"CRASH_AT": "2", "EXIT_CODE": "3"})
    assert result.returncode == 3, result.stderr
    assert "lockstep run: worker rank 1 (local rank 1, pid" in result.stderr
    assert "exited with code 3 (sys.exit); the job was stopped." in result.stderr
    assert "the other workers:\n  rank 0: CollectiveError" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_worker_that_finished_early_is_named_not_the_one_left_waiting(script: Path) -> None:
    """Rank 1 leaves after two steps with exit code 0 (as a rank that skipped a backward
    does, one collective short): rank 0's collective loses its partner. The verdict named
    only rank 0, which merely waited."""
    result = launch(str(BIN / "lockstep"), "run", "-n", "2", str(script),
                    env={"CRASH_AT": "2", "EXIT_CODE": "0"})
    assert result.returncode == 1, result.stderr
    assert "lockstep run: worker rank 0 (local rank 0, pid" in result.stderr
    assert "no worker failed on its own: rank(s) 1 had finished (exit code 0) while the " \
           "others waited in a collective they never joined" in result.stderr


def test_the_same_script_runs_under_plain_torchrun(script: Path) -> None:
    result = launch(str(BIN / "torchrun"), "--nproc-per-node=3", "--standalone",
                    f"--log-dir={script.parent / 'torchrun-logs'}", str(script))  # (not /tmp)
    assert result.returncode == 0, result.stderr
    assert sorted(line.split(" threads")[0] for line in records(result.stdout)) == [
        f"rank {r}/3 grad 3.00" for r in range(3)]


def test_without_a_launcher_it_is_a_world_of_one(script: Path) -> None:
    result = launch(sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    assert "rank 0/1 grad 0.00" in result.stdout


def test_a_missing_or_broken_script_is_reported_before_any_worker_starts(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    # Every Python process started below notes its command line: no worker may start.
    # (Seen, not timed: "in under 10 s" came within 2 s of failing on a loaded machine,
    # where the two launches took 16 s without starting any worker.)
    hook, started = tmp_path / "hook", tmp_path / "started"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        f"import sys\nwith open({str(started)!r}, 'a') as f:\n"
        "    f.write(repr(sys.argv) + '\\n')\n")
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    for target, expected in ((tmp_path / "absent.py", "no such file"),
                             (broken, "line 1: invalid syntax")):
        started.unlink(missing_ok=True)
        result = launch(str(BIN / "lockstep"), "run", "-n", "2", str(target),
                        env={"PYTHONPATH": path})
        assert result.returncode == 2
        assert expected in result.stderr and "Traceback" not in result.stderr
        processes = started.read_text().splitlines()
        assert len(processes) == 1 and "'run', '-n', '2'" in processes[0], processes


LATE_TORCH = textwrap.dedent("""
    import importlib, json, os, sys, threading
    import lockstep.launch.cli
    from lockstep.launch import elastic
    before = "torch" in sys.modules
    niceness, real = [], importlib.import_module
    def noting(name):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(name)
    importlib.import_module = noting
    elastic._load_jobstore(urgent=False)
    print(json.dumps({"before": before, "after": "torch" in sys.modules,
                      "import": sorted(set(niceness)),  # (torch's own import_module calls)
                      "launcher": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are Linux's")
def test_the_elastic_launcher_starts_its_workers_before_it_loads_torch() -> None:
    """A restarted worker waited out its launcher's import of torch (~2 s) before its own
    began: the launcher now loads torch only once its workers are started, and (where it
    does not host the store) at a lower priority, its own thread left as it was."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = json.loads(subprocess.run([sys.executable, "-c", LATE_TORCH], capture_output=True,
                                     text=True, check=True).stdout)
    assert seen == {"before": False, "after": True, "import": [min(base + 10, 19)],
                    "launcher": base}, seen


def test_workers_started_for_a_store_that_is_not_a_jobs_are_stopped(tmp_path: Path) -> None:
    """The workers start before the launcher reaches the job's store; when the endpoint
    turns out to be no elastic job's, the launcher says so and leaves no worker behind."""
    import torch.distributed as dist

    worker = tmp_path / "waits.py"
    worker.write_text("import time\ntime.sleep(120)\n")
    foreign = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    result = launch(str(BIN / "lockstep"), "run", "--elastic", "-n", "2", "--rdzv-endpoint",
                    f"127.0.0.1:{foreign.port}", str(worker))
    assert result.returncode == 2, result.stderr
    assert "is not an elastic lockstep job's" in result.stderr, result.stderr
    assert not _running(str(worker))


def test_workers_done_before_their_launcher_reaches_the_store_end_the_launch(
        tmp_path: Path) -> None:
    """A joiner's launcher loads torch while its worker already trains: a short job can end,
    and its store with it, first (seen in the DiLoCo rejoin test under load). The launch
    is then its workers' outcome, at once -- not "no elastic job answered" after 60 s."""
    quick = tmp_path / "quick.py"
    quick.write_text("print('trained', flush=True)\n")
    started = time.monotonic()
    result = launch(*_joiner_without_a_job(quick))
    assert result.returncode == 0 and "trained" in result.stdout, result.stderr
    assert time.monotonic() - started < 45  # not the launcher's 60 s wait for a store


def _joiner_without_a_job(worker: Path) -> list[str]:
    """A joiner's launch (--node-rank 1: it hosts nothing) at a port nobody serves."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [str(BIN / "lockstep"), "run", "--elastic", "-n", "1", "--nnodes", "2",
            "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", str(worker)]


def test_a_launcher_stopped_before_it_reached_the_store_stops_its_workers(
        tmp_path: Path) -> None:
    """SIGTERM while the launcher still waits for the job's store, its worker already
    running: the worker is stopped with it, and the exit is the signal's."""
    started = tmp_path / "started"
    worker = tmp_path / "sleeps.py"
    worker.write_text(f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(120)\n")
    launcher = subprocess.Popen(_joiner_without_a_job(worker), stderr=subprocess.PIPE,
                                text=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists()
        launcher.terminate()
        assert launcher.wait(timeout=30) == 128 + 15
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not _running(str(worker))


def test_a_launcher_that_found_no_job_says_so_when_its_workers_failed_too(
        tmp_path: Path) -> None:
    """Its workers, finding no store either, fail on their own: the launcher still names
    the cause -- no job at the endpoint -- not only their exits."""
    worker = tmp_path / "fails.py"
    worker.write_text("raise SystemExit(1)\n")
    result = launch(*_joiner_without_a_job(worker))
    assert result.returncode == 2 and "no elastic job answered at" in result.stderr, \
        result.stderr


def _running(marker: str) -> list[str]:
    """The command lines of this machine's processes that mention `marker`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended in between
            continue
        if marker in text:
            found.append(text)
    return found


BY_HAND = textwrap.dedent("""
    import sys, time, lockstep
    init = lockstep.init  # loads torch (lockstep's names load on first use): not timed
    started = time.monotonic()
    try:
        init()
    except RuntimeError as error:
        print(f"after {time.monotonic() - started:.1f}s: {error}", flush=True)
        sys.exit(1)
""")


def test_a_world_started_by_hand_on_a_taken_port_fails_on_every_rank_within_seconds() -> None:
    # Another program holds the port: rank 0 cannot bind it, and rank 1's connection is
    # accepted by that program, which never answers (rank 1 used to wait forever, then for
    # the whole timeout: 300 s by default). A store answers at once: rank 1 knows in 15 s.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(16)
        port = squatter.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "LOCKSTEP_TIMEOUT": "300"}
        ranks = [subprocess.Popen([sys.executable, "-c", BY_HAND], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**env, "RANK": str(rank)}) for rank in (0, 1)]
        try:
            outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
        finally:  # a rank that hangs (the bug) must not outlive the test
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
    assert [rank.returncode for rank in ranks] == [1, 1], outputs
    for rank, output in enumerate(outputs):
        seconds = float(re.search(r"after ([\d.]+)s", output).group(1))
        assert f"rank {rank} could not reach the rendezvous at 127.0.0.1:{port}" in output
        assert seconds <= 25, output  # not the 300 s timeout
    assert "the port is in use by another program (EADDRINUSE)" in outputs[0]
    assert ("never answered as a torch.distributed store: another program holds the port "
            "(waited 15s)") in outputs[1]
    assert float(re.search(r"after ([\d.]+)s", outputs[1]).group(1)) >= 14.9


def test_a_port_a_finished_job_left_in_time_wait_can_serve_the_next_job() -> None:
    """`lockstep run --elastic` run again right after a job on the same endpoint ended (the
    rerun that resumes from a checkpoint): the old store's connections linger in TIME_WAIT
    on the port. Before, the launcher took that for a live store, waited for it, and failed
    with "no elastic job answered" (seen rerunning benchmarks/elastic_adversary.py)."""
    from lockstep.launch.elastic import _claim_port

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server's side closes first: it is the one left in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    lingering = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True,
                               text=True).stdout
    assert "TIME-WAIT" in lingering, lingering
    claimed = _claim_port("127.0.0.1", port, needed=False)
    assert claimed is not None
    claimed.close()
    with socket.socket() as live:  # and one that someone serves is still not ours
        live.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        live.bind(("127.0.0.1", port))
        live.listen()
        assert _claim_port("127.0.0.1", port, needed=False) is None
        with pytest.raises(OSError, match="cannot host the job's store at"):
            _claim_port("127.0.0.1", port, needed=True)  # --node-rank 0 says it must


def test_the_other_workers_that_ended_alike_are_one_line() -> None:
    """A config error raised by every one of 8 workers read as 7 more copies of it."""
    from types import SimpleNamespace

    from lockstep.launch.run import _endings

    def raised(text: str) -> SimpleNamespace:
        return SimpleNamespace(message={"message": text}, exitcode=1)

    failed = SimpleNamespace(failures={
        **{r: raised("ValueError: bad global batch") for r in range(6)},
        6: raised("CollectiveError: rank 6: lost rank 0"),
        7: SimpleNamespace(message="Signals.SIGTERM", exitcode=-15)})
    assert _endings(failed, list(range(1, 8)), "ValueError: bad global batch") == [
        "  ranks 1, 2, 3, 4, 5: the same error",
        "  rank 6: CollectiveError: rank 6: lost rank 0",
        "  rank 7: stopped by the launcher"]


def test_a_finished_worker_stopped_on_its_way_out_still_reads_as_finished() -> None:
    """Rank 1 finished its script; rank 0's collective then lost its partner, and the
    launcher stopped rank 1 (SIGTERM) before its exit was seen -- on a slow machine its
    exit (groups torn down, a collection) outlasted rank 0's failure. The verdict named
    rank 1 "stopped by the launcher" and not as the one that finished early."""
    from types import SimpleNamespace

    from lockstep.launch.entry import FINISHED
    from lockstep.launch.run import RECORD, failure_summary

    def recorded(kind: str, text: str, code: int, at: float, exitcode: int
                 ) -> SimpleNamespace:
        return SimpleNamespace(message={"message": text, "extraInfo": {RECORD: {
            "kind": kind, "code": code, "time": at}}}, exitcode=exitcode, local_rank=0,
            pid=100, timestamp=int(at))

    failed = SimpleNamespace(failures={
        0: recorded("exception", "CollectiveError: rank 0: gradient all-reduce failed: "
                    "Connection closed by peer", 1, 20.0, 1),
        1: recorded("finished", FINISHED, 0, 10.0, -15)})
    summary = failure_summary(failed, nproc=2)
    assert summary.startswith("lockstep run: worker rank 0 "), summary
    assert "no worker failed on its own: rank(s) 1 had finished (exit code 0)" in summary
    assert "rank 1: finished its script (exit code 0)" in summary


def test_a_worker_stopped_while_writing_its_record_leaves_no_half_written_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher stops every worker once one fails; a worker stopped halfway through
    writing its error record left an empty file, torchrun's reader raised JSONDecodeError,
    and the launcher died with it instead of naming the killed worker (found by CI: a kill -9
    of rank 1 while rank 0 was recording its lost collective)."""
    import json

    from lockstep.launch import entry

    target = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(target))

    def stopped_halfway(obj: object, f: Any) -> None:
        f.write('{"message": ')
        raise KeyboardInterrupt  # stands for the launcher's SIGTERM mid-write

    monkeypatch.setattr(entry.json, "dump", stopped_halfway)
    with pytest.raises(KeyboardInterrupt):
        entry.record("exception", "CollectiveError: lost rank 1", 1)
    assert list(tmp_path.iterdir()) == []  # torchrun then reports the worker's exit code or signal
    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(target))
    entry.record("finished", entry.FINISHED, 0)
    assert json.loads(target.read_text())["message"]["message"] == entry.FINISHED
