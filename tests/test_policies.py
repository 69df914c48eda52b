"""Every policy of the library in `policies/`: loaded, compiled against a GPT-like model,
run for a few steps, and checked for its intended effect against PyTorch's own reference.

The model (helpers.models' `GPT`) uses the conventional GPT-2/nanoGPT names, so the library's
patterns are tested against the names they are written for.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers.outputs import metric
from helpers.models import lora, make_model, train_then_evaluate
from helpers.library import alert_records, counter, LIBRARY, load, opt_state, same_state, same_tensors, snapshot, stat

SCHEMA_LINE = "# yaml-language-server: $schema=../schemas/hookpolicy-v1.schema.json"
EXPECTED = {
    "nan-guard.yaml", "clip-per-layer.yaml", "clip-global.yaml", "gradient-monitor.yaml",
    "activation-sparsity.yaml", "feature-extraction.yaml", "explosion-guard.yaml", "freeze-embeddings.yaml",
    "lora-gradient-health.yaml", "loss-spike-guard.yaml", "zclip.yaml", "agc.yaml", "observe.yaml", "recover.yaml",
    "debug-after-spike.yaml",
}
#: policies that bind only a PEFT adapter: run on the model with LoRA on c_attn (tests/test_peft.py
#: checks their effects on a real GPT-2 fine-tune)
ADAPTER_ONLY = {"lora-gradient-health.yaml"}


def test_library_is_complete() -> None:
    assert EXPECTED <= {p.name for p in LIBRARY}


@pytest.mark.parametrize("path", LIBRARY, ids=[p.name for p in LIBRARY])
def test_policy_header(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert lines[0] == SCHEMA_LINE
    header = [ln for ln in lines[1:] if ln.startswith("#")]
    text = "\n".join(header)
    assert len(header) >= 8 and "What it does" in text and "When to use it" in text and "What to tune" in text


@pytest.mark.parametrize("path", LIBRARY, ids=[p.name for p in LIBRARY])
def test_policy_loads_compiles_and_runs(path: Path, workdir: Path) -> None:
    policies = load(path.name)
    model = make_model() if path.name not in ADAPTER_ONLY else lora(make_model())
    plan = policies.plan(model)
    assert plan.bindings
    assert not [w for w in plan.warnings if "matches no module" in w], plan.warnings
    reg = CollectorRegistry()
    with policies.attach(model, registry=reg, rank=0):
        train_then_evaluate(model, steps=3)
        assert counter(reg, "hookpolicy_steps_total") == 3
        for policy in policies.policies:
            assert metric(reg, "hookpolicy_policy_info", {
                "policy": policy.name, "revision": policy.revision, "mode": policy.mode, "rank": "0"}) == 1
    errors = [s for m in reg.collect() for s in m.samples if s.name == "hookpolicy_hook_errors_total" and s.value]
    assert not errors


def bundled_models() -> dict[str, nn.Module]:
    """The models of the bundled examples, as `hookpolicy explain --model` builds them."""
    import examples.charlm
    import examples.train_mlp

    from peft import LoraConfig, get_peft_model

    # The LoRA policies need an adapted model: charlm under PEFT, as a LoRA fine-tune of it would be.
    lora = get_peft_model(examples.charlm.build_model(), LoraConfig(r=4, target_modules=["c_attn", "c_fc"]))
    return {"examples.train_mlp": examples.train_mlp.build_model(), "examples.charlm": examples.charlm.build_model(),
            "examples.charlm + LoRA": lora}


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.stem)
def test_every_rule_of_the_library_binds_in_a_bundled_example(path: Path) -> None:
    """A newcomer can try each shipped policy on an example: every rule binds to some module of one."""
    policies = load(path.name)
    unbound = {rule.name for policy in policies.policies for rule in policy.rules}
    for model in bundled_models().values():
        unbound -= {row["rule"] for row in policies.plan(model).rows()}
    assert unbound == set(), f"{path.name}: rules binding in no bundled example: {sorted(unbound)}"


def test_example_monitor_does_rule_by_rule_what_its_header_says(
        workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """example-monitor.yaml on its example's model (examples/train_mlp.py, SGD with momentum):
    nan-guard skips the step whose gradients hold an Inf (the test's twin simply does not step
    there: parameters and momentum stay bit for bit the twin's) with one critical alert, counted;
    grad-norms, at every step, is each Linear's weight-and-bias gradient norm and largest magnitude
    (torch.linalg); layer-outputs, at steps 0 and 10 only, the rms, largest magnitude and non-finite
    count of each Linear's output, as the test's own forward hooks saw it (before the in-place ReLU)."""
    import examples.train_mlp

    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    model = examples.train_mlp.build_model()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n, m in linears.items()]
    x, y = examples.train_mlp.make_data(0, 64)
    poisoned = 4
    reg = CollectorRegistry()

    def gauge(rule: str, family: str, module: str) -> float:
        return stat(reg, family, "example-monitor", rule, module)

    try:
        with load("example-monitor.yaml").attach(model, registry=reg, rank=0):
            for step in range(12):
                rows = slice(4 * step, 4 * step + 16)
                for m in (model, twin):
                    F.mse_loss(m(x[rows]), y[rows]).backward()
                grads = {n: torch.cat([p.grad.flatten() for p in mod.parameters()]) for n, mod in linears.items()}
                if step == poisoned:
                    linears["2"].weight.grad[0, 0] = float("inf")
                else:
                    twin_opt.step()
                seen = {n: (o.pow(2).mean().sqrt().item(), o.abs().max().item()) for n, o in outputs.items()}
                opt.step()
                assert same_tensors(snapshot(model), snapshot(twin)), step
                assert same_state(opt_state(opt), opt_state(twin_opt)), step
                if step != poisoned:
                    for n, g in grads.items():
                        assert gauge("grad-norms", "hookpolicy_grad_l2_norm", n) == pytest.approx(
                            torch.linalg.vector_norm(g).item(), rel=1e-6)
                        assert gauge("grad-norms", "hookpolicy_grad_abs_max", n) == g.abs().max().item()
                if step % 10 == 0:
                    at_step = seen
                for n, (rms, abs_max) in at_step.items():  # steps 1-9 and 11 keep step 0's and 10's values
                    assert gauge("layer-outputs", "hookpolicy_output_rms", n) == pytest.approx(rms, rel=1e-6), step
                    assert gauge("layer-outputs", "hookpolicy_output_abs_max", n) == abs_max, step
                    assert gauge("layer-outputs", "hookpolicy_output_nonfinite", n) == 0
                assert seen != at_step or step % 10 == 0  # the outputs did change in between
                opt.zero_grad()
                twin_opt.zero_grad()
    finally:
        for h in handles:
            h.remove()
    labels = {"policy": "example-monitor", "rule": "nan-guard"}
    alerts = alert_records(tmp_path / "alerts.jsonl")
    assert [(a["rule"], a["step"], a["severity"], a["outcome"]) for a in alerts] == [
        ("nan-guard", poisoned, "critical", "step skipped")]
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 1
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 1
