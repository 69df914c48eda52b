"""What an alert message and an expression may name, and checking a message template.

A message field is a name (`MESSAGE_FIELDS`, a statistic) or an expression of the `if`
language; the names an expression may use depend on the rule's target (`expression_names`).
"""

from __future__ import annotations

import re
import string
from typing import Mapping, Optional, Sequence

from .expr import ExprError, NO_PAST, Template, Value, names_with, parse_value
from .model import LOSS, STATS, TARGETS, Capture, Policy, Rule, rule_name

__all__ = [
    "CLIP_NAMES", "MAX_FIELD_WIDTH", "MAX_MESSAGE_CHARS", "MESSAGE_FIELDS", "TARGET_ALIASES", "expression_names",
    "message_fields", "message_problem", "wake_notes",
]

#: the fields an alert message may use besides the statistic names.
MESSAGE_FIELDS: tuple[str, ...] = (
    "policy", "rule", "module", "tensor", "target", "step", "rank", "severity", "condition", "outcome",
)
#: target -> the names its rules' expressions may use besides the statistics (alias -> statistic).
TARGET_ALIASES: Mapping[str, Mapping[str, str]] = {LOSS: {"loss": "mean"}}
#: The one name a clip's `max_norm` and `when` expressions may use: the clip's own norm series.
CLIP_NAMES: Mapping[str, str] = {"norm": "norm"}


#: What a capture.tensorboard says where the tensorboard package is missing (at check, explain,
#: attach, and if it is still missing when the writer opens).
MISSING_TENSORBOARD = (
    "capture.tensorboard writes through torch.utils.tensorboard, which needs the tensorboard package: "
    "pip install 'hookpolicy[tensorboard]' (or: pip install torch==2.13.0 tensorboard)"
)


def missing_extras(policy: Policy) -> list[tuple[Rule, str]]:
    """The rules of `policy` that need an optional package this Python does not have, and what to install."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        return []
    return [(rule, f"{MISSING_TENSORBOARD}; until then this rule writes no event file")
            for rule in policy.rules
            if any(isinstance(a, Capture) and a.tensorboard is not None for a in rule.actions)]


def expression_names(target: Optional[str]) -> Mapping[str, str]:
    """The names an `if` or message expression of a rule on `target` may use: statistics and the target's aliases.

    With a `target` that is wrong or unknown (reported on its own), every target's aliases: a
    name the intended target has is no second error.
    """
    if target not in TARGETS:
        return names_with({alias: stat for aliases in TARGET_ALIASES.values() for alias, stat in aliases.items()})
    return names_with(TARGET_ALIASES.get(target or "", {}))


#: a value for every plain field: a template is formatted once with them when it is checked
_SAMPLE_FIELDS: Mapping[str, object] = {
    **{name: name for name in MESSAGE_FIELDS}, "step": 0, "rank": 0, **{stat: 0.0 for stat in STATS},
}
#: The same at the far end of what a run reaches: `{step:c}` formats step 0 and fails from
#: step 1,114,112 (past the last Unicode character), so a template must format both.
_LATE_SAMPLE_FIELDS: Mapping[str, object] = {**_SAMPLE_FIELDS, "step": 2 ** 63 - 1, "rank": 2 ** 31 - 1}


#: The longest alert message template, and the widest field or precision in it: a message
#: is one line of a log and of stderr (`{step:>99999999}` once wrote 1.5 GB in 5 steps).
MAX_MESSAGE_CHARS = 1000
MAX_FIELD_WIDTH = 100
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[_,]?(?:\.(?P<precision>\d*))?[a-zA-Z%]?")


def message_problem(message: str, names: Mapping[str, str]) -> Optional[tuple[str, Optional[int]]]:
    """What is wrong with an alert message template (and where in it), or None when it is fine.

    A field is a name (`MESSAGE_FIELDS`, a statistic) or an expression of the `if` language
    (`{zscore(l2_norm, 100):.1f}`); nothing else: `{module.__class__}` would let a policy
    file walk Python objects at render time. Widths and precisions are bounded, so a
    rendered message is at most about MAX_MESSAGE_CHARS plus its fields' values.
    """
    if len(message) > MAX_MESSAGE_CHARS:
        return f"the message is {len(message)} characters long; at most {MAX_MESSAGE_CHARS}", MAX_MESSAGE_CHARS
    allowed = MESSAGE_FIELDS + STATS
    try:
        fields = list(string.Formatter().parse(message))
    except ValueError as exc:
        return f"invalid message template: {exc} (write a literal brace as '{{{{' or '}}}}')", None
    expressions: dict[str, Value] = {}
    for _, name, spec, _ in fields:
        if name is None:
            continue
        if name not in allowed:
            at = _field_at(message, name)
            unknown = (f"unknown message field {{{name}}}; the fields are: {', '.join(allowed)}, or an expression "
                       "of the statistics such as {zscore(l2_norm, 100):.1f}")
            try:
                value = parse_value(name, names)
            except ExprError as exc:
                if name.isidentifier() or not name.strip() or "." in name or "[" in name:  # meant as a name
                    return unknown, at
                return f"invalid expression in a message field: {exc}", None if at is None else at + 1 + exc.offset
            if not value.stats:  # `{0}`: a number names no statistic
                return unknown, at
            expressions[name] = value
        if spec and "{" in spec:
            return f"the format spec of {{{name}}} may not contain fields", _field_at(message, name)
        sized = _FORMAT_SPEC.fullmatch(spec or "")
        for part in ("width", "precision"):
            digits = sized.group(part) if sized else None
            if digits and int(digits) > MAX_FIELD_WIDTH:
                return (f"the {part} of {{{name}:{spec}}} is {int(digits)}; at most {MAX_FIELD_WIDTH}",
                        _field_at(message, name))
    for sample in (_SAMPLE_FIELDS, _LATE_SAMPLE_FIELDS):
        try:
            Template(expressions, {stat: 0.0 for stat in STATS}, NO_PAST).format(message, **sample)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as exc:
            when = "" if sample is _SAMPLE_FIELDS else f" at step {sample['step']}"
            return f"the message cannot be formatted{when}: {exc} (statistics are numbers, the rest text)", None
    return None


def message_fields(message: str, names: Mapping[str, str]) -> tuple[tuple[str, Value], ...]:
    """The fields of a (checked) message template that are expressions, parsed."""
    plain = set(MESSAGE_FIELDS + STATS)
    found = {name: parse_value(name, names) for _, name, _, _ in string.Formatter().parse(message)
             if name is not None and name not in plain}
    return tuple(found.items())


def _field_at(message: str, name: str) -> Optional[int]:
    """Where the field `{name...}` starts in the template (its first occurrence)."""
    found = re.search(r"(?<!\{)\{" + re.escape(name) + r"[:!}]", message)
    return None if found is None else found.start()


def wake_notes(policies: Sequence[Policy]) -> list[str]:
    """`explain`'s lines for the rules that wake on an alert (`trigger.after`): which rule wakes which,
    for how many steps, and what they cost while asleep."""
    woken: dict[tuple[str, int], list[str]] = {}
    for policy in policies:
        for rule in policy.rules:
            after = rule.trigger.after
            if after is not None:
                woken.setdefault((rule_name(after.rule), after.steps), []).append(f"{policy.name}/{rule.name}")
    return [f"{waker} wakes {', '.join(names)} for {steps} steps after each step whose decision fires one of its "
            f"alerts (on every rank at the same steps); asleep {'they have' if len(names) > 1 else 'it has'} no "
            "hook installed and cost nothing, and in a process group the step's agreement carries whether the "
            "alert fired (its one collective, at every step)"
            for (waker, steps), names in woken.items()]
