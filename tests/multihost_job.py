"""Training job for the multi-host test: each rank trains on its slice of every global batch
and rank 0 saves the final weights -- once per algorithm, a fresh model each time, in one
launch (starting 4 workers on 2 emulated hosts is most of the cost). Run on every emulated
host with `lockstep run`.

    multihost_job.py OUT_PREFIX ALGORITHM[,ALGORITHM...]     # writes OUT_PREFIX.ALGORITHM.pt
"""

import sys

import torch
from sklearn.datasets import load_digits

import lockstep

STEPS, PER_RANK = 8, 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(step))
    x = torch.tensor(digits.data, dtype=torch.float32)[order[:size]] / 16.0
    return x, torch.tensor(digits.target)[order[:size]]


def train(algorithm: str) -> torch.nn.Module:
    world = lockstep.init()  # (already made: the same world)
    net = model()
    dp = lockstep.DataParallel(net, algorithm=algorithm)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK * world.world_size)
        mine = slice(world.rank * PER_RANK, (world.rank + 1) * PER_RANK)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(dp(x[mine]), y[mine]).backward()
        opt.step()
    dp.close()
    return net


def main() -> None:
    out, algorithms = sys.argv[1], sys.argv[2].split(",")
    world = lockstep.init()
    for algorithm in algorithms:
        net = train(algorithm)
        if world.is_main:
            torch.save(net.state_dict(), f"{out}.{algorithm}.pt")
    if world.is_main:
        print(f"trained on {world.world_size} ranks, {world.num_hosts} hosts", flush=True)


if __name__ == "__main__":
    main()
