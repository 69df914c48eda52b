"""What the stack scripts of tests/test_stacks.py measure themselves, without hookpolicy's help.

`Probe(optimizer)` registers the test's own step hooks on one optimizer: before each
update it records the L2 norm of the gradients the optimizer is about to apply (for
`step(closure)` it wraps the closure, so the norm is read after the closure's backward,
as the optimizer sees it) and a copy of the parameters and of the optimizer state, so
that `unchanged(k)` says whether step k left both bit for bit as they were. `finish()`
scrapes the process's own hookpolicy metrics endpoint (`HOOKPOLICY_METRICS_PORT`, set
by `hookpolicy apply --metrics-port`) and writes everything as JSON to `$STACK_OUT`.
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any, Optional

import torch


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


class Probe:
    """The test's own view of one optimizer's steps (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.norms: list[Optional[float]] = []  # per step: the norm applied, None if no gradient
        self.snapshots: list[Any] = []  # per step: parameters and state before it
        optimizer.register_step_pre_hook(self._pre)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def snapshot(self) -> Any:
        state = [_copy(self.optimizer.state.get(p, {})) for p in self._params()]
        return [[_copy(p) for p in self._params()], state]

    def _record_norm(self) -> None:
        grads = [p.grad for p in self._params() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)) if grads else None)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        self.snapshots.append(self.snapshot())
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._record_norm()
            return None
        first = [True]

        def wrapped() -> Any:
            loss = closure()
            if first[0]:  # LBFGS calls the closure again: the first evaluation is the step's
                first[0] = False
                self._record_norm()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def unchanged(self) -> list[bool]:
        """Per step: whether parameters and optimizer state were bit-identical after it."""
        after = [*self.snapshots[1:], self.snapshot()]
        return [_same(a, b) for a, b in zip(self.snapshots, after)]


def metrics() -> str:
    port = os.environ.get("HOOKPOLICY_METRICS_PORT")
    if not port:
        return ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        return answer.read().decode()


def finish(probes: dict[str, Probe], **facts: Any) -> None:
    """Write what the script measured and the metrics to `$STACK_OUT` as JSON."""
    out = {
        "probes": {name: {"norms": p.norms, "unchanged": p.unchanged()} for name, p in probes.items()},
        "metrics": metrics(),
        **facts,
    }
    with open(os.environ["STACK_OUT"], "w", encoding="utf-8") as f:
        json.dump(out, f)
