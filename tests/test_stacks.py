"""The compatibility matrix: real training stacks under `hookpolicy apply`, checked against their own numbers.

Each test runs an unmodified training script of one stack (tests/stacks/) under
tests/stacks/guard.yaml (a NaN guard that skips the step, a `per: rule` clip to 0.5,
per-layer gradient norms) and checks, against what hookpolicy did not compute:

- steps: `hookpolicy_steps_total` equals the framework's own count (Lightning's
  `global_step`, the Trainer's `state.global_step`, the loop's count);
- skip: the step with a NaN loss left the parameters and the optimizer state bit for bit
  as they were, every other step changed them, and `hookpolicy_skipped_steps_total` is 1;
- clip: the norm of the gradients the optimizer applied, read by the test's own
  optimizer step pre-hook (after the closure, for `step(closure)`), is at most 0.5,
  and equals min(the exported pre-clip norm, 0.5) at the last step;
- labels: the modules and the `model` label are the same whatever the script's flags.

docs/compatibility.md is the table these tests back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import hookpolicy
from conftest import REPO, metric
from hookpolicy.export.metrics import store_for

STACKS = REPO / "tests" / "stacks"
GUARD = STACKS / "guard.yaml"
MAX_NORM = 0.5

Sample = tuple[str, dict[str, str], float]


@dataclass
class Stack:
    """What one stack script measured (probe.py) and what hookpolicy exported, at its end."""

    out: dict[str, Any]
    stderr: str

    @property
    def samples(self) -> list[Sample]:
        text = self.out["metrics"]
        return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [v for n, lab, v in self.samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
        assert len(found) == 1, f"{name}{labels}: {found}\n{self.stderr}"
        return found[0]

    def labels(self, name: str, key: str, **labels: str) -> set[str]:
        return {lab[key] for n, lab, _ in self.samples if n == name and all(lab.get(k) == w for k, w in labels.items())}

    def probe(self, name: str = "optimizer") -> dict[str, Any]:
        return self.out["probes"][name]  # type: ignore[no-any-return]


def run_stack(tmp_path: Path, free_port: int, script: str, *args: str, policy: Path = GUARD,
              timeout: float = 240) -> Stack:
    out = tmp_path / f"{Path(script).stem}-{len(list(tmp_path.iterdir()))}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "STACK_OUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "default"}
    env.pop("HOOKPOLICY_POLICY_DIRS", None)
    done = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", str(policy), "--metrics-port", str(free_port), "--",
         sys.executable, str(STACKS / script), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return Stack(json.loads(out.read_text()), done.stderr)


def check_guarded(stack: Stack, nan_at: Optional[int], model: str, probe: str = "optimizer") -> None:
    """Steps, skip and clip as the module docstring says, for one model stepped by one optimizer."""
    seen = stack.probe(probe)
    assert stack.value("hookpolicy_steps_total", model=model) == stack.out["framework_steps"] == len(seen["norms"])
    changed = [i for i, same in enumerate(seen["unchanged"]) if not same]
    expected = [i for i in range(len(seen["norms"])) if i != nan_at]
    assert changed == expected, stack.stderr
    skipped = stack.value("hookpolicy_skipped_steps_total", model=model, rule="nan")
    assert skipped == (0 if nan_at is None else 1)
    applied = [n for i, n in enumerate(seen["norms"]) if i != nan_at]
    assert applied and all(n is not None and n <= MAX_NORM * (1 + 1e-5) for n in applied), applied
    assert any(n > MAX_NORM * 0.99 for n in applied)  # the clip had work to do
    exported = stack.value("hookpolicy_grad_l2_norm", model=model, rule="clip")
    assert applied[-1] == pytest.approx(min(exported, MAX_NORM), rel=1e-4)
    assert "Traceback" not in stack.stderr, stack.stderr


# -- in process: counters and model labels, with the Python API ----------------------------

COUNTING = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: p}
spec:
  rules:
    - name: nan
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "nonfinite > 0", per: module, then: skip_step}
    - name: outputs
      match: {types: [Linear]}
      trigger: {at: forward}
      actions:
        - capture: {stats: [rms]}
"""


def _metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = metric(registry, name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


def test_counters_count_what_their_names_say(tmp_path: Path) -> None:
    """One NaN step, 4 micro-batches a step, 3 Linears: 1 skipped step, 3 firings, actions once per step and module."""
    (tmp_path / "p.yaml").write_text(COUNTING)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = CollectorRegistry()
    with hookpolicy.load(tmp_path / "p.yaml").attach(model, registry=registry) as attached:
        for step in range(3):
            for _ in range(4):
                x = torch.randn(5, 4) * (float("nan") if step == 1 else 1.0)
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert _metric(registry, "hookpolicy_steps_total") == 3
    assert _metric(registry, "hookpolicy_skipped_steps_total", rule="nan") == 1
    assert _metric(registry, "hookpolicy_alerts_total", rule="nan") == 3  # one firing per module
    modules = {rule: len([b for b in attached.plan.bindings if b.rule.name == rule]) for rule in ("nan", "outputs")}
    assert modules == {"nan": 3, "outputs": 3}
    assert _metric(registry, "hookpolicy_actions_total", rule="nan", action="alert") == 3 * 3
    assert _metric(registry, "hookpolicy_actions_total", rule="outputs", action="capture") == 3 * 3  # not x 4


def test_every_family_says_its_unit() -> None:
    """The HELP text of each engine family, as Prometheus shows it: what one unit of it is."""
    registry = CollectorRegistry()
    text = generate_latest(registry).decode()
    assert text == ""  # nothing registered yet
    store_for(registry, 0)
    helps = {line.split()[2]: line.split(" ", 3)[3] for line in generate_latest(registry).decode().splitlines()
             if line.startswith("# HELP")}
    assert helps == {
        "hookpolicy_steps_total": "Optimizer steps of the model evaluated by hookpolicy: one per optimizer step() "
        "(several optimizers after one backward pass, or the micro-batches of one step, make one).",
        "hookpolicy_last_step_timestamp_seconds": "Unix time in seconds of the last step of the model hookpolicy evaluated.",
        "hookpolicy_actions_total": "Actions run: one per step and binding (a rule on one module) on which the action "
        "ran, however many calls or micro-batches the step had; audit actions change nothing.",
        "hookpolicy_alerts_total": "Alert firings: one per evaluation (once a step) and group of the alert's per "
        "(rule, module or tensor) on which it fired.",
        "hookpolicy_alert_firing": "1 while an alert's condition holds (after its for: count), else 0.",
        "hookpolicy_skipped_steps_total": "Optimizer steps skipped by a rule's alert: one per skipped step, however "
        "many modules fired.",
        "hookpolicy_hook_errors_total": "Errors raised inside hookpolicy's hooks: one per error.",
        "hookpolicy_hook_seconds_total": "Seconds spent inside hookpolicy's hooks and read-back.",
        "hookpolicy_policy_info": "The applied policies: revision is the file's content hash.",
        "hookpolicy_config_last_reload_successful": "1 if the last policy (re)load succeeded, else 0.",
        "hookpolicy_series_dropped_total": "Statistic series not exported because spec.limits.maxSeries was reached: "
        "one per series.",
    }


def test_two_models_of_one_class_get_their_own_label(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(COUNTING)
    policies = hookpolicy.load(tmp_path / "p.yaml")
    registry = CollectorRegistry()
    first, second = nn.Sequential(nn.Linear(4, 1)), nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        second[0].weight.mul_(100)
    with policies.attach(first, registry=registry), policies.attach(second, registry=registry):
        for model, steps in ((first, 2), (second, 3)):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(steps):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        assert _metric(registry, "hookpolicy_steps_total", model="Sequential") == 2
        assert _metric(registry, "hookpolicy_steps_total", model="Sequential#2") == 3
        rms = {m: _metric(registry, "hookpolicy_output_rms", model=m, module="0") for m in ("Sequential", "Sequential#2")}
        assert rms["Sequential#2"] > 10 * rms["Sequential"]  # neither overwrote the other
