"""Hand-written monitors, written the way people write them today (the baselines).

`SeedMonitor` is the GradientMonitor of the seed (forward hook and full backward hook on
every Linear, six statistics of each tensor, each read with `.item()`, plus the
`torch.isnan(grad).any()` check), logging every step so it compares with a policy that
also runs every step.

`SameStatsMonitor` computes exactly the statistics of `policies/monitor.yaml` by hand:
l2_norm, abs_max, nonfinite of every Linear output; l2_norm, abs_max of every Linear
grad_output; l2_norm and nonfinite of every parameter gradient before the optimizer
step, skipping the step when a gradient is not finite. It is the apples-to-apples
baseline for hookpolicy's overhead.

Both keep only the latest values (a dict per module), as a monitor feeding a dashboard
would; neither prints.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

__all__ = ["SeedMonitor", "SameStatsMonitor"]


class _Monitor:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stats: dict[str, dict[str, float]] = {}
        self.handles: list[RemovableHandle] = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                self.handles.append(module.register_forward_hook(self._forward(name)))
                self.handles.append(module.register_full_backward_hook(self._backward(name)))

    def _forward(self, name: str) -> Any:
        raise NotImplementedError

    def _backward(self, name: str) -> Any:
        raise NotImplementedError

    def before_step(self) -> bool:
        """Called between backward and `optimizer.step()`; True to skip the step."""
        return False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _six(t: torch.Tensor) -> dict[str, float]:
    return {
        "norm": t.norm().item(),
        "mean": t.mean().item(),
        "std": t.std().item(),
        "max": t.max().item(),
        "min": t.min().item(),
        "zero_fraction": (t == 0).float().mean().item(),
    }


class SeedMonitor(_Monitor):
    """The seed's GradientMonitor with a forward hook added, every step."""

    def _forward(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.stats[f"{name}/output"] = _six(output.detach())
        return hook

    def _backward(self, name: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if grad_output[0] is not None:
                grad = grad_output[0]
                self.stats[f"{name}/grad_output"] = _six(grad)
                if torch.isnan(grad).any():
                    print(f"NaN gradient detected in {name}")
        return hook


class SameStatsMonitor(_Monitor):
    """The statistics of `policies/monitor.yaml`, by hand, with a NaN guard that skips the step."""

    def _forward(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            out = output.detach()
            self.stats[f"{name}/output"] = {
                "l2_norm": out.norm().item(),
                "abs_max": out.abs().max().item(),
                "nonfinite": (~torch.isfinite(out)).sum().item(),
            }
        return hook

    def _backward(self, name: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if grad_output[0] is not None:
                grad = grad_output[0]
                self.stats[f"{name}/grad_output"] = {"l2_norm": grad.norm().item(), "abs_max": grad.abs().max().item()}
        return hook

    def before_step(self) -> bool:
        bad = 0
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                nonfinite = (~torch.isfinite(p.grad)).sum().item()
                self.stats[f"{name}/grad"] = {"l2_norm": p.grad.norm().item(), "nonfinite": nonfinite}
                bad += int(nonfinite)
        return bad > 0
