"""The step timeline (lockstep/comm/timeline.py): bounded per rank, merged across ranks into
one Chrome trace whose spans nest as a step runs, with the clocks' alignment error stated."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import lockstep
from lockstep.comm import timeline
from lockstep.launch import cli
from lockstep.testing import World
from lockstep.tools import traceplot
from lockstep.tools.cluster import Cluster
from lockstep.training.attribution import RankWindow, Stragglers, attribute
from lockstep.training.links import verdict
from lockstep.training.plots import read_metrics
from tests import slow_link_job
from tests.models import make_model
from tests.test_cluster import needs_namespaces
from tests.test_trainer import config, digit_sets, sgd, train


def test_the_last_steps_are_kept_whole_and_every_kth_before_them() -> None:
    recording = timeline.Timeline("unused.json", keep_last=3, every=5)
    for step in range(1, 13):
        recording.begin_step(step)
        recording.add("forward", step * 10, step * 10 + 5)
    kept = [s.number for s in recording.steps()]
    assert kept == [0, 5, 9, 10, 11, 12]  # (step 0: what ran before the first step)
    assert all(len(s.spans) == 1 for s in recording.steps() if s.number)
    with pytest.raises(ValueError, match="keep_last and every must be >= 1"):
        timeline.Timeline("x.json", keep_last=0)


def test_the_trace_moves_each_rank_onto_rank_0s_clock() -> None:
    """Rank 1's clock runs 5 ms ahead: its span, recorded at the same moment as rank 0's,
    lands at the same time in the trace."""
    ranks = [{"host": "a", "pid": 1, "steps": [(3, [("forward", "compute", 1_000_000,
                                                      2_000_000, {})])]},
             {"host": "b", "pid": 2, "steps": [(3, [("gradient bucket 1/1", "comm",
                                                      6_000_000, 7_500_000, {"bytes": 8})])]}]
    trace = timeline.chrome_trace(ranks, [0, 5_000_000], 40_000)
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans["forward"]["ts"] == 0 and spans["gradient bucket 1/1"]["ts"] == 0
    assert spans["gradient bucket 1/1"]["dur"] == 1500 and spans["forward"]["dur"] == 1000
    assert (spans["gradient bucket 1/1"]["pid"], spans["gradient bucket 1/1"]["tid"]) == (1, 1)
    assert spans["gradient bucket 1/1"]["args"] == {"step": 3, "bytes": 8}
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {(0, "rank 0 (a, pid 1)"), (1, "rank 1 (b, pid 2)")}
    assert trace["otherData"]["clock_alignment_error_us"] == 40.0


def test_ranks_are_named_by_the_host_the_job_gives_them(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The emulated cluster's hosts share the machine's hostname: a 2-host trace named all
    four ranks 'vm'. The launcher's LOCKSTEP_HOST names them, as the membership does."""
    from lockstep.comm.topology import this_host

    monkeypatch.setenv("LOCKSTEP_HOST", "1")
    assert this_host() == "1"
    monkeypatch.delenv("LOCKSTEP_HOST")
    assert this_host() == socket.gethostname()


def run_with_timeline(run_dir: str) -> dict[str, Any]:
    trainer, _ = train(run_dir, timeline=f"{run_dir}/timeline.json", eval_every_steps=10,
                       checkpoint_every_steps=15)
    return {"written": str(trainer.timeline) if trainer.timeline else None,
            "active_after": timeline.active() is not None}


def test_a_two_rank_trainer_run_writes_one_trace_of_both_ranks(world2: World,
                                                               tmp_path: Path) -> None:
    results = world2.run(run_with_timeline, str(tmp_path))
    path = tmp_path / "timeline.json"
    assert [r["written"] for r in results] == [str(path), None]  # rank 0 writes it
    assert not any(r["active_after"] for r in results)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert 0 <= trace["otherData"]["clock_alignment_error_us"] < 50_000  # one machine
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        for step in (1, 17, 30):  # 30 steps: every one kept (the last 100)
            at = {e["name"]: e for e in mine if e["args"]["step"] == step and e["tid"] == 0}
            data, forward, backward, optimizer = (at[n] for n in ("data", "forward",
                                                                 "backward", "optimizer"))
            assert data["ts"] <= forward["ts"] <= backward["ts"] <= optimizer["ts"], at
            wait = at["wait for communication"]  # inside backward, at its end
            assert backward["ts"] <= wait["ts"] <= wait["ts"] + wait["dur"] <= \
                backward["ts"] + backward["dur"] + 1
            buckets = [e for e in mine if e["args"]["step"] == step and e["tid"] == 1]
            assert buckets and all(e["name"].startswith("gradient bucket") and
                                   e["args"]["bytes"] > 0 for e in buckets)
            assert all(backward["ts"] <= e["ts"] <= wait["ts"] + wait["dur"] + 1
                       for e in buckets)  # launched during backward, done by its end
        names = {e["name"] for e in mine}
        assert {"evaluation", "checkpoint"} <= names
    per_step = path.stat().st_size / 31
    assert per_step < 20_000, per_step  # bounded: what one step costs on disk
    # The picture of its last two steps: a row per rank and track, every span of them
    picture = tmp_path / "trace.png"
    rows = traceplot.draw(path, picture, steps=2)
    assert rows == ["rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, drawn, chosen = traceplot.bars(trace, 2)
    assert chosen == [28, 29]  # the last two that neither evaluated (30) nor saved
    assert len(drawn) == len([e for e in spans if e["args"]["step"] in (28, 29)])


def comm_spans_of(run_dir: str, parallel: Any) -> list[tuple[str, int, int, dict[str, Any]]]:
    """The communication track's spans on rank 0's trace: (name, step, track, args)."""
    path = f"{run_dir}/timeline.json"
    train(run_dir, timeline=path, parallel=parallel, max_steps=8)
    if not lockstep.init().is_main:
        return []
    return [(e["name"], e["args"]["step"], e["tid"], e["args"]) for e in
            json.loads(Path(path).read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]


def test_zero_and_diloco_put_their_communication_on_the_timeline(world2: World,
                                                                 tmp_path: Path) -> None:
    """ZeRO-3's parameter gathers and prefetches, its gradients' reduce-scatters (timed
    while they run: they finish before the reducer's wait), ZeRO-2's all-gather of the
    stepped parameters, and a DiLoCo round's sync, each on the communication track."""
    zero3 = world2.run(comm_spans_of, str(tmp_path / "z3"), lockstep.ShardConfig(stage=3))[0]
    step = [(name, args) for name, s, tid, args in zero3 if s == 5 and tid == 1]
    names = [name for name, _ in step]
    assert any(n.startswith("gather of parameter unit") for n in names), names
    assert any(n.startswith("prefetch of parameter unit") for n in names), names
    scattered = [args for name, args in step if name.startswith("gradient bucket")]
    assert scattered and all(a["via"] == "ZeRO-3 reduce-scatter in host memory"
                             for a in scattered)
    zero2 = world2.run(comm_spans_of, str(tmp_path / "z2"), lockstep.ShardConfig(stage=2))[0]
    assert ("all-gather of the stepped parameters (ZeRO-2)", 5, 1) in \
        [(n, s, tid) for n, s, tid, _ in zero2]
    diloco = world2.run(comm_spans_of, str(tmp_path / "dl"),
                        lockstep.DiLoCoConfig(sync_every=4))[0]
    assert sorted(s for n, s, tid, _ in diloco if n == "DiLoCo round's sync" and tid == 1) \
        == [4, 8]


def plain_script(path: str) -> bool:
    """A DDP-style loop, no Trainer: its own step marks and spans. Whether the recording
    stopped with the context."""
    lockstep.init()
    torch.manual_seed(0)
    model = lockstep.DataParallel(make_model("mlp"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    with lockstep.record_timeline(path) as recording:
        for step in range(1, 4):
            recording.begin_step(step)
            with recording.span("forward"):
                loss = nn.functional.cross_entropy(model(x), y)
            with recording.span("backward"):
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return timeline.active() is None


def test_a_plain_script_records_a_timeline_in_a_context(world2: World, tmp_path: Path) -> None:
    assert world2.run(plain_script, str(tmp_path / "t.json")) == [True, True]
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
             if e["ph"] == "X"]
    for rank in (0, 1):
        at = {(e["name"], e["tid"]) for e in spans if e["pid"] == rank and e["args"]["step"] == 3}
        assert {("forward", 0), ("backward", 0), ("wait for communication", 0)} <= at, at
        assert any(name.startswith("gradient bucket") and tid == 1 for name, tid in at), at


def test_lockstep_run_timeline_asks_every_worker_for_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(cli, "run", lambda spec: seen.append(os.environ.get(timeline.ENV)) or 0)
    monkeypatch.delenv(timeline.ENV, raising=False)
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main(["run", "--timeline", "t.json", "-n", "2", str(script)]) == 0
    assert seen == [str(Path("t.json").resolve())]
    assert timeline.ENV not in os.environ  # this process's own launches are unaffected


# ---- attribution: who the others waited for, and why ---------------------------------------


def test_the_slowest_ranks_cause_is_the_phase_that_exceeds_the_others() -> None:
    fast = RankWindow(steps=5, data=0.001, forward=0.010, backward=0.030, wait=0.015,
                      optimizer=0.002, comm=0.020)
    slow = RankWindow(steps=5, data=0.021, forward=0.010, backward=0.016, wait=0.001,
                      optimizer=0.002, comm=0.020)
    found = attribute([fast, slow, fast], bytes_per_step=4e6)
    assert found.slowest == 1 and found.cause == "its data loading"
    assert found.behind == pytest.approx((0.021 + 0.010 + 0.015 + 0.002) / 0.028 - 1)
    assert found.hidden == pytest.approx(1 - 0.015 / 0.020)  # what the others still waited
    assert found.step_ms == pytest.approx(49.0)  # the slowest rank's step
    assert found.bus_gbit == pytest.approx(4e6 * 8 * (4 / 3) / 0.020 / 1e9)
    assert "slowest rank 1, +71% against the others (its data loading)" in found.line(10)
    compute = RankWindow(steps=5, data=0.001, forward=0.030, backward=0.030, wait=0.001,
                         optimizer=0.002, comm=0.020)
    assert attribute([fast, compute], 0).cause == "its compute (forward)"


def test_a_straggler_is_named_once_after_three_windows_behind_in_a_row() -> None:
    watch = Stragglers()
    late = attribute([RankWindow(1, data=0.001, forward=0.01),
                      RankWindow(1, data=0.01, forward=0.01)], 0)
    level = attribute([RankWindow(1, forward=0.01), RankWindow(1, forward=0.0102)], 0)
    said = [watch.observe(w) for w in (late, late, level, late, late, late, late)]
    assert said[:6] == [None] * 5 + [said[5]] and said[6] is None  # the run restarted at 3
    assert said[5] is not None and said[5].startswith(
        "straggler: rank 1 has been more than 10% behind the others for 3 logged windows")
    assert said[5].endswith("its data loading")


class SlowOnRank1(Dataset[Any]):
    """Rank 1's data loading sleeps a little per sample (a slow disk, say)."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if torch.distributed.get_rank() == 1:
            time.sleep(0.002)
        return self.inner[index]


class Burn(nn.Module):
    """Real work in forward: on rank 1 alone (a slower model's worth), or on every rank."""

    def __init__(self, inner: nn.Module, only_rank_1: bool = True) -> None:
        super().__init__()
        self.inner, self.ballast = inner, torch.randn(160, 160)
        self.only_rank_1 = only_rank_1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.only_rank_1 or torch.distributed.get_rank() == 1:
            for _ in range(40):
                self.ballast = (self.ballast @ self.ballast).tanh()
        return self.inner(x)


DUTY_CYCLE = """
import os, select, signal, sys
pid = int(sys.argv[1])
try:  # half of every 8 ms stopped, until the test closes stdin
    while not select.select([sys.stdin], [], [], 0)[0]:
        os.kill(pid, signal.SIGSTOP)
        select.select([], [], [], 0.004)
        os.kill(pid, signal.SIGCONT)
        select.select([], [], [], 0.004)
finally:
    os.kill(pid, signal.SIGCONT)
"""


@contextlib.contextmanager
def rank_1_throttled() -> Iterator[None]:
    """Rank 1 gets about half the CPU time it would, as a cgroup's CPU quota (cpu.max) gives
    it: a process stops and continues it every 4 ms. (Pinning it beside a busy neighbour
    with taskset was no throttle on a loaded machine: the scheduler moved the other load
    onto the free core, where rank 0 then ran slowest.)"""
    if torch.distributed.get_rank() != 1:
        yield
        return
    cycler = subprocess.Popen([sys.executable, "-c", DUTY_CYCLE, str(os.getpid())],
                              stdin=subprocess.PIPE)
    try:
        yield
    finally:
        assert cycler.stdin is not None
        cycler.stdin.close()  # (it continues this process once more as it ends)
        cycler.wait(timeout=60)


def run_with_a_planted_straggler(run_dir: str, plant: str) -> list[dict[str, Any]]:
    train_set, test_set = digit_sets()
    model = make_model("mlp")
    callbacks = []
    if plant == "data":
        train_set = SlowOnRank1(train_set)  # type: ignore[assignment]
    elif plant == "compute":
        model = Burn(model)
    elif plant == "throttled":
        model = Burn(model, only_rank_1=False)
    else:  # a user's callback that takes its time on rank 1, between the steps' phases
        callbacks.append(lambda _: time.sleep(0.03) if torch.distributed.get_rank() == 1
                         else None)
    trainer = lockstep.Trainer(model, sgd, train_set, test_set, callbacks=callbacks,
                               config=config(run_dir, timeline=f"{run_dir}/t.json"))
    with rank_1_throttled() if plant == "throttled" else contextlib.nullcontext():
        trainer.fit()
    return [r for r in read_metrics(Path(run_dir)) if r["kind"] in ("timeline", "straggler")]


@pytest.mark.parametrize("plant, cause", [
    ("data", "its data loading"), ("compute", "its compute (forward)"),
    ("throttled", "its compute (forward)"),
    ("callback", "its own code between steps (callbacks, logging)")])
def test_a_planted_straggler_is_named_with_its_cause_within_three_windows(
        world2: World, tmp_path: Path, plant: str, cause: str) -> None:
    records = world2.run(run_with_a_planted_straggler, str(tmp_path / plant), plant)[0]
    windows = [r for r in records if r["kind"] == "timeline"]
    assert len(windows) == 6  # 30 steps, logged every 5
    assert [w["timeline_slowest"] for w in windows[:3]] == [1, 1, 1], windows
    assert all(w["timeline_cause"] == cause and w["timeline_behind"] > 0.1
               for w in windows[:3]), windows
    named = [r for r in records if r["kind"] == "straggler"]
    assert named and named[0]["step"] == 15 and named[0]["rank"] == 1, records
    assert named[0]["cause"] == cause


def test_the_host_whose_link_is_slow_is_found_from_three_hosts_pair_rates() -> None:
    """A pair of hosts is as fast as the slower of their two links, so a host is as fast as
    its fastest pair; the one well under the others' median is named (pure)."""
    found = verdict([94e6, 95e6, 9.6e6], first_ranks=[0, 2, 4])
    assert found is not None and (found.host, found.first_rank) == (2, 4)
    assert found.behind == pytest.approx(94.5 / 9.6 - 1)
    assert found.cause() == "its link (10 Mbit/s; the other hosts' 94)"
    assert verdict([94e6, 95e6, 60e6], first_ranks=[0, 1, 2]) is None  # not half as fast
    for broken in ([94e6, 0.0, 9e6], [94e6, float("nan"), 9e6], [94e6, 9e6]):
        assert verdict(broken, first_ranks=[0, 1, 2]) is None  # no verdict, no error


@needs_namespaces
def test_a_rank_behind_a_slow_link_is_named_with_its_link_as_the_cause(tmp_path: Path) -> None:
    """3 emulated hosts at 100 Mbit/s, host 2's link cut to 10: every rank waits in every
    step for the bytes that cross it, no rank's own work is slower -- the probe that a
    communication-bound window runs names rank 2 and its link within three windows."""
    run_dir = tmp_path / "run"
    with Cluster(hosts=3, bandwidth="100mbit") as cluster:
        cluster.limit(2, "10mbit")
        results = cluster.run_job(1, str(Path(slow_link_job.__file__)), [str(run_dir)],
                                  timeout=300)
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:]
    records = read_metrics(run_dir)
    windows = [r for r in records if r["kind"] == "timeline"]
    assert len(windows) == 4, windows
    assert all(w["timeline_waiting"] >= 0.25 for w in windows), windows
    assert [w["timeline_slowest"] for w in windows[:3]] == [2, 2, 2], windows
    assert all(w["timeline_cause"].startswith("its link (") for w in windows[:3]), windows
    named = [r for r in records if r["kind"] == "straggler"]
    assert named and named[0]["step"] == 15 and named[0]["rank"] == 2, records
    assert named[0]["cause"].startswith("its link (")
