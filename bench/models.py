"""The benchmark's models, built from `torch.nn` only, each with a batch maker and a loss.

The GPT-style decoder is written without in-place operations on any `Linear` output
(the residual is `x = x + f(x)`, the MLP's GELU is out of place): the hand-written
monitor registers `register_full_backward_hook` on every Linear, which raises as soon as
a module's output is modified in place (hookpolicy's own backward hooks do not care).
The CNN keeps the `ReLU(inplace=True)` real CNNs use; only its Linear layers are hooked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "WORKLOADS", "GPT", "SmallCNN", "LSTMModel", "wide_model"]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.act(self.fc(x)))
        return out


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # out of place: full backward hooks need it
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-LN blocks, a Linear LM head."""

    def __init__(self, vocab: int = 1024, d: int = 256, heads: int = 4, layers: int = 6, seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([DecoderBlock(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


class SmallCNN(nn.Module):
    """Three conv stages (BatchNorm, in-place ReLU, pooling) and a two-layer Linear classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()

        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True), nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(stage(3, 32), stage(32, 64), stage(64, 128))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(self.features(x))
        return out


class LSTMModel(nn.Module):
    """Embedding, a Linear input projection, a 2-layer LSTM, a Linear MLP head."""

    def __init__(self, vocab: int = 1024, d: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.inp = nn.Linear(d, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.inp(self.emb(idx)))
        out: torch.Tensor = self.head(F.gelu(self.fc(h)))
        return out


@dataclass(frozen=True)
class Workload:
    """A model factory, a fixed batch factory and the loss, with the sizes written out."""

    name: str
    describe: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _tokens(vocab: int, batch: int, seq: int) -> Callable[[torch.Generator, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    def make(g: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    return make


def _images(g: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, 3, 32, 32, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device)


WORKLOADS: dict[str, Workload] = {
    "gpt": Workload(
        "gpt", "GPT decoder: 6 blocks, d_model 256, 4 heads, seq 128, batch 8, vocab 1024, AdamW",
        GPT, _tokens(1024, 8, 128), _lm_loss,
    ),
    "nanogpt": Workload(
        "nanogpt", "nanoGPT-style small GPT: 4 blocks, d_model 128, 4 heads, seq 64, batch 12, vocab 65 (characters), AdamW",
        lambda: GPT(vocab=65, d=128, heads=4, layers=4, seq=64), _tokens(65, 12, 64), _lm_loss,
    ),
    "cnn": Workload(
        "cnn", "CNN: 3 conv stages (32-64-128 ch, BN, in-place ReLU) + 2 Linear, 32x32 images, batch 64, AdamW",
        SmallCNN, _images, F.cross_entropy,
    ),
    "lstm": Workload(
        "lstm", "LSTM LM: 2 layers, hidden 256, Linear in/out, seq 64, batch 16, vocab 1024, AdamW",
        LSTMModel, _tokens(1024, 16, 64), _lm_loss,
    ),
}


def wide_model(blocks: int = 100, linears: int = 50) -> nn.Module:
    """A model with 1 + blocks * (1 + 2 * linears - 1) modules (10,001 by default): the plan benchmark.

    Each block is a Sequential of `linears` Linear(8, 8) layers with a ReLU between two of
    them, so it has real parameters for step rules and runs forward in a few milliseconds.
    """
    def block() -> nn.Sequential:
        layers: list[nn.Module] = []
        for i in range(linears):
            if i:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(8, 8))
        return nn.Sequential(*layers)

    return nn.Sequential(*[block() for _ in range(blocks)])
