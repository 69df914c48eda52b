"""The library's policies that change gradients (`policies/`): clip-global, clip-per-layer, zclip, agc
and freeze-embeddings, each against PyTorch's own reference or its authors' implementation.

The model (helpers.models' `GPT`) uses the conventional GPT-2/nanoGPT names, so the library's
patterns are tested against the names they are written for.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

from helpers.models import batch, make_model, train_step
from helpers.references import agc_reference
from helpers.library import counter, load, load_text, modules_named, own_params, POLICIES, same_tensors, snapshot, stat


def test_clip_global_equals_clip_grad_norm(workdir: Path) -> None:
    model = make_model()
    ref = copy.deepcopy(model)
    attn = own_params(modules_named(ref, r".*\.attn\.[^.]+", nn.Linear))
    assert len(attn) == 8  # c_attn and c_proj, weight and bias, of two blocks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reg = CollectorRegistry()
    with load("clip-global.yaml").attach(model, registry=reg, rank=0):
        for i in range(3):
            idx, targets = batch(i)
            for m in (model, ref):
                loss = m(idx, targets)[1]
                assert loss is not None
                (loss * 50).backward()
            total = torch.nn.utils.clip_grad_norm_(attn, max_norm=1.0, norm_type=2)
            assert total > 1.0  # the clip really acts
            opt.step()
            ref_opt.step()
            assert stat(reg, "hookpolicy_grad_l2_norm", "clip-global", "clip-attention") == pytest.approx(total.item(), rel=1e-6)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.grad is not None and q.grad is not None
                assert torch.equal(p.grad, q.grad), name
                assert torch.equal(p, q), name
            opt.zero_grad()
            ref_opt.zero_grad()


def own_layers(model: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """Each Linear and Embedding with the parameters it owns (a tied parameter belongs to the first module that has it)."""
    seen: set[int] = set()
    layers: list[tuple[str, list[nn.Parameter]]] = []
    for n, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            if own:
                layers.append((n, own))
    return layers


def test_clip_per_layer_equals_clip_grad_norm_per_module(workdir: Path) -> None:
    model = make_model()
    ref = copy.deepcopy(model)
    layers = own_layers(ref)
    assert "lm_head" not in dict(layers)  # tied to transformer.wte
    reg = CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with load("clip-per-layer.yaml").attach(model, registry=reg, rank=0):
        idx, targets = batch(0)
        for m in (model, ref):
            loss = m(idx, targets)[1]
            assert loss is not None
            (loss * 10).backward()
        norms = {n: torch.nn.utils.clip_grad_norm_(params, 1.0).item() for n, params in layers}
        assert max(norms.values()) > 1.0 and min(norms.values()) < 1.0  # some clipped, some not
        opt.step()
        for name, value in norms.items():
            assert stat(reg, "hookpolicy_grad_l2_norm", "clip-per-layer", "clip-each-layer", name) == pytest.approx(value, rel=1e-6)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None
            assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0), name


def test_freeze_embeddings_zeroes_their_gradients(workdir: Path) -> None:
    model = make_model()
    frozen = {"transformer.wte.weight": model.transformer.wte.weight, "transformer.wpe.weight": model.transformer.wpe.weight}
    before = snapshot(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reg = CollectorRegistry()

    with load("freeze-embeddings.yaml").attach(model, registry=reg, rank=0):
        for i in range(3):
            idx, targets = batch(i)
            loss = model(idx, targets)[1]
            assert loss is not None
            loss.backward()
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in frozen.values())
            opt.step()
            for name, p in frozen.items():
                assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
            opt.zero_grad()
        assert counter(reg, "hookpolicy_actions_total", policy="freeze-embeddings", rule="freeze-token-embeddings",
                       action="scale", mode="enforce") == 3 * 2  # once per step and module (wte, wpe)
    after = snapshot(model)
    for name in before:
        assert torch.equal(before[name], after[name]) == (name in frozen), name
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: frozen with it


def test_per_rule_clip_over_tied_weights_equals_clip_grad_norm(workdir: Path, tmp_path: Path) -> None:
    text = (POLICIES / "clip-global.yaml").read_text().replace('modules: ["**.attn.*", "**.self_attn", "**.self_attn.*", "**.multihead_attn", "**.multihead_attn.*"]',
                                                           'modules: ["**"]')
    text = text.replace("types: [Linear, Conv1D, MultiheadAttention]", "types: [Linear, Embedding, LayerNorm]")
    model = make_model()
    ref = copy.deepcopy(model)
    with load_text(tmp_path, text).attach(model, registry=CollectorRegistry(), rank=0):
        idx, targets = batch(0)
        for m in (model, ref):
            loss = m(idx, targets)[1]
            assert loss is not None
            (loss * 50).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None
            assert torch.allclose(p.grad, q.grad, rtol=1e-5), name


def test_zclip_equals_the_authors_zclip_on_a_gpt(workdir: Path) -> None:
    """The library policy on a GPT, against the authors' `zclip` package at its defaults on a
    twin (tests/test_zclip.py checks it in detail)."""
    from zclip import ZClip

    model = make_model()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    reference = ZClip()
    used: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append([p.grad.clone() for p in model.parameters()]))
    adaptive: list[int] = []
    with load("zclip.yaml").attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(50):
            scale = 30.0 if step in (35, 44) else 1.0  # two injected gradient spikes
            for m in (model, twin):
                loss = m(*batch(step))[1]
                assert loss is not None
                (loss * scale).backward()
            opt.step()
            if reference.initialized and reference._compute_clip_val(reference._compute_grad_norm(twin)) is not None:
                adaptive.append(step)
            reference.step(twin)
            for got, want in zip(used[-1], [p.grad for p in twin.parameters()]):
                torch.testing.assert_close(got, want, msg=lambda m: f"step {step}: {m}")
            twin_opt.step()
            opt.zero_grad()
            twin_opt.zero_grad()
    assert {35, 44} <= set(adaptive) and min(adaptive) >= 25, adaptive


def test_agc_equals_the_nfnets_equations_except_the_head(workdir: Path) -> None:
    model = make_model()
    twin = copy.deepcopy(model)
    # every parameter but the classifier's; GPT's lm_head is tied to transformer.wte, which
    # AGC clips under wte's name (a tied parameter belongs to the first module that has it)
    selected = [(n, p) for n, p in twin.named_parameters() if not n.startswith("lm_head")]
    assert any(n == "transformer.wte.weight" for n, _ in selected)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    used: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append([p.grad.clone() for p in model.parameters()]))
    reg = CollectorRegistry()
    total = 0
    with load("agc.yaml").attach(model, registry=reg, rank=0):
        for step in range(4):
            for m in (model, twin):
                loss = m(*batch(step))[1]
                assert loss is not None
                loss.backward()
            counts = agc_reference(selected, ratio=0.01, eps=1e-3)
            assert 0 < sum(counts.values()), counts  # AGC acts on this model
            total += sum(counts.values())
            opt.step()
            for got, want in zip(used[-1], [p.grad for p in twin.parameters()]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
            twin_opt.step()
            opt.zero_grad()
            twin_opt.zero_grad()
    clipped = [s.value for m in reg.collect() for s in m.samples if s.name == "hookpolicy_clipped_total"]
    assert sum(clipped) == total


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_freeze_embeddings_under_adamw_is_a_zero_gradient(workdir: Path, weight_decay: float) -> None:
    """freeze-embeddings.yaml's trap: "a zero gradient is still a gradient ... Adam/AdamW with
    weight_decay 0 leave the weights untouched; AdamW's decoupled weight decay (p -= lr * wd * p)
    ... still moves them." Against a twin whose script zeroes the embeddings' gradients by hand:
    the same weights bit for bit, every step; still at their start with weight_decay 0, and at
    start * (1 - lr * wd) ** steps with 0.1."""
    model = make_model()
    twin = copy.deepcopy(model)
    start = model.transformer.wpe.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=weight_decay)
    with load("freeze-embeddings.yaml").attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(3):
            for m, o in ((model, opt), (twin, twin_opt)):
                loss = m(*batch(step))[1]
                assert loss is not None
                loss.backward()
                if m is twin:
                    for p in (twin.transformer.wte.weight, twin.transformer.wpe.weight):
                        assert p.grad is not None
                        p.grad.zero_()
                o.step()
                o.zero_grad(set_to_none=True)
            assert same_tensors(snapshot(model), snapshot(twin)), step
    wpe = model.transformer.wpe.weight.detach()
    if weight_decay == 0:
        assert torch.equal(wpe, start)
    else:
        assert not torch.equal(wpe, start)
        torch.testing.assert_close(wpe, start * (1 - 1e-2 * weight_decay) ** 3)


def test_clip_per_layer_clips_after_accumulation_and_amp_unscaling(workdir: Path) -> None:
    """clip-per-layer.yaml: "once per optimizer step (before the update, after accumulation and AMP
    unscaling)". Two micro-batches a step under torch.amp.GradScaler (scale 2**10): each layer's
    norm and the update equal a twin's on which the test itself unscales (`scaler.unscale_`) the
    accumulated gradients and calls clip_grad_norm_ per layer (a clip of the scaled gradients would
    see norms 1024 times larger)."""
    model = make_model()
    ref = copy.deepcopy(model)
    layers = own_layers(ref)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2))
    reg = CollectorRegistry()
    with load("clip-per-layer.yaml").attach(model, registry=reg, rank=0):
        for step in range(3):
            for micro in range(2):
                for m, s in ((model, scaler), (ref, ref_scaler)):
                    loss = m(*batch(2 * step + micro))[1]
                    assert loss is not None
                    s.scale(loss * 5).backward()
            ref_scaler.unscale_(ref_opt)
            norms = {n: torch.nn.utils.clip_grad_norm_(params, 1.0).item() for n, params in layers}
            assert max(norms.values()) > 1.0 and min(norms.values()) < 1.0  # some clipped, some not
            for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
                s.step(o)
                s.update()
                o.zero_grad(set_to_none=True)
            for name, value in norms.items():
                assert stat(reg, "hookpolicy_grad_l2_norm", "clip-per-layer", "clip-each-layer", name) == pytest.approx(
                    value, rel=1e-6), (step, name)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda msg: f"step {step} {name}: {msg}")
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**10  # no step was an overflow


def test_freeze_embeddings_for_a_warm_up_window(workdir: Path, tmp_path: Path) -> None:
    """freeze-embeddings.yaml: "can be limited to a window of steps (steps.until) to freeze only during
    a warm-up". With steps: {until: 2} (the tuning line's form), SGD leaves the embeddings exactly as
    they were at steps 0 and 1 and moves them from step 2 on, as the test's own copies show."""
    text = (POLICIES / "freeze-embeddings.yaml").read_text().replace("at: step\n", "at: step\n        steps: {until: 2}\n", 1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wpe = model.transformer.wpe.weight
    with load_text(tmp_path, text).attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(4):
            before = wpe.detach().clone()
            train_step(model, opt, step)
            assert torch.equal(wpe, before) == (step < 2), step
