"""The shipped policies on torch's and HF's own layers: nn.Transformer and HF GPT-2.

`nn.MultiheadAttention` holds its input projection (`in_proj_weight`, `in_proj_bias`)
itself, beside its `out_proj` child (a Linear it never calls as a module); HF GPT-2's
projections are `Conv1D`, a Linear whose weight is stored transposed. A policy written
for Linear layers covered a quarter of torch's attention and nothing of GPT-2's blocks,
without a word. Each header sentence is checked here against references the test
computes itself: `clip_grad_norm_` over the parameters the header names, the gradients'
norms by `torch.linalg.vector_norm`, and the plan's warnings for a user policy that
names Linear alone.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Iterable

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers.gpt2 import BLOCK, VOCAB, base_model
from helpers.outputs import json_lines, metric
from helpers.policies import load_policy

POLICIES = Path(__file__).resolve().parent.parent / "policies"


def transformer(seed: int = 0) -> nn.Transformer:
    torch.manual_seed(seed)
    return nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=1,
                          dim_feedforward=32, dropout=0.0, batch_first=True)


def transformer_loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randn(3, 5, 16, generator=g), torch.randn(3, 4, 16, generator=g)
    return model(src, tgt)[..., 0].sum() * 1000


def gpt2_loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=g)
    return model(input_ids=idx, labels=idx).loss * 100


def attention_params(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of every attention: MultiheadAttention whole (in_proj and out_proj), GPT-2's c_attn and c_proj."""
    params: list[nn.Parameter] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) or name.endswith((".attn.c_attn", ".attn.c_proj")):
            params.extend(module.parameters())
    return params


def stat(reg: CollectorRegistry, family: str, policy: str, rule: str, module: str = "") -> float:
    value = metric(reg, family, {"policy": policy, "rule": rule, "module": module, "tensor": "", "rank": "0"})
    assert value is not None, f"{family}{{{policy}/{rule}, module={module!r}}} not exported"
    return value


MODELS = {"nn.Transformer": (transformer, transformer_loss), "HF GPT-2": (base_model, gpt2_loss)}


@pytest.mark.parametrize("kind", MODELS)
def test_clip_global_clips_every_attention_projection_as_clip_grad_norm(kind: str, workdir: Path) -> None:
    """clip-global.yaml: one L2 norm over all weights and biases of the attention projections."""
    build, loss_of = MODELS[kind]
    model = build()
    ref = copy.deepcopy(model)
    attn = attention_params(ref)
    if kind == "nn.Transformer":  # 3 attentions (2 encoder self, 1 decoder self + 1 cross): in_proj w+b, out_proj w+b
        assert len(attn) == 4 * 4
    else:
        assert len(attn) == 2 * 4  # c_attn and c_proj, weight and bias, of two blocks
    reg = CollectorRegistry()
    policy = hookpolicy.load(POLICIES / "clip-global.yaml")
    assert not [w for w in policy.plan(model).warnings if "clip-attention" in w], policy.plan(model).warnings
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    with policy.attach(model, registry=reg, rank=0):
        for step in range(2):
            for m in (model, ref):
                loss_of(m, step).backward()
            total = torch.nn.utils.clip_grad_norm_(attn, max_norm=1.0)
            assert total > 1.0  # the clip acts
            opt.step()
            ref_opt.step()
            assert stat(reg, "hookpolicy_grad_l2_norm", "clip-global", "clip-attention") == pytest.approx(total.item(), rel=1e-5)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name
            opt.zero_grad()
            ref_opt.zero_grad()


def test_clip_per_layer_clips_a_multihead_attentions_own_projection_as_one_layer(workdir: Path) -> None:
    """clip-per-layer.yaml: nn.MultiheadAttention's in_proj_weight and in_proj_bias are one layer, its out_proj another."""
    model = transformer()
    ref = copy.deepcopy(model)
    layers: list[tuple[str, list[nn.Parameter]]] = []
    for name, module in ref.named_modules():
        own = list(module.parameters(recurse=False))
        if own and isinstance(module, (nn.Linear, nn.MultiheadAttention)):
            layers.append((name, own))
    mha = [n for n, m in ref.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert len(mha) == 4
    reg = CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with hookpolicy.load(POLICIES / "clip-per-layer.yaml").attach(model, registry=reg, rank=0):
        for m in (model, ref):
            transformer_loss(m, 0).backward()
        norms = {n: torch.nn.utils.clip_grad_norm_(ps, 1.0).item() for n, ps in layers}
        opt.step()
        for name in mha:
            assert stat(reg, "hookpolicy_grad_l2_norm", "clip-per-layer", "clip-each-layer", name) == pytest.approx(
                norms[name], rel=1e-5)
    clipped = {n for n, m in ref.named_modules() if not isinstance(m, nn.LayerNorm)}
    for name, p in model.named_parameters():
        if name.rpartition(".")[0] not in clipped:
            continue  # LayerNorm is not in the policy's types: its gradient is ref's unclipped one
        q = dict(ref.named_parameters())[name]
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=0), name


def _linear_grad_norms(model: nn.Module, names: Iterable[str]) -> dict[str, float]:
    modules = dict(model.named_modules())
    return {n: torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in modules[n].parameters(recurse=False)
                                                   if p.grad is not None])).item() for n in names}


def test_observe_measures_gpt2s_conv1d_layers(workdir: Path) -> None:
    """observe.yaml on HF GPT-2: each Conv1D's gradient norm every step, its output every 10th, nothing changed."""
    from transformers.pytorch_utils import Conv1D

    model = base_model()
    reference = copy.deepcopy(model)
    conv = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(conv) == 8 and linears == ["lm_head"]
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n in conv]
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3)
    norms: list[dict[str, float]] = []
    rms: dict[str, float] = {}
    with hookpolicy.load(POLICIES / "observe.yaml").attach(model, rank=0):
        for step in range(3):
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad(set_to_none=True)
                gpt2_loss(m, step).backward()
                if m is model:
                    # lm_head is tied to wte (an Embedding): the tied weight belongs to the first module that has it
                    norms.append(_linear_grad_norms(model, conv))
                    if step == 0:
                        rms = {n: out.pow(2).mean().sqrt().item() for n, out in outputs.items()}
                o.step()
    for h in handles:
        h.remove()
    records = json_lines(workdir / "runs" / "observe.jsonl")
    grads = {(r["step"], r["module"]): r["stats"]["l2_norm"] for r in records if r["rule"] == "grad-norms"}
    for step, expected in enumerate(norms):
        for name, value in expected.items():
            assert grads[(step, name)] == pytest.approx(value, rel=1e-5), (step, name)
    outs = {r["module"]: r["stats"]["rms"] for r in records if r["rule"] == "layer-outputs" and r["step"] == 0}
    assert set(conv) <= set(outs)
    for name in conv:
        assert outs[name] == pytest.approx(rms[name], rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


LINEAR_ONLY = """
    - name: grads
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions: [{capture: {stats: [l2_norm]}}]
    - name: outputs
      match: {types: [Linear]}
      trigger: {at: forward}
      target: output
      actions: [{capture: {stats: [rms]}}]
"""


def test_a_linear_only_policy_says_what_it_leaves_out_of_gpt2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = load_policy(tmp_path, LINEAR_ONLY)
    warnings = policy.plan(base_model()).warnings
    for rule in ("grads", "outputs"):
        said = [w for w in warnings if w.startswith(f"p/{rule}:") and "Conv1D" in w]
        assert len(said) == 1, warnings
        assert "8 Conv1D modules" in said[0] and "transformer.h.0.attn.c_attn" in said[0]
    with caplog.at_level(logging.WARNING, logger="hookpolicy"):
        with policy.attach(base_model(), rank=0):
            pass
    assert sum("Conv1D" in r.getMessage() for r in caplog.records) == 2


def test_a_linear_only_policy_says_what_it_leaves_out_of_multihead_attention(tmp_path: Path) -> None:
    warnings = load_policy(tmp_path, LINEAR_ONLY).plan(transformer()).warnings
    grads = [w for w in warnings if w.startswith("p/grads:")]
    assert len(grads) == 1 and "in_proj_weight, in_proj_bias" in grads[0] and "MultiheadAttention" in grads[0], warnings
    outputs = [w for w in warnings if w.startswith("p/outputs:")]
    assert len(outputs) == 1 and "never called as a module" in outputs[0], warnings
    # the hooks on out_proj really never run: the warning is true
    model = transformer()
    calls: list[str] = []
    for name, module in model.named_modules():
        if name.endswith("out_proj"):
            module.register_forward_hook(lambda *a, n=name: calls.append(n))
    transformer_loss(model, 0)
    assert calls == []


def test_the_shipped_policies_say_nothing_of_the_kind_on_gpt2(tmp_path: Path) -> None:
    for name in ("clip-global.yaml", "clip-per-layer.yaml", "observe.yaml", "example-monitor.yaml"):
        warnings = hookpolicy.load(POLICIES / name).plan(base_model()).warnings
        assert not [w for w in warnings if "Conv1D" in w or "holds itself" in w or "hold themselves" in w], (name, warnings)

