"""The timed variants: one model copy, optimizer and step function per variant.

Every variant trains its own deep copy of one initial model on one fixed batch, so the
variants differ only in what is hooked. A step is forward, loss, backward, (clip or
monitor check), `optimizer.step()`, `zero_grad(set_to_none=True)`; hookpolicy's
readback runs inside `optimizer.step()` (its step pre-hook), so it is timed too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from prometheus_client import CollectorRegistry

import hookpolicy

from models import Workload
from monitors import SameStatsMonitor, SeedMonitor

__all__ = ["Variant", "VARIANTS", "build_variants", "POLICIES"]

POLICIES = Path(__file__).resolve().parent / "policies"


@dataclass
class Variant:
    key: str
    label: str
    step: Callable[[], None]
    close: Callable[[], None]
    #: for gated policies: whether the coming step is one where the rules are active
    active: Optional[Callable[[], bool]] = None
    attached: Optional[hookpolicy.Attached] = None
    model: Optional[torch.nn.Module] = field(default=None, repr=False)


#: key -> (table label, what it is)
VARIANTS: dict[str, str] = {
    "floor": "1  no hooks (the floor)",
    "seed": "2  hand-written, seed's GradientMonitor (6 stats, .item())",
    "hp_seed": "2p hookpolicy seed-stats.yaml (the same 6 stats)",
    "hand": "2b hand-written, monitor.yaml's statistics (.item())",
    "hp": "3  hookpolicy monitor.yaml, every step",
    "hp10": "4  hookpolicy monitor-every10.yaml",
    "clip_ref": "5a clip_grad_norm_(foreach=True)",
    "clip_hp": "5b hookpolicy clip.yaml (per: rule)",
}


def build_variants(workload: Workload, device: torch.device, keys: list[str], seed: int = 0) -> list[Variant]:
    """One ready-to-step Variant per key, all from the same initial weights and batch."""
    torch.manual_seed(seed)
    base = workload.build().to(device)
    x, y = workload.batch(torch.Generator().manual_seed(seed), device)
    return [_build(key, copy.deepcopy(base), workload, x, y) for key in keys]


def _build(key: str, model: torch.nn.Module, wl: Workload, x: torch.Tensor, y: torch.Tensor) -> Variant:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    label = VARIANTS[key]

    def plain() -> None:
        wl.loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)

    if key == "floor":
        return Variant(key, label, plain, lambda: None, model=model)
    if key in ("seed", "hand"):
        monitor = SeedMonitor(model) if key == "seed" else SameStatsMonitor(model)

        def monitored() -> None:
            wl.loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            if not monitor.before_step():
                opt.step()
            opt.zero_grad(set_to_none=True)
        return Variant(key, label, monitored, monitor.remove, model=model)
    if key == "clip_ref":
        def clipped() -> None:
            wl.loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return Variant(key, label, clipped, lambda: None, model=model)
    policy = {"hp": "monitor.yaml", "hp_seed": "seed-stats.yaml", "hp10": "monitor-every10.yaml", "clip_hp": "clip.yaml"}[key]
    attached = hookpolicy.load(POLICIES / policy).attach(model, registry=CollectorRegistry())
    active = (lambda: attached.step % 10 == 0) if key == "hp10" else None
    return Variant(key, label, plain, attached.remove, active, attached, model)
