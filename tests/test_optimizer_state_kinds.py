"""`target: optimizer_state` on optimizers that keep nothing it can measure, and what `explain` says they keep.

SGD without momentum keeps no state; LBFGS keeps one flat state for all its parameters.
An `optimizer_state` rule there wrote no record and said nothing, so an alert on it never
evaluated, silently. Now the first step says so, once, with what the optimizer holds.
The sentences `explain` prints of what each torch optimizer keeps are checked against
the optimizers themselves, after a real step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from hookpolicy.plan.planner import STATE_KEYS
from helpers.models import tiny
from helpers.policies import load_policy

RULE = """\
- name: state
  match: {types: [Linear]}
  trigger: {at: step}
  target: optimizer_state
  actions:
    - capture: {stats: [l2_norm], log: {path: state.jsonl}}
    - alert: {if: "l2_norm > 1e9", severity: warning}
"""


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 4, generator=g)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss
        opt.step(closure)


STATELESS: dict[str, tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], str]] = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1), "it holds none for them"),
    "lbfgs": (lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=2), "it holds "),
}


@pytest.mark.parametrize("kind", list(STATELESS))
def test_an_optimizer_without_state_is_said_at_the_first_step_once(
        kind: str, tmp_path: Path, out: Path, caplog: pytest.LogCaptureFixture) -> None:
    make, holds = STATELESS[kind]
    model = tiny()
    opt = make(list(model.parameters()))
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with load_policy(tmp_path, RULE).attach(model, registry=CollectorRegistry()):
            _steps(model, opt, 3)
    said = [r.getMessage() for r in caplog.records if "keeps no state tensor" in r.getMessage()]
    assert len(said) == 1, said
    name = type(opt).__name__
    assert said[0].startswith(f"p/state: {name} keeps no state tensor shaped like its parameter") and holds in said[0]
    assert STATE_KEYS[name] in said[0]
    assert not (out / "state.jsonl").exists()  # nothing measured, and now not silently


def test_an_optimizer_with_state_says_nothing(tmp_path: Path, out: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with load_policy(tmp_path, RULE).attach(model, registry=CollectorRegistry()):
            _steps(model, opt, 2)
    assert not [r for r in caplog.records if "keeps no state tensor" in r.getMessage()]
    assert (out / "state.jsonl").exists()


#: optimizer -> (how to make it, the per-parameter state keys its STATE_KEYS sentence names, keys said absent)
KEPT: dict[str, tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], set[str]]] = {
    "SGD": (lambda p: torch.optim.SGD(p, lr=0.1), set()),
    "Adam": (lambda p: torch.optim.Adam(p), {"exp_avg", "exp_avg_sq", "step"}),
    "AdamW": (lambda p: torch.optim.AdamW(p), {"exp_avg", "exp_avg_sq", "step"}),
    "NAdam": (lambda p: torch.optim.NAdam(p), {"exp_avg", "exp_avg_sq", "step", "mu_product"}),
    "RAdam": (lambda p: torch.optim.RAdam(p), {"exp_avg", "exp_avg_sq", "step"}),
    "Adamax": (lambda p: torch.optim.Adamax(p), {"exp_avg", "exp_inf", "step"}),
    "Adagrad": (lambda p: torch.optim.Adagrad(p), {"sum", "step"}),
    "Adadelta": (lambda p: torch.optim.Adadelta(p), {"square_avg", "acc_delta", "step"}),
    "RMSprop": (lambda p: torch.optim.RMSprop(p), {"square_avg", "step"}),
    "Rprop": (lambda p: torch.optim.Rprop(p), {"prev", "step_size", "step"}),
    "ASGD": (lambda p: torch.optim.ASGD(p), {"ax", "eta", "mu", "step"}),
    "Adafactor": (lambda p: torch.optim.Adafactor(p), {"row_var", "col_var", "step"}),
    "LBFGS": (lambda p: torch.optim.LBFGS(p, max_iter=2), set()),
}


@pytest.mark.parametrize("name", sorted(STATE_KEYS))
def test_what_explain_says_an_optimizer_keeps_is_what_it_keeps(name: str) -> None:
    assert set(KEPT) == set(STATE_KEYS)
    make, keys = KEPT[name]
    weight = nn.Parameter(torch.randn(3, 5))
    opt = make([weight])
    assert type(opt).__name__ == name

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = weight.pow(2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    held = set(opt.state[weight])
    if name == "LBFGS":  # its state sits under its first parameter, flat: none of it shaped like the parameter
        assert "d" in held and opt.state[weight]["d"].shape != weight.shape
    else:
        assert held == keys
    for key in keys:
        assert key in STATE_KEYS[name]
    if not keys:
        assert "none" in STATE_KEYS[name] or "no state" in STATE_KEYS[name]
    with_momentum = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    with_momentum.zero_grad()
    weight.pow(2).sum().backward()
    with_momentum.step()
    assert set(with_momentum.state[weight]) == {"momentum_buffer"}  # "only with momentum > 0"
