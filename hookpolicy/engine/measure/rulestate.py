"""What the engine keeps for one rule of one policy while it is attached.

Built once per attachment from the plan (`rule_states`), and bound anew to a new plan
when the model's tree changes (`rebind`: a rule keeps its state); read by every part of
the engine. Its one mutable field, `errors`, is written only by the executor's error
containment (`programs.Faults.fail`), so "is this rule switched off?" has one answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from .actions import Program, StatsOp, compile_rule
from ...plan.planner import Binding, Plan
from ...policy.model import Alert, Capture, Clip, Policy, Rule, RuleKey, Scale, rule_name

__all__ = ["MAX_ERRORS", "RuleState", "rebind", "refuse", "rule_states"]

log = logging.getLogger("hookpolicy")

#: A rule that raised this many times is switched off (`onError: continue`).
MAX_ERRORS = 3


@dataclass
class RuleState:
    """One rule of one policy: its compiled program, bindings, mode and error count."""

    policy: Policy
    rule: Rule
    program: Program
    mode: str
    bindings: list[Binding] = field(default_factory=list)
    errors: int = 0
    key: RuleKey = field(init=False)
    enforce: bool = field(init=False)
    #: per program op, the hookpolicy_actions_total labels one execution of it increments
    count_keys: list[list[tuple[str, ...]]] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.policy.name, self.rule.name)
        self.enforce = self.mode == "enforce"
        self.count_keys = [
            [(*self.key, "capture" if isinstance(a, Capture) else "alert", self.mode) for _, a in op.actions]
            if isinstance(op, StatsOp) else [(*self.key, op.name, self.mode)]
            for op in self.program
        ]

    #: why the rule cannot take effect on this model (`refuse`): it is off
    refused: Optional[str] = None

    @property
    def off(self) -> bool:
        """Switched off by `onError: continue` after `MAX_ERRORS` errors, or refused."""
        return self.errors >= MAX_ERRORS or self.refused is not None


def rule_states(plan: Plan, audit: bool) -> dict[tuple[str, str], RuleState]:
    """One `RuleState` per (policy, rule) of the plan, in binding order, programs compiled."""
    rules: dict[tuple[str, str], RuleState] = {}
    rebind(rules, plan, audit)
    return rules


def rebind(rules: dict[tuple[str, str], RuleState], plan: Plan, audit: bool) -> list[RuleState]:
    """Give each rule its bindings in `plan`, in place; returns the rules that are new.

    A rule keeps its state (error count, alert history in the read-back) across a rebind;
    one that binds nothing now keeps an empty list.
    """
    for kept in rules.values():
        kept.bindings = []
    new: list[RuleState] = []
    for b in plan.bindings:
        rs = rules.get(b.key)
        if rs is None:
            mode = "audit" if audit else b.rule.mode
            rs = rules[b.key] = RuleState(b.policy, b.rule, compile_rule(b.rule), mode)
            new.append(rs)
        rs.bindings.append(b)
    return new


def refuse(rules: dict[tuple[str, str], RuleState], model: str, reason: str, refused: bool) -> None:
    """Say that the step rules of `model` cannot act as written here; with `refused`, switch off those that would change anything.

    A rule that would clip, scale, skip or halt in enforce mode is refused rather than
    run as a no-op or on partial gradients; audit and capture-only rules keep running
    and their numbers come with this warning.
    """
    step_rules = [rs for rs in rules.values() if rs.rule.trigger.at == "step"]
    if not step_rules:
        return
    off = [rs for rs in step_rules if refused and rs.enforce and not rs.off and _acts(rs.rule)]
    for rs in off:
        rs.refused = reason
    tail = f"; refused: {', '.join(rule_name(rs.key) for rs in off)}" if off else ""
    log.warning("%s: %s%s", model, reason, tail)


def _acts(rule: Rule) -> bool:
    """Whether a rule changes training: a clip or scale, or an alert that skips the step or halts."""
    return any(isinstance(a, (Clip, Scale)) or (isinstance(a, Alert) and a.then != "log") for a in rule.actions)
