"""One call that makes a run start the same way every time: `lockstep.seed_everything(0)`.

Like `lightning.seed_everything` and `accelerate.utils.set_seed`: call it before the model is
built, so its initial weights are decided by the seed too. (The Trainer seeds its own data
order and per-rank RNG from `TrainConfig.seed`; a model built before any seed is set starts
from whatever the global RNG held, and so does every run after it.)
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> int:
    """Seed Python's, NumPy's and torch's global RNGs (every CUDA device included).
    Returns the seed, so `seed = seed_everything(args.seed)` reads naturally."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seed must fit 32 bits
    torch.manual_seed(seed)  # seeds every CUDA device as well
    return seed
