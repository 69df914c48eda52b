"""The run summary: what hookpolicy did in a run, in a few lines, read from the exported counters.

    run summary (rank 0): Sequential 200 steps
      nan-guard/nonfinite-grads: skipped 1 step, 1 critical alert
      loss-guard/spike: rewound 2 times, 2 warning alerts
      agc/agc: clipped 2691 units
      observe/grad-norms: wrote 1800 records to runs/observe.jsonl, exported 9 series, changed nothing (it only captures)
      outputs: metrics http://127.0.0.1:9400/metrics; log runs/observe.jsonl
      watch/acts: its capture goes nowhere (no log, tensorboard or tensors, and no --metrics-port)

A rule's line says what it changed, what it alerted, what it wrote where and how many
series it exported. Every change and alert is a sum of a counter a scrape shows
(`hookpolicy_steps_total`, `hookpolicy_skipped_steps_total`, ...) over the rule's series,
so the summary and Prometheus never disagree; records and series are the store's own
tallies of what it wrote and exported. "changed nothing" is said only where it is
known: of a rule that only captures (or whose alerts only log), or of one whose every
way to change the run is counted and counted nothing. `COUNTS` is the one list of the
counters a rule's line says: a new counter that a rule's line should show is one more
`Count` there (as `hookpolicy_rewinds_total`'s "rewound N times").

`hookpolicy apply` says it at the end of each governed process of rank 0 (at exit, on
SIGTERM, after a halt); the Python API returns it from `Attached.summary()`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from ..policy.model import Alert, Capture, Clip, Policy, Rule, Scale
from .metrics import ACTIONS, ALERTS, CLIPPED, HOOK_ERRORS, REWINDS, SKIPPED_STEPS, STEPS, Family, Labels
from .store import MetricsStore

__all__ = ["COUNTS", "Count", "summary_lines"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True)
class Count:
    """One counter as a rule's line says it: `family` summed over the rule's series.

    `words(n, value, rule)` is the phrase for a sum `n` > 0; with `by` (a label of the
    family), one phrase per value of that label (`value`), else `value` is "". With `where`,
    only the series whose labels it accepts are summed.
    """

    family: Family
    words: Callable[[int, str, Rule], str]
    by: Optional[str] = None
    #: only the series whose labels (without `model`'s absence: all of them) it accepts
    where: Optional[Callable[[Labels], bool]] = None


def _clipped(n: int, mode: str, rule: Rule) -> str:
    unitwise = any(isinstance(a, Clip) and a.unitwise_ratio is not None for a in rule.actions)
    what = _plural(n, "unit") if unitwise else _plural(n, "time")
    return f"would have clipped {what} (audit)" if mode == "audit" else f"clipped {what}"


#: What a rule's summary line says, in order. Only counts above 0 are said.
COUNTS: tuple[Count, ...] = (
    Count(SKIPPED_STEPS, lambda n, _, rule: f"skipped {_plural(n, 'step')}"),
    Count(REWINDS, lambda n, _, rule: f"rewound {_plural(n, 'time')}"),
    Count(CLIPPED, _clipped, by="mode"),
    Count(ACTIONS, lambda n, _, rule: f"scaled {_plural(n, 'time')}",
          where=lambda labels: labels[2:4] == ("scale", "enforce")),
    Count(ALERTS, lambda n, severity, rule: _plural(n, f"{severity} alert"), by="severity"),
    Count(HOOK_ERRORS, lambda n, _, rule: _plural(n, "error")),
)

_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def summary_lines(
    store: MetricsStore, policies: Sequence[Policy], *, metrics: Optional[str], root: Path,
    models: Optional[Sequence[str]] = None, heading: str = "run summary", no_metrics: str = "no --metrics-port",
) -> list[str]:
    """The summary of `policies` on `store`'s models (or only `models`), one string a line.

    `metrics` says where the metrics go (a URL, "the registry given to attach"); None when
    nothing serves them, and then a capture that writes no file computes into nowhere,
    which its own line says, with `no_metrics` for why (a port given that could not be
    bound is not "no --metrics-port"). `root` is the folder the policies' paths are relative to.
    """
    engine, _ = store.snapshot()
    def mine(model: str) -> bool:
        return models is None or model in models

    steps = {labels[-1]: int(v) for labels, v in engine.get(STEPS.name, {}).items() if mine(labels[-1])}
    lines = [f"{heading} (rank {store.rank}): "
             + (", ".join(f"{model} {_plural(n, 'step')}" for model, n in steps.items()) or "no model governed")]
    rules = [(policy, rule) for policy in policies for rule in policy.rules]
    written = store.records_written()
    stored = store.series_stored()
    for policy, rule in rules:
        said = _rule_counts(engine, policy.name, rule, mine)
        changed = any(phrase.startswith(("skipped ", "rewound ", "clipped ", "scaled ")) for phrase in said)
        alerted = any(key[:2] == (policy.name, rule.name) and mine(key[-1]) and n > 0
                      for key, n in engine.get(ALERTS.name, {}).items())
        said += [f"wrote {_plural(n, 'record')} to {'stderr' if not path else root / path}"
                 for path, n in _sum_by_path(written, policy.name, rule.name, mine).items() if n]
        series = sum(n for (p, r, model), n in stored.items() if (p, r) == (policy.name, rule.name) and mine(model))
        if series and metrics is not None:
            said.append(f"exported {series} series")
        off = {why for (p, r, model), why in store.switched_off().items() if (p, r) == (policy.name, rule.name)
               and mine(model)}
        said += [f"switched off {why}" for why in sorted(off)]
        said += _changed_nothing(rule, changed, alerted)
        lines.append(f"  {policy.name}/{rule.name}: {', '.join(said) or 'nothing counted'}")
    outputs = [f"metrics {metrics}"] if metrics is not None else []
    for kind, path in _files(policies, root):
        if f"{kind} {path}" not in outputs:
            outputs.append(f"{kind} {path}")
    lines.append(f"  outputs: {'; '.join(outputs) or 'no metrics endpoint, no file'}")
    if metrics is None:
        for policy, rule in rules:
            if any(isinstance(a, Capture) and a.log is None and a.tensorboard is None and a.tensors is None
                   and a.keep is None for a in rule.actions):
                lines.append(f"  {policy.name}/{rule.name}: its capture goes nowhere "
                             f"(no log, tensorboard or tensors, and {no_metrics})")
    return lines


def _sum_by_path(written: Mapping[Labels, Mapping[str, int]], policy: str, rule: str,
                 mine: Callable[[str], bool]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for (p, r, model), paths in written.items():
        if (p, r) == (policy, rule) and mine(model):
            for path, n in paths.items():
                out[path] += n
    return out


def _changed_nothing(rule: Rule, changed: bool, alerted: bool) -> list[str]:
    """"changed nothing", where that is known: of a rule that only captures or whose alerts only log, or of
    one that counted no skip, rewind, clip or scale and whose alerts never fired (a cool-down or a halt
    follows an alert)."""
    alerts = [a for a in rule.actions if isinstance(a, Alert)]
    if all(isinstance(a, Capture) or (isinstance(a, Alert) and a.then == "log") for a in rule.actions):
        return ["changed nothing (it only captures)" if not alerts else "changed nothing (its alerts only log)"]
    if changed or alerted:
        return []
    return [("no alert fired, " if alerts else "") + "changed nothing"]


def _rule_counts(
    engine: Mapping[str, Mapping[Labels, float]], policy: str, rule: Rule, mine: Callable[[str], bool],
) -> list[str]:
    said = []
    for count in COUNTS:
        by = None if count.by is None else count.family.labels.index(count.by)
        sums: dict[str, float] = defaultdict(float)
        for labels, counted in engine.get(count.family.name, {}).items():
            if labels[:2] == (policy, rule.name) and mine(labels[-1]) and (count.where is None or count.where(labels)):
                sums["" if by is None else labels[by]] += counted
        for value, n in sorted(sums.items(), key=lambda kv: (_SEVERITY_ORDER.get(kv[0], 9), kv[0])):
            if int(n) > 0:
                said.append(count.words(int(n), value, rule))
    return said


def _files(policies: Sequence[Policy], root: Path) -> list[tuple[str, str]]:
    """(kind, path) of every file output of the policies' captures, as the user would look for it."""
    out = []
    for policy in policies:
        for rule in policy.rules:
            for action in rule.actions:
                if not isinstance(action, Capture):
                    continue
                if action.log is not None:
                    out.append(("log", str(root / action.log.path) if action.log.path else "stderr"))
                if action.tensorboard is not None:
                    out.append(("TensorBoard", str(root / action.tensorboard.dir)))
                if action.tensors is not None:
                    out.append(("tensors", str(root / action.tensors.dir)))
                if action.keep is not None and action.keep.dump is not None:
                    out.append(("dumps", str(root / action.keep.dump.dir)))
    return out
