"""A policy written for a base model, on its PEFT (LoRA) fine-tune: same names, same labels,
the adapter selectable on its own, frozen parameters never bound by a gradient rule.

The models are real: HF's GPT2LMHeadModel from a tiny GPT2Config, wrapped by peft's
get_peft_model with LoraConfig(r=4, target_modules=["c_attn"]). References are computed
by the test itself: forward hooks it registers, torch.linalg.vector_norm of the
parameters' own `.grad`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers.gpt2 import BLOCK, VOCAB, base_model, lora_model
from helpers.outputs import metric
from hookpolicy.cli import cli

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(seed))


def train(model: Any, steps: int, lr: float = 1e-2) -> torch.optim.Optimizer:
    """`steps` AdamW steps on the trainable parameters (LoRA's A and B on a PEFT model)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for i in range(steps):
        x = batch(i)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def policy(tmp_path: Path, rules: str, name: str = "p") -> hookpolicy.PolicySet:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        apiVersion: hookpolicy/v1
        kind: HookPolicy
        metadata: {{name: {name}}}
        spec:
          rules:
        """) + textwrap.indent(textwrap.dedent(rules), "    "))
    return hookpolicy.load(path)


def stat(registry: CollectorRegistry, family: str, rule: str, module: str, tensor: str = "",
         policy_name: str = "p") -> float:
    value = metric(registry, 
        family, {"policy": policy_name, "rule": rule, "module": module, "tensor": tensor, "rank": "0"})
    assert value is not None, f"{family}{{rule={rule}, module={module}, tensor={tensor}}} not exported"
    return value


def modules_of(plan: Any) -> list[tuple[str, str, str, tuple[str, ...]]]:
    return [(b.rule.name, b.module, b.target, b.params) for b in plan.bindings]


BASE_POLICY = """\
- name: attn-out
  match: {modules: ["transformer.h.*.attn.c_attn"]}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms]}}]
- name: by-type
  match: {types: [Conv1D]}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms]}}]
- name: everything
  match: {modules: ["**"]}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms]}}]
- name: linear
  match: {types: [Linear]}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms]}}]
- name: weights
  match: {modules: ["**.c_attn"], params: [weight]}
  trigger: {at: step}
  target: weight
  actions: [{capture: {stats: [l2_norm]}}]
"""


def test_a_base_model_policy_binds_the_same_names_on_the_fine_tune(tmp_path: Path) -> None:
    policies = policy(tmp_path, BASE_POLICY)
    base, tuned = policies.plan(base_model()), policies.plan(lora_model())
    assert modules_of(tuned) == modules_of(base)
    # the one warning on both: `types: [Linear]` leaves GPT-2's Conv1D projections out (lm_head is its only Linear)
    assert tuned.warnings == base.warnings
    assert len(tuned.warnings) == 1 and tuned.warnings[0].startswith("p/linear: types: [Linear] does not select the 8 Conv1D")
    attn = [b for b in tuned.bindings if b.rule.name == "attn-out"]
    assert [b.module for b in attn] == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    assert [b.qualname for b in attn] == [f"base_model.model.{b.module}" for b in attn]
    assert all(type(b.obj).__module__.startswith("peft.") for b in attn)  # the lora.Linear wrapper
    weights = [b for b in tuned.bindings if b.rule.name == "weights"]
    assert {(b.params, b.paths()) for b in weights} == {(("weight",), ("base_layer.weight",))}


def test_the_adapted_layer_reports_what_the_fine_tuned_layer_outputs(tmp_path: Path) -> None:
    """The wrapper's output (base + adapter) is what a rule on the layer's output sees."""
    model = lora_model()
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.endswith("h.0.attn.c_attn") or name.endswith("h.0.attn.c_attn.base_layer"):
            module.register_forward_hook(lambda m, a, out, name=name: seen.setdefault(name, out.detach().clone()))
    registry = CollectorRegistry()
    with policy(tmp_path, BASE_POLICY).attach(model, registry=registry):
        train(model, 1)
        rms = stat(registry, "hookpolicy_output_rms", "attn-out", "transformer.h.0.attn.c_attn")
    wrapper = seen["base_model.model.transformer.h.0.attn.c_attn"]
    base = seen["base_model.model.transformer.h.0.attn.c_attn.base_layer"]
    assert not torch.equal(wrapper, base)  # the adapter contributes
    assert rms == pytest.approx(wrapper.pow(2).mean().sqrt().item(), rel=1e-5)


def test_a_whole_model_gradient_rule_binds_the_adapter_and_names_the_frozen_rest(tmp_path: Path) -> None:
    model = lora_model()
    plan = policy(tmp_path, """\
        - name: grads
          match: {modules: ["**"]}
          trigger: {at: step}
          target: grad
          actions: [{capture: {stats: [l2_norm], per: tensor}}]
        """).plan(model)
    assert modules_of(plan) == [
        ("grads", f"transformer.h.{i}.attn.c_attn", "grad", ("lora_A.default.weight", "lora_B.default.weight"))
        for i in range(2)
    ]
    frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    assert plan.warnings == (
        f"p/grads: {frozen} frozen parameters (requires_grad=False) left out: they never get a gradient",)


def test_a_gradient_rule_on_frozen_layers_only_says_so(tmp_path: Path) -> None:
    plan = policy(tmp_path, """\
        - name: frozen
          match: {modules: ["**.mlp.*"]}
          trigger: {at: step}
          target: grad
          actions: [{capture: {stats: [l2_norm]}}]
        """).plan(lora_model())
    assert not plan.bindings
    (nothing,) = plan.unmatched  # selecting nothing is positioned at the rule's match
    assert plan.warnings == (
        "p/frozen: 8 frozen parameters (requires_grad=False) left out: they never get a gradient",
        f"{nothing.file}:{nothing.line}:{nothing.column}: $.spec.rules[0].match: "
        "p/frozen: the matched modules have no trainable parameters matching *",
    )


ADAPTER_POLICY = """\
- name: pieces
  match: {adapters: all}
  trigger: {at: step}
  target: grad
  actions: [{capture: {stats: [l2_norm, nonfinite], per: module}}]
- name: down
  match: {modules: ["transformer.h.1.**"], adapters: down}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms]}}]
- name: up-weights
  match: {types: [Conv1D], adapters: up}
  trigger: {at: step}
  target: weight
  actions: [{capture: {stats: [l2_norm]}}]
- name: no-adapter-here
  match: {modules: ["**.mlp.c_fc"], adapters: all}
  trigger: {at: step}
  target: grad
  actions: [{capture: {stats: [l2_norm]}}]
"""


def test_adapters_selects_the_lora_pieces_without_spelling_their_names(tmp_path: Path) -> None:
    plan = policy(tmp_path, ADAPTER_POLICY).plan(lora_model())
    layer = "transformer.h.{}.attn.c_attn"
    assert modules_of(plan) == [
        *[("pieces", f"{layer.format(i)}.lora_{ab}.default", "grad", ("weight",)) for i in range(2) for ab in "AB"],
        ("down", f"{layer.format(1)}.lora_A.default", "output", ()),
        *[("up-weights", f"{layer.format(i)}.lora_B.default", "weight", ("weight",)) for i in range(2)],
    ]
    assert [b.kind for b in plan.bindings] == ["lora down", "lora up"] * 2 + ["lora down"] + ["lora up"] * 2
    (nothing,) = plan.unmatched
    assert plan.warnings == (
        f"{nothing.file}:{nothing.line}:{nothing.column}: {nothing.path}: "
        "p/no-adapter-here: none of the 2 matched modules is an adapted layer (PEFT tuner layer), "
        "so adapters: all selects nothing",
    )
    assert nothing.path.endswith(".match")


def test_adapter_gradient_norms_are_those_of_the_lora_parameters(tmp_path: Path) -> None:
    model = lora_model()
    grads: dict[str, torch.Tensor] = {}
    registry = CollectorRegistry()
    with policy(tmp_path, ADAPTER_POLICY).attach(model, registry=registry):
        opt = train(model, 0)
        x = batch(0)
        model(input_ids=x, labels=x).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        got = {
            f"{i}{ab}": stat(registry, "hookpolicy_grad_l2_norm", "pieces", f"transformer.h.{i}.attn.c_attn.lora_{ab}.default")
            for i in range(2) for ab in "AB"
        }
        nonfinite = stat(registry, "hookpolicy_grad_nonfinite", "pieces", "transformer.h.0.attn.c_attn.lora_A.default")
    assert len(grads) == 4
    for key, value in got.items():
        reference = grads[f"base_model.model.transformer.h.{key[0]}.attn.c_attn.lora_{key[1]}.default.weight"]
        assert value == pytest.approx(torch.linalg.vector_norm(reference).item(), rel=1e-5)
    assert nonfinite == 0


def test_explain_shows_the_adapted_layer_and_the_adapter_pieces(tmp_path: Path) -> None:
    policy(tmp_path, ADAPTER_POLICY + BASE_POLICY)
    (tmp_path / "peft_model.py").write_text(
        "import sys\nsys.path.insert(0, " + repr(str(Path(__file__).parent)) + ")\n"
        "from helpers.gpt2 import lora_model as build\n")
    result = CliRunner().invoke(cli, ["explain", str(tmp_path / "p.yaml"), "--model", f"{tmp_path / 'peft_model.py'}:build"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.split()[:3] == ["p/attn-out", "transformer.h.0.attn.c_attn", "Conv1D+lora"] for line in lines)
    assert any(line.split()[:4] == ["p/down", "transformer.h.1.attn.c_attn.lora_A.default", "Linear[lora", "down]"]
               for line in lines)


# --------------------------------------------------------------------------- the library's policies

POLICIES = Path(__file__).resolve().parent.parent / "policies"


def adapter_params(model: Any) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_lora_gradient_health_norms_and_clip_against_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-piece norms equal vector_norm of each raw gradient; the optimizer then applies the
    adapter gradients clipped as clip_grad_norm_(adapter, 1.0) clips a copy of them."""
    monkeypatch.chdir(tmp_path)
    model = lora_model()
    params = adapter_params(model)
    raw: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: raw.__setitem__(name, p.grad.detach().clone()))
    applied: list[dict[str, torch.Tensor]] = []
    opt = torch.optim.SGD(params.values(), lr=1e-3)
    opt.register_step_pre_hook(lambda o, a, k: applied.append({n: p.grad.clone() for n, p in params.items()}))
    registry = CollectorRegistry()
    policies = hookpolicy.load(POLICIES / "lora-gradient-health.yaml")
    assert [w for w in policies.plan(model).warnings if "frozen" not in w] == []
    with policies.attach(model, registry=registry):
        x = batch(0)
        (model(input_ids=x, labels=x).loss * 100).backward()  # a norm well above max_norm
        opt.step()

        def value(rule: str, family: str, module: str = "") -> float | None:
            return metric(registry, family, {
                "policy": "lora-gradient-health", "rule": rule, "module": module, "tensor": "", "rank": "0"})

        norms = {n: value("adapter-grad-norms", "hookpolicy_grad_l2_norm", n.removeprefix("base_model.model.")
                          .removesuffix(".weight")) for n in params}
        joint = value("adapter-clip", "hookpolicy_grad_l2_norm")
        weights = {n: value("adapter-weight-norms", "hookpolicy_weight_l2_norm", n.removeprefix("base_model.model.")
                            .removesuffix(".weight")) for n in params}
    assert len(params) == 4 and set(raw) == set(params)
    for name, grad in raw.items():
        assert norms[name] == pytest.approx(torch.linalg.vector_norm(grad).item(), rel=1e-5)
        assert weights[name] is not None
    reference = {n: g.clone() for n, g in raw.items()}
    copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in reference.values()]
    for c, g in zip(copies, reference.values()):
        c.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert total.item() > 1.0 and joint == pytest.approx(total.item(), rel=1e-5)
    for c, name in zip(copies, reference):
        torch.testing.assert_close(applied[0][name], c.grad, rtol=1e-5, atol=1e-7)


def test_lora_gradient_health_skips_a_non_finite_step_bit_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = lora_model()
    params = adapter_params(model)
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    registry = CollectorRegistry()
    with hookpolicy.load(POLICIES / "lora-gradient-health.yaml").attach(model, registry=registry):
        for step in range(3):
            x = batch(step)
            model(input_ids=x, labels=x).loss.backward()
            if step == 1:
                next(iter(params.values())).grad[0, 0] = float("nan")
                before = {n: p.detach().clone() for n, p in params.items()}
                state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
            opt.step()
            opt.zero_grad()
            if step == 1:
                assert all(torch.equal(p, before[n]) for n, p in params.items())
                assert all(torch.equal(v, state[n][k]) for n, p in params.items() for k, v in opt.state[p].items())
            else:
                assert all(torch.isfinite(p).all() for p in params.values())
        skipped = metric(registry, "hookpolicy_skipped_steps_total", {
            "policy": "lora-gradient-health", "rule": "adapter-nonfinite", "rank": "0"})
    assert skipped == 1


def test_activation_sparsity_measures_the_adapter_neurons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """adapter-neurons reads LoRA's A outputs (the bottleneck, r per token); the base
    model's MLP activations keep their names and labels on the fine-tune."""
    monkeypatch.chdir(tmp_path)
    policies = hookpolicy.load(POLICIES / "activation-sparsity.yaml")
    model = lora_model()
    on_base = {b.module for b in policies.plan(base_model()).bindings}
    on_tuned = {(b.rule.name, b.module) for b in policies.plan(model).bindings}
    assert on_tuned == {("mlp-activations", m) for m in on_base} | {
        ("adapter-neurons", f"transformer.h.{i}.attn.c_attn.lora_A.default") for i in range(2)}
    outputs: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda m, a, out, name=name: outputs.setdefault(name, out.detach().clone()))
    registry = CollectorRegistry()
    with policies.attach(model, registry=registry):
        train(model, 1)
        got = {name: {stat_name: stat(registry, f"hookpolicy_output_{stat_name}", "adapter-neurons",
                                      name.removeprefix("base_model.model."), policy_name="activation-sparsity")
                      for stat_name in ("rms", "abs_max", "zero_fraction")}
               for name in outputs}
    assert len(outputs) == 2
    for name, out in outputs.items():
        assert out.shape[-1] == 4  # r neurons per token
        assert got[name]["rms"] == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-5)
        assert got[name]["abs_max"] == pytest.approx(out.abs().max().item(), rel=1e-6)
        assert got[name]["zero_fraction"] == (out == 0).float().mean().item()
