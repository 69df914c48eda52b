"""The plan: which rule goes on which module, at which hook point, on which target.

`build_plan(policies, model)` is a pure function: it walks the model once, matches every
rule, and returns bindings ordered by (priority, policy order, rule order, module order),
plus the warnings a user should see before training (a rule that matches nothing, a
`grad_input` rule on a module whose inputs are indices). The runtime installs exactly
what the plan lists and nothing else; `explain` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .matcher import Matcher, iter_modules
from ..policy.model import PARAM_TARGETS, Action, Alert, Capture, Clip, Policy, Rule, Scale

__all__ = ["Binding", "Plan", "build_plan", "describe_action"]

#: Modules whose inputs are integer indices: no gradient ever reaches them.
_INDEX_INPUT_TYPES = ("Embedding", "EmbeddingBag")


@dataclass(frozen=True)
class Binding:
    """One rule on one module: `module` is the canonical name, `params` its selected parameters."""

    policy: Policy = field(repr=False)
    rule: Rule = field(repr=False)
    module: str
    qualname: str
    hook: str
    target: str
    params: tuple[str, ...] = ()
    obj: Any = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.policy.name, self.rule.name)

    def row(self) -> dict[str, Any]:
        """A JSON-ready description, as `explain --format json` prints it."""
        return {
            "policy": self.policy.name,
            "rule": self.rule.name,
            "priority": self.rule.priority,
            "mode": self.rule.mode,
            "module": self.module,
            "type": type(self.obj).__name__,
            "hook": self.hook,
            "target": self.target,
            "params": list(self.params),
            "select": list(self.rule.select),
            "actions": [describe_action(a) for a in self.rule.actions],
        }


@dataclass(frozen=True)
class Plan:
    bindings: tuple[Binding, ...]
    warnings: tuple[str, ...]

    def rows(self) -> list[dict[str, Any]]:
        return [b.row() for b in self.bindings]

    def __str__(self) -> str:
        lines = [
            f"{b.policy.name}/{b.rule.name} -> {b.module or '<root>'} "
            f"[{b.hook}:{b.target}{'(' + ','.join(b.params) + ')' if b.params else ''}] "
            + "; ".join(describe_action(a) for a in b.rule.actions)
            for b in self.bindings
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def describe_action(action: Action) -> str:
    """A short human form of an action, e.g. `clip(max_norm=1, per=rule)`."""
    if isinstance(action, Capture):
        parts = [",".join(action.stats)] if action.stats else []
        parts.append(f"per={action.per}")
        if action.tensors:
            parts.append(f"tensors={action.tensors.dir}")
        if action.log:
            parts.append(f"log={action.log.path or 'stderr'}")
        return f"capture({' '.join(parts)})"
    if isinstance(action, Clip):
        if action.max_norm is not None:
            return f"clip(max_norm={action.max_norm:g}, norm_type={action.norm_type:g}, per={action.per})"
        return f"clip(min={action.min}, max={action.max})"
    if isinstance(action, Scale):
        return f"scale({action.factor:g})"
    assert isinstance(action, Alert)
    return f"alert(if {action.source!r} for {action.for_} -> {action.then}, {action.severity})"


def build_plan(policies: Sequence[Policy], model: Any) -> Plan:
    """Compile policies against a model; never touches the model beyond reading its tree."""
    entries = iter_modules(model)
    ordered = sorted(
        ((rule.priority, p_index, rule.index, policy, rule)
         for p_index, policy in enumerate(policies) for rule in policy.rules),
        key=lambda item: item[:3],
    )
    bindings: list[Binding] = []
    warnings: list[str] = []
    for *_, policy, rule in ordered:
        matcher = Matcher(rule.match)
        found = [e for e in entries if matcher.matches(e.name, e.module, e.name == "")]
        where = f"{policy.name}/{rule.name}"
        if not found:
            warnings.append(f"{where}: matches no module of {type(model).__name__}")
            continue
        made = 0
        claimed: set[int] = set()  # a shared (tied) parameter belongs to the first module that has it
        for entry in found:
            params: tuple[str, ...] = ()
            if rule.target in PARAM_TARGETS:
                params = tuple(
                    name for name in matcher.param_names(entry.module)
                    if _claim(claimed, getattr(entry.module, name))
                )
                if not params:
                    continue
            if rule.target == "grad_input" and type(entry.module).__name__ in _INDEX_INPUT_TYPES:
                warnings.append(
                    f"{where}: {entry.name or '<root>'} is an {type(entry.module).__name__}; "
                    "its inputs are indices and never receive a gradient"
                )
            bindings.append(Binding(
                policy, rule, entry.name, entry.qualname, rule.trigger.at, rule.target, params, entry.module,
            ))
            made += 1
        if not made:
            warnings.append(f"{where}: the matched modules have no parameters matching {list(rule.match.params) or '*'}")
    return Plan(tuple(bindings), tuple(warnings))


def _claim(claimed: set[int], obj: Any) -> bool:
    """True the first time `obj` is seen in this rule."""
    if id(obj) in claimed:
        return False
    claimed.add(id(obj))
    return True
