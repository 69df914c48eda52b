"""A tiny character-level GPT, trained on a few lines of text: run it as `python -m examples.charlm`.

No hookpolicy in it: `hookpolicy apply POLICY -- python -m examples.charlm --steps 100`
governs it unmodified.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

TEXT = (
    "A policy is a small YAML file that says which tensors to watch and what to do about them. "
    "Rules match modules by name and type, fire before or after a forward, in the backward pass "
    "or at the optimizer step, and capture statistics, clip, scale or raise alerts. "
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's layout and module names (transformer.wte, transformer.h.N.attn.c_attn, ...,
    transformer.ln_f, lm_head), so the library policies written for GPT-style models bind here,
    and nanoGPT's `forward(idx, targets) -> (logits, loss)`, so `target: loss` sees the loss."""

    def __init__(self, vocab: int, dim: int = 48, heads: int = 4, layers: int = 2, context: int = 32) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim),
            wpe=nn.Embedding(context, dim),
            h=nn.ModuleList(Block(dim, heads) for _ in range(layers)),
            ln_f=nn.LayerNorm(dim),
        ))
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`(logits, loss)` as nanoGPT returns them: the loss is the cross-entropy with `targets`, None without."""
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def vocabulary() -> list[str]:
    return sorted(set(TEXT))


def build_model() -> TinyGPT:
    """The model `hookpolicy explain --model examples.charlm:build_model` compiles against."""
    return TinyGPT(len(vocabulary()))


def encode(text: str = TEXT) -> torch.Tensor:
    """`text` as indices into `vocabulary()`."""
    stoi = {c: i for i, c in enumerate(vocabulary())}
    return torch.tensor([stoi[c] for c in text])


def batch(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets of the windows starting at `starts`."""
    x = torch.stack([data[s:s + context] for s in starts])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts])
    return x, y
