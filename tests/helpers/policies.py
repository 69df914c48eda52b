"""Policies for a test: the user contract's example, and policies written on the fly."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import hookpolicy

#: The example policy of the user contract (shared/policy-spec.md), field for field.
SPEC_EXAMPLE = """\
# yaml-language-server: $schema=../schemas/hookpolicy-v1.schema.json
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: llm-guardrails              # required: [a-z0-9]([a-z0-9-]*[a-z0-9])?, at most 63 chars
  labels: {team: ml-platform}       # optional, string to string; shown in hookpolicy_policy_info
  annotations: {runbook: "..."}     # optional, free text, never parsed
spec:
  mode: enforce                     # enforce (default) | audit
  onError: continue                 # continue (default) | halt
  limits:
    maxSeries: 10000                # cap on the metric series this policy may create
  rules:
    - name: clip-attention-grads    # required, unique within the policy
      mode: audit                   # optional, overrides spec.mode for this rule
      priority: 50                  # optional int 0..100, lower runs first; ties keep file order
      match:
        modules: ["transformer.h.*.attn.*"]
        types: [Linear]
        exclude: ["**.c_proj"]
        params: ["weight"]          # only for targets that are parameters (grad, weight)
      trigger:
        at: step                    # forward_pre | forward | backward | step
        every: 1                    # evaluate on steps where step % every == 0
        steps: {from: 100, until: 5000}   # optional window: from inclusive, until exclusive
        phase: train                # train (default) | eval | any
      target: grad                  # see the table in 3.
      actions:
        - capture: {stats: [l2_norm, abs_max, nonfinite]}
        - clip: {max_norm: 1.0, norm_type: 2, per: rule}
        - alert:
            if: "nonfinite > 0"
            for: 1
            severity: critical
            then: skip_step
            message: "non-finite gradients in {module} at step {step}"
"""



def policy_text(rules: str, *, name: str = "p", spec: str = "") -> str:
    """A policy named `name` with `rules` (a YAML list, indented as you like) and more `spec` keys."""
    text = f"apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata:\n  name: {name}\nspec:\n"
    text += textwrap.indent(textwrap.dedent(spec), "  ")
    return text + "  rules:\n" + textwrap.indent(textwrap.dedent(rules), "    ")


def write_policy(folder: Path, rules: str, *, name: str = "p", spec: str = "") -> Path:
    """`policy_text(...)` written to `folder/<name>.yaml`."""
    path = folder / f"{name}.yaml"
    path.write_text(policy_text(rules, name=name, spec=spec))
    return path


def load_policy(folder: Path, rules: str, *, name: str = "p", spec: str = "") -> hookpolicy.PolicySet:
    """`write_policy(...)`, loaded as users load it (`hookpolicy.load`)."""
    return hookpolicy.load(write_policy(folder, rules, name=name, spec=spec))


def refusal(folder: Path, rules: str) -> str:
    """What `hookpolicy.load` says refusing `policy_text(rules)` (a `PolicyError`), checked to start with the file."""
    path = write_policy(folder, rules)
    with pytest.raises(hookpolicy.PolicyError) as caught:
        hookpolicy.load(path)
    shown = str(caught.value)
    assert shown.startswith(f"{path}:"), shown
    return shown


#: Two rules: the Linear layers' gradient statistics logged to logs/norms.jsonl every step,
#: and their outputs' rms.
LOG_EVERY_STEP = """\
- name: norms
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm, mean, std, max, min], per: tensor, log: {path: logs/norms.jsonl}}
- name: outputs
  match: {types: [Linear]}
  trigger: {at: forward}
  actions:
    - capture: {stats: [rms]}
"""


#: A NaN in any gradient halts the step (`.replace("halt", "skip_step")` skips it instead): the policy of
#: the tests of what a process leaves at exit (tests/test_push.py, tests/test_textfile.py).
HALT_ON_NAN = """\
- name: nan
  match: {modules: ["**"]}
  trigger: {at: step}
  target: grad
  actions:
    - alert: {if: "nonfinite > 0", severity: critical, then: halt}
"""
