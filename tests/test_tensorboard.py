"""The TensorBoard sink, read back with TensorBoard's own reader and compared with the JSON lines
and with the gradients an optimizer hook of the test saw itself."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from hookpolicy.export.tensorboard import MISSING_TENSORBOARD
from helpers.policies import write_policy

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

RULES = """
    - name: grads
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - capture:
            stats: [l2_norm, min, max, numel]
            per: tensor
            log: {path: grads.jsonl}
            tensorboard: {dir: runs, histograms: true}
    - name: total
      match: {modules: ["**"]}
      trigger: {at: step, every: 2}
      target: grad
      actions:
        - capture: {stats: [l2_norm], per: rule, tensorboard: {dir: runs}}
"""
STEPS = 6


def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry) -> dict[int, dict[str, torch.Tensor]]:
    """A few SGD steps under the policy; returns the gradients each step applied, as the test saw them."""
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path))
    path = write_policy(tmp_path, RULES, name="tb")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    opt.register_step_pre_hook(lambda o, a, k: seen.__setitem__(len(seen), {
        names[id(p)]: p.grad.detach().clone() for g in o.param_groups for p in g["params"] if p.grad is not None}))
    with hookpolicy.load(path).attach(model, registry=registry, rank=0):
        for _ in range(STEPS):
            model(torch.randn(5, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    return seen


def test_tensorboard_scalars_and_histograms_match_the_log_and_the_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = train(tmp_path, monkeypatch, CollectorRegistry())
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "runs" / "rank0"), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0},
    )
    acc.Reload()
    records = [json.loads(line) for line in (tmp_path / "grads.jsonl").read_text().splitlines()]
    assert len(records) == STEPS * 4  # 2 Linear x (weight, bias)
    for r in records:
        for stat, value in r["stats"].items():
            tag = f"tb/grads/grad_{stat}/{r['module']}/{r['tensor']}"
            by_step = {e.step: e.value for e in acc.Scalars(tag)}
            assert by_step[r["step"]] == pytest.approx(value, rel=1e-6)  # TensorBoard keeps float32
    # The histograms hold exactly the gradients the optimizer applied.
    for step, grads in seen.items():
        for name, grad in grads.items():
            module, tensor = name.split(".")
            histo = {e.step: e.histogram_value for e in acc.Histograms(f"tb/grads/grad/{module}/{tensor}")}[step]
            assert histo.num == grad.numel()
            assert histo.min == pytest.approx(grad.min().item(), rel=1e-6)
            assert histo.max == pytest.approx(grad.max().item(), rel=1e-6)
            assert histo.sum == pytest.approx(grad.sum().item(), rel=1e-4, abs=1e-6)
    # The per-rule total, every second step, is clip_grad_norm_'s number.
    total = {e.step: e.value for e in acc.Scalars("tb/total/grad_l2_norm/<rule>")}
    assert sorted(total) == list(range(0, STEPS, 2))
    for step, value in total.items():
        reference = torch.nn.utils.get_total_norm(list(seen[step].values()))
        assert value == pytest.approx(reference.item(), rel=1e-5)
    assert "tb/total/grad_l2_norm/<rule>" not in {t for t in acc.Tags()["histograms"]}


def test_without_tensorboard_the_rule_reports_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    registry = CollectorRegistry()
    with caplog.at_level(logging.ERROR, logger="hookpolicy"):
        train(tmp_path, monkeypatch, registry)
    assert MISSING_TENSORBOARD in caplog.text
    errors = [s.value for family in registry.collect() for s in family.samples
              if s.name == "hookpolicy_hook_errors_total" and s.labels.get("rule") == "grads"]
    assert errors and errors[0] >= 1


def test_a_missing_tensorboard_is_said_at_check_explain_and_attach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Before any step: `check` and `explain` warn with the install line, and so does attach."""
    from click.testing import CliRunner

    from hookpolicy.cli import cli

    policy = write_policy(tmp_path, """
    - name: boards
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions: [{capture: {stats: [l2_norm], tensorboard: {dir: tb}}}]
""")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if the package were not installed
    line = f"p/boards: {MISSING_TENSORBOARD}; until then this rule writes no event file"
    checked = CliRunner().invoke(cli, ["check", str(policy)])
    assert checked.exit_code == 0 and f"warning: {policy}: {line}" in checked.stderr
    explained = CliRunner().invoke(cli, ["explain", str(policy), "--model", "examples.train_mlp:build_model"])
    assert f"warning: {line}" in explained.stdout
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with hookpolicy.load(policy).attach(nn.Sequential(nn.Linear(2, 2)), registry=CollectorRegistry()):
            assert line in caplog.text
    monkeypatch.delitem(sys.modules, "tensorboard")
    assert "tensorboard" not in CliRunner().invoke(cli, ["check", str(policy)]).stderr  # installed: nothing said
