"""Publishing off the step (issue 36): a pass that only exports is handed to the store unfinished.

The reference is the read-back that finishes every value at the step, as it did before: the
same policy with a log sink on each capture (a sink reads the values, so they are finished
at once), run on a twin model with the same seed and inputs. Every exported sample (the
statistics, the dropped-series counter, every engine counter but the seconds), every
`last_values()` and the series budgets come out equal, bit for bit, and the gradient norms
equal torch's own. Whether a step finished anything is counted (`passes.finish`'s calls
inside `optimizer.step()`), never timed.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

import hookpolicy
from hookpolicy.engine.decide import passes
from hookpolicy.export.metrics import stat_family
from hookpolicy.export.store import MetricsStore
from hookpolicy.policy.model import Policy

#: policy `p` up to its step rule's actions (a `str.format` template: `limit`, then `sink` in each action)
GRADS = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: p}}
spec:
  limits: {{maxSeries: {limit}}}
  rules:
    - name: grads
      match: {{types: [Linear]}}
      trigger: {{at: step}}
      target: grad
      actions:
"""

POLICY = GRADS + """\
        - capture: {{stats: [l2_norm, mean, nonfinite]{sink}}}
        - capture: {{stats: [max], per: tensor{sink}}}
    - name: outs
      match: {{types: [Linear]}}
      trigger: {{at: forward}}
      target: output
      actions:
        - capture: {{stats: [rms]{sink}}}
"""

OTHER = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: other}
spec:
  rules:
    - name: g
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions: [{capture: {stats: [l2_norm]}}]
"""

#: a pass with an alert beside its capture: the capture's values may wait for a scrape, the alert's may not
GUARDED = GRADS + """\
        - capture: {{stats: [l2_norm, nonfinite], per: tensor{sink}}}
        - alert: {{if: "l2_norm > {threshold!r}", per: rule, severity: warning, message: "large gradients"}}
"""

#: steps after which the test scrapes (not after 3: step 4's values replace step 3's unread ones)
SCRAPED = {1, 2, 4, 5, 6}


def _exposed(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the wall-clock ones (seconds, the last step's time) and the policy's revision (its text differs)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect() for s in family.samples
            if not s.name.startswith(("hookpolicy_hook_seconds", "hookpolicy_last_step_timestamp", "hookpolicy_policy_info"))}


class _Finishes:
    """Counts `passes.finish`: the statistics finished, one call per group."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = passes.finish

        def counted(*args: Any) -> Any:
            self.calls += 1
            return original(*args)
        monkeypatch.setattr(passes, "finish", counted)


def _run(tmp_path: Path, name: str, limit: int, logged: bool, finishes: _Finishes, steps: int = 6,
         between: Optional[Callable[[int, CollectorRegistry, nn.Module], None]] = None,
         registry: Optional[CollectorRegistry] = None, scraped: set[int] = SCRAPED, policy: str = POLICY,
         threshold: float = 0.0) -> dict[str, Any]:
    """Train a 3-Linear model `steps` steps under the policy; what was exposed, kept and finished per step."""
    sink = f", log: {{path: {name}.jsonl}}" if logged else ""  # relative to the output folder: tmp_path
    path = tmp_path / f"{name}.yaml"
    path.write_text(policy.format(limit=limit, sink=sink, threshold=threshold))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.Generator().manual_seed(1)
    grads: list[dict[str, torch.Tensor]] = []
    opt.register_step_pre_hook(lambda *a: grads.append(
        {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}))
    registry = CollectorRegistry() if registry is None else registry
    out: dict[str, Any] = {"exposed": {}, "last": {}, "in_step": [], "grads": grads}
    with hookpolicy.load(path).attach(model, registry=registry, rank=0) as attached:
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(torch.randn(5, 4, generator=inputs)).square().mean().backward()
            before = finishes.calls
            opt.step()
            out["in_step"].append(finishes.calls - before)
            if between is not None:
                between(step, registry, model)
            if step in scraped:
                out["exposed"][step] = _exposed(registry)
            if step in (2, 5, steps):
                out["last"][step] = {f: dict(s) for f, s in attached.last_values().items()}
    return out


@pytest.mark.parametrize("limit", [1000, 7])
def test_exported_values_and_budgets_are_those_of_the_step_that_finishes_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """All 18 series held (maxSeries 1000), or 11 dropped (maxSeries 7, counted once each): the same samples.

    With every series held the export-only step finishes nothing from its second step on;
    with a full budget it publishes through the store's admission every step, as before.
    """
    monkeypatch.chdir(tmp_path)
    finishes = _Finishes(monkeypatch)
    logged = _run(tmp_path, "logged", limit, True, finishes)
    handed = _run(tmp_path, "handed", limit, False, finishes)
    assert handed["exposed"] == logged["exposed"] and handed["last"] == logged["last"]
    assert all(n > 0 for n in logged["in_step"])
    if limit == 1000:
        assert handed["in_step"][0] > 0 and handed["in_step"][1:] == [0] * 5
    else:
        assert all(n > 0 for n in handed["in_step"])
        dropped = handed["exposed"][6][("hookpolicy_series_dropped_total", (("policy", "p"), ("rank", "0")))]
        stats = [k for k in handed["exposed"][6] if k[0].startswith(("hookpolicy_grad_", "hookpolicy_output_"))]
        assert (dropped, len(stats)) == (11, 7)
        return
    for step in SCRAPED:  # the norms are torch's, of the gradients the optimizer saw at that step
        grads = handed["grads"][step - 1]
        for module in ("0", "2", "3"):
            exposed = handed["exposed"][step][("hookpolicy_grad_l2_norm", (
                ("model", "Sequential"), ("module", module), ("policy", "p"), ("rank", "0"), ("rule", "grads"),
                ("tensor", "")))]
            both = torch.cat([grads[f"{module}.weight"].flatten(), grads[f"{module}.bias"]])
            assert exposed == pytest.approx(torch.linalg.vector_norm(both).item(), rel=1e-6)


def test_an_alert_is_judged_at_the_step_while_the_captures_of_its_pass_are_handed_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step rule's capture per tensor and its alert per rule, one pass: from the second step only the
    alert's group is finished in the step, and every sample (the alert's count and gauge included) and every
    `last_values()` is the twin's whose capture logs (finished at the step); the alert fires at the steps
    whose gradients, all of them together, have a norm above the threshold, computed by torch."""
    monkeypatch.chdir(tmp_path)
    finishes = _Finishes(monkeypatch)
    # the alert changes nothing in the training: the gradients of every run are those of the first
    first = _run(tmp_path, "first", 1000, False, finishes, policy=GUARDED)
    norms = [torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])).item()
             for grads in first["grads"]]
    ordered = sorted(norms)
    threshold = (ordered[2] + ordered[3]) / 2  # half the steps fire, none near the threshold
    logged, handed = (_run(tmp_path, f"guarded{logged}", 1000, logged, finishes, policy=GUARDED, threshold=threshold)
                      for logged in (True, False))
    assert handed["exposed"] == logged["exposed"] and handed["last"] == logged["last"]
    fired = [n > threshold for n in norms]
    assert 0 < sum(fired) < len(fired)
    # 6 tensors and the rule; the alert is judged on its own statistics, and the rule's group is finished in
    # full for the record of a step it fires at
    assert logged["in_step"] == [7 + f for f in fired]
    assert handed["in_step"] == [7 + fired[0]] + [1 + f for f in fired[1:]]
    labels = (("model", "Sequential"), ("policy", "p"), ("rank", "0"), ("rule", "grads"), ("severity", "warning"))
    for step in SCRAPED:
        assert handed["exposed"][step][("hookpolicy_alerts_total", labels)] == sum(fired[:step])
        assert handed["exposed"][step][("hookpolicy_alert_firing", labels)] == float(fired[step - 1])
        grads = handed["grads"][step - 1]
        for name, grad in grads.items():
            module, tensor = name.split(".")
            exposed = handed["exposed"][step][("hookpolicy_grad_l2_norm", (
                ("model", "Sequential"), ("module", module), ("policy", "p"), ("rank", "0"), ("rule", "grads"),
                ("tensor", tensor)))]
            assert exposed == pytest.approx(torch.linalg.vector_norm(grad).item(), rel=1e-6)


def test_a_forgotten_series_sends_the_next_step_through_the_budget_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another policy on the same registry detached after step 3 (its series forgotten): step 4 publishes
    through the store's admission again, step 5 is handed over again, and every value stays the reference's."""
    monkeypatch.chdir(tmp_path)
    finishes = _Finishes(monkeypatch)
    (tmp_path / "other.yaml").write_text(OTHER)
    results = []
    for logged in (True, False):
        others: list[Any] = []

        def between(step: int, registry: CollectorRegistry, model: nn.Module) -> None:
            if step == 1:
                others.append(hookpolicy.load(tmp_path / "other.yaml").attach(nn.Linear(2, 2), registry=registry))
            if step == 3:
                others.pop().remove()
        results.append(_run(tmp_path, f"forget{logged}", 1000, logged, finishes, between=between))
    logged_run, handed = results
    assert handed["exposed"] == logged_run["exposed"] and handed["last"] == logged_run["last"]
    assert handed["in_step"][1:3] == [0, 0] and handed["in_step"][3] > 0 and handed["in_step"][4:] == [0, 0]


def test_a_pass_whose_rows_change_publishes_at_once_after_what_it_handed_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2 is handed over and not scraped; a bias frozen before step 3 changes the pass's rows, so step 3
    publishes at once: what step 2 handed over is written first, never over step 3's values."""
    monkeypatch.chdir(tmp_path)
    finishes = _Finishes(monkeypatch)

    def between(step: int, registry: CollectorRegistry, model: nn.Module) -> None:
        if step == 2:
            model[2].bias.requires_grad_(False)  # type: ignore[index]
    logged, handed = (_run(tmp_path, f"frozen{logged}", 1000, logged, finishes, between=between, scraped={1, 3, 4, 6})
                      for logged in (True, False))
    assert handed["exposed"] == logged["exposed"] and handed["last"] == logged["last"]
    assert handed["in_step"][1] == 0 and handed["in_step"][2] > 0 and handed["in_step"][3:] == [0, 0, 0]


def test_a_scrape_during_training_sees_only_values_some_step_published(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scrapes from another thread while the step swaps values in: each sample is one a step published."""
    monkeypatch.chdir(tmp_path)
    finishes = _Finishes(monkeypatch)
    _run(tmp_path, "reference", 1000, True, finishes, steps=12)
    seen: list[dict[tuple[str, tuple[tuple[str, str], ...]], float]] = []
    registry = CollectorRegistry()
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            seen.append(_exposed(registry))
    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        _run(tmp_path, "scraped", 1000, False, finishes, steps=12, registry=registry)
    finally:
        stop.set()
        thread.join()
    # every value a step of the reference published, per series (its log records hold them all)
    published: dict[tuple[str, tuple[str, ...]], set[float]] = {}
    for record in map(json.loads, (tmp_path / "reference.jsonl").read_text().splitlines()):
        for stat, value in record["stats"].items():
            published.setdefault((stat_family(record["target"], stat), (record["rule"], record["module"],
                                                                          record["tensor"])), set()).add(value)
    checked = 0
    for sample in seen:
        for (name, labels), value in sample.items():
            key = dict(labels)
            series = published.get((name, (key.get("rule", ""), key.get("module", ""), key.get("tensor", ""))))
            if series is not None:
                assert value in series, (name, labels, value)
                checked += 1
    assert checked > 0


class _Values:
    def __init__(self, values: list[float]) -> None:
        self._values, self.calls = values, 0

    def values(self) -> list[float]:
        self.calls += 1
        return self._values


def test_the_store_refuses_a_swap_checked_before_a_series_was_forgotten() -> None:
    """`holding` answers for one generation; a forget starts the next, and writes what was swapped in first."""
    policies = {"p": Policy(name="p", source="", revision="", rules=(), max_job_series=10)}
    keys = [(stat_family("grad", "l2_norm"), ("p", "g", m, "", "Net")) for m in "ab"]
    store = MetricsStore(rank=0)
    assert store.holding(keys, policies, 1) is None  # not admitted yet
    store.set_stats(dict.fromkeys(keys, 1.0), policies, 1)
    assert store.holding(keys, policies, 2) is None  # counted at 1 rank, not 2: set_stats would count it anew
    generation = store.holding(keys, policies, 1)
    assert generation is not None
    deferred = _Values([2.0, 3.0])
    assert store.swap_in("t", keys, deferred, generation)
    assert store.snapshot()[1][keys[0][0]] == {keys[0][1]: 2.0, keys[1][1]: 3.0} and deferred.calls >= 1
    assert store.swap_in("t", keys, _Values([4.0, 5.0]), generation)
    store.forget_series(keys[:1])  # writes what was swapped in, then forgets: a new generation
    assert not store.swap_in("t", keys, _Values([6.0, 7.0]), generation)
    assert store.snapshot()[1][keys[0][0]] == {keys[1][1]: 5.0}
    assert store.swap_in("t", keys[1:], _Values([8.0]), store.generation())
    store.forget_policy("p")  # what was swapped in is not written back after the forget
    assert store.snapshot()[1] == {}
