"""The Trainer under fault tolerance: `TrainConfig(elastic=ElasticConfig(...))` with
`lockstep run --elastic` (tests/elastic_trainer_job.py, least squares in float64).

A worker killed mid-run costs the survivors no restart, a worker started later joins, every
global batch is trained exactly once, and the final weights are one process's on the same
global batches -- with the LR scheduler, evaluation, metrics and checkpoints carrying on.
A job whose every worker died resumes from its last checkpoint when run again; a joiner
that differs from the job in what is trained is refused with the reason, and the job goes
on.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lockstep.launch.elastic import free_port
from lockstep.seeding import seed_everything
from lockstep.training.sampler import global_order
from tests import elastic_job
from tests.test_elastic import (
    ROOT,
    _check_history,
    _kill_and_rejoin,
    _launch,
    _records,
    _wait_for,
)

JOB = str(ROOT / "tests" / "elastic_trainer_job.py")
PER_EPOCH = elastic_job.SAMPLES // 12


def order(step: int, global_batch: int) -> tuple[torch.Tensor, int]:
    """The Trainer's sample order for global step `step` (seed 0), and the step in its epoch."""
    per_epoch = elastic_job.SAMPLES // global_batch
    return global_order(elastic_job.SAMPLES, 0, step // per_epoch, True), step % per_epoch


def reference(steps: int, global_batch: int) -> list[torch.Tensor]:
    """One process, the same global batches, optimizer and schedule."""
    x, y = elastic_job.data()
    seed_everything(0)
    model = nn.Linear(elastic_job.FEATURES, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    for step in range(steps):
        permutation, within = order(step, global_batch)
        batch = permutation[within * global_batch:(within + 1) * global_batch]
        ((model(x[batch]) - y[batch]) ** 2).mean().backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return [v.flatten() for v in model.state_dict().values()]


def assert_weights(finals: list[dict], expected: list[torch.Tensor]) -> None:
    for final in finals:
        for got, want in zip(final["params"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                       rtol=1e-9, atol=1e-11)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_goes_on_through_a_kill_and_lets_a_worker_join(tmp_path: Path) -> None:
    steps = 60
    run = _kill_and_rejoin(tmp_path, ["--steps", str(steps), "--pace", "0.04",
                                      "--hold-at", "30", "--timeline"], kill_at=8, job=JOB)
    finals = _check_history(run, steps, 12, order=order)
    assert_weights(finals, reference(steps, 12))
    # One history of evaluations, the same on every worker (the joiner received it), and
    # metrics recorded once at every logging step, through both regroups.
    assert len({json.dumps(f["history"]) for f in finals}) == 1
    assert [h["step"] for h in finals[0]["history"]] == [10, 20, 30, 40, 50, 60]
    logged = metrics(tmp_path / "run")
    assert [r["step"] for r in logged if r["kind"] == "train"] == list(range(5, 61, 5))
    assert [r["step"] for r in logged if r["kind"] == "eval"] == [10, 20, 30, 40, 50, 60]
    written = sorted(int(p.name.split("-")[-1]) for p in (tmp_path / "run" / "checkpoints")
                     .iterdir() if p.name.startswith("step-"))
    assert written == [10, 20, 30, 40, 50, 60]
    assert "3 -> 2 workers, continuing at step" in run["stderr"]
    assert "joined, state sent from rank 0; 2 -> 3 workers" in run["stderr"]
    # (and nothing kept the dropped DataParallel alive through the regroup -- checked in
    # _check_history: the Trainer's checkpoints held it once, and resuming took 13 s)
    # The timeline went on through both regroups, and shows them on the survivors' tracks.
    spans = [e for e in json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
             if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2}  # the final world, the joiner included
    regroups = {e["name"] for e in spans}
    assert {"regroup (a peer was lost)", "regroup (admitting joiners)"} <= regroups
    assert any(r["kind"] == "timeline" for r in logged)  # attribution, every window


@pytest.mark.parametrize("mode", ["sync", "zero3"])
def test_a_job_whose_every_worker_died_resumes_from_its_checkpoint(tmp_path: Path,
                                                                  mode: str) -> None:
    """Both workers killed after the checkpoint at step 20: the same command, run again,
    resumes there and ends with one process's weights -- under ZeRO-3 too, whose shards
    and their mirrors the checkpoint gives back."""
    steps, args = 60, ["--steps", "60", "--pace", "0.03", "--mode", mode]
    port = free_port()
    first = _launch(tmp_path, port, 2, args, "launcher1.err", JOB)
    try:
        _wait_for(tmp_path, lambda r: r["attempt"] >= 24, 90, "step 24")
        for pid in {r["pid"] for r in _records(tmp_path) if "attempt" in r}:
            os.kill(pid, signal.SIGKILL)
        assert first.wait(timeout=60) != 0
    finally:
        if first.poll() is None:
            first.kill()
    stderr = (tmp_path / "launcher1.err").read_text()
    assert "the job goes on without it" not in stderr  # every worker died at once
    killed_at = time.time()
    again = _launch(tmp_path, port, 2, args, "launcher2.err", JOB)
    assert again.wait(timeout=120) == 0, (tmp_path / "launcher2.err").read_text()[-3000:]
    stderr = (tmp_path / "launcher2.err").read_text()
    assert "resumed from" in stderr and "at step 20" in stderr, stderr[-2000:]
    finals = [r for r in _records(tmp_path) if r.get("final")]
    assert len(finals) == 2 and all(f["step"] == steps for f in finals)
    assert_weights(finals, reference(steps, 12))
    # the second run trained from step 20 on: nothing before it again
    assert min(r["attempt"] for r in _records(tmp_path) if "attempt" in r
               and r["time"] > killed_at) == 20


def test_a_joiner_that_differs_from_the_job_is_refused_and_the_job_goes_on(
        tmp_path: Path) -> None:
    """Before, a joiner with a wider layer made every member raise ModelMismatchError, and
    one with another global batch was let in (samples lost and repeated, weights off).
    The job waits at step 5 until both joiners have been dealt with: under load a joiner
    once started only after the job had finished (and exited 0, nothing to join)."""
    go = tmp_path / "joiners-done"
    steps, args = 40, ["--steps", "40", "--pace", "0.02", "--hold-at", "5", "--hold-for",
                       str(go)]
    port = free_port()
    job = _launch(tmp_path, port, 2, args, "launcher.log", JOB)
    joiners = []
    try:
        _wait_for(tmp_path, lambda r: r["attempt"] >= 3, 90, "step 3")
        for name, differ in (("batch", ["--global-batch", "24"]), ("wider", ["--width", "2"])):
            (tmp_path / name).mkdir()
            joiners.append(_launch(tmp_path / name, port, 1, [*args, *differ], "joiner.log",
                                   JOB))
        assert [j.wait(timeout=120) for j in joiners] == [1, 1]
        go.touch()
        assert job.wait(timeout=240) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        for p in (job, *joiners):
            if p.poll() is None:
                p.kill()
    said = {name: (tmp_path / name / "joiner.log").read_text() for name in ("batch", "wider")}
    assert "the job refused it: it differs from the job in what is trained " \
        "(config.global_batch_size: 24 here, 12 in the job" in said["batch"]
    assert "model entry 'bias': [2] float64 here, [1] float64 in the job" in said["wider"]
    log = (tmp_path / "launcher.log").read_text()
    assert log.count("it differs from the job in what is trained") == 2
    finals = [r for r in _records(tmp_path) if r.get("final")]
    assert sorted(f["world"] for f in finals) == [2, 2]
    assert {r["world"] for r in _records(tmp_path) if "attempt" in r} == {2}
    assert_weights(finals, reference(steps, 12))


def test_a_worker_stopped_past_the_timeout_is_left_out_then_joins_again(
        tmp_path: Path) -> None:
    """SIGSTOP of a worker for 10 s, twice (the collective timeout is 3 s: the others stop
    waiting for it after 3 + 4.5 s): each time the others go on without it; woken, it finds
    itself left out, joins again by itself and trains the step the others are at. Before,
    it joined again across an epoch boundary and ran that epoch's evaluation alone ('desync
    at collective #8: ... rank 2 issued "trainer: evaluation sums"'), and the job crashed in
    Gloo; and the second time it was never let in (still marked as admitted from the
    first). The second stop is in the checkpoint at an epoch's end (20 steps an epoch):
    let in again later, it ran that epoch's evaluation alone, while the others trained
    (Gloo: 'Received data size doesn't match expected size'). The weights are one
    process's."""
    # 350 paced steps outlast both stops: at most 20 steps a second, and about 26 s to the
    # second return, 15 s of it with the others waiting
    plan = tmp_path / "stop-plan.json"
    steps, args = 350, ["--steps", "350", "--pace", "0.05", "--collective-timeout", "3",
                        "--stop-plan", str(plan)]
    job = _launch(tmp_path, free_port(), 3, args, "launcher.log", JOB)
    try:
        victim = _wait_for(tmp_path, lambda r: r["attempt"] >= 10 and r["rank"] == 1, 90,
                           "step 10")[0]
        os.kill(victim["pid"], signal.SIGSTOP)  # in a training step (membership epoch 1)
        time.sleep(10)
        os.kill(victim["pid"], signal.SIGCONT)
        back = _wait_for(tmp_path, lambda r: r["worker"] == victim["worker"]
                         and r["epoch"] > 1, 90, f"worker {victim['worker']} to be back")
        # then it stops itself in the checkpoint at the end of an epoch still ahead
        at = (max(r["attempt"] for r in back) // 20 + 2) * 20
        plan.write_text(json.dumps({"worker": victim["worker"], "step": at}))
        _wait_until_stopped(victim["pid"], 90)
        time.sleep(10)
        os.kill(victim["pid"], signal.SIGCONT)
        _wait_for(tmp_path, lambda r: r["worker"] == victim["worker"] and r["epoch"] > 3
                  and r["attempt"] > at, 90, f"worker {victim['worker']} to be back")
        assert job.wait(timeout=240) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    log = (tmp_path / "launcher.log").read_text()
    finals = [r for r in _records(tmp_path) if r.get("final")]
    assert sorted(f["world"] for f in finals) == [3, 3, 3], log[-3000:]
    assert all(f["step"] == steps for f in finals)
    assert log.count("was formed without it (it was silent too long); joining again") == 2
    assert log.count(f"worker {victim['worker']} joined the job at step") == 2
    assert "desync" not in log
    assert_weights(finals, reference(steps, 12))


def _wait_until_stopped(pid: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while elastic_job.process_state(pid) != "T":
        if time.monotonic() > deadline:
            raise AssertionError(f"worker pid {pid} did not stop itself in its checkpoint")
        time.sleep(0.05)


def test_zero_3_under_elastic_loses_nothing_to_a_kill_and_reshards_for_a_joiner(
        tmp_path: Path) -> None:
    """ZeRO-3 with fault tolerance: each rank keeps the next rank's shard too, so the kill
    of rank 1 loses no parameters or optimizer state; the survivors reshard from 3 to 2
    ranks, then to 3 again for the joiner, and the final weights are one process's
    (float64). Before, the Trainer refused ShardConfig with elastic=. (Stage 2: the plain
    loop's test, tests/test_elastic.py.)

    Rank 2 does not take step 19 (its optimizer fails on the connection to the killed
    rank 1) while ranks 0 and 1 complete it and go on to evaluate the epoch's end (the
    first collective after it: nothing is logged, saved or evaluated mid-epoch here):
    shard 2 after step 19 lived only on rank 1 (its mirror), so the survivors go back to
    step 19 and train it again. Before, the job ended ("held at step 20 by no survivor"),
    in 2 of 5 clean-clone CI runs, with the kill in the next step's gather."""
    steps = 60
    run = _kill_and_rejoin(tmp_path, ["--steps", str(steps), "--pace", "0.04", "--hold-at",
                                      "30", "--mode", "zero3", "--unstepped-at", "19",
                                      "--log-every", "7", "--checkpoint-every", "7",
                                      "--eval-every", "0"],
                           kill_at=19, job=JOB, stepped=True)
    finals = _check_history(run, steps, 12, order=order, taken_back=1)
    assert_weights(finals, reference(steps, 12))
    assert "step 19, which it had completed, is taken back" in run["stderr"]
    for final in finals:  # the evaluation at step 20, interrupted, was done once, after it
        assert [h["step"] for h in final["history"]] == [20, 40, 60]
    assert "3 -> 2 workers, continuing at step" in run["stderr"]
    assert "joined, state sent from rank 0, ZeRO shards from every member; 2 -> 3 workers" \
        in run["stderr"]
