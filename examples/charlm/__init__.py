"""A tiny character-level GPT, trained on a few lines of text: run it as `python -m examples.charlm`.

No hookpolicy in it: `hookpolicy apply POLICY -- python -m examples.charlm --steps 100`
governs it unmodified.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

TEXT = (
    "A policy is a small YAML file that says which tensors to watch and what to do about them. "
    "Rules match modules by name and type, fire before or after a forward, in the backward pass "
    "or at the optimizer step, and capture statistics, clip, scale or raise alerts. "
)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 48, heads: int = 4, layers: int = 2, context: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def vocabulary() -> list[str]:
    return sorted(set(TEXT))


def build_model() -> TinyGPT:
    """The model `hookpolicy explain --model examples.charlm:build_model` compiles against."""
    return TinyGPT(len(vocabulary()))
