"""A Trainer job for the crash-and-resume test: it records, per rank and step, which samples
the step trained on, writes its pid so a test can kill it, and prints its final fingerprint.

    lockstep run -n 2 tests/resumable_job.py RUN_DIR [STEP_DELAY_S]
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset

import lockstep


class RecordedDigits(Dataset):
    """The first 1,440 real digits; remembers which indices were read since last asked."""

    def __init__(self) -> None:
        data = load_digits()
        self.x = torch.tensor(data.data[:1440], dtype=torch.float32) / 16.0
        self.y = torch.tensor(data.target[:1440], dtype=torch.long)
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        self.read.append(int(index))
        return self.x[index], self.y[index]


def main() -> None:
    run_dir, delay = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    world = lockstep.init()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"pid-rank{world.rank}").write_text(str(os.getpid()))
    data = RecordedDigits()
    log = open(run_dir / f"samples-rank{world.rank}.jsonl", "a")  # noqa: SIM115

    def record(trainer: lockstep.Trainer) -> None:
        log.write(json.dumps({"step": trainer.state.global_step, "indices": data.read}) + "\n")
        log.flush()
        data.read = []
        (run_dir / f"step-rank{world.rank}").write_text(str(trainer.state.global_step))
        time.sleep(delay)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 10))
    config = lockstep.TrainConfig(global_batch_size=48, max_batch_per_rank=8, epochs=2,
                                  lr=0.05, checkpoint=lockstep.CheckpointConfig(every_steps=4),
                                  run_dir=str(run_dir),
                                  progress=False, log_every_steps=4)
    trainer = lockstep.Trainer(model, lambda p: torch.optim.AdamW(p), data, config=config,
                               callbacks=[record])
    summary = trainer.fit()
    if world.is_main:
        print(f"FINGERPRINT {summary['fingerprint']}", flush=True)


if __name__ == "__main__":
    main()
