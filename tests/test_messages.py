"""Alert messages name modules as names: the model's class for the root, `Sequential.2` for a layer index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers.policies import write_policy


def test_a_message_names_the_root_by_its_class_and_an_index_with_its_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
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
