"""The tiny models: an MLP, a two-block GPT with nanoGPT's module names (and its LoRA
fine-tune), their batches and training loop."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


def tiny(seed: int = 0, out: int = 2) -> nn.Sequential:
    """Linear(4, 8), ReLU, Linear(8, out), seeded: the smallest model with a hidden layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, out))


VOCAB, BLOCK = 64, 16

class GAN(nn.Module):
    """A generator and a discriminator in one module; `forward` is the generator (Lightning's GAN example)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.act = nn.ReLU()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A two-block GPT with nanoGPT's module names and weight tying.

    The conventional GPT-2/nanoGPT names (`transformer.wte`, `transformer.h.N.attn.c_attn`,
    `transformer.h.N.mlp.c_fc`, `lm_head`, ...) with the token embedding tied to
    `lm_head`, as nanoGPT does: the names the policy library's patterns are written for.
    """

    def __init__(self, d: int = 32, n_head: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, d), wpe=nn.Embedding(BLOCK, d), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(d, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(d),
        ))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT()


def lora(model: GPT) -> nn.Module:
    """`model` with LoRA (r=4) on every c_attn, as peft.get_peft_model makes it."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"]))  # type: ignore[no-any-return]


def batch(seed: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    idx = torch.randint(0, VOCAB, (size, BLOCK), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, loss_scale: float = 1.0,
               before_step: Optional[Callable[[], None]] = None) -> None:
    idx, targets = batch(seed)
    _, loss = model(idx, targets)
    assert loss is not None
    (loss * loss_scale).backward()
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_then_evaluate(model: nn.Module, steps: int) -> None:
    """`steps` AdamW training steps, then one evaluation batch (eval mode, no grad)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        train_step(model, opt, i)
    model.eval()
    with torch.no_grad():
        model(batch(99)[0])
    model.train()


def tiny_step(model: nn.Module, opt: torch.optim.Optimizer, batch: int = 6) -> float:
    """One step of `tiny` (or any 4-input model) on a random batch; returns the loss."""
    loss = model(torch.randn(batch, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()
