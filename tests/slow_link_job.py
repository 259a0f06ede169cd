"""Training job for the slow-link attribution test: the Trainer with a step timeline, on
every emulated host (`lockstep run`), a model whose gradients take far longer to cross a
slow link than to compute.

    slow_link_job.py RUN_DIR
"""

import sys

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import lockstep


def main(run_dir: str) -> None:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train, test = TensorDataset(x[:960], y[:960]), TensorDataset(x[960:1200], y[960:1200])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),  # 85K parameters
                              torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    config = lockstep.TrainConfig(global_batch_size=48, max_steps=20, log_every_steps=5,
                                  run_dir=run_dir, progress=False, timeline=f"{run_dir}/t.json")
    lockstep.Trainer(net, lambda p: torch.optim.SGD(p, lr=0.05), train, test,
                     config=config).fit()


if __name__ == "__main__":
    main(sys.argv[1])
