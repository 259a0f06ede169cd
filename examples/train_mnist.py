"""The low-level API in one page: a CNN on real MNIST digits, data parallel.

    lockstep run -n 2 examples/train_mnist.py --epochs 3
    torchrun --nproc-per-node=2 examples/train_mnist.py      # the same script, plain torchrun
    python examples/train_mnist.py                           # a world of one
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
args = parser.parse_args()

world = lockstep.init()                              # reads torchrun's environment
train_set, test_set = mnist()
torch.manual_seed(0)
model = lockstep.DataParallel(small_cnn().to(world.device))  # same start on every rank
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
sampler = lockstep.ShardedSampler(train_set, shuffle=True, seed=0)  # this rank's slice
loader = DataLoader(train_set, batch_size=args.batch_size // world.world_size, sampler=sampler)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for images, labels in loader:
        loss = F.cross_entropy(model(images.to(world.device)), labels.to(world.device))
        optimizer.zero_grad()
        loss.backward()                              # returns with .grad averaged over ranks
        optimizer.step()
    if world.is_main:
        print(f"epoch {epoch}: loss {loss.item():.3f}")

if world.is_main:                                    # every replica is identical: ask one
    with torch.no_grad():
        images, labels = (t.to(world.device) for t in test_set.tensors)
        accuracy = (model.module.eval()(images).argmax(1) == labels).float().mean().item()
    print(f"test accuracy: {accuracy:.2f}")
