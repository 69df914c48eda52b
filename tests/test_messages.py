"""Alert messages name modules as names: the model's class for the root, `Sequential.2` for a layer index;
on stderr an alert is one readable `hookpolicy:` line (at most 10 a rule and severity), or its JSON
record with HOOKPOLICY_LOG_FORMAT=json; HOOKPOLICY_ALERT_LOG gets every record either way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers import REPO
from helpers.outputs import alert_lines, json_lines, metric
from helpers.policies import write_policy


def test_a_message_names_the_root_by_its_class_and_an_index_with_its_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "json")  # the records' `module`, besides the message
    policy = write_policy(tmp_path, """
    - name: every
      match: {modules: ["**"]}
      trigger: {at: forward}
      target: output
      actions: [{alert: {if: "numel > 0"}}]
""")
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    capsys.readouterr()
    # a fresh registry: in the process-wide one, earlier tests' Sequentials make this one Sequential#N
    with hookpolicy.load(policy).attach(model, registry=CollectorRegistry()):
        model(torch.randn(2, 3)).sum().backward()
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    said = {r["module"]: r["message"] for r in records}
    assert said == {  # the labels stay as they are; only the sentence reads the names
        "": "p/every: numel > 0 in Sequential at step 0",
        "0": "p/every: numel > 0 in Sequential.0 at step 0",
        "1": "p/every: numel > 0 in Sequential.1 at step 0",
        "2": "p/every: numel > 0 in Sequential.2 at step 0",
    }


EVERY_STEP = """
    - name: every
      match: {modules: ["0"]}
      trigger: {at: forward}
      target: output
      actions: [{alert: {if: "numel > 0", severity: critical, message: "{numel:.0f} values in {module}"}}]
"""


def _train(policy: Path, steps: int) -> CollectorRegistry:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = CollectorRegistry()
    with hookpolicy.load(policy).attach(model, registry=registry):
        for _ in range(steps):
            model(torch.randn(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return registry


def test_alerts_are_readable_lines_then_counted_and_every_record_goes_to_the_alert_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An alert that fires at each of 15 steps (the script's forwards: the reference): 10 lines,
    one line saying the rest are counted, 15 in the counter and 15 records in the alert log."""
    monkeypatch.delenv("HOOKPOLICY_LOG_FORMAT", raising=False)
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    capsys.readouterr()
    registry = _train(write_policy(tmp_path, EVERY_STEP), steps=15)
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if " p/every " in line or "p/every:" in line] == [
        f"hookpolicy: CRITICAL p/every step {step}: 8 values in Sequential.0" for step in range(10)
    ] + ["hookpolicy: CRITICAL p/every: 10 alert lines printed; the rest are counted (hookpolicy_alerts_total, "
         "the run summary), not printed"]
    assert "{" not in err
    assert metric(registry, "hookpolicy_alerts_total", {"rule": "every"}) == 15
    records = json_lines(tmp_path / "alerts.jsonl")
    assert [(r["event"], r["step"], r["module"], r["message"]) for r in records] == [
        ("alert", step, "0", "8 values in Sequential.0") for step in range(15)]


def test_log_format_json_writes_every_record_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "json")
    capsys.readouterr()
    _train(write_policy(tmp_path, EVERY_STEP), steps=15)
    err = capsys.readouterr().err
    assert not alert_lines(err)
    assert [json.loads(line)["step"] for line in err.splitlines() if line.startswith("{")] == list(range(15))


def test_a_log_format_that_is_not_one_is_an_error_at_attach_and_at_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "yaml")
    with pytest.raises(ValueError, match="HOOKPOLICY_LOG_FORMAT='yaml': write one of text, json"):
        hookpolicy.load(write_policy(tmp_path, EVERY_STEP)).attach(nn.Linear(3, 1), registry=CollectorRegistry())
    done = subprocess.run([sys.executable, "-m", "hookpolicy", "apply", str(REPO / "policies" / "nan-guard.yaml"), "--",
                           sys.executable, "-c", "print('never')"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "never" not in done.stdout
    assert "HOOKPOLICY_LOG_FORMAT='yaml': write one of text, json" in done.stderr


EVAL_SKIP = """
    - name: out
      match: {modules: ["0"]}
      trigger: {at: forward, phase: any}
      target: output
      actions: [{alert: {if: "abs_max >= 0", then: skip_step}}]
"""


def test_a_skip_alert_at_an_evaluation_forward_says_it_skipped_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An evaluation forward is no step: its skip_step alert skips nothing, and its record says so;
    the training step after it is skipped (the test's own copy of the weights), and its record says so."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookpolicy.load(write_policy(tmp_path, EVAL_SKIP)).attach(model, registry=CollectorRegistry()):
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
        model.train()
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    records = json_lines(tmp_path / "alerts.jsonl")
    assert [r["outcome"] for r in records] == ["step not skipped (not at a training step)", "step skipped"]
    assert records[0]["message"].endswith(" [step not skipped (not at a training step)]")
