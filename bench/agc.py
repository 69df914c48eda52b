"""What AGC (`clip: {unitwise_ratio, eps}`) costs per training step, against the same clip written by hand.

    python bench/agc.py            # about a minute on 2 CPU cores

The bundled tiny GPT (`examples.charlm`, AdamW, batch 16 x 32), interleaved, medians
over 100 steps: no clip; AGC by hand before `opt.step()` as timm's `adaptive_clip_grad`
writes it (a loop of per-parameter ops); hookpolicy's AGC rule on the whole model;
the same rule in audit mode (measures and counts, multiplies nothing). Also the AGC
operation alone on the model's gradients, hand loop against `clip_unitwise`. Timings
are printed, never asserted.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from prometheus_client import CollectorRegistry
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hookpolicy  # noqa: E402
from timing import step_table  # noqa: E402
from examples.charlm import batch, build_model, encode  # noqa: E402
from hookpolicy.engine.measure.actions import clip_unitwise  # noqa: E402

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: bench}
spec:
  mode: MODE
  rules:
    - name: agc
      match: {modules: ["**"]}
      trigger: {at: step}
      actions: [{clip: {unitwise_ratio: 0.01, eps: 0.001}}]
"""


def by_hand(params: list[nn.Parameter], ratio: float = 0.01, eps: float = 1e-3) -> None:
    """timm.utils.agc.adaptive_clip_grad, as users write it in their loop."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            dims = tuple(range(1, p.ndim)) if p.ndim > 1 else None
            bound = torch.linalg.vector_norm(p, dim=dims, keepdim=True).clamp_(min=eps).mul_(ratio)
            g_norm = torch.linalg.vector_norm(p.grad, dim=dims, keepdim=True)
            p.grad.copy_(torch.where(g_norm < bound, p.grad, p.grad * (bound / g_norm.clamp(min=1e-6))))


def operation(rounds: int = 50) -> None:
    torch.manual_seed(0)
    params = list(build_model().parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    grads, weights = [p.grad for p in params], [p.detach() for p in params]
    timed: dict[str, list[float]] = {"by hand": [], "clip_unitwise": []}
    for _ in range(rounds):
        for key, run in (("by hand", lambda: by_hand(params)),
                         ("clip_unitwise", lambda: clip_unitwise(grads, weights, 0.01, 1e-3, True))):
            start = time.perf_counter()
            run()
            timed[key].append(time.perf_counter() - start)
    numel = sum(p.numel() for p in params)
    for key, samples in timed.items():
        print(f"AGC alone on {len(params)} tensors ({numel:,} elements), {key:14s} "
              f"{statistics.median(samples) * 1e3:6.2f} ms")


def steps(rounds: int = 100) -> None:
    torch.manual_seed(0)
    data = encode()
    x, y = batch(data, torch.randint(0, len(data) - 33, (16,)), 32)
    folder = Path(tempfile.mkdtemp())
    variants: dict[str, Callable[[], None]] = {}
    registries: dict[str, CollectorRegistry] = {}
    for key, mode, hand in (("none", None, False), ("by hand", None, True), ("hookpolicy", "enforce", False),
                            ("hookpolicy audit", "audit", False)):
        model = build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt, hand: bool = hand) -> None:
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if hand:
                by_hand(list(model.parameters()))
            opt.step()

        if mode is not None:
            path = folder / f"{mode}.yaml"
            path.write_text(POLICY.replace("MODE", mode))
            registries[key] = CollectorRegistry()
            hookpolicy.load(path).attach(model, registry=registries[key])
        variants[key] = step
    step_table(variants, rounds, lambda key: registries[key].get_sample_value(
        "hookpolicy_hook_seconds_total", {"policy": "bench", "rule": "agc", "model": "TinyGPT", "rank": "0"}
    ) if key in registries else None)


if __name__ == "__main__":
    torch.set_num_threads(1)
    operation()
    steps()
