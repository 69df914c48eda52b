"""Semantic checks and building the typed Policy from a Document."""

from __future__ import annotations

import math

import pytest

from hookpolicy.policy import build
from hookpolicy.policy.build import build_policy
from hookpolicy.policy.checks import check_semantics
from hookpolicy.errors import PolicyError, Problem
from hookpolicy.policy.expr import parse
from hookpolicy.policy.loader import parse_document
from hookpolicy.policy.model import (
    Alert, Capture, Clip, LogSink, Match, Policy, Rule, Scale, TensorFiles, Trigger,
)

from helpers.policies import SPEC_EXAMPLE, policy_text


def policy_of(rules: str, spec: str = "", name: str = "p") -> Policy:
    return build_policy(parse_document(policy_text(rules, name=name, spec=spec), "p.yaml"))


def problems_of(rules: str, spec: str = "") -> list[Problem]:
    with pytest.raises(PolicyError) as caught:
        policy_of(rules, spec)
    return list(caught.value.problems)


def test_the_spec_example_builds_into_the_expected_model() -> None:
    document = parse_document(SPEC_EXAMPLE, "policies/llm.yaml")
    policy = build_policy(document)
    alert = Alert(
        condition=parse("nonfinite > 0"), source="nonfinite > 0", for_=1, severity="critical",
        then="skip_step", message="non-finite gradients in {module} at step {step}", per="module",
    )
    rule = Rule(
        name="clip-attention-grads",
        index=0,
        trigger=Trigger(at="step", every=1, steps_from=100, steps_until=5000, phase="train"),
        target="grad",
        match=Match(
            modules=("transformer.h.*.attn.*",), types=("Linear",), root=False,
            exclude=("**.c_proj",), params=("weight",),
        ),
        actions=(
            Capture(stats=("l2_norm", "abs_max", "nonfinite"), per="module"),
            Clip(max_norm=1.0, norm_type=2.0, per="rule"),
            alert,
        ),
        mode="audit",
        priority=50,
    )
    assert policy == Policy(
        name="llm-guardrails", source="policies/llm.yaml", revision=document.revision,
        rules=(rule,), mode="enforce", on_error="continue", max_series=10000,
        labels={"team": "ml-platform"}, annotations={"runbook": "..."},
    )
    assert policy.rules[0].stats == ("l2_norm", "abs_max", "nonfinite")


def test_defaults_are_filled() -> None:
    policy = policy_of("""\
        - name: fwd
          match: {root: true}
          trigger: {at: forward}
          actions:
            - clip: {max_norm: 2}
            - alert: {if: "abs_max > 1e4"}
        - name: step
          mode: enforce
          match: {types: [torch.nn.Linear]}
          trigger: {at: step}
          actions:
            - clip: {max_norm: 2, norm_type: inf}
            - capture: {tensors: {dir: dumps}, stats: [mean], log: {}}
        - name: bwd
          match: {modules: ["**"]}
          trigger: {at: backward}
          actions:
            - clip: {min: -1}
            - scale: {factor: -0.5}
        """, spec="mode: audit\n")
    fwd, step, bwd = policy.rules
    assert (policy.mode, policy.on_error, policy.max_series) == ("audit", "continue", 10000)
    assert (policy.labels, policy.annotations) == ({}, {})
    assert [r.index for r in policy.rules] == [0, 1, 2]
    assert (fwd.mode, step.mode, bwd.mode) == ("audit", "enforce", "audit")
    assert (fwd.target, step.target, bwd.target) == ("output", "grad", "grad_output")
    assert (fwd.priority, fwd.select) == (50, ())
    assert fwd.trigger == Trigger(
        at="forward", every=1, steps_from=0, steps_until=None, phase="train"
    )
    assert fwd.match == Match(root=True)
    assert fwd.actions[0] == Clip(max_norm=2.0, norm_type=2.0, per="tensor")
    alert = fwd.actions[1]
    assert isinstance(alert, Alert)
    assert (alert.for_, alert.severity, alert.then, alert.per) == (1, "warning", "log", "module")
    assert alert.message == Alert.message  # the model's default
    assert step.actions[0] == Clip(max_norm=2.0, norm_type=math.inf, per="rule")
    assert step.actions[1] == Capture(
        stats=("mean",), per="module",
        tensors=TensorFiles(dir="dumps", max_files=1000, max_bytes=1 << 30),
        log=LogSink(path=None),
    )
    assert bwd.actions == (Clip(min=-1.0), Scale(factor=-0.5))


def test_values_are_converted_to_their_model_types() -> None:
    policy = policy_of("""\
        - name: r
          priority: 7
          select: [0, logits]
          match: {modules: ["**"]}
          trigger: {at: forward, every: 2.0, steps: {until: 10}, phase: any}
          actions:
            - scale: {factor: 2}
            - capture: {stats: [rms], per: tensor, log: {path: logs/rms.jsonl}}
        """, spec="limits: {maxSeries: 5, maxJobSeries: 40.0, maxHistoryValues: 300.0}\nonError: halt\n")
    (rule,) = policy.rules
    assert (policy.max_series, policy.max_job_series, policy.max_history_values, policy.on_error) == (5, 40, 300, "halt")
    assert isinstance(policy.max_history_values, int) and isinstance(policy.max_job_series, int)
    assert rule.select == (0, "logits") and rule.priority == 7
    assert rule.trigger == Trigger(at="forward", every=2, steps_until=10, phase="any")
    assert isinstance(rule.trigger.every, int)
    assert rule.actions[0] == Scale(factor=2.0) and isinstance(rule.actions[0].factor, float)
    assert rule.actions[1] == Capture(stats=("rms",), per="tensor", log=LogSink("logs/rms.jsonl"))


def test_all_problems_of_a_file_are_reported_at_once() -> None:
    problems = problems_of("""\
        - name: r
          match: {modules: ["[oops"]}
          trigger: {at: step, every: 0}
          target: output
          actions:
            - capture: {stats: [l2_norm]}
        """)
    assert [(p.line, p.path) for p in problems] == [
        (8, "$.spec.rules[0].match.modules[0]"),
        (9, "$.spec.rules[0].trigger.every"),
        (10, "$.spec.rules[0].target"),
    ]


def test_semantic_checks_survive_malformed_documents() -> None:
    text = policy_text("""\
        - name: [not, a, string]
          match: 3
          trigger: {at: [step], steps: {from: x, until: []}}
          target: {}
          select: 5
          actions: [{capture: 1}, {clip: []}, {alert: {if: 3, message: 4}}, 7, {a: 1, b: 2}]
        - 42
        """, spec="mode: 1\n")
    document = parse_document(text, "p.yaml")
    assert check_semantics(document) == []
    with pytest.raises(PolicyError):
        build_policy(document)


def test_condition_column_points_into_the_string() -> None:
    problems = problems_of("""\
        - name: r
          match: {modules: ["**"]}
          trigger: {at: forward}
          actions:
            - alert: {if: 'l2_norm > 1 and mean ? 2'}
            - alert:
                if: >-
                  l2_norm >
        """)
    first, second = problems
    assert (first.line, first.column) == (11, 45)  # the '?' inside the single-quoted string
    assert "unexpected character '?'" in first.message
    assert (second.line, second.column) == (13, 17)  # a block scalar: the node itself
    assert "expected a number, a name, a function or '(' after '>'" in second.message


def test_message_may_use_every_documented_field_and_stat() -> None:
    message = (
        "{policy}/{rule} {module} {tensor} {target} {step:>6} {severity} {condition!r} "
        "{l2_norm:.3g} {nonfinite:.0f} {numel} {{literal}}"
    )
    policy = policy_of(f"""\
        - name: r
          match: {{modules: ["**"]}}
          trigger: {{at: forward}}
          actions:
            - alert: {{if: "mean > 1", message: "{message}"}}
        """)
    alert = policy.rules[0].actions[0]
    assert isinstance(alert, Alert) and alert.message == message
    assert alert.stats == frozenset({"mean", "l2_norm", "nonfinite", "numel"})
    assert policy.rules[0].stats == ("l2_norm", "mean", "nonfinite", "numel")


@pytest.mark.parametrize("message, wanted", [
    ("{0}", "unknown message field {0}"),
    ("{}", "unknown message field {}"),
    ("{step[0]}", "unknown message field {step[0]}"),
    ("{mean:{step}}", "may not contain fields"),
    ("{mean", "invalid message template"),
    ("}", "invalid message template"),
])
def test_bad_message_templates(message: str, wanted: str) -> None:
    (problem,) = problems_of(f"""\
        - name: r
          match: {{modules: ["**"]}}
          trigger: {{at: forward}}
          actions:
            - alert: {{if: "mean > 1", message: "{message}"}}
        """)
    assert wanted in problem.message and problem.path.endswith(".alert.message")


ESCAPING = ["/abs", r"\\server\share", r"C:\x", "C:x", "~/x", "a/../b", "..", r"a\..\b"]


@pytest.mark.parametrize("value", ESCAPING)
def test_paths_may_not_leave_the_output_folder(value: str) -> None:
    (problem,) = problems_of(f"""\
        - name: r
          match: {{modules: ["**"]}}
          trigger: {{at: forward}}
          actions:
            - capture: {{tensors: {{dir: '{value}'}}}}
        """)
    assert problem.path == "$.spec.rules[0].actions[0].capture.tensors.dir"
    assert "must be relative" in problem.message or "must not contain '..'" in problem.message


@pytest.mark.parametrize("value", ["dumps", "./dumps", "a/b..c/d", "run-1/x.jsonl"])
def test_relative_paths_are_fine(value: str) -> None:
    policy = policy_of(f"""\
        - name: r
          match: {{modules: ["**"]}}
          trigger: {{at: forward}}
          actions:
            - capture: {{tensors: {{dir: "{value}"}}}}
        """)
    assert policy.rules[0].actions[0] == Capture(tensors=TensorFiles(dir=value))


@pytest.mark.parametrize("at, target, ok", [
    ("forward_pre", "input", True), ("forward_pre", "output", False),
    ("forward", "output", True), ("forward", "input", True), ("forward", "grad", False),
    ("backward", "grad_output", True), ("backward", "grad_input", True),
    ("backward", "weight", False),
    ("step", "grad", True), ("step", "weight", True), ("step", "output", False),
])
def test_target_must_fit_the_trigger(at: str, target: str, ok: bool) -> None:
    rules = f"""\
        - name: r
          match: {{modules: ["**"]}}
          trigger: {{at: {at}}}
          target: {target}
          actions:
            - capture: {{stats: [mean]}}
        """
    if ok:
        assert policy_of(rules).rules[0].target == target
    else:
        (problem,) = problems_of(rules)
        assert problem.path == "$.spec.rules[0].target"
        assert f"does not fit trigger.at '{at}'" in problem.message


def test_clip_per_rule_only_at_step_and_only_with_max_norm() -> None:
    rule = policy_of("""\
        - name: r
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - clip: {max_norm: 1, per: module, norm_type: 1}
        """).rules[0]
    assert rule.actions[0] == Clip(max_norm=1.0, norm_type=1.0, per="module")
    (problem,) = problems_of("""\
        - name: r
          match: {modules: ["**"]}
          trigger: {at: forward_pre}
          actions:
            - clip: {max_norm: 1, per: rule}
        """)
    assert problem.path.endswith("clip.per") and "needs trigger.at: step" in problem.message


def test_clip_unitwise_builds_agc_with_eps_by_default() -> None:
    rule = policy_of("""\
        - name: r
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - clip: {unitwise_ratio: 0.01}
            - clip: {unitwise_ratio: 0.16, eps: 0.0001}
        """).rules[0]
    assert rule.actions == (Clip(unitwise_ratio=0.01, eps=1e-3), Clip(unitwise_ratio=0.16, eps=1e-4))
    assert all(isinstance(a, Clip) and a.unitwise for a in rule.actions)
    assert not Clip(max_norm=1.0).unitwise


def test_booleans_are_not_integers() -> None:
    problems = problems_of("""\
        - name: r
          priority: false
          match: {modules: ["**"], root: 1}
          trigger: {at: step, every: true}
          actions:
            - scale: {factor: true}
        """)
    assert [p.message for p in problems] == [
        "expected an integer, got boolean false",
        "expected a boolean (true or false), got integer 1",
        "expected an integer, got boolean true",
        "expected a number, got boolean true",
    ]


def test_unquoted_numbers_where_text_is_expected_get_a_hint() -> None:
    (problem,) = problems_of("""\
        - name: 123
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - scale: {factor: 1}
        """)
    assert problem.message == (
        "expected a string, got integer 123; quote the value to make it a string"
    )


def test_problems_are_capped() -> None:
    rule = (
        "- name: r{}\n  bogus: 1\n  match: {{modules: ['**']}}\n  trigger: {{at: step}}\n"
        "  actions: [{{scale: {{factor: 1}}}}]\n"
    )
    rules = "".join(rule.format(i) for i in range(150))
    problems = problems_of(rules)
    assert len(problems) == build.MAX_PROBLEMS + 1
    assert problems[-1].message == "... and 50 more problems"


def test_pattern_errors_that_re_raises_oddly_are_problems_too() -> None:
    (problem,) = problems_of("""\
        - name: r
          match: {modules: ["re:a{99999999999}"]}
          trigger: {at: step}
          actions:
            - scale: {factor: 1}
        """)
    assert problem.path == "$.spec.rules[0].match.modules[0]"


def test_an_empty_clip_says_what_it_needs() -> None:
    (problem,) = problems_of("""\
        - name: r
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - clip: {}
        """)
    assert problem.path == "$.spec.rules[0].actions[0].clip"
    assert problem.message == (
        "a clip needs max_norm (clip by norm), min and/or max (clamp values), or unitwise_ratio (AGC, at step)"
    )


def test_a_second_action_key_that_is_not_plain_text_is_quoted_in_one_line() -> None:
    """Found by the fuzz tests: a key with a line break made the message two lines."""
    problems = problems_of("""
        - name: r
          match: {modules: ["**"]}
          trigger: {at: forward}
          actions:
            - {capture: {stats: [l2_norm]}, "\\n": []}
    """)
    assert all("\n" not in p.message for p in problems), problems
    assert any(p.message == "an actions item holds exactly one action, found capture and '\\n'; "
                            "write '\\n' as its own list item" for p in problems), problems
