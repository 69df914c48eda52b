"""`hookpolicy.export.rules`: Prometheus rules checked and unit-tested by the real promtool, and a
Grafana dashboard whose every query names a metric family the policy really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import yaml
from prometheus_client import CollectorRegistry

import hookpolicy
from hookpolicy.export.rules import exported_families, prometheus_rules
from hookpolicy.export.grafana import grafana_dashboard
from hookpolicy.export.metrics import FAMILIES
from hookpolicy.policy.model import Alert, Capture, Clip, Policy
from helpers.library import load
from helpers.models import lora, make_model, train_step

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = sorted((ROOT / "policies").glob("*.y*ml"))
RULES = Path(__file__).resolve().parent / "rules"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed")

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (labels, functions, keywords removed)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][\w:]*)\s*(\(?)", e):
        word, call = m.groups()
        if not call and word not in _KEYWORDS:
            names.add(word)
    return names


def test_metric_names_helper() -> None:
    expr = ('sum by (job, rank) (rate(hookpolicy_hook_seconds_total{policy=~"a|b", job=~"$job"}[5m])) '
            '/ on (job) group_left sum by (job) (rate(hookpolicy_steps_total[$__rate_interval])) '
            'or time() - hookpolicy_last_step_timestamp_seconds offset 5m > 1e3')
    assert metric_names(expr) == {"hookpolicy_hook_seconds_total", "hookpolicy_steps_total",
                                  "hookpolicy_last_step_timestamp_seconds"}


def library() -> list[Policy]:
    return list(hookpolicy.load([str(p) for p in LIBRARY]).policies)


def really_exported(policies: list[Policy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The families a scrape shows after a short run of the policies on a GPT-like model
    (with LoRA on c_attn for the policies that bind only adapters): statistic families
    with samples, and every declared engine family. Where a rule wakes on an alert
    (debug-after-spike on loss-spike-guard's), the run is 24 steps with a loss 100 times
    larger at step 21 (the guard judges from 20 steps of history on), so that it wakes (and
    the update of step 22 is read back at step 23)."""
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path))
    names: set[str] = set()
    adapter_only = [p for p in policies if all(rule.match.adapters for rule in p.rules)]
    for group, model in ((adapter_only, lora(make_model())),
                         ([p for p in policies if p not in adapter_only], make_model())):
        reg = CollectorRegistry()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        woken = any(rule.trigger.after is not None for policy in group for rule in policy.rules)
        with hookpolicy.PolicySet(tuple(group)).attach(model, registry=reg, rank=0):
            for i in range(24 if woken else 2):
                train_step(model, opt, i, loss_scale=100.0 if woken and i == 21 else 1.0)
            names |= {s.name for m in reg.collect() for s in m.samples}
    engine = {f"{f.name}_total" if f.kind == "counter" else f.name for f in FAMILIES}
    return names | engine


# --------------------------------------------------------------------------- rules


@needs_promtool
@pytest.mark.parametrize("which", ["library", "each", "none", "unit-test-policy"])
def test_rules_pass_promtool_check(which: str, tmp_path: Path) -> None:
    sets: list[list[Policy]] = {
        "library": [library()],
        "each": [[p] for p in library()],
        "none": [[]],
        "unit-test-policy": [list(hookpolicy.load(RULES / "train-guard.yaml").policies)],
    }[which]
    for i, policies in enumerate(sets):
        path = tmp_path / f"rules-{i}.yml"
        path.write_text(prometheus_rules(policies))
        done = subprocess.run([str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_rules_pass_promtool_unit_tests(tmp_path: Path) -> None:
    policies = hookpolicy.load(RULES / "train-guard.yaml").policies
    (tmp_path / "hookpolicy-alerts.rules.yml").write_text(prometheus_rules(policies))
    shutil.copy(RULES / "hookpolicy-alerts.test.yml", tmp_path)
    done = subprocess.run([str(PROMTOOL), "test", "rules", "hookpolicy-alerts.test.yml"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def _alert_rules(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for group in doc["groups"]:
        for rule in group["rules"]:
            yield group["name"], rule


def test_rules_cover_every_alert_with_a_group_per_policy() -> None:
    policies = library() + list(hookpolicy.load(RULES / "train-guard.yaml").policies)
    doc = yaml.safe_load(prometheus_rules(policies))
    assert [g["name"] for g in doc["groups"]] == [f"hookpolicy.{p.name}" for p in policies] + ["hookpolicy.engine"]
    rules = list(_alert_rules(doc))
    names = [r["alert"] for _, r in rules]
    assert len(names) == len(set(names))
    for _, rule in rules:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["alert"])
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    by_group = {g["name"]: g["rules"] for g in doc["groups"]}
    for policy in policies:
        group = by_group[f"hookpolicy.{policy.name}"]
        for rule in policy.rules:
            alerts = [a for a in rule.actions if isinstance(a, Alert)]
            for severity in {a.severity for a in alerts}:
                (generated,) = [r for r in group if r["labels"].get("rule") == rule.name and r["labels"]["severity"] == severity]
                assert generated["labels"]["policy"] == policy.name
                mine = [a for a in alerts if a.severity == severity]
                event = any(a.then != "log" or a.for_ == 1 for a in mine)
                if event:  # the `for:` mapping (see hookpolicy.export.rules)
                    assert generated["for"] == "0s" and "increase(hookpolicy_alerts_total{" in generated["expr"]
                else:
                    assert generated["for"] == "1m" and generated["expr"].startswith("hookpolicy_alert_firing{")
                for a in mine:
                    assert f"`{a.source}`" in generated["annotations"]["description"]
        assert any("hookpolicy_hook_errors_total" in r["expr"] for r in group)
        assert any("hookpolicy_series_dropped_total" in r["expr"] for r in group)
    engine = [r["expr"] for r in by_group["hookpolicy.engine"]]
    assert any(e.startswith('time() - hookpolicy_last_step_timestamp_seconds{run=""} > ') for e in engine)


def test_rules_name_only_exported_families() -> None:
    policies = library()
    families = exported_families(policies)
    for _, rule in _alert_rules(yaml.safe_load(prometheus_rules(policies))):
        assert metric_names(rule["expr"]) <= set(families), rule["expr"]


# --------------------------------------------------------------------------- Grafana


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


@pytest.mark.parametrize("which", [p.name for p in LIBRARY] + ["all"])
def test_grafana_dashboard(which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policies = library() if which == "all" else list(load(which).policies)
    dashboard = json.loads(grafana_dashboard(policies))

    assert 36 <= dashboard["schemaVersion"] <= 41
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "job", "rank", "model"} <= set(variables)
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    for name in ("job", "rank", "model"):
        assert re.findall(r"hookpolicy_\w+", variables[name]["definition"]) == ["hookpolicy_steps_total"]

    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert panel["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"])
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24

    captured = {
        f"hookpolicy_{rule.target}_{s}"  # `keep.export: false` keeps them in the ring instead
        for policy in policies for rule in policy.rules for a in rule.actions if isinstance(a, Capture) and a.exports
        for s in a.stats
    }
    real = really_exported(policies, tmp_path, monkeypatch)
    assert captured <= real  # the policy really exports what it captures, on a real model
    stat_panels = [p for p in panels if p["title"].startswith("hookpolicy_")]
    assert sorted(p["title"] for p in stat_panels) == sorted(captured)  # one panel per captured family
    for panel in stat_panels:
        for target in panel["targets"]:  # two when some of its rules are once per job and others per rank
            assert metric_names(target["expr"]) == {panel["title"]}
            assert ("{{module}}" in target["legendFormat"] or "per rule" in panel["description"]
                    or "{{rule}}" in target["legendFormat"])
    titles = {p["title"] for p in panels}
    for title in ("Steps per second", "Hook errors", "hookpolicy seconds per step"):
        assert title in titles
    actions = [a for policy in policies for rule in policy.rules for a in rule.actions]
    alerts = [a for a in actions if isinstance(a, Alert)]
    # a panel with nothing to show is left out
    assert ("Alerts firing" in titles) == ("Alert evaluations that fired" in titles) == bool(alerts)
    assert ("Skipped steps" in titles) == any(a.then == "skip_step" for a in alerts)
    assert ("Rewinds" in titles) == any(a.then == "rewind" for a in alerts)
    assert ("Clipped groups" in titles) == any(isinstance(a, Clip) for a in actions)
    step_rate = next(p for p in panels if p["title"] == "Steps per second")
    assert "rate(hookpolicy_steps_total{" in step_rate["targets"][0]["expr"]

    exprs = _exprs(dashboard)
    assert exprs
    once_per_job = {t["expr"] for p in stat_panels for t in p["targets"] if "ignore the rank variable" in p["description"]}
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= real, (expr, names - real)
        assert names <= set(exported_families(policies)), expr
        assert 'job=~"$job"' in expr and ('rank=~"$rank"' in expr or expr in once_per_job), expr
        # a family with a model label is filtered by the $model variable; a process-wide one is not
        # (a model filter would hide it: its series have no model label)
        per_model = {n for n in names if n in PROCESS_WIDE} == set()
        assert ('model=~"$model"' in expr) == per_model, expr


#: the engine families without a model label (one series per process or policy)
PROCESS_WIDE = {f"{f.name}_total" if f.kind == "counter" else f.name for f in FAMILIES if "model" not in f.labels}


def test_grafana_legend_per_module_and_tensor() -> None:
    policies = list(hookpolicy.load(ROOT / "policies" / "gradient-monitor.yaml").policies)
    dashboard = json.loads(grafana_dashboard(policies))
    panel = next(p for p in dashboard["panels"] if p["title"] == "hookpolicy_grad_output_l2_norm")
    assert panel["targets"][0]["legendFormat"] == "{{model}} {{module}} rank {{rank}}"
    assert 'policy=~"gradient-monitor"' in panel["targets"][0]["expr"]


def test_grafana_rows_name_the_target_of_every_statistic() -> None:
    """abs_max panels sit under their own target's row, not under "grad_abs" (a suffix match on max)."""
    policies = list(hookpolicy.load(ROOT / "policies" / "example-monitor.yaml").policies)
    dashboard = json.loads(grafana_dashboard(policies))
    rows: dict[str, list[str]] = {}
    current = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], [])
        elif current is not None and panel["title"].startswith("hookpolicy_"):
            current.append(panel["title"])
    stat_rows = {title: panels for title, panels in rows.items() if title.startswith("Statistics: ")}
    assert "hookpolicy_grad_abs_max" in stat_rows["Statistics: grad"]
    assert "hookpolicy_output_abs_max" in stat_rows["Statistics: output"]
    assert set(stat_rows) <= {f"Statistics: {t}" for t in ("input", "output", "grad_output", "grad_input", "grad", "weight")}


def test_the_series_dropped_alert_names_the_limits_the_policy_sets(tmp_path: Path) -> None:
    from helpers.policies import load_policy
    capture = "- name: g\n  match: {types: [Linear]}\n  trigger: {at: step}\n  target: grad\n" \
              "  actions: [{capture: {stats: [l2_norm]}}]\n"
    for spec, named in (("", "(maxSeries 10000)"), ("limits: {maxSeries: 50, maxJobSeries: 400}\n",
                                                    "(maxSeries 50, maxJobSeries 400)")):
        (policy,) = load_policy(tmp_path, capture, spec=spec).policies
        (dropped,) = [r for _, r in _alert_rules(yaml.safe_load(prometheus_rules([policy])))
                      if "hookpolicy_series_dropped_total" in r["expr"]]
        assert named in dropped["annotations"]["description"]
        assert dropped["annotations"]["summary"].endswith("maxSeries or maxJobSeries" if "Job" in named else "maxSeries")


# --------------------------------------------------------------------------- nothing a policy says is executed

HOSTILE_RUNBOOK = 'https://runbooks.example.com/{{ range query "up" }}{{ .Labels.instance }},{{ end }}?v={{ $value }}'
HOSTILE_POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: hostile
  annotations: {runbook_url: '%s'}
spec:
  rules:
    - name: nan
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert:
            if: "nonfinite > 0"
            severity: critical
            then: skip_step
            message: '{{{{ query "up" }}}} {policy} {{{{ $labels.job }}}} }}}} {{{{ end }}}}'
""" % HOSTILE_RUNBOOK.replace("'", "''")

HOSTILE_TEST = """\
rule_files: [hostile.rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{job="train", instance="node-1:9400"}'
        values: '1x10'
      - series: 'hookpolicy_alerts_total{job="train", instance="node-1:9400", rank="0", model="GPT", policy="hostile", rule="nan", severity="critical"}'
        values: '_ 1 1 1'
    alert_rule_test:
      - eval_time: 2m
        alertname: HookpolicyHostileNan
        exp_alerts:
          - exp_labels: {severity: critical, policy: hostile, rule: nan, job: train, instance: "node-1:9400", rank: "0", model: GPT}
            exp_annotations:
              summary: %s
              description: %s
              runbook_url: %s
"""


@needs_promtool
def test_nothing_a_policy_says_is_executed_by_prometheus(tmp_path: Path) -> None:
    """The reported fault: `metadata.annotations.runbook_url` was copied unescaped, and Prometheus
    ran `{{ range query "up" }}` in it, rendering the scrape targets into the URL. promtool renders
    every annotation of the generated rules with a live `up` series: each reads as the policy wrote it."""
    # a file name with a newline: the rules' header comment must not end early (YAML injection)
    path = tmp_path / "hostile\ngroups: []\n.yaml"
    path.write_text(HOSTILE_POLICY)
    policies = hookpolicy.load(path).policies
    assert policies[0].annotations["runbook_url"] == HOSTILE_RUNBOOK
    text = prometheus_rules(policies)
    (tmp_path / "hostile.rules.yml").write_text(text)
    assert [g["name"] for g in yaml.safe_load(text)["groups"]] == ["hookpolicy.hostile", "hookpolicy.engine"]
    message = '{{{{ query "up" }}}} {policy} {{{{ $labels.job }}}} }}}} {{{{ end }}}}'  # as written (a format string)
    summary = '{{ query "up" }} hostile {{ $labels.job }} }} {{ end }}'
    description = (
        "Rule nan of hookpolicy policy hostile (grad at step) fired within the last 5m on job train, instance "
        f"node-1:9400, rank 0, model GPT: `nonfinite > 0` held on 1 consecutive evaluation (then: skip_step; log "
        f"message: \"{message}\"). The module, step and statistics are in the run's alert log: a hookpolicy: line on "
        "stderr per firing (a JSON record with HOOKPOLICY_LOG_FORMAT=json), and the file HOOKPOLICY_ALERT_LOG names."
    )
    (tmp_path / "hostile.test.yml").write_text(HOSTILE_TEST % tuple(json.dumps(s) for s in (summary, description,
                                                                                             HOSTILE_RUNBOOK)))
    for argv in (["check", "rules", "hostile.rules.yml"], ["test", "rules", "hostile.test.yml"]):
        done = subprocess.run([str(PROMTOOL), *argv], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_hostile_file_name_stays_text_in_the_dashboard(tmp_path: Path) -> None:
    """Names in the dashboard come from the schema's alphabets; the one free string, the file name, is JSON text."""
    path = tmp_path / 'x"}, {"type": "text\n.yaml'
    path.write_text(HOSTILE_POLICY)
    dashboard = json.loads(grafana_dashboard(hookpolicy.load(path).policies))
    assert dashboard["description"].endswith(str(path))
    assert {p["type"] for p in dashboard["panels"]} <= {"row", "timeseries", "state-timeline", "table"}


def test_the_dashboard_shows_events_and_once_per_job_series_whatever_the_rank() -> None:
    """The reported faults: "Alerts firing" stayed blank for event alerts (it read the gauge, which clears
    at the next step, before any scrape); picking rank=1 emptied every once-per-job panel; "Clipped
    groups" was always empty for a policy without a clip."""
    from helpers.policies import policy_text

    rules = """\
- name: nan
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], per: rule}
    - alert: {if: "nonfinite > 0", severity: critical, then: skip_step}
- name: acts
  match: {types: [Linear]}
  trigger: {at: forward}
  actions:
    - capture: {stats: [l2_norm]}
"""
    (policy,) = _load_text(policy_text(rules, name="events"))
    dashboard = json.loads(grafana_dashboard([policy]))
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    (firing,) = panels["Alerts firing"]["targets"]
    assert "hookpolicy_alerts_total" in firing["expr"] and "hookpolicy_alert_firing" not in firing["expr"]
    assert "Clipped groups" not in panels and "Rewinds" not in panels and "Skipped steps" in panels
    (grad,) = panels["hookpolicy_grad_l2_norm"]["targets"]  # a step rule on grad: once per job
    assert "rank=~" not in grad["expr"] and 'rule=~"nan"' in grad["expr"]
    (acts,) = panels["hookpolicy_output_l2_norm"]["targets"]  # activations: per rank
    assert 'rank=~"$rank"' in acts["expr"]


def _load_text(text: str) -> tuple[Policy, ...]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "p.yaml"
        path.write_text(text)
        return hookpolicy.load(path).policies


@needs_promtool
def test_every_dashboard_query_parses_as_promql(tmp_path: Path) -> None:
    """Each query of the library's dashboard, its variables filled in as Grafana fills them, passes
    promtool's parser (as a recording rule)."""
    exprs = _exprs(json.loads(grafana_dashboard(library())))
    filled = [e.replace("$__rate_interval", "1m").replace("$job", ".*").replace("$rank", ".*").replace("$model", ".*")
              for e in exprs]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"q:{i}", "expr": e} for i, e in enumerate(filled)]}]}
    (tmp_path / "q.yml").write_text(yaml.safe_dump(rules))
    done = subprocess.run([str(PROMTOOL), "check", "rules", "q.yml"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
