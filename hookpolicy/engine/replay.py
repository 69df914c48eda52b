"""`hookpolicy replay`: a policy's alerts and decisions evaluated offline over a recorded capture log.

What the live step does with a step's statistics, done again from the values a capture log
holds (`export/report.py` reads it): the same `Alerts` (warm-ups, history functions through
`History`, `for:` streaks), the same `fire` (an alert's record and its `then` in the step's
`StepReport`), the same `Healing.choose` and `Healing.decided` (which heal takes the step,
a rewind's `max_rewinds` and its halt, a rung that cannot act climbing), the same `settled`
records and the same history commit (a skipped step never enters the history); after a
rewind every `for:` count starts again, as live. Nothing here evaluates an expression or
keeps a series by itself.

What replay cannot know, and says (`Replayed.notes`):
- a decision changes the run: after a replayed skip, rewind or cool-down, the log's later
  values came from a run that did not take it (unless the log's own alert records show that
  its run skipped exactly those steps);
- a snapshot exists only as a schedule (`_Schedule`: one after every `snapshots.every`
  steps, `keep` kept): replay assumes that one optimizer steps the model and that every
  snapshot fits `maxSnapshotBytes`;
- which modules a rule selects: a log holds names, not types or parameters;
- values the log does not hold: each series a rule reads and the log lacks is named, never
  guessed, and an alert without its series is not evaluated at all.

One rank is replayed (`rank`, the lowest in the log by default): a live run also decides on
the other ranks' alerts.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from ..export.report import Records, ReportError, read_runs
from ..export.store import MetricsStore, ModelMetrics
from ..policy.model import AFTER_UPDATE, LOSS, Alert, Clip, Policy, Rule, RuleKey, Scale, rule_name
from ..policy.patterns import compile_glob
from .decide.alerts import Alerts, StepReport, bounded_skips, fire, settled
from .execute.executor import woken
from .heal.healing import Healing
from .heal.snapshots import Snapshot, Snapshots, config
from .measure.actions import compile_rule
from .measure.history import History
from .measure.rulestate import RuleState

__all__ = ["ReplayError", "Replayed", "RuleOutcome", "replay"]

log = logging.getLogger("hookpolicy")


class ReplayError(Exception):
    """A replay cannot be made: no usable log, no such run or rank."""


#: per (module, tensor): its statistics at one step
Groups = dict[tuple[str, str], dict[str, float]]


@dataclass(frozen=True)
class LogRule:
    """What the log holds of one recording rule on one rank: its target, its groups' shape, its statistics."""

    key: RuleKey
    target: str
    per: str
    stats: frozenset[str]


@dataclass
class Source:
    """Where one alert of a replayed rule reads its values: a recording rule's groups, by step."""

    rule: LogRule
    steps: dict[int, Groups]


@dataclass
class RuleOutcome:
    """What one replayed rule did, step by step."""

    key: RuleKey
    #: per action index of an alert it evaluates: where it read from
    sources: dict[int, LogRule] = field(default_factory=dict)
    #: per action index: the steps at which it fired (once per step, however many groups fired)
    fired: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    #: per action index: how many times it fired (once per group and step)
    counts: Counter[int] = field(default_factory=Counter)
    skipped: list[int] = field(default_factory=list)
    rewound: list[int] = field(default_factory=list)
    cooled: list[int] = field(default_factory=list)
    halted: Optional[int] = None


@dataclass
class Replayed:
    """A replay's result: per rule its decisions, every alert record it would have written, what it could not know."""

    policies: tuple[Policy, ...]
    records: Records
    rank: int
    audit: bool
    rules: dict[RuleKey, RuleOutcome]
    #: the alert records the policies would have written (as a live run's `FILE.alerts.jsonl` holds them)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    #: the steps replayed (the log's steps a replayed rule had values at, up to a halt)
    steps: list[int] = field(default_factory=list)
    #: one line per series a rule reads that the log lacks, per rule
    missing: dict[RuleKey, list[str]] = field(default_factory=lambda: defaultdict(list))
    #: what replay cannot know about this replay, one line each
    notes: list[str] = field(default_factory=list)
    #: the step and message of the halt that ended the replay
    halt: Optional[tuple[int, str]] = None
    #: steps of the log after the halt, not replayed
    after_halt: int = 0

    @property
    def unevaluated(self) -> list[RuleKey]:
        """The rules with alerts of which none could be evaluated."""
        return [key for key, out in self.rules.items() if not out.sources and self.missing.get(key)]


def replay(policies: Sequence[Policy], logs: Sequence[str], run: Optional[str] = None, rank: Optional[int] = None,
           audit: bool = False) -> Replayed:
    """Evaluate the alerts of `policies` over the logs' run `run` (default: the last) on `rank` (default: the
    lowest), as enforced (`audit` False: the rules' own modes) or as in audit mode."""
    if not any(isinstance(a, Alert) for p in policies for r in p.rules for a in r.actions):
        raise ReplayError(f"{', '.join(p.name for p in policies)}: no rule has an alert; replay evaluates alerts and "
                          "the decisions they take (captures, clips and scales are not replayed)")
    try:
        runs = read_runs(logs)
        records = runs.pick([run] if run else [])[0]
    except ReportError as exc:
        raise ReplayError(str(exc)) from None
    ranks = sorted({key[6] for key in records.series})
    if not ranks:
        raise ReplayError(f"no captured statistic in {', '.join(str(f) for f in records.files)} (only alert records): "
                          "replay reads the values a capture's `log:` writes")
    chosen = ranks[0] if rank is None else rank
    if chosen not in ranks:
        raise ReplayError(f"no records of rank {chosen} in the logs (ranks: {', '.join(map(str, ranks))})")
    out = Replayed(tuple(policies), records, chosen, audit, {})
    others = [r or "(no run id)" for r in runs.runs if r != records.run]
    if others:
        out.notes.append(f"the logs hold {len(others)} other run(s), not replayed (--run ID): {', '.join(others)}")
    if len(ranks) > 1:
        out.notes.append(f"the logs hold ranks {', '.join(map(str, ranks))}; rank {chosen}'s values are replayed "
                         "(--rank N for another): a live run also skips or halts on another rank's alert")
    held = _log_rules(records, chosen)
    states: list[tuple[RuleState, dict[int, Source]]] = []
    ordered = sorted(((p, r) for p in policies for r in p.rules), key=lambda pr: (pr[1].priority,
                                                                                  policies.index(pr[0]), pr[1].index))
    for policy, rule in ordered:
        alerts = [(i, a) for i, a in enumerate(rule.actions) if isinstance(a, Alert)]
        if not alerts:
            continue
        if any(isinstance(a, (Clip, Scale)) for a in rule.actions):
            out.notes.append(f"{policy.name}/{rule.name}: its clips and scales are not replayed (a log holds "
                             "the statistics, not the gradients they would change)")
        rs = RuleState(policy, rule, compile_rule(rule), "audit" if audit else rule.mode)
        outcome = out.rules[rs.key] = RuleOutcome(rs.key)
        sources: dict[int, Source] = {}
        for index, action in alerts:
            found = _source(rs.key, rule, action, held, out.missing[rs.key], index)
            if found is not None:
                sources[index] = Source(found, _values(records, found, chosen, rule))
                outcome.sources[index] = found
        if rule.trigger.at != "step" or rule.trigger.phase == "eval":
            out.notes.append(f"{rule_name(rs.key)} runs at {rule.trigger.at} ({rule.trigger.phase}): replay takes the "
                             "log's one value per step for it (an evaluation forward's values, if any, are not told apart)")
        _say_selection(rule, sources, out.notes, rs.key)
        after = rule.trigger.after
        if after is not None and not any((p.name, r.name) == after.rule for p in policies for r in p.rules):
            out.notes.append(f"{rule_name(rs.key)} wakes on alerts of {rule_name(after.rule)}, which is not among the "
                             "policies replayed: it stays asleep (name that policy too)")
        if sources:
            states.append((rs, sources))
    _say_gaps(out, states)
    _run(out, states, records, chosen)
    return out


def _say_gaps(out: Replayed, states: list[tuple[RuleState, dict[int, "Source"]]]) -> None:
    """Per alert, the steps of the log's span its rule is active on and its source has no value at, said:
    live, its history and `for:` counted those steps."""
    logged = sorted({s for _, sources in states for source in sources.values() for s in source.steps})
    if not logged:
        return
    for rs, sources in states:
        if rs.rule.trigger.after is not None:  # asleep but on its windows: a gap there is said by its waker's alerts
            continue
        active = [s for s in range(logged[0], logged[-1] + 1) if rs.rule.trigger.active_at(s)]
        for index, source in sources.items():
            gaps = [s for s in active if s not in source.steps]
            if gaps:
                out.notes.append(
                    f"{rule_name(rs.key)}: action {index} reads {rule_name(source.rule.key)}, which has no value at "
                    f"{len(gaps)} of the {len(active)} steps {logged[0]}-{logged[-1]} the rule is active on (e.g. "
                    f"{_steps(gaps[:5])}): replayed, its history and for: count only the logged steps, live they "
                    "counted them all")


def _log_rules(records: Records, rank: int) -> dict[tuple[RuleKey, str], LogRule]:
    """Every recording rule of the log on `rank`, per (rule, target): its groups' shape and statistics."""
    groups: dict[tuple[RuleKey, str], tuple[set[str], set[str], set[str]]] = {}
    for (policy, rule, target, stat, module, tensor, rank_) in records.series:
        if rank_ != rank:
            continue
        modules, tensors, stats = groups.setdefault(((policy, rule), target), (set(), set(), set()))
        modules.add(module)
        tensors.add(tensor)
        stats.add(stat)
    out = {}
    for (key, target), (modules, tensors, stats) in groups.items():
        per = "rule" if target == LOSS or (modules == {""} and tensors == {""}) else (
            "tensor" if "" not in tensors else "module")
        out[(key, target)] = LogRule(key, target, per, frozenset(stats))
    return out


def _source(key: RuleKey, rule: Rule, action: Alert, held: dict[tuple[RuleKey, str], LogRule], missing: list[str],
            index: int) -> Optional[LogRule]:
    """The recording rule an alert reads: the replayed rule's own records first, else the first that holds every
    statistic its condition reads, of its target and per. What the log lacks goes to `missing`, one line each."""
    needs = sorted(action.condition.stats)
    shaped = [lr for lr in held.values() if lr.target == rule.target and (rule.target == LOSS or lr.per == action.per)]
    complete = [lr for lr in shaped if set(needs) <= lr.stats]
    ranked = [lr for lr in complete if lr.key == key] + [lr for lr in complete if lr.key[1] == rule.name] + complete
    if ranked:
        return ranked[0]
    what = f"action {index} (if: {action.source})"
    per = "" if rule.target == LOSS else f" per {action.per}"
    if shaped:
        for stat in needs:
            if not any(stat in lr.stats for lr in shaped):
                missing.append(f"{what} reads {stat} of the {rule.target}{per}: the log has none "
                               f"(its {rule.target} records{per} hold {_stats_of(shaped)})")
        if not any(s for s in needs if not any(s in lr.stats for lr in shaped)):
            missing.append(f"{what} reads {', '.join(needs)} of the {rule.target}{per}: no rule of the log records "
                           f"them all ({_stats_of(shaped)})")
        return None
    other = [lr for lr in held.values() if lr.target == rule.target]
    if other:
        missing.append(f"{what} reads {', '.join(needs)} of the {rule.target}{per}: the log has the {rule.target} "
                       f"only per {', '.join(sorted({lr.per for lr in other}))} "
                       f"({', '.join(rule_name(lr.key) for lr in other)}); replay does not combine groups")
    else:
        missing.append(f"{what} reads {', '.join(needs)} of the {rule.target}{per}: the log has no {rule.target} "
                       "series at all")
    return None


def _stats_of(rules: Sequence[LogRule]) -> str:
    return "; ".join(f"{rule_name(lr.key)}: {', '.join(sorted(lr.stats))}" for lr in rules)


def _values(records: Records, source: LogRule, rank: int, rule: Rule) -> dict[int, Groups]:
    """The source's groups by step, the replayed rule's `match.modules`/`exclude` applied to module names."""
    take = _names(rule)
    steps: dict[int, Groups] = defaultdict(dict)
    for (policy, name, target, stat, module, tensor, rank_), points in records.series.items():
        if (policy, name) != source.key or target != source.target or rank_ != rank or not take(module):
            continue
        for step, value in points.items():
            steps[step].setdefault((module, tensor), {})[stat] = value
    return steps


def _names(rule: Rule) -> Any:
    """Whether a module name is one the rule's name patterns select (every name for a rule without any)."""
    if rule.target == LOSS or not (rule.match.modules or rule.match.exclude):
        return lambda name: True
    take = [compile_glob(p) for p in rule.match.modules]
    drop = [compile_glob(p) for p in rule.match.exclude]

    def selects(name: str) -> bool:
        chosen = (rule.match.root and name == "") or any(p.fullmatch(name) for p in take)
        return bool(chosen) and not any(p.fullmatch(name) for p in drop)
    return selects


def _say_selection(rule: Rule, sources: dict[int, Source], notes: list[str], key: RuleKey) -> None:
    """What replay cannot check of the modules a rule selects, said once per rule."""
    read = sorted({rule_name(s.rule.key) for s in sources.values() if s.rule.key != key})
    if read and rule.target != LOSS:  # a loss is the step's, whichever rule logged it
        notes.append(f"{rule_name(key)} reads the records of {', '.join(read)}: replay cannot check that they are of "
                     "the modules it selects")
    match = rule.match
    if rule.target != LOSS and (match.types or match.params or match.adapters or match.state):
        notes.append(f"{rule_name(key)} selects by type, parameter, adapter or state key too: a log holds module "
                     "names only, so replay reads every module of the log its name patterns take")


class _Schedule(Snapshots):
    """Snapshots as a schedule only: after every `every` steps one more (at most `keep`), no copy taken.

    Assumes one optimizer steps the model and every snapshot fits `maxSnapshotBytes` (said in the notes).
    """

    def take_if_due(self, step: int) -> None:
        if (step + 1) % self.every:
            return
        self.kept = (self.kept[-(self.keep - 1):] if self.keep > 1 else []) + [Snapshot(step + 1, [], [])]

    def changed(self, step: int) -> list[str]:
        return []

    def restore(self, step: int) -> tuple[int, list[str]]:
        self.kept = [s for s in self.kept if s.step <= step]
        return step, []


def _schedule(model: torch.nn.Module, policies: Sequence[Policy], name: str) -> Optional[Snapshots]:
    wanted = config(policies)
    return None if wanted is None else _Schedule(model, wanted[0], wanted[1], name)


class _Quiet(logging.Filter):
    """The live healing's lines ("learning rate x0.1 from step ...") describe a run; a replay prints its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _run(out: Replayed, states: list[tuple[RuleState, dict[int, Source]]], records: Records, rank: int) -> None:
    """The steps, as the live cycle takes them: evaluate, decide, heal, settle, commit; a halt ends them."""
    history = History(budgets={p.name: p.max_history_values for p in out.policies})
    alerts = Alerts(history)
    model = records.model or "model"
    quiet = _Quiet()
    log.addFilter(quiet)
    try:
        healing = Healing(torch.nn.Module(), out.policies, ModelMetrics(MetricsStore(rank), model),
                          snapshots=_schedule)
        if healing.snapshots is not None and not out.audit:
            out.notes.append("a rewind goes back to a snapshot replay only schedules (spec.snapshots): it assumes "
                             "one optimizer steps the model and every snapshot fits spec.limits.maxSnapshotBytes")
        steps = sorted({s for _, sources in states for source in sources.values() for s in source.steps})
        changed: Optional[tuple[int, str]] = None
        awake: dict[RuleKey, tuple[int, int]] = {}  # rules with trigger.after: the steps [first, end) they are awake on
        for n, step in enumerate(steps):
            report = StepReport()
            for rs, sources in states:
                if not rs.rule.trigger.active_at(step) or not _awake(rs, awake, step):
                    continue
                base_rule = {"run": records.run, "time": None, "step": step, "rank": rank, "model": model,
                             "policy": rs.policy.name, "rule": rs.rule.name}
                for index, source in sources.items():
                    action = rs.rule.actions[index]
                    assert isinstance(action, Alert)
                    for (module, tensor), values in source.steps.get(step, {}).items():
                        stats = {s: values.get(s, float("nan")) for s in sorted(set(values) | action.stats)}
                        fired, past = alerts.judge(rs, index, action, module, tensor, stats, report.observed)
                        if fired:
                            base = {**base_rule, "module": module, "target": rs.rule.target, "tensor": tensor}
                            held = (rs.enforce and action.then == "skip_step"
                                    and alerts.holds_back(rs, index, action))
                            fire(report, rs, index, action, base, stats, past, final=False, held=held)
                            outcome = out.rules[rs.key]
                            outcome.counts[index] += 1
                            if not outcome.fired[index] or outcome.fired[index][-1] != step:
                                outcome.fired[index].append(step)
            waking = {p.rule.key for p in report.pending}  # every alert that fired, any mode: rules wake on them
            report.fired = frozenset(p.key for p in report.pending)
            report.bounded = alerts.bounded(report.fired, {rs.key: rs for rs, _ in states})
            for rs, _ in states:
                after = rs.rule.trigger.after
                if after is not None and after.rule in waking:
                    awake[rs.key] = woken(awake.get(rs.key, (0, 0)), step, after.steps)
            report.heal = healing.choose(report.heals)
            healed = healing.decided(report, step, True)
            bounded_skips(alerts, report, healed)
            written = [settled(p, report, healed, True) for p in report.pending]
            out.alerts += written
            for record in written:
                key = (record["policy"], record["rule"])
                if record["outcome"] == "rewinding":
                    out.rules[key].rewound.append(step)
                elif record["outcome"] == "cooling down":
                    out.rules[key].cooled.append(step)
            for key in report.skip_by:
                out.rules[key].skipped.append(step)
            if changed is None and (report.skip or report.heal):
                changed = (step, "skipped" if report.skip else "cooled down")
            history.commit([o for o in report.observed if not report.skip or _updated(o.key[0], states)])
            out.steps.append(step)
            if report.halt is not None:
                out.halt = (step, report.halt.message)
                out.rules[(report.halt.policy, report.halt.rule)].halted = step
                out.after_halt = len(steps) - n - 1
                break
            if healing.step_ended(step):
                alerts.restart()
    finally:
        log.removeFilter(quiet)
    if changed is not None:
        out.notes.append(_after_change(out, records, rank, *changed))


def _awake(rs: RuleState, awake: dict[RuleKey, tuple[int, int]], step: int) -> bool:
    """Whether `rs` is awake at `step`: always, without `trigger.after`; else in the window its alert opened."""
    if rs.rule.trigger.after is None:
        return True
    first, end = awake.get(rs.key, (0, 0))
    return first <= step < end


def _updated(key: RuleKey, states: list[tuple[RuleState, dict[int, Source]]]) -> bool:
    """Whether rule `key` measures an update already applied (`AFTER_UPDATE`): a skip does not keep it out."""
    return any(rs.key == key and rs.rule.target in AFTER_UPDATE for rs, _ in states)


def _after_change(out: Replayed, records: Records, rank: int, step: int, what: str) -> str:
    """What replay cannot know once a decision changed the run at `step`."""
    skipped = sorted({s for o in out.rules.values() for s in o.skipped})
    healed = any(o.rewound or o.cooled for o in out.rules.values())
    if records.alerts_known and not healed and skipped == sorted(records.skipped.get(rank, set())):
        return (f"the log's own run skipped the same steps ({_steps(skipped)}): its later values are those of a run "
                "that skipped them, so the decisions after them are what a run under this policy met")
    return (f"from step {step} on the log's values came from a run that was not {what} there (nor at the later "
            "steps this replay decides): a run under this policy would have seen other values; the decisions after "
            f"step {step} are what the policy makes of the recorded ones, not what that run would have done")


def _steps(steps: Sequence[int]) -> str:
    """`3, 7-9, 12`: steps as ranges."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _ranges(steps))


def _ranges(steps: Sequence[int]) -> Iterator[tuple[int, int]]:
    run: Optional[list[int]] = None
    for s in sorted(set(steps)):
        if run is not None and s == run[1] + 1:
            run[1] = s
            continue
        if run is not None:
            yield run[0], run[1]
        run = [s, s]
    if run is not None:
        yield run[0], run[1]


def summary(out: Replayed) -> list[str]:
    """The replay in lines: per rule what it read, its decisions, how often each alert fired; then the notes."""
    files = ", ".join(str(Path(f)) for f in out.records.files)
    span = f"steps {out.steps[0]}-{out.steps[-1]}" if out.steps else "no step"
    how = "as in audit mode (every step enters the history; nothing is decided)" if out.audit else "as enforced"
    lines = [f"replay of {', '.join(p.name for p in out.policies)} over {files}: run "
             f"{out.records.run or '(no run id)'}, rank {out.rank}, {span}, {how}"]
    for key, rule in out.rules.items():
        lines.append(f"{rule_name(key)}:")
        for line in out.missing.get(key, []):
            lines.append(f"  not evaluated: {line}")
        if not rule.sources:
            continue
        read = sorted({(rule_name(lr.key), lr.target, lr.per) for lr in rule.sources.values()})
        lines.append("  reads " + "; ".join(f"{name} ({target}{'' if target == LOSS else ' per ' + per})"
                                           for name, target, per in read))
        if not out.audit:
            for word, steps in (("skipped", rule.skipped), ("rewound", rule.rewound), ("cooled down", rule.cooled)):
                lines.append(f"  {word}: {len(steps)} step{'s' if len(steps) != 1 else ''}"
                             + (f" ({_steps(steps)})" if steps else ""))
            lines.append(f"  halted: at step {rule.halted}" if rule.halted is not None else "  halted: no")
        policy = next(p for p in out.policies if p.name == key[0])
        actions = next(r for r in policy.rules if r.name == key[1]).actions
        for index in rule.sources:
            action = actions[index]
            assert isinstance(action, Alert)
            steps = rule.fired.get(index, [])
            verb = f"then {action.then}" + (" (audit: not taken)" if out.audit and action.then != "log" else "")
            lines.append(f"  action {index} (if: {action.source}; {verb}): fired {rule.counts[index]} time"
                         f"{'s' if rule.counts[index] != 1 else ''}" + (f" at steps {_steps(steps)}" if steps else ""))
    if out.halt is not None:
        lines.append(f"halted at step {out.halt[0]}: {out.halt[1]}"
                     + (f" ({out.after_halt} later step(s) of the log not replayed)" if out.after_halt else ""))
    lines += [f"note: {note}" for note in out.notes]
    return lines
