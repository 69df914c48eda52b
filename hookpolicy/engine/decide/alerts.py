"""Alert evaluation and message rendering: `for:` streaks, warm-ups over a history, messages.

`Alerts.evaluate` says whether an alert fires (its condition held `for:` evaluations in a
row, after its warm-up), `Alerts.observe` hands what an alert with history functions saw
to the step's report; `render` writes its message, never claiming an effect (a skip, a
halt) that did not happen. What an alert's `then` did is known only once the step is decided
(the ranks agreed on its skip or halt, the step chose among the healing alerts that fired:
`healing`, a rewind wins over a cool-down): its record waits as a `Pending` until then.

**The decision a read-back returns** (`StepReport`): skip the step, halt, or go on; and
what the cycle still has to act on.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional, Union

from ...errors import Halt
from ...policy.expr import NO_PAST, Past, Template
from ...policy.model import HEALS, Alert, AlertKey, RuleKey
from ..measure.history import History, Observation, Tracked
from ..execute.ledger import Entry
from ..measure.rulestate import MAX_ERRORS, RuleState

__all__ = ["ACTED", "Alerts", "bounded_skips", "MAX_RENDERED_CHARS", "Pending", "SinkHalts", "StepReport", "alert_line", "fire", "json_number",
           "not_taken", "outcome", "render", "settled"]


class Alerts:
    """The alerts of one attachment: their streaks, and their histories in `history`."""

    def __init__(self, history: History) -> None:
        self.history = history
        self._streaks: dict[tuple[Any, ...], int] = {}
        #: per alert with `skip_step: {max_in_a_row: N}`: the steps in a row it fired at (any group; in a process
        #: group, on any rank) that were skipped, counted from the step's decision alone (`skipped`), so the
        #: same on every rank
        self._skipped: dict[AlertKey, int] = {}

    def observe(
        self, rs: RuleState, index: int, action: Alert, module: str, tensor: str, stats: dict[str, float],
        observed: list[Observation],
    ) -> Optional[Tracked]:
        """The history of an alert that keeps one (None for one that does not); its values go to `observed`
        (the step's `StepReport.observed`, committed once the step is decided)."""
        if not action.remembers:
            return None
        tracked = self.history.tracking(rs.key, index, action.stats, action.calls, action.warmup)
        observed.append(tracked.observe(module, tensor, stats))
        return tracked

    def judge(
        self, rs: RuleState, index: int, action: Alert, module: str, tensor: str, stats: dict[str, float],
        observed: list[Observation],
    ) -> tuple[bool, Past]:
        """One group of an alert at one step: whether it fires (`evaluate`), and the past its message reads.

        What it saw goes to `observed` (`observe`). The one evaluation of an alert: a live
        read-back and `hookpolicy replay` both call it.
        """
        tracked = self.observe(rs, index, action, module, tensor, stats, observed)
        fired = self.evaluate(rs, index, action, module, tensor, stats, tracked)
        return fired, NO_PAST if tracked is None else tracked.past(module, tensor)

    def restart(self) -> None:
        """Every `for:` streak from 0: after a rewind, the steps that made them were dropped."""
        self._streaks.clear()
        self._skipped.clear()

    def holds_back(self, rs: RuleState, index: int, action: Alert) -> bool:
        """Whether a firing `skip_step` alert leaves its step applied: it skipped `max_in_a_row` steps in a row.

        Over those steps the weights did not change and the condition held each time, so the
        weights (the update before the first skip), not the batches, made it: skipping again
        cannot undo that, an update can. The count starts again from the applied step, so the
        alert never skips more than N steps in a row. The count is the alert's (whichever group
        fired), kept from the steps' decisions (`skipped`): in a process group it is the same on
        every rank, so every rank where the alert fires holds back alike.
        """
        bound = action.max_in_a_row
        return bound is not None and self._skipped.get((rs.key, index), 0) >= bound

    def bounded(self, fired: Collection[AlertKey], rules: Mapping[RuleKey, RuleState]) -> list[tuple[AlertKey, bool]]:
        """The alerts of `fired` (the step's, on every rank alike: `StepReport.fired`) whose skip is bounded and
        in force (`rules`: this attachment's rule states), each with whether it holds its skip back."""
        out: list[tuple[AlertKey, bool]] = []
        for key in sorted(fired):
            rs = rules.get(key[0])
            action = None if rs is None or not rs.enforce else rs.rule.actions[key[1]]
            if isinstance(action, Alert) and action.then == "skip_step" and action.max_in_a_row is not None:
                out.append((key, self._skipped.get(key, 0) >= action.max_in_a_row))
        return out

    def skipped(self, bounded: Collection[tuple[AlertKey, bool]], skip: bool) -> None:
        """Once the step is decided: the bounded alerts that fired (`bounded`, from `bounded`) count a skipped
        step, and start again from 0 at an applied one; one that fired on no rank ends its count."""
        fired = {key for key, _ in bounded}
        for key in [key for key in self._skipped if key not in fired]:
            del self._skipped[key]
        for key in fired:
            self._skipped[key] = self._skipped.get(key, 0) + 1 if skip else 0

    def evaluate(
        self, rs: RuleState, index: int, action: Alert, module: str, tensor: str, stats: dict[str, float],
        tracked: Optional[Tracked],
    ) -> bool:
        """Whether the alert fires: its condition held `for:` evaluations in a row, after its warmup."""
        if tracked is None:
            holds = action.condition.evaluate(stats)
        else:
            holds = tracked.ready(module, tensor) and action.condition.evaluate(stats, tracked.past(module, tensor))
        key = (rs.key, index, module, tensor)
        streak = self._streaks.get(key, 0) + 1 if holds else 0
        self._streaks[key] = streak
        return streak >= action.for_


class _StatFormat(dict[str, Any]):
    def __missing__(self, key: str) -> float:
        return math.nan


#: A rendered alert message is cut to this many characters: the template and its widths are
#: bounded at check time, a module name (the one field of unbounded length) is not.
MAX_RENDERED_CHARS = 4096


#: then -> (what it did, what it did not do)
_OUTCOMES = {
    "skip_step": ("step skipped", "step not skipped"), "halt": ("halting", "not halted"),
    "cool_down": ("cooling down", "not cooled down"), "rewind": ("rewinding", "not rewound"),
}


def outcome(then: str, applied: bool, mode: str) -> str:
    """What an alert's `then` did this time, in words: a message must not claim a skip that did not happen."""
    if then == "log":
        return "logged"
    done, undone = _OUTCOMES[then]
    if applied:
        return done
    return f"{undone} ({'audit mode' if mode == 'audit' else 'the policy was being removed'})"


def not_taken(then: str, why: str) -> str:
    """The outcome of an alert whose `then` was not taken at a step that took another decision, and why."""
    return f"{_OUTCOMES[then][1]} ({why})"


@dataclass
class Pending:
    """The record of an alert that fired, until the step is decided; `settles`: its `then` was to act
    (enforced, not at `remove()`), so its outcome waits for the step's decision."""

    rule: RuleState
    index: int
    action: Alert
    base: dict[str, Any]
    stats: dict[str, float]
    past: Past
    record: dict[str, Any]
    settles: bool = False
    #: a `skip_step` alert past its `max_in_a_row`: it asked for no skip (`Alerts.holds_back`)
    held_back: bool = False

    @property
    def key(self) -> tuple[tuple[str, str], int]:
        return (self.rule.key, self.index)

    def settled(self, happened: str) -> dict[str, Any]:
        """The record, its outcome and message saying `happened`."""
        if happened == self.record["outcome"]:
            return self.record
        applied = happened == _OUTCOMES[self.action.then][0]
        message = render(self.action, {**self.base, "outcome": happened}, self.stats, applied, self.past)
        return {**self.record, "outcome": happened, "message": message}


def module_name(model: str, module: str) -> str:
    """A module as a message names it: the model (its class) for the root, `Sequential.2` for a
    name that starts with an index (a `Sequential`'s layer), the name itself otherwise."""
    if not module:
        return model
    return f"{model}.{module}" if module.split(".", 1)[0].isdigit() else module


def render(
    action: Alert, base: dict[str, Any], stats: dict[str, float], applied: bool = True, past: Past = NO_PAST,
) -> str:
    """The alert's message; when its `then` did not take effect and the template does not
    say so through `{outcome}`, the outcome is appended, so no message claims an effect that
    did not happen (a shipped "...; step skipped" under `--audit`). Expression fields
    (`{zscore(loss, 100):.1f}`) are evaluated against the same past as the condition."""
    fields = _StatFormat(base, severity=action.severity, condition=action.source, **stats)
    fields["module"] = module_name(str(base.get("model") or "model"), base["module"])
    message = Template(dict(action.fields), stats, past).vformat(action.message, (), fields)
    if action.then != "log" and not applied and "outcome" not in action.message:
        message += f" [{base['outcome']}]"
    return message if len(message) <= MAX_RENDERED_CHARS else message[: MAX_RENDERED_CHARS - 1] + "…"


#: The logging level of an alert's line, by severity.
LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}


def alert_line(record: dict[str, Any]) -> tuple[int, str]:
    """An alert record as one readable line and its logging level:
    `CRITICAL nan-guard/nonfinite-grads step 40: <message>` (`step 40 rank 1` on another rank
    than 0); a line break in the message is written as a space, so it stays one line."""
    severity = str(record["severity"])
    where = f"step {record['step']}" + (f" rank {record['rank']}" if record.get("rank", 0) != 0 else "")
    message = " ".join(str(record["message"]).splitlines())
    return LEVELS.get(severity, logging.WARNING), f"{severity.upper()} {record['policy']}/{record['rule']} {where}: {message}"


def json_number(value: float) -> Union[float, int]:
    """Counts print as ints; NaN and Inf stay floats (JSON `NaN`/`Infinity`), never hidden."""
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def fire(
    report: "StepReport", rs: RuleState, index: int, action: Alert, base: dict[str, Any], stats: dict[str, float],
    past: Past, final: bool, decides: bool = True, held: bool = False,
) -> dict[str, Any]:
    """An alert fired for one group (`base`: the step, module, tensor, ...): its record waits in `report.pending`
    (`settled` once the step is decided) and, in force (enforce mode, not at `remove()`), its `then` goes into
    the report's decision: a skip, a heal, a halt. Returns the record as it stands before the step is decided.
    `decides` False (the job's loss rules at a step where the ranks hold different rules): the record
    waits as in force, but no decision is taken (its record then says why). `held`: a `skip_step` alert
    past its `max_in_a_row` (`Alerts.holds_back`) asks for no skip; once the ranks agreed, the step cycle
    notes every bounded alert that fired on any rank in `report.bounded` and decides them (`bounded_skips`).

    The one place an alert that fired becomes a record and a decision: a live read-back and `hookpolicy
    replay` both call it.
    """
    applied = rs.enforce and not final
    happened = outcome(action.then, applied, rs.mode)
    message = render(action, {**base, "outcome": happened}, stats, applied, past)
    record = {
        **base, "stats": {k: json_number(v) for k, v in stats.items()}, "event": "alert",
        "severity": action.severity, "then": action.then, "mode": rs.mode, "outcome": happened,
        "condition": action.source, "message": message,
    }
    report.pending.append(Pending(rs, index, action, base, stats, past, record, settles=applied and action.then != "log",
                                  held_back=held))
    if applied and decides and not held:
        if action.then == "skip_step" and rs.key not in report.skip_by:
            report.skip = True
            report.skip_rule = report.skip_rule or rs.key
            report.skip_by.append(rs.key)  # counted once per step and rule, once agreed on
        elif action.then in HEALS and (rs.key, index) not in report.heals:
            report.heals.append((rs.key, index))
        elif action.then == "halt" and report.halt is None:
            report.halt = Halt(rs.policy.name, rs.rule.name, int(base["step"]), message)
    return record


def bounded_skips(alerts: Alerts, report: "StepReport", healed: Mapping[tuple[tuple[str, str], int], str]) -> None:
    """Once a step's heal is decided (live or in `hookpolicy replay`): the skips held back past `max_in_a_row`.

    Such a step is applied, unless its rule's own cool-down or rewind acted at it (that rung is
    the rule's answer to a spike that persists, and the step stays skipped, as the rule's
    ladder says) or the run halts at it (a halting step is never applied, and is counted
    skipped as every alert that asked for its skip); then every bounded alert that fired
    counts the step (`Alerts.skipped`).
    """
    acted = {key for (key, _), did in healed.items() if did in ACTED}
    for (rule, _), held in report.bounded:
        if held and (rule in acted or report.halt is not None) and rule not in report.skip_by:
            report.skip = True
            report.skip_rule = report.skip_rule or rule
            report.skip_by.append(rule)
    alerts.skipped(report.bounded, report.skip)


#: what a cool-down or rewind that acted says of itself (`healing.Healing.decided`)
ACTED = frozenset({outcome("cool_down", True, "enforce"), outcome("rewind", True, "enforce")})


def settled(
    pending: Pending, report: "StepReport", healed: Mapping[tuple[tuple[str, str], int], str], decided: bool,
) -> dict[str, Any]:
    """The record of an alert that fired, now that its step is decided (`decided`: False for an evaluation
    forward's read-back, which decides no step): a record whose `then` was to act says what became of it, a
    skip or halt the ranks did not take, a cool-down or rewind the step did not take (`healed`: by rule and
    action index, from `Healing.decided`). A live read-back and `hookpolicy replay` both call it."""
    then = pending.action.then
    if not pending.settles:
        return pending.record
    why = "the ranks hold different rules: no decision at this step" if decided else "not at a training step"
    if then == "skip_step":
        if decided and not report.skip and pending.held_back:
            return pending.settled(not_taken(then, f"{pending.action.max_in_a_row} skipped in a row on the same "
                                                   "weights: a spike that outlasts them may be the weights', which only an update "
                                                   "undoes; the update is applied"))
        return pending.settled(outcome(then, True, "enforce") if decided and report.skip else not_taken(then, why))
    if then == "halt":
        return pending.settled(outcome(then, True, "enforce") if report.halt is not None else not_taken(then, why))
    return pending.settled(healed.get(pending.key) or not_taken(then, why))


@dataclass
class StepReport:
    """What one read-back decided, for the step cycle to act on."""

    skip: bool = False
    #: the first rule whose alert skips the step (named to the other ranks, see agreement.py)
    skip_rule: Optional[tuple[str, str]] = None
    #: the rules whose alerts skip the step (each counts the step once, however many modules fired)
    skip_by: list[tuple[str, str]] = field(default_factory=list)
    #: the alerts with `skip_step: {max_in_a_row: N}` in enforce mode that fired at this step on any rank
    #: (`Alerts.bounded` of `fired`, set by the step cycle once the ranks agreed, so the same on every rank),
    #: each with whether it holds back its skip (`Alerts.holds_back`)
    bounded: list[tuple[AlertKey, bool]] = field(default_factory=list)
    #: the alerts with `then: cool_down` or `then: rewind` that fired in enforce mode: (rule key, action index)
    heals: list[tuple[tuple[str, str], int]] = field(default_factory=list)
    #: the one the step takes, agreed on by every rank: its place + 1 in `healing.heal_order`; 0 for none
    heal: int = 0
    #: the records of the alerts that fired, written once the step is decided (`Readback.settle`)
    pending: list["Pending"] = field(default_factory=list)
    #: the first alert with `then: halt` in enforce mode
    halt: Optional[Halt] = None
    #: sinks that could not write, in order: each is a fault of its rule, handled by `onError`
    errors: list[tuple[RuleState, Exception]] = field(default_factory=list)
    #: time spent per rule, for `hookpolicy_hook_seconds_total`
    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    #: what was evaluated against a history, appended to it (`History.commit`) unless the step is skipped
    observed: list[Observation] = field(default_factory=list)
    #: entries the read-back was told to hold (`ranks: job` statistics), with their fetched rows, unpublished
    held: list[tuple[Entry, list[list[float]]]] = field(default_factory=list)
    #: the alerts that fired at this step's decision, the same on every rank (set by the step cycle once the
    #: ranks agreed: `StepCycle._decide`); what wakes rules (`trigger.after`) and dumps the recorder
    fired: frozenset[AlertKey] = frozenset()

    def off(self, rs: RuleState) -> bool:
        """Whether `rs` is switched off, counting the errors this report still has to hand over."""
        return rs.errors + sum(1 for r, _ in self.errors if r is rs) >= MAX_ERRORS


class SinkHalts(Exception):
    """A sink of a rule with `onError: halt` failed: the read-back stops there."""
