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
from hookpolicy.export.metrics import FAMILIES, HOOK_ERRORS, SERIES_DROPPED, STEPS, Family, stat_family
from hookpolicy.export.store import MetricsStore
from hookpolicy.export.collector import store_for
from hookpolicy.policy.model import Policy

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
    engine.pop("hookpolicy_run_info")  # every store's, from the start
    assert engine == {"hookpolicy_steps": {("Net",): 1.0}} and stats == {"hookpolicy_grad_l2_norm": {("p", "r", "", ""): 1.0}}


def _stored(store: MetricsStore) -> set[tuple[str, tuple[str, ...]]]:
    return {(family, labels) for family, series in store.snapshot()[1].items() for labels in series}


def _dropped(store: MetricsStore) -> float:
    return store.snapshot()[0].get(SERIES_DROPPED.name, {}).get(("p",), 0.0)


def test_the_job_budget_counts_a_series_each_rank_exports_once_per_rank() -> None:
    """maxJobSeries on 2 ranks: a job's series costs 1, a rank's own costs 2, counted alike on both ranks.

    Published interleaved (own0, job0, own1, job1, own2, job2, job3), the job's series are
    kept first: job0-3 make 4 of 7, own0 makes 6, own1 (8) and own2 do not fit. Rank 0
    exports the 4 job series and own0, rank 1 own0: 6 series in the job. Each drop is counted
    once, by the rank that would have exported the series: own1 and own2 on both ranks.
    """
    policies = {"p": Policy(name="p", source="", revision="", rules=(), max_job_series=7)}
    own = [(stat_family("output", "rms"), ("p", "acts", f"m{i}", "")) for i in range(3)]
    job = [(stat_family("grad", "l2_norm"), ("p", "grads", f"m{i}", "")) for i in range(4)]
    values = dict.fromkeys([own[0], job[0], own[1], job[1], own[2], job[2], job[3]], 1.0)
    zero, one = MetricsStore(rank=0), MetricsStore(rank=1)
    for _ in range(3):  # later steps change nothing: the same series fit, each drop was counted once
        zero.set_stats(values, policies, 2, job)
        one.set_stats(values, policies, 2, job, withheld=job)
        assert _stored(zero) == {own[0], *job} and _stored(one) == {own[0]}
        assert (_dropped(zero), _dropped(one)) == (2, 2)
    # without a job-wide budget nothing is reordered or dropped
    free = {"p": Policy(name="p", source="", revision="", rules=())}
    store = MetricsStore(rank=0)
    store.set_stats(values, free, 2, job)
    assert _stored(store) == set(values) and _dropped(store) == 0
    # once the policy is forgotten (a detach, a reload), its room is free again
    zero.forget_policy("p")
    zero.set_stats(dict.fromkeys(own, 1.0), policies, 2)
    assert _stored(zero) == set(own)


def test_a_series_whose_ranks_change_is_counted_anew_and_kept() -> None:
    """A series first each rank's (the process group not yet up: 1 rank) keeps its place when it becomes the job's."""
    policies = {"p": Policy(name="p", source="", revision="", rules=(), max_job_series=3)}
    first, second = ((stat_family("grad", "l2_norm"), ("p", "g", m, "")) for m in ("a", "b"))
    store = MetricsStore(rank=0)
    store.set_stats({first: 1.0}, policies, 1)  # alone: costs 1
    store.set_stats({first: 2.0, second: 1.0}, policies, 4)  # 4 ranks, each exports its own: 4 + 4 > 3
    assert _stored(store) == {first} and _dropped(store) == 1
    store.set_stats({first: 3.0, second: 1.0}, policies, 4, job={first, second})  # the job's: 1 + 1
    assert _stored(store) == {first, second} and store.snapshot()[1][first[0]][first[1]] == 3.0


def test_max_series_counts_each_series_it_drops_once() -> None:
    policies = {"p": Policy(name="p", source="", revision="", rules=(), max_series=1)}
    values = {(stat_family("grad", "l2_norm"), ("p", "g", m, "")): 1.0 for m in "abc"}
    store = MetricsStore(rank=0)
    for _ in range(4):
        store.set_stats(values, policies)
    assert len(_stored(store)) == 1 and _dropped(store) == 2


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
