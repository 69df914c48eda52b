"""Check what a schema cannot express, then build the typed, frozen `model.Policy`.

`build_policy` reports every problem of a file at once: the schema's and the semantic
ones (a target that does not fit the trigger, a glob that does not compile, an `if`
that does not parse...). The semantic checks therefore run on data that may have
failed the schema, and read it defensively: a value of the wrong type is skipped here
because the schema has already said what is wrong with it. Only a document with no
problem at all is built, and the building then trusts its shape.
"""

from __future__ import annotations

import math
import ntpath
import re
import string
import unicodedata
from typing import Any, Callable, Mapping, NamedTuple, Optional

from ..errors import PolicyError, Problem
from .document import Document, JsonPath
from .expr import ExprError, NO_PAST, Template, Value, names_with, parse, parse_value
from .model import (
    HOOK_POINTS, LOSS, PARAM_TARGETS, STATS, TARGETS, Action, Alert, Board, Capture, Clip, LogSink, Match,
    Policy, Rule, Scale, TensorFiles, Trigger,
)
from .patterns import compile_glob, shown
from .schema import validate

__all__ = ["CLIP_NAMES", "MESSAGE_FIELDS", "TARGET_ALIASES", "build_policy", "check_semantics", "expression_names"]

#: the fields an alert message may use besides the statistic names.
MESSAGE_FIELDS: tuple[str, ...] = (
    "policy", "rule", "module", "tensor", "target", "step", "rank", "severity", "condition", "outcome",
)
#: target -> the names its rules' expressions may use besides the statistics (alias -> statistic).
TARGET_ALIASES: Mapping[str, Mapping[str, str]] = {LOSS: {"loss": "mean"}}
#: The one name a clip's `max_norm` expression may use: the clip's own norm series.
CLIP_NAMES: Mapping[str, str] = {"norm": "norm"}


def expression_names(target: Optional[str]) -> Mapping[str, str]:
    """The names an `if` or message expression of a rule on `target` may use: statistics and the target's aliases."""
    return names_with(TARGET_ALIASES.get(target or "", {}))


#: labels that hookpolicy_policy_info sets itself, so a policy label may not use them.
RESERVED_LABELS = frozenset({"policy", "revision", "mode", "rank"})
#: at most this many problems of one file are reported.
MAX_PROBLEMS = 100

#: Unicode categories refused in paths: controls (NUL, line breaks), format characters
#: (U+202E reverses what a listing shows), surrogates, line and paragraph separators.
_CONTROL = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

_SAMPLE_FIELDS: Mapping[str, object] = {
    **{name: name for name in MESSAGE_FIELDS}, "step": 0, "rank": 0, **{stat: 0.0 for stat in STATS},
}


def build_policy(document: Document) -> Policy:
    """The Policy a document describes; raises PolicyError listing every problem."""
    problems = validate(document) + check_semantics(document)
    if problems:
        raise PolicyError(_capped(problems))
    return _policy(document)


def check_semantics(document: Document) -> list[Problem]:
    """The problems a JSON Schema cannot find, each at its node."""
    checker = _Checker(document)
    checker.policy(document.data)
    return checker.problems


def _capped(problems: list[Problem]) -> list[Problem]:
    """The first MAX_PROBLEMS problems and, when there were more, a line saying so."""
    ordered = sorted(problems)
    if len(ordered) <= MAX_PROBLEMS:
        return ordered
    first_left_out = ordered[MAX_PROBLEMS]
    more = len(ordered) - MAX_PROBLEMS
    note = Problem(
        first_left_out.file, first_left_out.line, first_left_out.column, first_left_out.path,
        f"... and {more} more problems",
    )
    return ordered[:MAX_PROBLEMS] + [note]


# --------------------------------------------------------------------------- checks


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _number(value: Any) -> Optional[float]:
    """`value` as a float when it is a (finite) number, not a boolean; else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def _choice(value: Any, options: Mapping[str, Any]) -> Optional[str]:
    """`value` when it is one of the string keys of `options`, else None."""
    return value if isinstance(value, str) and value in options else None


class _Site(NamedTuple):
    """Where an action sits: its JSON path, and its rule's hook point and target if known."""

    path: JsonPath
    at: Optional[str]
    target: Optional[str]


class _Checker:
    """Walks a document that may be malformed and records semantic problems."""

    def __init__(self, document: Document) -> None:
        self.document = document
        self.problems: list[Problem] = []
        self.actions: dict[str, Callable[[dict[str, Any], _Site], None]] = {
            "capture": self.capture, "clip": self.clip, "scale": self.scale, "alert": self.alert,
        }

    def add(
        self, path: JsonPath, message: str, *, key: bool = False, offset: Optional[int] = None
    ) -> None:
        self.problems.append(self.document.problem(path, message, key=key, offset=offset))

    def policy(self, data: dict[str, Any]) -> None:
        for label in _dict(_dict(data.get("metadata")).get("labels")):
            if label in RESERVED_LABELS:
                self.add(
                    ("metadata", "labels", label),
                    f"the label {label!r} is set by hookpolicy itself (hookpolicy_policy_info "
                    f"has {', '.join(sorted(RESERVED_LABELS))}); choose another name",
                    key=True,
                )
        first_line: dict[str, int] = {}
        for index, rule in enumerate(_list(_dict(data.get("spec")).get("rules"))):
            if not isinstance(rule, dict):
                continue
            path: JsonPath = ("spec", "rules", index)
            self.rule(rule, path)
            name = rule.get("name")
            if not isinstance(name, str):
                continue
            if name in first_line:
                self.add(
                    path + ("name",),
                    f"duplicate rule name {name!r} (first at line {first_line[name]}); "
                    "rule names must be unique within a policy",
                )
            else:
                first_line[name] = self.document.position(path + ("name",))[0]

    def rule(self, rule: dict[str, Any], path: JsonPath) -> None:
        trigger = _dict(rule.get("trigger"))
        at = _choice(trigger.get("at"), HOOK_POINTS)
        target = self.target(rule, path, at)
        if isinstance(rule.get("match"), dict):
            self.match(rule["match"], path + ("match",), target)
        self.steps(_dict(trigger.get("steps")), path + ("trigger", "steps"))
        if "select" in rule and target in PARAM_TARGETS:
            self.add(
                path + ("select",),
                f"select narrows tuple, list and dict inputs and outputs; the target {target!r} "
                "is a parameter: choose parameters with match.params instead",
                key=True,
            )
        if target == LOSS:
            self.loss_rule(rule, path, trigger)
        for index, item in enumerate(_list(rule.get("actions"))):
            if isinstance(item, dict) and len(item) == 1:
                ((kind, body),) = item.items()
                check = self.actions.get(kind)
                if check is not None and isinstance(body, dict):
                    check(body, _Site(path + ("actions", index, kind), at, target))

    def target(self, rule: dict[str, Any], path: JsonPath, at: Optional[str]) -> Optional[str]:
        """The rule's effective target (given or default), None where it is not known."""
        if "target" not in rule:
            return HOOK_POINTS[at][0] if at else None
        given = rule["target"]
        if not isinstance(given, str) or given not in TARGETS:
            return None
        if at is not None and given not in HOOK_POINTS[at]:
            self.add(
                path + ("target",),
                f"target {given!r} does not fit trigger.at {at!r}; at {at} the targets are: "
                f"{', '.join(HOOK_POINTS[at])}",
            )
            return None
        return given

    def loss_rule(self, rule: dict[str, Any], path: JsonPath, trigger: dict[str, Any]) -> None:
        """`target: loss` is the step's training loss: nothing to select in it, nothing to change."""
        if "select" in rule:
            self.add(path + ("select",), "select narrows a module's inputs and outputs; target: loss is the "
                     "step's loss, one value per micro-batch: drop select", key=True)
        if trigger.get("phase", Trigger.phase) != "train":
            self.add(path + ("trigger", "phase"), "target: loss is the training loss of each step; "
                     "only phase: train (the default) applies")
        if "adapters" in _dict(rule.get("match")):
            self.add(path + ("match", "adapters"), "target: loss is the loss of the whole model, matched at its "
                     "root; adapters selects adapter pieces: drop it", key=True)
        for index, item in enumerate(_list(rule.get("actions"))):
            for kind in ("clip", "scale"):
                if isinstance(item, dict) and kind in item:
                    self.add(path + ("actions", index, kind), f"{kind} cannot change target: loss (the loss "
                             "was already backpropagated); clip or scale target: grad, or alert with "
                             "then: skip_step", key=True)

    def match(self, match: dict[str, Any], path: JsonPath, target: Optional[str]) -> None:
        if not ("modules" in match or "types" in match or match.get("root") is True or "adapters" in match):
            self.add(path, "a match needs at least one of: modules, types, root: true, adapters")
        if "adapters" in match and match.get("root") is True:
            self.add(
                path + ("adapters",),
                "adapters selects the adapter pieces of adapted layers; the root (the whole model) "
                "is never one: drop root: true, or select the layers with modules or types",
                key=True,
            )
        for field in ("modules", "exclude", "params"):
            for index, pattern in enumerate(_list(match.get(field))):
                if isinstance(pattern, str) and pattern:
                    self.pattern(pattern, path + (field, index))
        if "params" in match and target is not None and target not in PARAM_TARGETS:
            self.add(
                path + ("params",),
                "params applies only to the parameter targets "
                f"({', '.join(sorted(PARAM_TARGETS))}); this rule's target is {target!r}",
                key=True,
            )

    def pattern(self, pattern: str, path: JsonPath) -> None:
        try:
            compile_glob(pattern)
        except ValueError as exc:  # patterns.PatternError, a ValueError with the reason (and where)
            self.add(path, str(exc), offset=getattr(exc, "offset", None))
        except (RecursionError, OverflowError) as exc:  # from re.compile on absurd regexes
            self.add(path, f"invalid pattern {shown(pattern)}: {exc}")

    def steps(self, steps: dict[str, Any], path: JsonPath) -> None:
        start, until = _number(steps.get("from", 0)), _number(steps.get("until"))
        if start is not None and until is not None and until <= start:
            self.add(
                path + ("until",),
                f"until ({until:g}) must be greater than from ({start:g}): "
                "the window is from inclusive, until exclusive",
            )

    def capture(self, body: dict[str, Any], site: _Site) -> None:
        path = site.path
        board = _dict(body.get("tensorboard"))
        if "tensorboard" in body and "stats" not in body and board.get("histograms") is not True:
            self.add(path + ("tensorboard",), "tensorboard writes statistics or histograms: add stats to this "
                     "capture or histograms: true", key=True)
        elif "stats" not in body and "tensors" not in body and board.get("histograms") is not True:
            self.add(path, "a capture needs stats, tensors or tensorboard histograms", key=True)
        if "log" in body and "stats" not in body:
            self.add(path + ("log",), "log writes statistics: add stats to this capture", key=True)
        self.relative(_dict(body.get("tensors")).get("dir"), path + ("tensors", "dir"))
        self.relative(board.get("dir"), path + ("tensorboard", "dir"))
        log = _dict(body.get("log"))
        self.relative(log.get("path"), path + ("log", "path"))
        for key in ("max_bytes", "keep"):
            if key in log and "path" not in log:
                self.add(path + ("log", key), f"{key} rotates a log file: add a path (stderr is not rotated)", key=True)

    def relative(self, value: Any, path: JsonPath) -> None:
        """A path that must stay inside the output folder: relative, no `..` segment.

        Control characters are refused too: a NUL (`"t\\0x"` in a double-quoted YAML
        string) makes every file call raise ValueError, and a line break in a file name
        only hides it.
        """
        if not isinstance(value, str):
            return
        control = next((c for c in value if unicodedata.category(c) in _CONTROL), None)
        if control is not None:
            self.add(
                path,
                f"{value!r} contains the control character U+{ord(control):04X}; "
                "a path is printable text",
            )
        elif value.startswith(("/", "\\", "~")) or ntpath.splitdrive(value)[0]:
            self.add(
                path,
                f"{value!r} must be relative to the output folder (no leading /, \\, ~ or drive)",
            )
        elif ".." in re.split(r"[\\/]", value):
            self.add(path, f"{value!r} must not contain '..': files stay inside the output folder")

    def clip(self, body: dict[str, Any], site: _Site) -> None:
        path = site.path
        by_norm = "max_norm" in body
        if by_norm and ("min" in body or "max" in body):
            self.add(
                path,
                "clip takes either max_norm (clip by norm) or min/max (clamp values), not both; "
                "write two clip actions",
                key=True,
            )
        if not body:
            self.add(
                path, "a clip needs max_norm (clip by norm), min and/or max (clamp values), "
                "or unitwise_ratio (AGC, at step)",
                key=True,
            )
        if "unitwise_ratio" in body or "eps" in body:
            self.unitwise(body, site)
        for key in ("norm_type", "per"):
            if key in body and not by_norm and "unitwise_ratio" not in body:
                self.add(
                    path + (key,), f"{key} applies to clipping by norm: add max_norm", key=True
                )
        if by_norm and body.get("per") == "rule" and site.at not in (None, "step"):
            self.add(
                path + ("per",),
                "per: rule (one joint norm over everything the rule matched) needs trigger.at: "
                "step; use per: tensor or per: module",
            )
        low, high = _number(body.get("min")), _number(body.get("max"))
        if low is not None and high is not None and low > high:
            self.add(path + ("max",), f"max ({high:g}) is below min ({low:g})")
        threshold = body.get("max_norm")
        if isinstance(threshold, str) and threshold:
            try:
                parse_value(threshold, CLIP_NAMES, current=False)
            except ExprError as exc:
                self.add(path + ("max_norm",), f"invalid max_norm expression: {exc}", offset=exc.offset)
        if "warmup" in body and not isinstance(threshold, str) and "unitwise_ratio" not in body:
            self.add(path + ("warmup",), "warmup applies to a max_norm expression (which needs a history); a fixed "
                     "max_norm clips from the first step (trigger.steps.from starts a rule later)", key=True)
        self.modifies(site)

    def unitwise(self, body: dict[str, Any], site: _Site) -> None:
        """AGC reads the parameters' weights next to their gradients: only at step, on grad, alone."""
        path = site.path
        if "unitwise_ratio" not in body:
            self.add(path + ("eps",), "eps is the weight norm floor of AGC: add unitwise_ratio", key=True)
            return
        others = [key for key in ("max_norm", "min", "max", "norm_type", "per", "warmup") if key in body]
        if others:
            self.add(
                path + (others[0],),
                f"unitwise_ratio (AGC: per unit, relative to its weights) takes only eps, not {', '.join(others)}; "
                "a norm or value clip goes in a clip action of its own",
                key=True,
            )
        if site.at not in (None, "step"):
            self.add(
                path + ("unitwise_ratio",),
                "unitwise_ratio (AGC) compares gradients with their parameters' weights: it needs "
                f"trigger.at: step and target: grad, not trigger.at: {site.at}",
                key=True,
            )
        elif site.at == "step" and site.target not in (None, "grad"):
            self.add(
                path + ("unitwise_ratio",),
                f"unitwise_ratio (AGC) clips gradients: it needs target: grad, not target: {site.target}",
                key=True,
            )

    def scale(self, body: dict[str, Any], site: _Site) -> None:
        self.modifies(site)

    def modifies(self, site: _Site) -> None:
        """An action that changes its target must run before the target is used."""
        if site.at == "forward" and site.target == "input":
            self.add(
                site.path,
                f"{site.path[-1]} changes the target, but at trigger.at: forward the module has "
                "already used its input; use trigger.at: forward_pre to change a module's input",
                key=True,
            )

    def alert(self, body: dict[str, Any], site: _Site) -> None:
        path = site.path
        names = expression_names(site.target)
        condition = body.get("if")
        if isinstance(condition, str) and condition:
            try:
                parse(condition, names)
            except ExprError as exc:
                self.add(path + ("if",), f"invalid condition: {exc}", offset=exc.offset)
        message = body.get("message")
        if isinstance(message, str):
            wrong = _message_problem(message, names)
            if wrong:
                self.add(path + ("message",), wrong[0], offset=wrong[1])


#: The longest alert message template, and the widest field or precision in it: a message
#: is one line of a log and of stderr (`{step:>99999999}` once wrote 1.5 GB in 5 steps).
MAX_MESSAGE_CHARS = 1000
MAX_FIELD_WIDTH = 100
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[_,]?(?:\.(?P<precision>\d*))?[a-zA-Z%]?")


def _message_problem(message: str, names: Mapping[str, str]) -> Optional[tuple[str, Optional[int]]]:
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
    try:
        Template(expressions, {stat: 0.0 for stat in STATS}, NO_PAST).format(message, **_SAMPLE_FIELDS)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as exc:
        return f"the message cannot be formatted: {exc} (statistics are numbers, the rest text)", None
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


# --------------------------------------------------------------------------- building


def _policy(document: Document) -> Policy:
    metadata, spec = document.data["metadata"], document.data["spec"]
    mode = spec.get("mode", Policy.mode)
    return Policy(
        name=metadata["name"],
        source=document.file,
        revision=document.revision,
        rules=tuple(
            _rule(rule, index, mode, document.position(("spec", "rules", index, "match"), key=True))
            for index, rule in enumerate(spec["rules"])
        ),
        mode=mode,
        on_error=spec.get("onError", Policy.on_error),
        max_series=int(spec.get("limits", {}).get("maxSeries", Policy.max_series)),
        labels=dict(metadata.get("labels", {})),
        annotations=dict(metadata.get("annotations", {})),
    )


def _rule(rule: dict[str, Any], index: int, mode: str, match_at: tuple[int, int]) -> Rule:
    trigger = rule["trigger"]
    at = trigger["at"]
    target = rule.get("target", HOOK_POINTS[at][0])
    return Rule(
        name=rule["name"],
        index=index,
        trigger=_trigger(trigger),
        target=target,
        match=_match(rule["match"]),
        actions=tuple(_action(item, at, target) for item in rule["actions"]),
        mode=rule.get("mode", mode),
        priority=int(rule.get("priority", Rule.priority)),
        select=tuple(s if isinstance(s, str) else int(s) for s in rule.get("select", ())),
        match_at=match_at,
    )


def _trigger(trigger: dict[str, Any]) -> Trigger:
    steps = trigger.get("steps", {})
    until = steps.get("until")
    return Trigger(
        at=trigger["at"],
        every=int(trigger.get("every", Trigger.every)),
        steps_from=int(steps.get("from", Trigger.steps_from)),
        steps_until=None if until is None else int(until),
        phase=trigger.get("phase", Trigger.phase),
    )


def _match(match: dict[str, Any]) -> Match:
    return Match(
        modules=tuple(match.get("modules", ())),
        types=tuple(match.get("types", ())),
        root=bool(match.get("root", False)),
        exclude=tuple(match.get("exclude", ())),
        params=tuple(match.get("params", ())),
        adapters=match.get("adapters"),
    )


def _action(item: dict[str, Any], at: str, target: str) -> Action:
    ((kind, body),) = item.items()
    return _BUILDERS[kind](body, at, target)


def _capture(body: dict[str, Any], at: str, target: str) -> Capture:
    tensors, log, board = body.get("tensors"), body.get("log"), body.get("tensorboard")
    return Capture(
        stats=tuple(body.get("stats", ())),
        per=body.get("per", Capture.per),
        tensors=None if tensors is None else TensorFiles(
            dir=tensors["dir"],
            max_files=int(tensors.get("max_files", TensorFiles.max_files)),
            max_bytes=int(tensors.get("max_bytes", TensorFiles.max_bytes)),
        ),
        log=None if log is None else LogSink(
            path=log.get("path"), max_bytes=int(log.get("max_bytes", LogSink.max_bytes)),
            keep=int(log.get("keep", LogSink.keep)),
        ),
        tensorboard=None if board is None else Board(dir=board["dir"], histograms=bool(board.get("histograms", Board.histograms))),
    )


def _clip(body: dict[str, Any], at: str, target: str) -> Clip:
    if "unitwise_ratio" in body:
        return Clip(unitwise_ratio=float(body["unitwise_ratio"]), eps=float(body.get("eps", Clip.eps)))
    if "max_norm" in body:
        norm_type = body.get("norm_type", Clip.norm_type)
        threshold = body["max_norm"]
        return Clip(
            max_norm=(parse_value(threshold, CLIP_NAMES, current=False) if isinstance(threshold, str)
                      else float(threshold)),
            norm_type=math.inf if norm_type == "inf" else float(norm_type),
            per=body.get("per", "rule" if at == "step" else Clip.per),  # a step clip defaults to the whole rule
            warmup=int(body.get("warmup", Clip.warmup)),
        )
    low, high = body.get("min"), body.get("max")
    return Clip(min=None if low is None else float(low), max=None if high is None else float(high))


def _scale(body: dict[str, Any], at: str, target: str) -> Scale:
    return Scale(factor=float(body["factor"]))


def _alert(body: dict[str, Any], at: str, target: str) -> Alert:
    names = expression_names(target)
    message = body.get("message")
    optional: dict[str, Any] = {} if message is None else {"message": message, "fields": message_fields(message, names)}
    return Alert(
        condition=parse(body["if"], names),
        source=body["if"],
        for_=int(body.get("for", Alert.for_)),
        severity=body.get("severity", Alert.severity),
        then=body.get("then", Alert.then),
        per=body.get("per", Alert.per),
        warmup=int(body.get("warmup", Alert.warmup)),
        **optional,
    )


#: action name -> how to build it; the one place that knows every action.
_BUILDERS: Mapping[str, Callable[[dict[str, Any], str, str], Action]] = {
    "capture": _capture, "clip": _clip, "scale": _scale, "alert": _alert,
}
