"""Prometheus alerting rules and a Grafana dashboard generated from policies.

Both outputs are pure functions of the typed policies (no model, no torch): the metric
families a policy exports are known from its rules alone, `hookpolicy_<target>_<stat>`
for every statistic a `capture` action names, plus the engine families of
`hookpolicy.metrics.ENGINE_FAMILIES`. `exported_families` lists them, and everything
generated here names only those.

Mapping an alert's step count (`for: N`) to Prometheus
------------------------------------------------------
The runtime already applies `for: N` where steps are visible: `hookpolicy_alerts_total`
and `hookpolicy_alert_firing` only move once the condition has held on N consecutive
evaluations. Prometheus sees wall-clock scrapes, not steps, so re-counting N there would
count twice. Each alert therefore becomes one of two shapes:

- an **event** (`then: skip_step`, `then: halt`, or `for: 1`): one confirmed occurrence
  matters and the condition usually clears on the next step, faster than a scrape, so
  the firing gauge would be missed. The rule watches the counter,
  `increase(hookpolicy_alerts_total[5m]) > 0` (plus a clause for a counter series that
  appears with a value already above zero, which `increase` cannot see), with
  Prometheus `for: 0s`: it fires at the first evaluation that sees the event and
  resolves 5 minutes after the last one.
- a **condition** (`then: log` with `for: N >= 2`): a sustained state. The rule watches
  `hookpolicy_alert_firing == 1` with Prometheus `for: 1m`: the gauge must still read 1
  a minute later (at least two evaluations at Prometheus' default 1m interval), so a
  state that clears within one scrape never pages.

Alerts of one rule that share a severity share their series (the labels are policy,
rule and severity), so they become one alerting rule whose annotations list each of them.

Trap: Grafana and Prometheus read label values, not file names; a policy renamed in its
file is a new set of series, and dashboards and rules must be regenerated.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import yaml

from .metrics import ENGINE_FAMILIES, stat_family
from .model import STATS, Alert, Capture, Policy, Rule

__all__ = [
    "ALERT_WINDOW", "CONDITION_FOR", "STALL_SECONDS", "exported_families", "stat_families",
    "prometheus_rules", "grafana_dashboard",
]

#: The range over which a counter-based (event) alert looks back; also how long it
#: keeps firing after the last event.
ALERT_WINDOW = "5m"
#: Seconds without a step after which a run counts as stalled.
STALL_SECONDS = 900
#: Prometheus `for:` of a condition alert (`then: log`, `for: N >= 2`).
CONDITION_FOR = "1m"

_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
_UNITS = {"zero_fraction": "percentunit"}


# --------------------------------------------------------------------------- families


def stat_families(policies: Sequence[Policy]) -> dict[str, list[tuple[Policy, Rule, Capture]]]:
    """Every statistic family the policies export -> the captures that feed it, in file order."""
    found: dict[str, list[tuple[Policy, Rule, Capture]]] = {}
    for policy in policies:
        for rule in policy.rules:
            for action in rule.actions:
                if isinstance(action, Capture):
                    for stat in action.stats:
                        found.setdefault(stat_family(rule.target, stat), []).append((policy, rule, action))
    return found


def exported_families(policies: Sequence[Policy]) -> dict[str, str]:
    """Every metric family name the policies make hookpolicy export -> its Prometheus type.

    Counters carry their `_total` suffix, as a scrape shows them.
    """
    families = {
        (f"{name}_total" if kind == "counter" else name): kind
        for name, (kind, _, _) in ENGINE_FAMILIES.items()
    }
    families.update((name, "gauge") for name in stat_families(policies))
    return families


# --------------------------------------------------------------------------- PromQL


def _quote(value: str) -> str:
    """A PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _selector(metric: str, **labels: str) -> str:
    inner = ", ".join(f"{key}={_quote(value)}" for key, value in labels.items())
    return f"{metric}{{{inner}}}" if inner else metric


def _counter_fired(metric: str, window: str, **labels: str) -> str:
    """True while `metric` rose within `window`, including a series that is new in it.

    `increase()` needs two samples, so a counter that first appears with value 1 (the
    first alert of a run) shows no increase; the `unless ... offset` clause catches it.
    """
    sel = _selector(metric, **labels)
    return f"increase({sel}[{window}]) > 0 or ({sel} unless {sel} offset {window}) > 0"


# --------------------------------------------------------------------------- alert text


def _go_literal(text: str) -> str:
    """Literal text in a Prometheus (Go template) annotation: `{` may open an action."""
    return text.replace("{", '{{ "{" }}')


def _summary(alert: Alert, policy: Policy, rule: Rule) -> str:
    """The alert's `message` when Prometheus knows all its fields, else `policy/rule: condition`.

    A message naming per-step values (module, step, statistics) cannot be rendered from
    the alert series; those values are in the run's alert log, whose line quotes the
    rendered message.
    """
    known = {
        "policy": _go_literal(policy.name), "rule": _go_literal(rule.name),
        "severity": alert.severity, "target": rule.target, "condition": _go_literal(alert.source),
        "rank": "{{ $labels.rank }}",
    }
    fallback = f"{_go_literal(policy.name)}/{_go_literal(rule.name)}: {_go_literal(alert.source)} on rank {{{{ $labels.rank }}}}"
    try:
        parts = list(string.Formatter().parse(alert.message))
    except ValueError:
        return fallback
    out: list[str] = []
    for literal, field, spec, conversion in parts:
        out.append(_go_literal(literal))
        if field is not None:
            if field not in known or spec or conversion:
                return fallback
            out.append(known[field])
    return "".join(out)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _trigger_text(rule: Rule) -> str:
    trigger = rule.trigger
    text = f"{rule.target} at {trigger.at}"
    if trigger.every > 1:
        text += f", every {trigger.every} steps"
    return text


def _is_event(alert: Alert) -> bool:
    return alert.then in ("skip_step", "halt") or alert.for_ <= 1


def _alert_name(*parts: str) -> str:
    """`HookpolicyNanGuardNonfiniteGrads`: alert names must be `[a-zA-Z_:][a-zA-Z0-9_:]*`."""
    words = [w for part in parts for w in part.replace("_", "-").split("-") if w]
    return "Hookpolicy" + "".join(w[:1].upper() + w[1:] for w in words)


def _runbook(policy: Policy) -> dict[str, str]:
    for key in ("runbook_url", "runbook"):
        if key in policy.annotations:
            return {"runbook_url": policy.annotations[key]}
    return {}


@dataclass(frozen=True)
class _AlertGroup:
    """The alerts of one rule with one severity: they share their series."""

    policy: Policy
    rule: Rule
    severity: str
    alerts: tuple[Alert, ...]

    @property
    def event(self) -> bool:
        return any(_is_event(a) for a in self.alerts)

    def describe(self, alert: Alert) -> str:
        mode = "audit: reported only, nothing was changed" if self.rule.mode == "audit" else f"then: {alert.then}"
        return (
            f"`{_go_literal(alert.source)}` held on {_plural(alert.for_, 'consecutive evaluation')} "
            f"({mode}; log message: \"{_go_literal(alert.message)}\")"
        )


def _alert_groups(policy: Policy) -> list[_AlertGroup]:
    groups: list[_AlertGroup] = []
    for rule in policy.rules:
        by_severity: dict[str, list[Alert]] = {}
        for action in rule.actions:
            if isinstance(action, Alert):
                by_severity.setdefault(action.severity, []).append(action)
        for severity in sorted(by_severity, key=_SEVERITY_ORDER.__getitem__):
            groups.append(_AlertGroup(policy, rule, severity, tuple(by_severity[severity])))
    return groups


def _alerting_rule(group: _AlertGroup, several_severities: bool) -> dict[str, Any]:
    policy, rule, severity = group.policy, group.rule, group.severity
    labels = {"policy": policy.name, "rule": rule.name, "severity": severity}
    name_parts = [policy.name, rule.name] + ([severity] if several_severities else [])
    if group.event:
        expr = _counter_fired("hookpolicy_alerts_total", ALERT_WINDOW, **labels)
        duration = "0s"
        when = f"fired within the last {ALERT_WINDOW}"
    else:
        expr = f"{_selector('hookpolicy_alert_firing', **labels)} == 1"
        duration = CONDITION_FOR
        when = "is firing"
    summary = "; ".join(dict.fromkeys(_summary(a, policy, rule) for a in group.alerts))
    description = (
        f"Rule {rule.name} of hookpolicy policy {policy.name} ({_trigger_text(rule)}) {when} on "
        "job {{ $labels.job }}, instance {{ $labels.instance }}, rank {{ $labels.rank }}: "
        + "; ".join(group.describe(a) for a in group.alerts)
        + ". The module, step and statistics are in the run's alert log "
        "(JSON lines with \"event\": \"alert\", on stderr)."
    )
    return {
        "alert": _alert_name(*name_parts),
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity, "policy": policy.name, "rule": rule.name},
        "annotations": {"summary": summary, "description": description, **_runbook(policy)},
    }


def _policy_group(policy: Policy) -> dict[str, Any]:
    groups = _alert_groups(policy)
    severities: dict[str, set[str]] = {}
    for g in groups:
        severities.setdefault(g.rule.name, set()).add(g.severity)
    rules = [_alerting_rule(g, len(severities[g.rule.name]) > 1) for g in groups]
    error_severity = "critical" if policy.on_error == "halt" else "warning"
    rules.append({
        "alert": _alert_name(policy.name, "hook-errors"),
        "expr": _counter_fired("hookpolicy_hook_errors_total", ALERT_WINDOW, policy=policy.name),
        "for": "0s",
        "labels": {"severity": error_severity, "policy": policy.name},
        "annotations": {
            "summary": f"hookpolicy rule {{{{ $labels.rule }}}} of policy {_go_literal(policy.name)} raised errors",
            "description": (
                f"A hook of rule {{{{ $labels.rule }}}} (policy {_go_literal(policy.name)}, onError: "
                f"{policy.on_error}) raised within the last {ALERT_WINDOW} on job {{{{ $labels.job }}}}, "
                "instance {{ $labels.instance }}, rank {{ $labels.rank }}. The traceback is in the run's "
                "log; a rule is switched off after 3 errors."
            ),
            **_runbook(policy),
        },
    })
    rules.append({
        "alert": _alert_name(policy.name, "series-dropped"),
        "expr": _counter_fired("hookpolicy_series_dropped_total", "15m", policy=policy.name),
        "for": "0s",
        "labels": {"severity": "warning", "policy": policy.name},
        "annotations": {
            "summary": f"hookpolicy policy {_go_literal(policy.name)} reached spec.limits.maxSeries",
            "description": (
                f"Policy {_go_literal(policy.name)} (maxSeries {policy.max_series}) dropped statistic series "
                "within the last 15m on job {{ $labels.job }}, instance {{ $labels.instance }}, rank "
                "{{ $labels.rank }}: narrow its match, use per: module or per: rule instead of per: tensor, "
                "or raise spec.limits.maxSeries if Prometheus can take it."
            ),
            **_runbook(policy),
        },
    })
    return {"name": f"hookpolicy.{policy.name}", "rules": rules}


def _engine_group(stall_seconds: int) -> dict[str, Any]:
    return {"name": "hookpolicy.engine", "rules": [
        {
            "alert": "HookpolicyTrainingStalled",
            "expr": f"time() - hookpolicy_last_step_timestamp_seconds > {stall_seconds}",
            "for": "0s",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Training on {{ $labels.instance }} rank {{ $labels.rank }} made no step for "
                           f"{stall_seconds}s",
                "description": (
                    "No optimizer step for {{ $value | humanizeDuration }} on job {{ $labels.job }}, instance "
                    "{{ $labels.instance }}, rank {{ $labels.rank }}, while the process still serves metrics: "
                    "a hung collective, a stuck data loader, or a long evaluation or checkpoint."
                ),
            },
        },
        {
            "alert": "HookpolicyReloadFailed",
            "expr": "hookpolicy_config_last_reload_successful == 0",
            "for": "0s",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "hookpolicy on {{ $labels.instance }} rank {{ $labels.rank }} rejected a policy reload",
                "description": (
                    "The last reload of the policy files was invalid and the previous version is still "
                    "applied (see hookpolicy_policy_info for the live revision); the problems are in the run's log."
                ),
            },
        },
    ]}


def prometheus_rules(policies: Sequence[Policy], *, stall_seconds: int = STALL_SECONDS) -> str:
    """Prometheus alerting rules (YAML, for `rule_files`) for the policies' alerts.

    One group per policy (its alerts, its hook errors and dropped series) and one
    `hookpolicy.engine` group (a stalled run, a failed reload). See the module docstring
    for how an alert's `for:` in steps becomes a Prometheus `for:`.
    """
    doc = {"groups": [_policy_group(p) for p in policies] + [_engine_group(stall_seconds)]}
    sources = ", ".join(p.source for p in policies) or "no policy"
    header = (
        f"# Prometheus alerting rules generated by `hookpolicy export prometheus-rules` from {sources}.\n"
        "# Regenerate them when a policy changes; check with `promtool check rules FILE`.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100000, allow_unicode=True)


# --------------------------------------------------------------------------- Grafana

_DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def _regex_alternatives(values: Iterable[str]) -> str:
    """`a|b` for a PromQL `=~` matcher, regex metacharacters escaped."""
    special = set("\\.^$*+?()[]{}|")
    escaped = ("".join("\\" + c if c in special else c for c in v) for v in values)
    return "|".join(escaped)


def _filters(policy_regex: str | None = None) -> str:
    parts = ['job=~"$job"', 'rank=~"$rank"']
    if policy_regex is not None:
        parts.append(f"policy=~{_quote(policy_regex)}")
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


def _stat_panel(family: str, feeds: list[tuple[Policy, Rule, Capture]]) -> dict[str, Any]:
    stat = next(s for s in STATS if family.endswith("_" + s))
    target = family[len("hookpolicy_"):-len(stat) - 1]
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
    policies = _regex_alternatives(dict.fromkeys(p.name for p, _, _ in feeds))
    rules = _regex_alternatives(dict.fromkeys(r.name for _, r, _ in feeds))
    expr = f"{family}{{{_filters(policies)}, rule=~{_quote(rules)}}}"
    where = ", ".join(f"{p}/{r}" for p, r in keys)
    description = (
        f"{stat} of the {target} tensors selected by {where}, read once per evaluated step "
        f"(per {', '.join(sorted(pers))}); the module label is \"\" for per: rule."
    )
    return _timeseries(family, description, [_target(expr, " ".join(legend))], unit=_UNITS.get(stat, "short"))


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
    rate, seconds since the last step, hookpolicy's own time per step), alerts (firing,
    skipped steps, hook errors, dropped series), then one timeseries per exported
    statistic family. Every `expr` names only families in `exported_families(policies)`.
    """
    names = [p.name for p in policies]
    mine = _regex_alternatives(names) if names else "$^"
    f_all, f_mine = _filters(), _filters(mine)
    layout = _Layout()

    layout.row("Training")
    layout.add(_timeseries(
        "Steps per second", "Optimizer steps evaluated by hookpolicy per second, per rank.",
        [_target(f"sum by (job, instance, rank) (rate(hookpolicy_steps_total{{{f_all}}}[5m]))", "{{instance}} rank {{rank}}")],
        unit="short", min_zero=True))
    layout.add(_timeseries(
        "Seconds since the last step",
        f"Rises linearly while a run is stalled; the HookpolicyTrainingStalled alert fires above {STALL_SECONDS}s.",
        [_target(f"time() - hookpolicy_last_step_timestamp_seconds{{{f_all}}}", "{{instance}} rank {{rank}}")],
        unit="s", min_zero=True))
    layout.add(_timeseries(
        "hookpolicy seconds per step",
        "Time spent inside hookpolicy's hooks per optimizer step, by rule: the overhead the policies add.",
        [_target(
            f"sum by (job, instance, rank, policy, rule) (rate(hookpolicy_hook_seconds_total{{{f_mine}}}[5m]))"
            f" / on (job, instance, rank) group_left sum by (job, instance, rank) "
            f"(rate(hookpolicy_steps_total{{{f_all}}}[5m]))",
            "{{policy}}/{{rule}} rank {{rank}}")],
        unit="s", min_zero=True))
    layout.add(_timeseries(
        "Actions per second", "Actions run by rule, action and mode (audit actions change nothing).",
        [_target(f"sum by (policy, rule, action, mode) (rate(hookpolicy_actions_total{{{f_mine}}}[5m]))",
                 "{{policy}}/{{rule}} {{action}} ({{mode}})")],
        unit="short", min_zero=True))

    layout.row("Alerts")
    layout.add({
        "type": "state-timeline", "title": "Alerts firing",
        "description": "hookpolicy_alert_firing: 1 while an alert's condition holds (after its for: count).",
        "datasource": dict(_DATASOURCE),
        "targets": [_target(f"max by (policy, rule, severity, rank) (hookpolicy_alert_firing{{{f_mine}}})",
                            "{{policy}}/{{rule}} {{severity}} rank {{rank}}")],
        "fieldConfig": {"defaults": {
            "min": 0, "max": 1, "unit": "none",
            "color": {"mode": "thresholds"},
            "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}]},
            "mappings": [{"type": "value", "options": {"0": {"text": "ok", "index": 0}, "1": {"text": "firing", "index": 1}}}],
        }, "overrides": []},
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.9,
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
    })
    layout.add(_timeseries(
        "Alert evaluations that fired", "increase(hookpolicy_alerts_total) per interval, by rule and severity.",
        [_target(f"sum by (policy, rule, severity) (increase(hookpolicy_alerts_total{{{f_mine}}}[$__rate_interval]))",
                 "{{policy}}/{{rule}} {{severity}}")],
        bars=True, min_zero=True))
    layout.add(_timeseries(
        "Skipped steps", "Optimizer steps not applied because of a skip_step alert.",
        [_target(f"sum by (policy, rule, rank) (increase(hookpolicy_skipped_steps_total{{{f_mine}}}[$__rate_interval]))",
                 "{{policy}}/{{rule}} rank {{rank}}")],
        bars=True, min_zero=True))
    layout.add(_timeseries(
        "Hook errors", "Errors raised inside hookpolicy's hooks; a rule is switched off after 3 (onError: continue).",
        [_target(f"sum by (policy, rule, rank) (increase(hookpolicy_hook_errors_total{{{f_mine}}}[$__rate_interval]))",
                 "{{policy}}/{{rule}} rank {{rank}}")],
        bars=True, min_zero=True))
    layout.add(_timeseries(
        "Series dropped (maxSeries)", "Statistic series not exported because spec.limits.maxSeries was reached.",
        [_target(f"sum by (policy, rank) (increase(hookpolicy_series_dropped_total{{{f_mine}}}[$__rate_interval]))",
                 "{{policy}} rank {{rank}}")],
        bars=True, min_zero=True))
    layout.add({
        "type": "table", "title": "Applied policies",
        "description": "hookpolicy_policy_info: the live revision (content hash) of each policy, and whether a reload failed.",
        "datasource": dict(_DATASOURCE),
        "targets": [
            _target(f"max by (instance, rank, policy, revision, mode) (hookpolicy_policy_info{{{f_mine}}})", "",
                    ref="A", instant=True, fmt="table"),
        ],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
        "transformations": [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
    })

    families = stat_families(policies)
    by_target: dict[str, list[str]] = {}
    for family in families:
        stat = next(s for s in STATS if family.endswith("_" + s))
        by_target.setdefault(family[len("hookpolicy_"):-len(stat) - 1], []).append(family)
    for target, members in by_target.items():
        layout.row(f"Statistics: {target}")
        for family in members:
            layout.add(_stat_panel(family, families[family]))

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
        ]},
        "panels": layout.panels,
    }
    return json.dumps(dashboard, indent=2) + "\n"

