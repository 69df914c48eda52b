"""`hookpolicy.export.metrics`: typed families, what the collector describes, the last-values view.

The reference for "registered" and "exported" is prometheus_client itself: its registry's
name clash check, `restricted_registry`, and `get_sample_value`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry, Counter

import hookpolicy
from helpers.outputs import metric
from hookpolicy.export.metrics import FAMILIES, HOOK_ERRORS, STEPS, Family, MetricsStore, stat_family, store_for

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: p}
spec:
  rules:
    - name: g
      match: {modules: ["1"]}
      trigger: {at: step}
      actions: [{capture: {stats: [l2_norm]}}]
"""


def test_the_store_refuses_families_it_does_not_export() -> None:
    store = MetricsStore(rank=0)
    with pytest.raises(ValueError, match="unknown metric family"):
        store.inc(Family("hookpolicy_stepz", "counter", "a typo"))
    with pytest.raises(ValueError, match="unknown metric family"):
        store.set("hookpolicy_steps", (), 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"takes labels \('policy', 'rule', 'model'\)"):
        store.inc(HOOK_ERRORS, ("p",))
    with pytest.raises(ValueError, match="unknown statistic families"):
        store.set_stats({("hookpolicy_grad_l2norm", ("p", "r", "", "")): 1.0}, {})
    store.set_stats({(stat_family("grad", "l2_norm"), ("p", "r", "", "")): 1.0}, {})
    store.inc(STEPS, ("Net",))
    engine, stats = store.snapshot()
    assert engine == {"hookpolicy_steps": {("Net",): 1.0}} and stats == {"hookpolicy_grad_l2_norm": {("p", "r", "", ""): 1.0}}


def test_describe_names_the_engine_families() -> None:
    registry = CollectorRegistry()
    store_for(registry, 0).inc(STEPS, ("Net",))
    restricted = registry.restricted_registry(["hookpolicy_steps_total", "hookpolicy_hook_errors_total"])
    samples = {(s.name, s.value) for m in restricted.collect() for s in m.samples}
    assert samples == {("hookpolicy_steps_total", 1.0)}  # hook_errors has no series yet
    for family in FAMILIES:  # a user metric with an engine family's name clashes at registration
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            Counter(family.name, "mine", registry=registry)


def test_a_clashing_user_metric_registered_first_makes_attach_fail() -> None:
    registry = CollectorRegistry()
    Counter("hookpolicy_alerts", "mine", registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        store_for(registry, 0)


def test_last_values_are_a_read_only_view_kept_after_remove(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(POLICY)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[torch.Tensor] = []
    opt.register_step_pre_hook(lambda *a: grads.append(torch.cat([p.grad.flatten() for p in model[1].parameters()])))
    registry = CollectorRegistry()
    with hookpolicy.load(tmp_path / "p.yaml").attach(model, registry=registry, rank=0) as attached:
        assert attached.last_values() == {}
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(5, 3)).sum().backward()
            opt.step()
        values = attached.last_values()
        exported = metric(registry, 
            "hookpolicy_grad_l2_norm", {"policy": "p", "rule": "g", "module": "1", "tensor": "", "rank": "0",
                                        "model": "Sequential"})
    series = values["hookpolicy_grad_l2_norm"]
    assert series[("p", "g", "1", "")] == exported
    assert series[("p", "g", "1", "")] == pytest.approx(torch.linalg.vector_norm(grads[-1]).item(), rel=1e-6)
    with pytest.raises(TypeError):
        values["hookpolicy_grad_l2_norm"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        series[("p", "g", "1", "")] = 0.0  # type: ignore[index]
    assert metric(registry, "hookpolicy_grad_l2_norm", {"policy": "p", "rule": "g", "module": "1",
                                                                 "tensor": "", "rank": "0"}) is None
    assert attached.last_values()["hookpolicy_grad_l2_norm"] == series  # still there after remove()
