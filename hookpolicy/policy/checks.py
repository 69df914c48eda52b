"""The semantic checks: what a JSON Schema cannot express, each problem at its node.

They run on data that may have failed the schema, and read it defensively: a value of
the wrong type is skipped here because the schema has already said what is wrong with it.
"""

from __future__ import annotations

import math
import ntpath
import re
import unicodedata
from typing import Any, Callable, Mapping, NamedTuple, Optional

from ..errors import Problem
from .document import Document, JsonPath
from .expr import ExprError, parse, parse_value
from .messages import CLIP_NAMES, expression_names, message_problem
from .model import (
    ACTIVATIONS, AFTER_UPDATE, HOOK_POINTS, LOSS, OPTIMIZER_STATE, PARAM_TARGETS, STATS, TARGETS, UPDATE, UPDATE_RATIO,
    HEALS, Capture, Trigger, stats_of, woken_by,
)
from .patterns import compile_glob, shown

__all__ = ["RESERVED_LABELS", "check_semantics"]

#: labels that hookpolicy_policy_info sets itself, so a policy label may not use them.
RESERVED_LABELS = frozenset({"policy", "revision", "mode", "rank"})
#: Unicode categories refused in paths: controls (NUL, line breaks), format characters
#: (U+202E reverses what a listing shows), surrogates, line and paragraph separators.
_CONTROL = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def check_semantics(document: Document) -> list[Problem]:
    """The problems a JSON Schema cannot find, each at its node."""
    checker = _Checker(document)
    checker.policy(document.data)
    return checker.problems


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _number(value: Any) -> Optional[float]:
    """`value` as a float when it is a (finite) number, not a boolean; else None.

    An integer past float's range is None too: the schema check says why (more than
    64 bits), and `float()` of it would raise OverflowError out of `check`.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            return None
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
        self.snapshots = "snapshots" in _dict(data.get("spec"))
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
        self.after(_dict(trigger.get("after")), rule.get("name"), path + ("trigger", "after"))
        if "select" in rule and target in PARAM_TARGETS:
            self.add(
                path + ("select",),
                f"select narrows tuple, list and dict inputs and outputs; the target {target!r} "
                "is a parameter: choose parameters with match.params instead"
                + (" and state keys with match.state" if target == OPTIMIZER_STATE else ""),
                key=True,
            )
        if target == LOSS:
            self.loss_rule(rule, path, trigger)
        elif "ranks" in rule and target is not None and target not in ACTIVATIONS:
            self.add(path + ("ranks",), f"ranks applies to target: loss and to activations ({', '.join(ACTIVATIONS)}); "
                     f"the {target} statistics of a data-parallel model are the job's already (after DDP's "
                     "all-reduce, of FSDP2's full tensors): drop ranks", key=True)
        elif rule.get("ranks") == "job" and target is not None:
            self.job_activations(rule, path, trigger)
        if target in AFTER_UPDATE:
            self.after_update_rule(rule, path, target)
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

    def after_update_rule(self, rule: dict[str, Any], path: JsonPath, target: str) -> None:
        """`update` and `optimizer_state` are measured after the optimizer applied the step: nothing
        can change them any more, and a skip cannot undo them."""
        for index, item in enumerate(_list(rule.get("actions"))):
            if not isinstance(item, dict):
                continue
            for kind in ("clip", "scale"):
                if kind in item:
                    self.add(path + ("actions", index, kind), f"{kind} cannot change target: {target} (measured after "
                             "the optimizer applied the step); to bound what reaches the weights, "
                             f"{kind} target: grad; here use capture or alert", key=True)
            then = _dict(item.get("alert")).get("then")
            if then == "skip_step":
                self.add(path + ("actions", index, "alert", "then"), f"then: skip_step cannot undo target: {target}: "
                         "it is measured after the optimizer applied the step, and read back at the next step; use "
                         "then: halt (training stops before the next update) or log, or alert on target: grad "
                         "with then: skip_step to keep a step from being applied")

    def job_activations(self, rule: dict[str, Any], path: JsonPath, trigger: dict[str, Any]) -> None:
        """`ranks: job` on an activation target: captures of statistics per module or rule, at training steps."""
        if trigger.get("phase", Trigger.phase) != "train":
            self.add(path + ("trigger", "phase"), "ranks: job reduces statistics across ranks in each training "
                     "step's agreement; only phase: train (the default) applies")
        for index, item in enumerate(_list(rule.get("actions"))):
            if not isinstance(item, dict) or len(item) != 1:
                continue
            ((kind, body),) = item.items()
            where = path + ("actions", index, kind)
            if kind != "capture":
                self.add(where, f"ranks: job reduces captured statistics across ranks; {kind} acts on this "
                         "rank's tensors: put it in a rule of its own (ranks: own, the default)", key=True)
                continue
            body = _dict(body)
            if body.get("per", Capture.per) == "tensor":
                self.add(where + ("per",) if "per" in body else where, "ranks: job reduces statistics per module "
                         "or per rule (a module's tensors are named by what each call returned): per: module "
                         "or per: rule", key="per" in body)
            if "tensors" in body or _dict(body.get("tensorboard")).get("histograms") is True:
                self.add(where, "ranks: job reduces statistics; tensor files and histograms would hold this "
                         "rank's tensors: put them in a capture of their own (ranks: own)", key=True)

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
        for field in ("modules", "exclude", "params", "state"):
            for index, pattern in enumerate(_list(match.get(field))):
                if isinstance(pattern, str) and pattern:
                    self.pattern(pattern, path + (field, index))
        if "params" in match and target is not None and target not in PARAM_TARGETS:
            self.add(
                path + ("params",),
                "params applies only to the parameter targets "
                f"({', '.join(t for t in TARGETS if t in PARAM_TARGETS)}); this rule's target is {target!r}",
                key=True,
            )
        if "state" in match and target is not None and target != OPTIMIZER_STATE:
            self.add(path + ("state",), f"state selects the optimizer's state tensors (exp_avg, exp_avg_sq, ...) "
                     f"of target: {OPTIMIZER_STATE}; this rule's target is {target!r}", key=True)

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

    def after(self, after: dict[str, Any], name: Any, path: JsonPath) -> None:
        """A rule cannot wake on its own alert: asleep until then, it never fires one (other policies'
        rules are looked up where the policies applied together are known: `sources.load_sources`)."""
        alert, policy = after.get("alert"), _dict(self.document.data.get("metadata")).get("name")
        if not isinstance(alert, str) or not isinstance(name, str) or not isinstance(policy, str):
            return
        if woken_by(alert, policy) == (policy, name):
            self.add(path + ("alert",), f"rule {name!r} would wake on its own alert, which it never fires while it "
                                        "sleeps; name the rule whose alert should wake it (POLICY/RULE or RULE)")

    def capture(self, body: dict[str, Any], site: _Site) -> None:
        path = site.path
        for index, stat in enumerate(_list(body.get("stats"))):
            if site.target is not None and stat in STATS and stat not in stats_of(site.target):  # update_ratio
                self.add(path + ("stats", index), _only_update(site.target))
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
        keep = _dict(body.get("keep"))
        if "keep" in body and "stats" not in body:
            self.add(path + ("keep",), "keep holds statistics in a ring: add stats to this capture", key=True)
        dump = _dict(keep.get("dump"))
        self.relative(dump.get("dir"), path + ("keep", "dump", "dir"))
        before, after, steps = (_number(dump.get("before", 100)), _number(dump.get("after", 0)),
                                _number(keep.get("steps")))
        if dump and before is not None and after is not None and steps is not None and before + after >= steps:
            self.add(path + ("keep", "steps"), f"the ring keeps {steps:g} steps, too few for a dump of {before:g} "
                     f"steps before the alert, its step and {after:g} after: keep.steps must be at least "
                     f"{before + after + 1:g}")

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
                parse_value(threshold, CLIP_NAMES)
            except ExprError as exc:
                for error in (exc, *exc.others):
                    self.add(path + ("max_norm",), f"invalid max_norm expression: {error}", offset=error.offset)
        when = body.get("when")
        if "when" in body and not by_norm:
            self.add(path + ("when",), "when restricts a clip by norm to the groups where it holds: add max_norm",
                     key=True)
        elif isinstance(when, str) and when:
            try:
                parse(when, CLIP_NAMES)
            except ExprError as exc:
                for error in (exc, *exc.others):
                    self.add(path + ("when",), f"invalid when condition: {error}", offset=error.offset)
        if "warmup" in body and not isinstance(threshold, str) and "when" not in body and "unitwise_ratio" not in body:
            self.add(path + ("warmup",), "warmup applies to a max_norm expression or a when (which need a history); "
                     "a fixed max_norm clips from the first step (trigger.steps.from starts a rule later)", key=True)
        self.modifies(site)

    def unitwise(self, body: dict[str, Any], site: _Site) -> None:
        """AGC reads the parameters' weights next to their gradients: only at step, on grad, alone."""
        path = site.path
        if "unitwise_ratio" not in body:
            self.add(path + ("eps",), "eps is the weight norm floor of AGC: add unitwise_ratio", key=True)
            return
        others = [key for key in ("max_norm", "min", "max", "norm_type", "per", "warmup", "when") if key in body]
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

    def heals(self, body: dict[str, Any], path: JsonPath) -> None:
        """`then: cool_down` takes a `cool_down` block, `then: rewind` snapshots to go back to; a `skip_step`,
        `cool_down` or `rewind` block goes with its own `then`."""
        then = body.get("then")
        for key in (*HEALS, "skip_step"):
            if key in body and then != key:
                self.add(path + (key,), f"{key} says how then: {key} acts, but this alert's then is "
                         f"{then if isinstance(then, str) else 'log'}: write then: {key}, or drop {key}", key=True)
        if then == "cool_down" and "cool_down" not in body:
            self.add(path + ("then",), "then: cool_down needs its factor and length: add "
                     "cool_down: {factor: 0.1, steps: 100} (the lr times 0.1 for 100 steps) to this alert")
        factor = _number(_dict(body.get("cool_down")).get("factor"))
        if factor is not None and not 0 < factor <= 1:
            self.add(path + ("cool_down", "factor"), f"cool_down.factor ({factor:g}) multiplies the learning rate: "
                     "it must be above 0 and at most 1 (0.1 is ten times lower)")
        if then == "rewind" and not self.snapshots:
            self.add(path + ("then",), "then: rewind goes back to a snapshot, and this policy takes none: add "
                     "snapshots: {every: 50, keep: 2} under spec (a copy of the model and optimizer state "
                     "after every 50 steps, 2 kept in host memory)")

    def alert(self, body: dict[str, Any], site: _Site) -> None:
        path = site.path
        names = expression_names(site.target)
        condition = body.get("if")
        if isinstance(condition, str) and condition:
            try:
                parse(condition, names)
            except ExprError as exc:
                for error in (exc, *exc.others):
                    self.add(path + ("if",), f"invalid condition: {error}", offset=error.offset)
        self.heals(body, path)
        message = body.get("message")
        if isinstance(message, str):
            wrong = message_problem(message, names)
            if wrong:
                self.add(path + ("message",), wrong[0], offset=wrong[1])
        if site.target in (None, UPDATE):
            return
        for key, text in (("if", condition), ("message", message)):
            if not isinstance(text, str):
                continue
            found = _RATIO.search(text)
            if found is not None and (key == "if" or _in_field(text, found.start())):
                self.add(path + (key,), _only_update(site.target), offset=found.start())


def _only_update(target: Optional[str]) -> str:
    return (f"{UPDATE_RATIO} is the update's norm over its parameter's: only target: {UPDATE} (at step) has it; "
            f"this rule's target is {target!r} (l2_norm is its norm)")


#: the statistic `update_ratio` named in an expression
_RATIO = re.compile(rf"\b{UPDATE_RATIO}\b")


def _in_field(message: str, offset: int) -> bool:
    """Whether `offset` of a message template lies inside a `{field}` (not in its literal text)."""
    depth = 0
    for char in re.sub(r"\{\{|\}\}", "  ", message[:offset]):
        depth += 1 if char == "{" else -1 if char == "}" else 0
    return depth > 0
