"""The plan: a pure function of policies and model, ordered by (priority, file order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.nn as nn

from hookpolicy.errors import PolicyError
from hookpolicy.plan.planner import build_plan

from helpers.policies import load_policy


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight


def test_bindings_follow_priority_then_file_order(tmp_path: Path) -> None:
    a = load_policy(tmp_path, """
        - {name: late, priority: 90, match: {types: [Linear]}, trigger: {at: forward}, actions: [{capture: {stats: [numel]}}]}
        - {name: first, priority: 10, match: {modules: [head]}, trigger: {at: forward}, actions: [{capture: {stats: [numel]}}]}
        - {name: tie-1, match: {modules: [head]}, trigger: {at: forward}, actions: [{capture: {stats: [numel]}}]}
    """, name="a")
    b = load_policy(tmp_path, """
        - {name: tie-2, match: {modules: [head]}, trigger: {at: forward}, actions: [{capture: {stats: [numel]}}]}
    """, name="b")
    plan = build_plan(a.policies + b.policies, Tied())
    assert [(x.rule.name, x.module) for x in plan.bindings] == [
        ("first", "head"), ("tie-1", "head"), ("tie-2", "head"),
        ("late", "body.0"), ("late", "body.2"), ("late", "head"),
    ]


def test_plan_is_pure_and_printable(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - {name: g, match: {modules: ["**"]}, trigger: {at: step}, actions: [{clip: {max_norm: 1}}]}
    """, name="p")
    model = Tied()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    plan = pol.plan(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all((model.state_dict()[n] == t).all() for n, t in before.items())
    assert str(plan).splitlines()[0] == "p/g -> wte [step:grad(weight)] clip(max_norm=1, norm_type=2, per=rule)"
    row = plan.rows()[0]
    assert row == {
        "policy": "p", "rule": "g", "priority": 50, "mode": "enforce", "module": "wte", "type": "Embedding",
        "hook": "step", "target": "grad", "params": ["weight"], "select": [],
        "actions": ["clip(max_norm=1, norm_type=2, per=rule)"],
    }


def test_tied_parameter_is_selected_once(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - {name: g, match: {modules: ["**"]}, trigger: {at: step}, actions: [{capture: {stats: [l2_norm]}}]}
    """, name="p")
    plan = pol.plan(Tied())
    owners = [(b.module, p) for b in plan.bindings for p in b.params]
    assert ("wte", "weight") in owners and ("head", "weight") not in owners
    assert len(owners) == 5  # wte.weight, body.0.{weight,bias}, body.2.{weight,bias}


def test_warnings_for_rules_that_cannot_fire(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - {name: none, match: {modules: ["decoder.**"]}, trigger: {at: forward}, actions: [{capture: {stats: [numel]}}]}
        - {name: no-params, match: {types: [ReLU]}, trigger: {at: step}, actions: [{capture: {stats: [numel]}}]}
        - name: indices
          match: {types: [Embedding]}
          trigger: {at: backward}
          target: grad_input
          actions: [{capture: {stats: [numel]}}]
    """, name="p")
    plan = pol.plan(Tied())
    source = pol.policies[0].source
    # A rule that selects nothing is positioned at its `match` (the second line of the rules here).
    assert plan.warnings == (
        f"{source}:{plan.unmatched[0].line}:{plan.unmatched[0].column}: $.spec.rules[0].match: "
        "p/none: matches no module of Tied",
        f"{source}:{plan.unmatched[1].line}:{plan.unmatched[1].column}: $.spec.rules[1].match: "
        "p/no-params: the matched modules have no parameters matching *",
        "p/indices: wte is an Embedding; its inputs are indices and never receive a gradient",
    )
    text = Path(source).read_text().splitlines()
    for problem in plan.unmatched:
        assert text[problem.line - 1][problem.column - 1:].startswith("match:")


def test_strict_attach_refuses_before_installing_anything(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - {name: some, match: {types: [Linear]}, trigger: {at: forward}, actions: [{capture: {stats: [numel]}}]}
        - {name: none, match: {modules: ["decoder.**"]}, trigger: {at: forward}, actions: [{capture: {stats: [numel]}}]}
    """)
    model = Tied()
    with pytest.raises(PolicyError) as refused:
        pol.attach(model, strict=True)
    (problem,) = refused.value.problems
    assert (problem.path, problem.message) == ("$.spec.rules[1].match", "p/none: matches no module of Tied")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pol.attach(model):  # not strict: a warning, and the rule that matches is in
        assert any(m._forward_hooks for m in model.modules())
