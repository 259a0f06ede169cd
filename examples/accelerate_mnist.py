"""An ordinary Hugging Face Accelerate script, with lockstep's wrapper in place of torch's DDP.

    ACCELERATE_USE_CPU=1 torchrun --nproc-per-node 2 examples/accelerate_mnist.py --wrapper lockstep
    ACCELERATE_USE_CPU=1 lockstep run -n 2 examples/accelerate_mnist.py --wrapper ddp

On CPUs Accelerate needs ACCELERATE_USE_CPU=1 (else it sees no GPU and, in each process,
trains alone); `accelerate launch --cpu --num_processes 2` starts one process, not two.

`--wrapper ddp` is the plain Accelerate way; `--wrapper lockstep` differs in one place:
Accelerate prepares the model for all but data parallelism (device, autocast,
torch.compile, save_state) with `evaluation_mode=True` -- as transformers' Trainer does for
a model that "already owns placement and gradient reduction" -- and lockstep.DataParallel
wraps it where Accelerate's DDP would. accumulate() reaches the wrapper's no_sync(). The
two take the same steps: the same per-step losses, to the last bit.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

import lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn

parser = argparse.ArgumentParser()
parser.add_argument("--wrapper", choices=["ddp", "lockstep"], default="lockstep")
parser.add_argument("--steps", type=int, default=60, help="micro-batches per rank")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--out", help="rank 0 writes the per-step losses here, as JSON")
args = parser.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.accumulate)
train_set, _ = mnist()
set_seed(0)                                            # before the model: its weights too
model = small_cnn()
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
loader = DataLoader(train_set, batch_size=32, shuffle=True)   # per process, as Accelerate has it

if args.wrapper == "ddp":
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
else:
    model = lockstep.DataParallel(accelerator.prepare_model(model, evaluation_mode=True))
    optimizer, loader = accelerator.prepare(optimizer, loader)

losses = []
while len(losses) < args.steps:
    for images, labels in loader:
        with accelerator.accumulate(model):            # no_sync() on all but the last micro-batch
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()                           # steps only when gradients were synced
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
        if len(losses) == args.steps:
            break

accelerator.print(f"{args.wrapper}: {len(losses)} steps, last loss {losses[-1]:.4f}")
if args.out and accelerator.is_main_process:
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "processes": accelerator.num_processes,
                   "wrapper": type(model).__name__}, f)
accelerator.wait_for_everyone()
accelerator.end_training()                             # destroys the process group
