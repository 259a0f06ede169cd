"""Small models and real data (scikit-learn's digits) shared by the multi-process tests."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """1,797 real 8x8 handwritten digits: pixels scaled to [0, 1], and labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (torch.tensor(data.data, dtype=torch.float32) / 16.0,
            torch.tensor(data.target, dtype=torch.long))


class TinyGPT(nn.Module):
    """One transformer block over digit rows read as tokens (pixel intensity 0..16), with the
    output head tied to the embedding and a frozen positional table."""

    def __init__(self, vocab: int = 17, width: int = 32, length: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02, requires_grad=False)
        # bias=False: the attention key bias has an exactly-zero true gradient (softmax
        # ignores a shift), so its .grad is pure roundoff and Adam turns roundoff into
        # full-size steps -- a property of Adam, not of data parallelism.
        self.block = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=64, dropout=0.0,
                                                batch_first=True, bias=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        h = self.block(h, src_mask=self.mask[: tokens.shape[1], : tokens.shape[1]],
                       is_causal=True)
        return self.head(self.norm(h))  # (B, T, vocab)


class BranchNet(nn.Module):
    """A trunk, a head, and a branch that forward() uses only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(64, 32)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.relu(self.branch(h))
        return self.head(h)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    if kind == "conv":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1),
                             nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(),
                             nn.Linear(16 * 6 * 6, 10))
    if kind == "bn":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1),
                             nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10))
    if kind == "transformer":
        return TinyGPT()
    if kind == "branch":
        return BranchNet()
    raise ValueError(kind)


def make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)  # type: ignore[arg-type]
    raise ValueError(name)


def batch(kind: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch number `step`: real digits, taken in a fixed shuffled order."""
    x, y = digits()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(step))[:size]
    if kind == "transformer":
        tokens = (x[order] * 16).round().long()
        return tokens[:, :16], tokens[:, 1:17]
    return x[order], y[order]


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            **kwargs: object) -> torch.Tensor:
    out = model(x, **kwargs)
    if kind == "transformer":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max((p.float() - q.float()).abs().max().item() for p, q in pairs)


def digest(model: nn.Module, parameters_only: bool = False) -> str:
    """A hash of the exact bytes of the weights (and buffers, unless parameters_only)."""
    import hashlib

    h = hashlib.sha256()
    tensors = model.parameters() if parameters_only else model.state_dict().values()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
