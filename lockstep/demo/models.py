"""Small reference models for the demo, the examples and the benchmarks. lockstep never needs
a model of its own; these exist so every measurement uses the same, readable networks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def small_cnn() -> nn.Module:
    """A two-conv CNN for 28x28 grey images (MNIST, Fashion-MNIST): ~0.2M parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # (16, 14, 14)
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (32, 7, 7)
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2)
                   for t in (q, k, v))  # (B, heads, T, head_width)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_attn, self.ln_mlp = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class CharGPT(nn.Module):
    """A small GPT in the style of nanoGPT: learned positions, pre-norm blocks, and an output
    head tied to the token embedding. Maps (B, T) tokens to (B, T, vocab) logits."""

    def __init__(self, vocab: int, block_size: int = 64, width: int = 192, layers: int = 4,
                 heads: int = 4) -> None:
        super().__init__()
        self.block_size = block_size
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)  # (B, T, width)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_out(x))  # (B, T, vocab)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend (B, T) `tokens` by `new` sampled tokens."""
        for _ in range(new):
            logits = self(tokens[:, -self.block_size:])[:, -1] / temperature
            choice = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            tokens = torch.cat([tokens, choice], dim=1)
        return tokens
