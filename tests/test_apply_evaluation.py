"""`hookpolicy apply` on scripts that evaluate: one that only evaluates, and nanoGPT's
evaluation at step 0, before its first training forward.

Discovery used to start at the first forward with grad on, so an evaluation-only script
under `activation-sparsity.yaml` or `feature-extraction.yaml` (whose headers say to run an
evaluation loop under `apply`) got "no model was governed", and nanoGPT's `estimate_loss`
at iteration 0 was never measured. The references are the scripts' own forward hooks on
the same modules, written beside the run; hookpolicy's numbers come from its log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import pytest

from helpers.outputs import json_lines
from helpers.processes import Run, child_env

REPO = Path(__file__).resolve().parent.parent
POLICIES = REPO / "policies"

SCRIPT = """
import json, sys
import torch, torch.nn as nn

torch.manual_seed(0)
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    def forward(self, x):
        return x + self.mlp(x)
model = nn.Sequential(Block(), Block())
reference = []
def watch(name):
    def hook(module, args, out):
        o = out.double()
        reference.append({"module": name, "zero_fraction": (o == 0).double().mean().item(),
                          "mean": o.mean().item(), "rms": o.pow(2).mean().sqrt().item(),
                          "abs_max": o.abs().max().item(), "train": module.training})
    return hook
for name, m in model.named_modules():
    if isinstance(m, nn.GELU):
        m.register_forward_hook(watch(name))
mode = sys.argv[1]
def evaluate():
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8))
    model.train()
if mode == "evaluate-only":
    for _ in range(3):
        evaluate()
else:  # nanoGPT's loop: optimizer first, estimate_loss at iteration 0, then train
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for it in range(3):
        if it % 2 == 0:
            evaluate()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
json.dump(reference, open(sys.argv[2], "w"))
"""


def _policy(tmp_path: Path, log: str = "act.jsonl") -> Path:
    """activation-sparsity.yaml measuring every forward (every: 1), with a log beside its export."""
    text = (POLICIES / "activation-sparsity.yaml").read_text()
    text = text.replace("        every: 10\n", "        every: 1\n")
    text = text.replace("capture: {stats: [zero_fraction, mean, rms, abs_max], per: module}",
                        f"capture: {{stats: [zero_fraction, mean, rms, abs_max], per: module, log: {{path: {log}}}}}", 1)
    assert str(log) in text and "        every: 1\n" in text
    path = tmp_path / "activation-sparsity.yaml"
    path.write_text(text)
    return path


def _compare(records: list[dict], reference: list[dict]) -> None:
    assert len(records) == len(reference)
    for record, ref in zip(records, reference):
        assert record["module"] == ref["module"]
        for stat in ("zero_fraction", "mean", "rms", "abs_max"):
            assert record["stats"][stat] == pytest.approx(ref[stat], rel=1e-5, abs=1e-7), (record, ref)


def _run(apply: Callable[..., Run], tmp_path: Path, mode: str) -> tuple[list[dict], list[dict]]:
    """The script in `mode` under the measuring policy: hookpolicy's records and the script's own reference."""
    script, ref_file = tmp_path / "script.py", tmp_path / "reference.json"
    script.write_text(SCRIPT)
    run = apply(str(_policy(tmp_path)), "--", sys.executable, str(script), mode, str(ref_file),
                env=child_env(HOOKPOLICY_OUTPUT_DIR=str(tmp_path)))
    assert run.wait() == 0, run.stderr
    assert "no model was governed" not in run.stderr
    records = [r for r in json_lines(tmp_path / "act.jsonl") if r["rule"] == "mlp-activations"]
    return records, json.loads(ref_file.read_text())


@pytest.mark.slow
def test_an_evaluation_only_script_is_governed_and_measured(apply: Callable[..., Run], tmp_path: Path) -> None:
    records, reference = _run(apply, tmp_path, "evaluate-only")
    assert len(reference) == 6 and not any(r["train"] for r in reference)  # 3 evaluations x 2 GELUs
    _compare(records, reference)


@pytest.mark.slow
def test_nanogpts_evaluation_before_the_first_step_is_measured(apply: Callable[..., Run], tmp_path: Path) -> None:
    records, reference = _run(apply, tmp_path, "train")
    # evaluations at iterations 0 and 2, training forwards at 0, 1, 2: 2 GELUs each
    assert [r["train"] for r in reference[::2]] == [False, True, True, False, True]
    _compare(records, reference)
    assert records[0]["step"] == 0  # the evaluation before the first step, at step 0


@pytest.mark.slow
def test_a_training_policy_still_waits_for_the_first_training_forward(apply: Callable[..., Run], tmp_path: Path) -> None:
    """A policy of training rules alone does not govern what an evaluation-only script calls: it says so."""
    script, ref_file = tmp_path / "evaluate.py", tmp_path / "reference.json"
    script.write_text(SCRIPT)
    run = apply(str(POLICIES / "nan-guard.yaml"), "--", sys.executable, str(script), "evaluate-only", str(ref_file))
    assert run.wait() == 0, run.stderr
    assert "no model was governed" in run.stderr
