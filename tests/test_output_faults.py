"""A model's output is the script's: hookpolicy reads nothing from it that can raise into training.

Issue 24.5: a model output whose `.loss` raised (anything but AttributeError) crashed
training under `target: loss`, from an output hook outside any containment. The loss is
now taken at the backward root (engine/hooks/loss.py), so the output is never read; this keeps
it so. The reference is the loss the script itself backpropagated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers.policies import write_policy


class Output:
    """A model output whose `.loss` raises, as some libraries' outputs do without labels."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    @property
    def loss(self) -> torch.Tensor:
        raise RuntimeError("no labels were given")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.linear(x))


def test_an_output_whose_loss_raises_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path))
    path = write_policy(tmp_path, """
        - name: loss
          match: {root: true}
          trigger: {at: step}
          target: loss
          actions:
            - capture: {stats: [mean], log: {path: loss.jsonl}}
    """)
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = CollectorRegistry()
    losses = []
    with hookpolicy.load(path).attach(model, registry=registry, rank=0):
        for _ in range(5):
            loss = model(torch.randn(3, 4)).logits.pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    records = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert [r["stats"]["mean"] for r in records] == [pytest.approx(v, rel=1e-6) for v in losses]
    assert not registry.get_sample_value(
        "hookpolicy_hook_errors_total", {"policy": "p", "rule": "loss", "rank": "0", "model": "Model"})
