"""References that more than one test file checks hookpolicy against, written from the
published equations: adaptive gradient clipping (NFNets, Brock et al. 2021) and ZClip
(arXiv 2504.02507: warm-up mean and population variance, z-score, clip to mean + k * std,
EMA of the effective norm); and the shipped loss guards' spike test and skips, written from
their headers (`loss_spike`, `guard_skips`)."""

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


def loss_spike(loss: float, applied: list[float]) -> bool:
    """loss-spike-guard.yaml's (and recover.yaml's) spike test, from the losses of the steps that were
    applied: the median and the median absolute deviation (statistics.median), scaled by 1.4826."""
    if not math.isfinite(loss):
        return True
    if len(applied) < 20:  # count(loss) >= 20
        return False
    window = applied[-100:]
    median = statistics.median(window)
    mad = statistics.median([abs(x - median) for x in window])
    z = (loss - median) / (1.4826 * mad) if mad else math.copysign(math.inf, loss - median)
    return z > 4 and loss > 1.2 * median


def guard_skips(losses: list[float], max_in_a_row: int) -> set[int]:
    """The steps a shipped loss guard skips, from the losses a script saw (no optimizer for a ladder's
    rungs to act on): a spike is skipped, but a spike after `max_in_a_row` skipped in a row is applied
    (the weights, unchanged by the skips, made it) and the count starts again; a loss that is not
    finite is never applied. An applied step's loss enters the baseline, a skipped one's never."""
    applied: list[float] = []
    skipped: set[int] = set()
    in_a_row = 0
    for step, loss in enumerate(losses):
        if not math.isfinite(loss):  # its own alert, unbounded: the spike alert's count in a row ends
            skipped.add(step)
            in_a_row = 0
        elif not loss_spike(loss, applied) or in_a_row >= max_in_a_row:
            in_a_row = 0
            applied.append(loss)
        else:
            skipped.add(step)
            in_a_row += 1
    return skipped
