"""A Grafana dashboard generated from policies (`hookpolicy export grafana`).

A pure function of the typed policies, like `hookpolicy.export`: datasource, job and rank
template variables; one panel per captured statistic family with a series per module;
panels for alerts, skipped steps, hook errors and the step rate. Every `expr` names a
family of `hookpolicy.export.rules.exported_families` (tests/test_export.py checks it against
a real run's scrape).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Iterable, Sequence

from .metrics import stat_family
from .rules import STALL_SECONDS, promql_string, stat_families
from ..policy.model import PARAM_TARGETS, STATS, TARGETS, Alert, Capture, Clip, Policy, Rule

__all__ = ["grafana_dashboard"]

_UNITS = {"zero_fraction": "percentunit"}

_DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def _regex_alternatives(values: Iterable[str]) -> str:
    """`a|b` for a PromQL `=~` matcher, regex metacharacters escaped."""
    special = set("\\.^$*+?()[]{}|")
    escaped = ("".join("\\" + c if c in special else c for c in v) for v in values)
    return "|".join(escaped)


def _filters(policy_regex: str | None = None, per_model: bool = True, per_rank: bool = True) -> str:
    """The dashboard's variables as a selector; `per_model`: the family has a `model` label;
    `per_rank`: its series differ by rank (a once-per-job series is rank 0's alone, and a
    rank filter would empty it)."""
    parts = ['job=~"$job"'] + (['rank=~"$rank"'] if per_rank else []) + (['model=~"$model"'] if per_model else [])
    if policy_regex is not None:
        parts.append(f"policy=~{promql_string(policy_regex)}")
    return ", ".join(parts)


class _Layout:
    """Places panels two to a row of the 24-column grid, rows between sections."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append({
            "type": "row", "title": title, "id": self.next_id, "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
        })
        self.next_id += 1
        self.y += 1

    def add(self, panel: dict[str, Any], width: int = 12) -> None:
        if self.x + width > 24:
            self.y += 8
            self.x = 0
        panel["id"] = self.next_id
        panel["gridPos"] = {"h": 8, "w": width, "x": self.x, "y": self.y}
        self.next_id += 1
        self.panels.append(panel)
        self.x += width
        if self.x >= 24:
            self.y += 8
            self.x = 0


def _target(expr: str, legend: str, ref: str = "A", instant: bool = False, fmt: str = "time_series") -> dict[str, Any]:
    target: dict[str, Any] = {
        "datasource": dict(_DATASOURCE), "refId": ref, "expr": expr, "legendFormat": legend,
        "range": not instant, "instant": instant, "format": fmt,
    }
    return target


def _timeseries(
    title: str, description: str, targets: list[dict[str, Any]], unit: str = "short",
    bars: bool = False, min_zero: bool = False,
) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "bars" if bars else "line", "lineWidth": 1, "fillOpacity": 10 if bars else 0,
                              "showPoints": "never", "spanNulls": False}
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if min_zero:
        defaults["min"] = 0
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": dict(_DATASOURCE),
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def _alerts(policies: Sequence[Policy]) -> list[Alert]:
    return [a for p in policies for r in p.rules for a in r.actions if isinstance(a, Alert)]


def _has_alert(then: str) -> Callable[[Sequence[Policy]], bool]:
    return lambda policies: any(a.then == then for a in _alerts(policies))


def _has(kind: type) -> Callable[[Sequence[Policy]], bool]:
    return lambda policies: any(isinstance(a, kind) for p in policies for r in p.rules for a in r.actions)


#: Engine counters shown as their increase per interval: title, description, metric, sum by, legend, and
#: whether the policies can count anything in it (a panel that cannot is left out).
_COUNTER_PANELS: tuple[tuple[str, str, str, str, str, Callable[[Sequence[Policy]], bool]], ...] = (
    ("Alert evaluations that fired",
     "increase(hookpolicy_alerts_total) per interval, by rule and severity.",
     "hookpolicy_alerts_total", "model, policy, rule, severity", "{{model}} {{policy}}/{{rule}} {{severity}}",
     lambda policies: bool(_alerts(policies))),
    ("Skipped steps",
     "Optimizer steps not applied because of a skip_step alert.",
     "hookpolicy_skipped_steps_total", "model, policy, rule, rank", "{{model}} {{policy}}/{{rule}} rank {{rank}}",
     _has_alert("skip_step")),
    ("Rewinds",
     "Rewinds to an in-memory snapshot by a then: rewind alert.",
     "hookpolicy_rewinds_total", "model, policy, rule, rank", "{{model}} {{policy}}/{{rule}} rank {{rank}}",
     _has_alert("rewind")),
    ("Clipped groups",
     "Groups (per: rule, module or tensor) a norm clip scaled down per interval; mode=audit: would have, nothing changed.",
     "hookpolicy_clipped_total", "model, policy, rule, mode", "{{model}} {{policy}}/{{rule}} {{mode}}",
     _has(Clip)),
    ("Hook errors",
     "Errors raised inside hookpolicy's hooks; a rule is switched off after 3 (onError: continue).",
     "hookpolicy_hook_errors_total", "model, policy, rule, rank", "{{model}} {{policy}}/{{rule}} rank {{rank}}",
     lambda policies: True),
    ("Series dropped (maxSeries, maxJobSeries)",
     "Statistic series not exported because spec.limits.maxSeries or maxJobSeries was reached: each counted once.",
     "hookpolicy_series_dropped_total", "policy, rank", "{{policy}} rank {{rank}}",
     _has(Capture)),
)


def _increase_panel(title: str, description: str, metric: str, by: str, legend: str, filters: str) -> dict[str, Any]:
    """Bars of a counter's increase per interval, summed by the labels `by`."""
    expr = f"sum by ({by}) (increase({metric}{{{filters}}}[$__rate_interval]))"
    return _timeseries(title, description, [_target(expr, legend)], bars=True, min_zero=True)


#: family name -> (target, statistic): split by exact name, never by suffix (`abs_max` ends in `max`).
_SPLIT = {stat_family(t, s): (t, s) for t in TARGETS for s in STATS}


def _once_per_job(rule: Rule, capture: Capture) -> bool:
    """Whether the capture's series can be exported once per job, by rank 0 alone (`engine` replicas)."""
    return capture.series == "job" and ((rule.trigger.at == "step" and rule.target in PARAM_TARGETS)
                                        or (rule.target == "loss" and rule.ranks == "job"))


def _stat_panel(family: str, feeds: list[tuple[Policy, Rule, Capture]]) -> dict[str, Any]:
    target, stat = _SPLIT[family]
    keys = list(dict.fromkeys((p.name, r.name) for p, r, _ in feeds))
    pers = {c.per for _, _, c in feeds}
    legend: list[str] = []
    if len(keys) > 1:
        legend.append("{{policy}}/{{rule}}")
    if pers - {"rule"}:
        legend.append("{{module}}")
    if "tensor" in pers:
        legend.append("{{tensor}}")
    if not legend:
        legend.append("{{rule}}")
    legend.append("rank {{rank}}")
    legend.insert(0, "{{model}}")
    targets: list[dict[str, Any]] = []
    for per_rank in (False, True):  # once-per-job rules ignore the rank variable: their series are rank 0's
        mine = [(p, r) for p, r, c in feeds if _once_per_job(r, c) != per_rank]
        if not mine:
            continue
        policies = _regex_alternatives(dict.fromkeys(p.name for p, _ in mine))
        rules = _regex_alternatives(dict.fromkeys(r.name for _, r in mine))
        expr = f"{family}{{{_filters(policies, per_rank=per_rank)}, rule=~{promql_string(rules)}}}"
        targets.append(_target(expr, " ".join(legend), ref="AB"[len(targets)]))
    where = ", ".join(f"{p}/{r}" for p, r in keys)
    description = (
        f"{stat} of the {target} tensors selected by {where}, read once per evaluated step "
        f"(per {', '.join(sorted(pers))}); the module label is \"\" for per: rule."
    )
    if len(targets) > 1 or "rank=~" not in targets[0]["expr"]:
        description += (" In a process group, statistics that are the same on every rank (after DDP's all-reduce, "
                        "FSDP2 full tensors, the job's loss) are exported by rank 0 alone: their lines ignore the "
                        "rank variable.")
    return _timeseries(family, description, targets, unit=_UNITS.get(stat, "short"))


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": dict(_DATASOURCE),
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "sort": 3, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0,
    }


def grafana_dashboard(policies: Sequence[Policy]) -> str:
    """A Grafana dashboard (JSON, for import or provisioning) for the policies' metrics.

    Template variables: `DS_PROMETHEUS` (the data source; also an `__inputs` entry, so
    the import dialog asks for it), `job` and `rank`. Panels: the training engine (step
    rate, seconds since the last step, hookpolicy's own time per step, the agreement's
    wait per step), alerts (firing, from the counter; skipped steps, rewinds, clips, hook errors, dropped series; a panel the
    policies cannot fill is left out), then one timeseries per exported statistic family
    (once-per-job rules ignore the rank variable). Every `expr` names only families in
    `exported_families(policies)`.
    """
    names = [p.name for p in policies]
    mine = _regex_alternatives(names) if names else "$^"
    f_all, f_mine, f_process = _filters(), _filters(mine), _filters(mine, per_model=False)
    layout = _Layout()

    layout.row("Training")
    layout.add(_timeseries(
        "Steps per second", "Optimizer steps evaluated by hookpolicy per second, per rank.",
        [_target(f"sum by (job, instance, rank, model) (rate(hookpolicy_steps_total{{{f_all}}}[5m]))",
                 "{{instance}} rank {{rank}} {{model}}")],
        unit="short", min_zero=True))
    layout.add(_timeseries(
        "Seconds since the last step",
        f"Rises linearly while a run is stalled; the HookpolicyTrainingStalled alert fires above {STALL_SECONDS}s.",
        [_target(f"time() - hookpolicy_last_step_timestamp_seconds{{{f_all}}}", "{{instance}} rank {{rank}} {{model}}")],
        unit="s", min_zero=True))
    layout.add(_timeseries(
        "hookpolicy seconds per step",
        "Time spent inside hookpolicy's hooks per optimizer step, by rule: the overhead the policies add.",
        [_target(
            f"sum by (job, instance, rank, model, policy, rule) (rate(hookpolicy_hook_seconds_total{{{f_mine}}}[5m]))"
            f" / on (job, instance, rank, model) group_left sum by (job, instance, rank, model) "
            f"(rate(hookpolicy_steps_total{{{f_all}}}[5m]))",
            "{{model}} {{policy}}/{{rule}} rank {{rank}}")],
        unit="s", min_zero=True))
    layout.add(_timeseries(
        "Agreement wait per step (stragglers)",
        "Seconds each rank waits per step in hookpolicy's step agreement for the last rank to arrive: the straggler "
        "waits least, its peers about its delay. A rank slow before or in its backward pass is waited for inside "
        "DDP's or FSDP's own collectives instead (docs/operations.md, stragglers). Empty outside a process group.",
        [_target(
            f"sum by (job, instance, rank, model) (rate(hookpolicy_agreement_wait_seconds_total{{{f_all}}}[5m]))"
            f" / sum by (job, instance, rank, model) (rate(hookpolicy_steps_total{{{f_all}}}[5m]))",
            "{{instance}} rank {{rank}} {{model}}")],
        unit="s", min_zero=True))
    layout.add(_timeseries(
        "Actions per second", "Actions run by rule, action and mode (audit actions change nothing).",
        [_target(f"sum by (model, policy, rule, action, mode) (rate(hookpolicy_actions_total{{{f_mine}}}[5m]))",
                 "{{model}} {{policy}}/{{rule}} {{action}} ({{mode}})")],
        unit="short", min_zero=True))

    layout.row("Alerts")
    if _alerts(policies):
        layout.add(_alerts_firing(f_mine))
    for title, description, metric, by, legend, shown in _COUNTER_PANELS:
        if shown(policies):
            layout.add(_increase_panel(title, description, metric, by, legend, f_mine if "model" in by else f_process))
    layout.add({
        "type": "table", "title": "Applied policies",
        "description": "hookpolicy_policy_info: the live revision (content hash) of each policy, and whether a reload failed.",
        "datasource": dict(_DATASOURCE),
        "targets": [
            _target(f"max by (instance, rank, policy, revision, mode) (hookpolicy_policy_info{{{f_process}}})", "",
                    ref="A", instant=True, fmt="table"),
        ],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
        "transformations": [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
    })

    families = stat_families(policies)
    by_target: dict[str, list[str]] = {}
    for family in families:
        by_target.setdefault(_SPLIT[family][0], []).append(family)
    for target, members in by_target.items():
        layout.row(f"Statistics: {target}")
        for family in members:
            layout.add(_stat_panel(family, families[family]))
    return _dashboard(names, policies, layout)


def _alerts_firing(filters: str) -> dict[str, Any]:
    """A state timeline of the intervals in which each alert fired, from the counter: an event alert's
    gauge clears at the next step, before any scrape, so only the counter shows it."""
    return {
        "type": "state-timeline", "title": "Alerts firing",
        "description": ("1 in an interval in which the alert fired (hookpolicy_alerts_total rose): events that clear "
                        "at the next step (skip_step, halt) show as well as conditions that hold."),
        "datasource": dict(_DATASOURCE),
        "targets": [_target(
            f"clamp_max(sum by (model, policy, rule, severity, rank) "
            f"(increase(hookpolicy_alerts_total{{{filters}}}[$__rate_interval])), 1)",
            "{{model}} {{policy}}/{{rule}} {{severity}} rank {{rank}}")],
        "fieldConfig": {"defaults": {
            "min": 0, "max": 1, "unit": "none",
            "color": {"mode": "thresholds"},
            "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}]},
            "mappings": [{"type": "value", "options": {"0": {"text": "ok", "index": 0}, "1": {"text": "firing", "index": 1}}}],
        }, "overrides": []},
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.9,
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
    }


def _dashboard(names: list[str], policies: Sequence[Policy], layout: _Layout) -> str:
    digest = hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:12]
    dashboard: dict[str, Any] = {
        "__inputs": [{
            "name": "DS_PROMETHEUS", "label": "Prometheus", "description": "The Prometheus that scrapes hookpolicy.",
            "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus",
        }],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "state-timeline", "name": "State timeline", "version": ""},
            {"type": "panel", "id": "table", "name": "Table", "version": ""},
        ],
        "title": "hookpolicy: " + (", ".join(names) or "engine"),
        "description": "Generated by `hookpolicy export grafana` from " + (", ".join(p.source for p in policies) or "no policy"),
        "uid": f"hookpolicy-{digest}",
        "tags": ["hookpolicy", *names],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "links": [],
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
            _variable("job", "Job", "label_values(hookpolicy_steps_total, job)"),
            _variable("rank", "Rank", 'label_values(hookpolicy_steps_total{job=~"$job"}, rank)'),
            _variable("model", "Model", 'label_values(hookpolicy_steps_total{job=~"$job"}, model)'),
        ]},
        "panels": layout.panels,
    }
    return json.dumps(dashboard, indent=2) + "\n"

