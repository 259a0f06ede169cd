"""`lockstep demo`, as a new user runs it, shortened to one epoch."""

import re
import subprocess
import sys
from pathlib import Path


def test_demo_trains_at_1_and_2_workers_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run([str(Path(sys.executable).parent / "lockstep"), "demo",
                             "--epochs", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(re.search(r"^test accuracy: (0\.\d\d)$", result.stdout, re.M).group(1))
    assert accuracy >= 0.85  # one epoch of real MNIST digits
    assert re.search(r"1 worker :\s+\d+ samples/s", result.stdout)
    assert re.search(r"2 workers:\s+\d+ samples/s", result.stdout)
    assert re.search(r"^weights fingerprint: [0-9a-f]{12}$", result.stdout, re.M)
    for run in ("1-worker", "2-workers"):
        assert (out / run / "training.png").stat().st_size > 10_000
        assert (out / run / "metrics.jsonl").read_text().count('"kind": "eval"') == 1
    assert "train:" in result.stderr  # the progress bar, on rank 0 of the main run
