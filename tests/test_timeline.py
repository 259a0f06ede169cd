"""The step timeline (lockstep/comm/timeline.py): bounded per rank, merged across ranks into
one Chrome trace whose spans nest as a step runs, with the clocks' alignment error stated."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lockstep.comm import timeline
from lockstep.launch import cli
from lockstep.testing import World
from tests.test_trainer import train


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
