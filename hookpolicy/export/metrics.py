"""The metric families hookpolicy publishes: the engine's typed `Family` constants and the statistic families.

The engine's families are typed: each is a `Family` constant below (`STEPS`,
`HOOK_ERRORS`, ...), the store refuses any other family or a wrong number of labels
(`checked_name`: a `ValueError`, so a typo cannot silently never be exported), and the
collector's `describe()` names them, so `registry.restricted_registry([...])` finds them and
a user metric with a clashing name fails when it is registered. The statistic families
(`hookpolicy_<target>_<stat>`) are made by `stat_family` from the policy language's
targets and statistics; any other name is refused too.

The values live in a `store.MetricsStore` (with the `maxSeries`/`maxJobSeries` budgets),
which `collector.StoreCollector` turns into metric families at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policy.model import STATS, TARGETS

__all__ = [
    "ACTIONS", "AGREEMENT_WAIT", "ALERTS", "ALERT_FIRING", "CLIPPED", "FAMILIES", "Family", "HOOK_ERRORS", "HOOK_SECONDS",
    "LAST_STEP_TIMESTAMP", "POLICY_INFO", "RELOAD_SUCCESSFUL", "REWINDS", "RUN_INFO", "SERIES_DROPPED", "SKIPPED_STEPS",
    "STAT_FAMILIES", "STAT_LABELS", "STEPS", "Labels", "MODEL_FAMILIES", "checked_name", "split_family", "stat_family",
]

Labels = tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """One engine metric family: name (without `_total` for counters), type, help, labels besides `rank`."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    labels: Labels = ()


# Each help text says what one unit of the family is; tests/test_stacks.py pins them.
STEPS = Family(
    "hookpolicy_steps", "counter", "Optimizer steps of the model evaluated by hookpolicy: one per optimizer step() "
    "(several optimizers after one backward pass, or the micro-batches of one step, make one).", ("model",),
)
LAST_STEP_TIMESTAMP = Family(
    "hookpolicy_last_step_timestamp_seconds", "gauge",
    "Unix time in seconds of the last step of the model hookpolicy evaluated.", ("model",),
)
ACTIONS = Family(
    "hookpolicy_actions", "counter", "Actions run: one per step and binding (a rule on one module) on which the action "
    "ran, however many calls or micro-batches the step had; audit actions change nothing.",
    ("policy", "rule", "action", "mode", "model"),
)
ALERTS = Family(
    "hookpolicy_alerts", "counter", "Alert firings: one per evaluation (once a step) and group of the alert's per "
    "(rule, module or tensor) on which it fired.", ("policy", "rule", "severity", "model"),
)
ALERT_FIRING = Family(
    "hookpolicy_alert_firing", "gauge", "1 while an alert's condition holds (after its for: count), else 0.",
    ("policy", "rule", "severity", "model"),
)
SKIPPED_STEPS = Family(
    "hookpolicy_skipped_steps", "counter", "Optimizer steps skipped by a rule's alert: one per skipped step, however "
    "many modules fired.", ("policy", "rule", "model"),
)
REWINDS = Family(
    "hookpolicy_rewinds", "counter", "Rewinds to an in-memory snapshot by a rule's then: rewind alert: one per rewind "
    "(the steps since the snapshot are dropped).", ("policy", "rule", "model"),
)
CLIPPED = Family(
    "hookpolicy_clipped", "counter", "Groups (per: tensor, module or rule) a norm clip scaled down, or units a unit-wise "
    "clip did: one per group or unit and clip execution (a call of the hooked module, or a step for trigger.at: "
    "step); in audit mode the ones it would have clipped, nothing changed.", ("policy", "rule", "module", "mode", "model"),
)
HOOK_ERRORS = Family(
    "hookpolicy_hook_errors", "counter", "Errors raised inside hookpolicy's hooks: one per error.", ("policy", "rule", "model"),
)
HOOK_SECONDS = Family(
    "hookpolicy_hook_seconds", "counter", "Seconds spent inside hookpolicy's hooks and read-back.", ("policy", "rule", "model"),
)
POLICY_INFO = Family(
    "hookpolicy_policy_info", "gauge", "The applied policies: revision is the file's content hash.",
    ("policy", "revision", "mode"),
)
RELOAD_SUCCESSFUL = Family(
    "hookpolicy_config_last_reload_successful", "gauge", "1 if the last policy (re)load succeeded, else 0.",
)
SERIES_DROPPED = Family(
    "hookpolicy_series_dropped", "counter",
    "Statistic series not exported because spec.limits.maxSeries or maxJobSeries was reached: one per series.", ("policy",),
)
AGREEMENT_WAIT = Family(
    "hookpolicy_agreement_wait_seconds", "counter", "Seconds this rank waited in the step's agreement, hookpolicy's one "
    "collective a step in a process group, from entering it to its result: the ranks that arrive first wait for the "
    "last, so a straggler waits least and its peers about its delay.", ("model",),
)
RUN_INFO = Family(
    "hookpolicy_run_info", "gauge", "1, labelled with this run's identity (HOOKPOLICY_RUN_ID): a retry is a new run, "
    "which the alerting rules join to tell its counters from the previous attempt's.", ("run",),
)

#: Every engine family, in exposition order.
FAMILIES: tuple[Family, ...] = (
    STEPS, LAST_STEP_TIMESTAMP, ACTIONS, ALERTS, ALERT_FIRING, SKIPPED_STEPS, REWINDS, CLIPPED, HOOK_ERRORS,
    HOOK_SECONDS, AGREEMENT_WAIT,
    POLICY_INFO, RELOAD_SUCCESSFUL, SERIES_DROPPED, RUN_INFO,
)
_BY_NAME = {f.name: f for f in FAMILIES}

STAT_LABELS: Labels = ("policy", "rule", "module", "tensor", "model")

#: The engine families whose series belong to one governed model (their last label is `model`).
MODEL_FAMILIES = frozenset(f for f in FAMILIES if f.labels[-1:] == ("model",))


def stat_family(target: str, stat: str) -> str:
    """`hookpolicy_<target>_<stat>`, e.g. `hookpolicy_grad_l2_norm`."""
    return f"hookpolicy_{target}_{stat}"


#: Every statistic family name the policy language can produce.
STAT_FAMILIES = frozenset(stat_family(t, s) for t in TARGETS for s in STATS)


def split_family(name: str) -> tuple[str, str]:
    """(target, statistic) of a statistic family name: the inverse of `stat_family`."""
    rest = name[len("hookpolicy_"):]
    for target in sorted(TARGETS, key=len, reverse=True):
        if rest.startswith(target + "_") and rest[len(target) + 1:] in STATS:
            return target, rest[len(target) + 1:]
    raise ValueError(f"{name!r} is not a statistic family (hookpolicy_<target>_<stat>)")


def checked_name(family: Family, labels: Labels) -> str:
    """`family`'s name, after refusing an unknown family or a wrong number of labels."""
    if _BY_NAME.get(getattr(family, "name", None)) is not family:  # type: ignore[arg-type]
        raise ValueError(f"unknown metric family {family!r}; the engine's are {', '.join(_BY_NAME)}")
    if len(labels) != len(family.labels):
        raise ValueError(f"{family.name} takes labels {family.labels}, got {labels!r}")
    return family.name
