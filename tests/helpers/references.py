"""References that more than one test file checks hookpolicy against, written from the
published equations: adaptive gradient clipping (NFNets, Brock et al. 2021) and ZClip
(arXiv 2504.02507: warm-up mean and population variance, z-score, clip to mean + k * std,
EMA of the effective norm)."""

from __future__ import annotations

import math
import statistics
from typing import Optional

import torch
from torch import nn


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    """||x_i|| over all dims but the first, keeping them for broadcasting; of the whole tensor for ndim <= 1."""
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def agc_reference(params: list[tuple[str, nn.Parameter]], ratio: float, eps: float, apply: bool = True,
                  ) -> dict[str, int]:
    """Clip each unit's gradient as NFNets does (unless not `apply`); returns how many units were
    (or would have been) clipped per module."""
    clipped: dict[str, int] = {}
    with torch.no_grad():
        for name, p in params:
            if p.grad is None:
                continue
            bound = unit_norm(p).clamp(min=eps) * ratio
            g_norm = unit_norm(p.grad)
            over = g_norm > bound
            if apply:
                p.grad.copy_(torch.where(over, p.grad * (bound / g_norm.clamp(min=1e-6)), p.grad))
            module = name.rpartition(".")[0]
            clipped[module] = clipped.get(module, 0) + int(over.sum())
    return clipped


class ZClipReference:
    """ZClip's update equations, step by step, on the gradients of `params`."""

    def __init__(self, alpha: float = 0.97, k: float = 2.5, warmup: int = 25) -> None:
        self.alpha, self.k, self.warmup = alpha, k, warmup
        self.buffer: list[float] = []
        self.mu: Optional[float] = None
        self.var = 0.0

    def step(self, params: list[nn.Parameter], apply: bool) -> bool:
        """Clip the gradients (when `apply`) as ZClip would; True when it clips (or would)."""
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        g = total.item()
        if self.mu is None:  # warm-up: collect, then start from the buffer's mean and population variance
            self.buffer.append(g)
            if len(self.buffer) == self.warmup:
                self.mu = statistics.fmean(self.buffer)
                self.var = statistics.pvariance(self.buffer, self.mu)
            return False
        sigma = math.sqrt(self.var)
        z = (g - self.mu) / (sigma + 1e-6)
        clipped = z > self.k
        effective = g
        if clipped:
            threshold = self.mu + self.k * sigma
            if apply:
                torch._foreach_mul_(grads, torch.clamp(threshold / (total + 1e-6), max=1.0))
            effective = threshold
        self.mu = self.alpha * self.mu + (1 - self.alpha) * effective
        self.var = self.alpha * self.var + (1 - self.alpha) * (effective - self.mu) ** 2
        return clipped
