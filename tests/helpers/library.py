"""The policy library's test helpers: its files, loading them, and reading what they exported and changed.

Shared by tests/test_policies*.py (one file per family of policies).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

import hookpolicy
from . import REPO
from .outputs import json_lines, metric

#: the policy library
POLICIES = REPO / "policies"
LIBRARY = sorted(POLICIES.glob("*.y*ml"))


#: library files that name another's rule (`trigger.after`), loaded together with it: alone they are refused
WITH: dict[str, tuple[str, ...]] = {"debug-after-spike.yaml": ("loss-spike-guard.yaml",)}


def load(name: str) -> hookpolicy.PolicySet:
    """The library file `name`, with the files whose rules it names (`WITH`)."""
    return hookpolicy.load([POLICIES / name, *(POLICIES / other for other in WITH.get(name, ()))])


def load_text(tmp_path: Path, text: str, name: str = "policy.yaml") -> hookpolicy.PolicySet:
    path = tmp_path / name
    path.write_text(text)
    return hookpolicy.load(path)


def stat(reg: CollectorRegistry, family: str, policy: str, rule: str, module: str = "", tensor: str = "") -> float:
    value = metric(reg, family, {"policy": policy, "rule": rule, "module": module, "tensor": tensor, "rank": "0"})
    assert value is not None, f"{family}{{policy={policy}, rule={rule}, module={module}}} not exported"
    return value


def counter(reg: CollectorRegistry, family: str, **labels: str) -> float:
    return metric(reg, family, {**labels, "rank": "0"}) or 0.0


def modules_named(model: nn.Module, pattern: str, kind: type) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if re.fullmatch(pattern, n) and isinstance(m, kind)]


def own_params(modules: list[tuple[str, nn.Module]]) -> list[nn.Parameter]:
    return [p for _, m in modules for p in m.parameters(recurse=False)]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def lr_seen(opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, list[float]]:
    """`opt` and the lr of its first group at each of its steps, read by its own step pre-hook."""
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    return opt, used


def opt_state(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt.state_dict()["state"].values()]


def same_state(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b)
    )


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit, NaN included (torch.equal says NaN != NaN)."""
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def alert_records(path: Path) -> list[dict[str, Any]]:
    """The alert records of a HOOKPOLICY_ALERT_LOG file (none when nothing fired)."""
    return json_lines(path) if path.exists() else []
