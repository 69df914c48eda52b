"""Each name and default of the policy language is defined once; the other places that spell it agree.

The definitions: the statistic names are `policy.expr.STATS`; a field's default is the
default of its dataclass in `policy.model`. What must follow them and is not derived from
them in code: the JSON schema shipped to editors (its `Statistic` enum and the "(default X)"
of its descriptions) and the engine's table of what each statistic is computed from.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, get_args

import pytest

from hookpolicy.engine.measure import stats as engine_stats
from hookpolicy.policy import model
from hookpolicy.policy.build import build_policy
from hookpolicy.policy.expr import STATS
from hookpolicy.policy.loader import read_document
from hookpolicy.policy.schema import schema

from helpers.policies import write_policy

PACKAGE = Path(model.__file__).resolve().parent.parent

#: schema definition -> property -> (model class, field) whose default its description names
DESCRIBED = {
    ("onError", None): (model.Policy, "on_error"),
    ("limits", "maxSeries"): (model.Policy, "max_series"),
    ("limits", "maxHistoryValues"): (model.Policy, "max_history_values"),
    ("snapshots", "keep"): (model.Snapshots, "keep"),
    ("rewind", "back"): (model.Rewind, "back"),
    ("rewind", "max_rewinds"): (model.Rewind, "max_rewinds"),
    ("priority", None): (model.Rule, "priority"),
    ("trigger", "every"): (model.Trigger, "every"),
    ("trigger", "phase"): (model.Trigger, "phase"),
    ("steps", None): (model.Trigger, "steps_from"),
    ("tensors", "max_files"): (model.TensorFiles, "max_files"),
    ("tensors", "max_bytes"): (model.TensorFiles, "max_bytes"),
    ("tensorboard", "histograms"): (model.Board, "histograms"),
    ("log", "max_bytes"): (model.LogSink, "max_bytes"),
    ("log", "keep"): (model.LogSink, "keep"),
    ("clip", "warmup"): (model.Clip, "warmup"),
    ("clip", "norm_type"): (model.Clip, "norm_type"),
    ("clip", "eps"): (model.Clip, "eps"),
    ("alert", "warmup"): (model.Alert, "warmup"),
    ("alert", "for"): (model.Alert, "for_"),
    ("alert", "severity"): (model.Alert, "severity"),
    ("alert", "then"): (model.Alert, "then"),
}


def described_default(description: str) -> Any:
    """The first default a description names: `(default 10000)`, `(> 0, default 0.001)` or `warning (default)`."""
    found = re.search(r"default ([\w.]+)", description) or re.search(r"(\w+) \(default\)", description)
    assert found is not None, description
    word = found.group(1)
    if word in ("true", "false"):
        return word == "true"
    try:
        return float(word)
    except ValueError:
        return word


def test_the_schema_enum_of_statistics_is_stats() -> None:
    assert schema()["definitions"]["stat"]["enum"] == list(STATS)


def test_the_engine_computes_exactly_the_statistics() -> None:
    assert set(engine_stats._NEEDS) == set(STATS)


def test_model_re_exports_the_one_definition() -> None:
    assert model.STATS is STATS


@pytest.mark.parametrize(("where", "field"), list(DESCRIBED.items()), ids=["/".join(filter(None, k)) for k in DESCRIBED])
def test_the_schema_text_names_the_models_default(where: tuple[str, Any], field: tuple[type, str]) -> None:
    definition, prop = where
    node = schema()["definitions"][definition]
    description = (node["properties"][prop] if prop else node)["description"]
    cls, name = field
    expected = getattr(cls, name)
    assert described_default(description) == (float(expected) if isinstance(expected, (int, float))
                                               and not isinstance(expected, bool) else expected)


def test_an_empty_rule_gets_the_models_defaults(tmp_path: Path) -> None:
    """What the builder fills in for keys a file leaves out is the dataclasses' own defaults."""
    path = write_policy(tmp_path, """
        - name: r
          match: {root: true}
          trigger: {at: step}
          actions:
            - capture: {stats: [mean], tensors: {dir: t}, log: {path: l.jsonl}, tensorboard: {dir: b}}
            - clip: {max_norm: 1.0}
            - clip: {unitwise_ratio: 0.01}
            - alert: {if: "mean > 1"}
    """)
    policy = build_policy(read_document(path))
    rule = policy.rules[0]
    capture, norm_clip, agc, alert = rule.actions
    assert (policy.mode, policy.on_error, policy.max_series) == (model.Policy.mode, model.Policy.on_error, model.Policy.max_series)
    assert policy.max_history_values == model.Policy.max_history_values
    assert policy.max_job_series is model.Policy.max_job_series is None
    assert rule.priority == model.Rule.priority
    assert rule.trigger == model.Trigger(at="step")
    assert isinstance(capture, model.Capture) and capture.per == model.Capture.per
    assert capture.tensors == model.TensorFiles(dir="t")
    assert capture.log == model.LogSink(path="l.jsonl")
    assert capture.tensorboard == model.Board(dir="b")
    assert isinstance(norm_clip, model.Clip) and (norm_clip.norm_type, norm_clip.warmup) == (2.0, 0)
    assert norm_clip.per == "rule"  # at step a norm clip covers the whole rule unless it says otherwise
    assert agc == model.Clip(unitwise_ratio=0.01)
    assert isinstance(alert, model.Alert)
    assert (alert.for_, alert.severity, alert.then, alert.per, alert.warmup, alert.message) == (
        model.Alert.for_, model.Alert.severity, model.Alert.then, model.Alert.per, model.Alert.warmup, model.Alert.message,
    )



def _package_trees() -> list[tuple[str, ast.AST]]:
    return [(str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text("utf-8")))
            for path in sorted(PACKAGE.rglob("*.py"))]


def test_the_then_values_are_the_models_and_the_schemas() -> None:
    thens = get_args(model.Then)
    assert schema()["definitions"]["alert"]["properties"]["then"]["enum"] == list(thens)
    assert set(model.DECIDES) <= set(thens) and "log" not in model.DECIDES
    assert set(model.HEALS) < set(model.DECIDES)
    assert {"cool_down", "rewind"} == set(model.HEALS)  # each has a block of its own name in the schema
    assert all(heal in schema()["definitions"]["alert"]["properties"] for heal in model.HEALS)


def _inline_thens(tree: ast.AST) -> list[int]:
    """Lines of tuples, lists and sets that spell two or more `then` values."""
    thens = set(get_args(model.Then))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            and sum(isinstance(e, ast.Constant) and e.value in thens for e in node.elts) >= 2]


def _inline_keys(tree: ast.AST) -> list[int]:
    """Lines that join something with "/" other than a generator: a rule key's text form written out."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "join" and isinstance(node.func.value, ast.Constant) and node.func.value.value == "/"
            and node.args and not isinstance(node.args[0], (ast.GeneratorExp, ast.ListComp))]


def test_no_module_lists_then_values_of_its_own() -> None:
    """A tuple, list or set of two or more `then` values is `DECIDES` or `HEALS`, written in `policy/model.py` only."""
    found = [f"{name}:{line}" for name, tree in _package_trees() if name != "hookpolicy/policy/model.py"
             for line in _inline_thens(tree)]
    assert found == []


def test_a_rule_keys_text_form_is_rule_name() -> None:
    """`"/".join(key)` is written once, in `model.rule_name`; every other place calls it."""
    assert model.rule_name(("p", "r")) == "p/r"
    found = [f"{name}:{line}" for name, tree in _package_trees() if name != "hookpolicy/policy/model.py"
             for line in _inline_keys(tree)]
    assert found == []


def test_the_source_checks_find_what_they_look_for() -> None:
    """The two checks above can fail: the spellings they refuse are found, the allowed ones are not."""
    tree = ast.parse('a.then in ("skip_step", "halt")\n"/".join(rs.key)\n"/".join(e.get(n) for n in names)\n'
                     'kind in ("clip", "scale")\n')
    assert (_inline_thens(tree), _inline_keys(tree)) == ([1], [2])
    model_tree = ast.parse((PACKAGE / "policy" / "model.py").read_text("utf-8"))
    assert _inline_thens(model_tree) and _inline_keys(model_tree)  # the one definition of each
