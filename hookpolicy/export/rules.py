"""Prometheus alerting rules generated from policies, and the metric families they name.

A pure function of the typed policies (no model, no torch): the metric families a policy
exports are known from its rules alone, `hookpolicy_<target>_<stat>` for every statistic
a `capture` action names, plus the engine families of `hookpolicy.export.metrics.FAMILIES`.
`exported_families` lists them, and everything generated here and in `hookpolicy.export.grafana`
names only those.

Mapping an alert's step count (`for: N`) to Prometheus
------------------------------------------------------
The runtime already applies `for: N` where steps are visible: `hookpolicy_alerts_total`
and `hookpolicy_alert_firing` only move once the condition has held on N consecutive
evaluations. Prometheus sees wall-clock scrapes, not steps, so re-counting N there would
count twice. Each alert therefore becomes one of two shapes:

- an **event** (`then: skip_step`, `cool_down`, `rewind`, `halt`, or `for: 1`): one confirmed occurrence
  matters and the condition usually clears on the next step, faster than a scrape, so
  the firing gauge would be missed. The rule watches the counter, with Prometheus
  `for: 0s`, in three clauses (`_counter_fired`): `increase(X[5m]) > 0` (a rise within a
  run, and a restart whose counter climbs again: `increase` counts across a reset); a
  series first seen within the window with a value above 0 (`increase` needs two samples,
  so the first alert of a short job shows none); and a counter above 0 in a run that
  started within the window (`hookpolicy_run_info` with a `run` label new in it): a retry
  of the same job on the same target that reaches the same count as the attempt before
  (3, then 3) shows no increase and no new series. It fires at the first evaluation
  that sees the event and resolves 5 minutes after the last one.
- a **condition** (`then: log` with `for: N >= 2`): a sustained state. The rule watches
  `hookpolicy_alert_firing == 1` with Prometheus `for: 1m`: the gauge must still read 1
  a minute later (at least two evaluations at Prometheus' default 1m interval), so a
  state that clears within one scrape never pages.

A process's final series pushed to a Pushgateway at exit (`apply --push-gateway`) carry
the `run` label of their group. The counters' clauses see them as the new series they are;
the rules on states (a firing gauge, the last step's time, the reload gauge) read only
series without `run` (`{run=""}`), the live ones: a pushed final state stays in the
Pushgateway, and a finished run is not a stalled one.

Alerts of one rule that share a severity share their series (the labels are policy,
rule and severity), so they become one alerting rule whose annotations list each of them.

Nothing a policy says is executed: every string of the policy that goes into a template
(annotations are Go templates that Prometheus renders, `{{ query "..." }}` included) is
made literal by `go_literal`; labels and names come from the schema's restricted
alphabets, and quoted into PromQL by `promql_string`.

Trap: Grafana and Prometheus read label values, not file names; a policy renamed in its
file is a new set of series, and dashboards and rules must be regenerated.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Sequence

import yaml

from .metrics import FAMILIES, stat_family
from ..policy.model import Alert, Capture, Policy, Rule

__all__ = [
    "ALERT_WINDOW", "CONDITION_FOR", "STALL_SECONDS", "exported_families", "stat_families",
    "go_literal", "promql_string", "prometheus_rules",
]

#: The range over which a counter-based (event) alert looks back; also how long it
#: keeps firing after the last event.
ALERT_WINDOW = "5m"
#: Seconds without a step after which a run counts as stalled.
STALL_SECONDS = 900
#: Prometheus `for:` of a condition alert (`then: log`, `for: N >= 2`).
CONDITION_FOR = "1m"

_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


# --------------------------------------------------------------------------- families


def stat_families(policies: Sequence[Policy]) -> dict[str, list[tuple[Policy, Rule, Capture]]]:
    """Every statistic family the policies export -> the captures that feed it, in file order."""
    found: dict[str, list[tuple[Policy, Rule, Capture]]] = {}
    for policy in policies:
        for rule in policy.rules:
            for action in rule.actions:
                if isinstance(action, Capture) and action.exports:  # `keep.export: false`: the ring only
                    for stat in action.stats:
                        found.setdefault(stat_family(rule.target, stat), []).append((policy, rule, action))
    return found


def exported_families(policies: Sequence[Policy]) -> dict[str, str]:
    """Every metric family name the policies make hookpolicy export -> its Prometheus type.

    Counters carry their `_total` suffix, as a scrape shows them.
    """
    families = {(f"{f.name}_total" if f.kind == "counter" else f.name): f.kind for f in FAMILIES}
    families.update((name, "gauge") for name in stat_families(policies))
    return families


# --------------------------------------------------------------------------- PromQL


def promql_string(value: str) -> str:
    """A PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _selector(metric: str, **labels: str) -> str:
    inner = ", ".join(f"{key}={promql_string(value)}" for key, value in labels.items())
    return f"{metric}{{{inner}}}" if inner else metric


#: The run identity every process exports (`hookpolicy_run_info{run}`), joined on the labels
#: that name one process's endpoint.
_RUN_JOIN = "on (job, instance, rank)"


def _counter_fired(metric: str, window: str, **labels: str) -> str:
    """True while `metric` rose within `window`, including a series or a run that is new in it.

    - `increase()` sees a rise within a run, and a restart whose counter climbs again (it
      counts across a reset; a restart that stays at 0 adds nothing);
    - it needs two samples, so a counter that first appears above 0 (the first alert of a
      short job) shows none: `max_over_time(...) unless ... offset` catches a series first
      seen within the window, for `window` after that sample even once the job is gone;
    - a retry on the same target whose counter first shows the count the attempt before
      ended with (3, then 3) is neither: the counter above 0 in a run whose
      `hookpolicy_run_info{run}` series is new within the window catches it.
    """
    sel = _selector(metric, **labels)
    return (
        f"increase({sel}[{window}]) > 0"
        f" or max_over_time({sel}[{window}]) > 0 unless {sel} offset {window}"
        f" or {sel} > 0 and {_RUN_JOIN} (hookpolicy_run_info unless hookpolicy_run_info offset {window})"
    )


# --------------------------------------------------------------------------- alert text


def go_literal(text: str) -> str:
    """Literal text in a Prometheus (Go template) annotation: `{` may open an action.

    Every `{` becomes the action `{{ "{" }}`, which prints one; nothing else opens an
    action, so `{{ range query "up" }}` in a policy's runbook URL is printed, not run.
    """
    return text.replace("{", '{{ "{" }}')



def _summary(alert: Alert, policy: Policy, rule: Rule) -> str:
    """The alert's `message` when Prometheus knows all its fields, else `policy/rule: condition`.

    A message naming per-step values (module, step, statistics) cannot be rendered from
    the alert series; those values are in the run's alert log, whose line quotes the
    rendered message.
    """
    known = {
        "policy": go_literal(policy.name), "rule": go_literal(rule.name),
        "severity": alert.severity, "target": rule.target, "condition": go_literal(alert.source),
        "rank": "{{ $labels.rank }}", "model": "{{ $labels.model }}",
    }
    fallback = (f"{go_literal(policy.name)}/{go_literal(rule.name)}: {go_literal(alert.source)} "
                "on {{ $labels.model }} rank {{ $labels.rank }}")
    try:
        parts = list(string.Formatter().parse(alert.message))
    except ValueError:
        return fallback
    out: list[str] = []
    for literal, field, spec, conversion in parts:
        out.append(go_literal(literal))
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
    return alert.then != "log" or alert.for_ <= 1


def _alert_name(*parts: str) -> str:
    """`HookpolicyNanGuardNonfiniteGrads`: alert names must be `[a-zA-Z_:][a-zA-Z0-9_:]*`."""
    words = [w for part in parts for w in part.replace("_", "-").split("-") if w]
    return "Hookpolicy" + "".join(w[:1].upper() + w[1:] for w in words)


def _limit_names(policy: Policy) -> str:
    """The series limits `policy` sets, as the annotations name them."""
    return "maxSeries" if policy.max_job_series is None else "maxSeries or maxJobSeries"


def _limits(policy: Policy) -> str:
    """`maxSeries N` and, when set, `maxJobSeries M`."""
    job = "" if policy.max_job_series is None else f", maxJobSeries {policy.max_job_series}"
    return f"maxSeries {policy.max_series}{job}"


def _runbook(policy: Policy) -> dict[str, str]:
    for key in ("runbook_url", "runbook"):
        if key in policy.annotations:
            return {"runbook_url": go_literal(policy.annotations[key])}
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
            f"`{go_literal(alert.source)}` held on {_plural(alert.for_, 'consecutive evaluation')} "
            f"({mode}; log message: \"{go_literal(alert.message)}\")"
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
        expr = f"{_selector('hookpolicy_alert_firing', **labels, run='')} == 1"  # live, not a pushed final value
        duration = CONDITION_FOR
        when = "is firing"
    summary = "; ".join(dict.fromkeys(_summary(a, policy, rule) for a in group.alerts))
    description = (
        f"Rule {rule.name} of hookpolicy policy {policy.name} ({_trigger_text(rule)}) {when} on "
        "job {{ $labels.job }}, instance {{ $labels.instance }}, rank {{ $labels.rank }}, model {{ $labels.model }}: "
        + "; ".join(group.describe(a) for a in group.alerts)
        + ". The module, step and statistics are in the run's alert log: a hookpolicy: line on stderr per "
        "firing (a JSON record with HOOKPOLICY_LOG_FORMAT=json), and the file HOOKPOLICY_ALERT_LOG names."
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
            "summary": f"hookpolicy rule {{{{ $labels.rule }}}} of policy {go_literal(policy.name)} raised errors",
            "description": (
                f"A hook of rule {{{{ $labels.rule }}}} (policy {go_literal(policy.name)}, onError: "
                f"{policy.on_error}) raised within the last {ALERT_WINDOW} on job {{{{ $labels.job }}}}, "
                "instance {{ $labels.instance }}, rank {{ $labels.rank }}, model {{ $labels.model }}. The traceback is in the run's "
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
            "summary": f"hookpolicy policy {go_literal(policy.name)} reached spec.limits.{_limit_names(policy)}",
            "description": (
                f"Policy {go_literal(policy.name)} ({_limits(policy)}) dropped statistic series "
                "within the last 15m on job {{ $labels.job }}, instance {{ $labels.instance }}, rank "
                "{{ $labels.rank }}: narrow its match, use per: module or per: rule instead of per: tensor, "
                f"or raise spec.limits.{_limit_names(policy)} if Prometheus can take it."
            ),
            **_runbook(policy),
        },
    })
    return {"name": f"hookpolicy.{policy.name}", "rules": rules}


def _engine_group(stall_seconds: int) -> dict[str, Any]:
    return {"name": "hookpolicy.engine", "rules": [
        {
            "alert": "HookpolicyTrainingStalled",
            "expr": f"time() - hookpolicy_last_step_timestamp_seconds{{run=\"\"}} > {stall_seconds}",
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
            "expr": 'hookpolicy_config_last_reload_successful{run=""} == 0',
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
    sources = ", ".join(_one_line(p.source) for p in policies) or "no policy"
    header = (
        f"# Prometheus alerting rules generated by `hookpolicy export prometheus-rules` from {sources}.\n"
        "# Regenerate them when a policy changes; check with `promtool check rules FILE`.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100000, allow_unicode=True)


def _one_line(text: str) -> str:
    """`text` for a comment line: control characters (a file name may hold a newline) escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
