"""A fault of hookpolicy's own code in a module hook is its rule's, never the script's.

A rule's program runs under `Faults.guarded`; the work around it in the module hook that
serves the rule (picking the tensors, registering the gradient's tensor hook, the phase
check) ran outside it, so a fault there raised out of the user's forward or backward pass:
for instance `tensor_hooks.add` on a torch whose private tensor attributes moved. Each
rule's part of a hook call is now contained as its body is: counted in
`hookpolicy_hook_errors_total`, said once, the rule switched off after 3 errors, a
`hookpolicy.Halt` under `onError: halt`. The reference is the same loop without
hookpolicy: a rule that only measures leaves the parameters bit for bit as they were.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers.policies import write_policy
from hookpolicy.engine.execute import executor, programs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise AttributeError("an attribute this torch no longer has")


#: (what breaks, where it is patched, the rule it breaks)
FAULTS = {
    "the gradient's tensor hook cannot be registered (post_hook)": (
        executor.tensor_hooks, "add", "at: backward\n  target: grad_output"),
    "the inputs cannot be picked (pre_hook)": (executor, "_input_tensors", "at: forward_pre\n  target: input"),
    "torch's recomputation check is gone (post_hook)": (executor, "recomputing", "at: forward\n  target: output"),
    "the gradient's measurement fails around its program (the gradient's tensor hook)": (
        programs.Programs, "measure", "at: backward\n  target: grad_output"),
}


def _train(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(5, 4, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _policy(tmp_path: Path, trigger: str, on_error: str = "continue") -> Path:
    at, target = trigger.split("\n")
    return write_policy(tmp_path, f"""
        - name: watch
          match: {{types: [Linear]}}
          trigger: {{{at.strip()}}}
          {target.strip()}
          actions:
            - capture: {{stats: [l2_norm, abs_max]}}
    """, spec=f"onError: {on_error}\n")


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_around_a_rule_is_the_rules_and_training_goes_on_as_without_hookpolicy(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    owner, name, trigger = FAULTS[fault]
    torch.manual_seed(0)
    plain, governed = Net(), Net()
    governed.load_state_dict(plain.state_dict())
    expected = _train(plain, 4)

    monkeypatch.setattr(owner, name, _boom)
    registry = CollectorRegistry()
    with caplog.at_level(logging.ERROR, logger="hookpolicy"):
        with hookpolicy.load(_policy(tmp_path, trigger)).attach(governed, registry=registry, rank=0):
            losses = _train(governed, 4)

    assert losses == expected
    for mine, theirs in zip(governed.parameters(), plain.parameters()):
        assert torch.equal(mine, theirs)
    labels = {"policy": "p", "rule": "watch", "rank": "0", "model": "Net"}
    assert registry.get_sample_value("hookpolicy_hook_errors_total", labels) == 3  # then switched off
    said = [r.getMessage() for r in caplog.records if "p/watch raised at step" in r.getMessage()]
    assert len(said) == 1 and "an attribute this torch no longer has" in said[0]
    assert any("p/watch switched off after 3 errors" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_under_on_error_halt_a_fault_around_a_rule_halts_the_run(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    owner, name, trigger = FAULTS[fault]
    monkeypatch.setattr(owner, name, _boom)
    model = Net()
    with hookpolicy.load(_policy(tmp_path, trigger, on_error="halt")).attach(model, registry=CollectorRegistry()):
        with pytest.raises(hookpolicy.Halt, match="hook error: AttributeError"):
            _train(model, 1)
