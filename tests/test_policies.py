"""Every policy of the library in `policies/`: loaded, compiled against a GPT-like model,
run for a few steps, and checked for its intended effect against PyTorch's own reference.

The model (helpers.models' `GPT`) uses the conventional GPT-2/nanoGPT names, so the library's
patterns are tested against the names they are written for.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers.outputs import json_lines, metric

from helpers.models import batch, lora, make_model, train_step, train_then_evaluate
from helpers.references import agc_reference

POLICIES = Path(__file__).resolve().parent.parent / "policies"
LIBRARY = sorted(POLICIES.glob("*.y*ml"))
SCHEMA_LINE = "# yaml-language-server: $schema=../schemas/hookpolicy-v1.schema.json"
EXPECTED = {
    "nan-guard.yaml", "clip-per-layer.yaml", "clip-global.yaml", "gradient-monitor.yaml",
    "activation-sparsity.yaml", "feature-extraction.yaml", "explosion-guard.yaml", "freeze-embeddings.yaml",
    "lora-gradient-health.yaml", "loss-spike-guard.yaml", "zclip.yaml", "agc.yaml", "observe.yaml", "recover.yaml",
}
#: policies that bind only a PEFT adapter: run on the model with LoRA on c_attn (tests/test_peft.py
#: checks their effects on a real GPT-2 fine-tune)
ADAPTER_ONLY = {"lora-gradient-health.yaml"}

# --------------------------------------------------------------------------- helpers


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Files a policy writes land in a fresh folder."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(out))
    return out


def load(name: str) -> hookpolicy.PolicySet:
    return hookpolicy.load(POLICIES / name)


def load_text(tmp_path: Path, text: str, name: str = "policy.yaml") -> hookpolicy.PolicySet:
    path = tmp_path / name
    path.write_text(text)
    return hookpolicy.load(path)


def stat(reg: CollectorRegistry, family: str, policy: str, rule: str, module: str = "", tensor: str = "") -> float:
    value = metric(reg, family, {"policy": policy, "rule": rule, "module": module, "tensor": tensor, "rank": "0"})
    assert value is not None, f"{family}{{policy={policy}, rule={rule}, module={module}}} not exported"
    return value


def counter(reg: CollectorRegistry, family: str, **labels: str) -> float:
    return metric(reg, family, {**labels, "rank": "0"}) or 0.0


def modules_named(model: nn.Module, pattern: str, kind: type) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if re.fullmatch(pattern, n) and isinstance(m, kind)]


def own_params(modules: list[tuple[str, nn.Module]]) -> list[nn.Parameter]:
    return [p for _, m in modules for p in m.parameters(recurse=False)]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def lr_seen(opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, list[float]]:
    """`opt` and the lr of its first group at each of its steps, read by its own step pre-hook."""
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    return opt, used


def opt_state(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt.state_dict()["state"].values()]


def same_state(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b)
    )


@pytest.fixture
def grad_outputs() -> Iterator[Callable[[nn.Module, type], dict[str, list[torch.Tensor]]]]:
    """Records the gradient w.r.t. the output of every module of a type, with tensor hooks."""
    handles: list[Any] = []

    def install(model: nn.Module, kind: type) -> dict[str, list[torch.Tensor]]:
        seen: dict[str, list[torch.Tensor]] = {}
        for name, module in model.named_modules():
            if isinstance(module, kind):
                def hook(mod: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
                    if out.requires_grad:
                        out.register_hook(lambda g: seen.setdefault(name, []).append(g.detach().clone()))
                handles.append(module.register_forward_hook(hook))
        return seen

    yield install
    for h in handles:
        h.remove()


# --------------------------------------------------------------------------- every file


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
    policies = hookpolicy.load(path)
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


# --------------------------------------------------------------------------- effects


def test_nan_guard_skips_the_step_bit_identically(workdir: Path) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reg = CollectorRegistry()
    labels = {"policy": "nan-guard", "rule": "nonfinite-grads"}
    with load("nan-guard.yaml").attach(model, registry=reg, rank=0):
        for i in range(2):
            train_step(model, opt, i)
        params, state = snapshot(model), opt_state(opt)

        def poison() -> None:
            grad = model.transformer.h[1].mlp.c_fc.weight.grad
            assert grad is not None
            grad[0, 0] = float("nan")

        train_step(model, opt, 2, before_step=poison)
        after = snapshot(model)
        assert all(torch.equal(params[n], after[n]) for n in params)
        assert same_state(state, opt_state(opt))
        assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 1
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") >= 1
        assert stat(reg, "hookpolicy_grad_nonfinite", **labels) == 1

        train_step(model, opt, 3)  # a clean step is applied again
        assert not torch.equal(params["transformer.h.1.mlp.c_fc.weight"], model.transformer.h[1].mlp.c_fc.weight)
        assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 1
        assert stat(reg, "hookpolicy_grad_nonfinite", **labels) == 0
        assert counter(reg, "hookpolicy_steps_total") == 4


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


def test_gradient_monitor_matches_torch_statistics(workdir: Path, grad_outputs: Any) -> None:
    model = make_model()
    seen = grad_outputs(model, nn.Linear)
    reg = CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with load("gradient-monitor.yaml").attach(model, registry=reg, rank=0):
        train_step(model, opt, 0)  # step 0: evaluated (every: 10)
        assert set(seen) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        for name, (g,) in seen.items():
            g = g.double()
            expected = {
                "l2_norm": torch.linalg.vector_norm(g), "mean": g.mean(), "std": g.std(), "max": g.max(),
                "min": g.min(), "zero_fraction": (g == 0).double().mean(), "nonfinite": (~torch.isfinite(g)).sum(),
            }
            for key, value in expected.items():
                got = stat(reg, f"hookpolicy_grad_output_{key}", "gradient-monitor", "layer-grads", name)
                assert got == pytest.approx(value.item(), rel=1e-4, abs=1e-9), (name, key)
        assert counter(reg, "hookpolicy_alerts_total", policy="gradient-monitor", rule="layer-grads", severity="warning") == 0


def test_gradient_monitor_alerts(workdir: Path) -> None:
    labels = {"policy": "gradient-monitor", "rule": "layer-grads"}
    policies = load("gradient-monitor.yaml")

    # large norm: a loss scaled by 1e4 gives layer gradients far above 10
    model, reg = make_model(), CollectorRegistry()
    with policies.attach(model, registry=reg, rank=0):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), 0, loss_scale=1e4)
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="warning") >= 1
        assert counter(reg, "hookpolicy_alert_firing", **labels, severity="warning") == 1
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 0

    # NaN: one poisoned weight makes every gradient downstream of it non-finite
    model, reg = make_model(), CollectorRegistry()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    with policies.attach(model, registry=reg, rank=0):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), 0)
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") >= 1
        assert stat(reg, "hookpolicy_grad_output_nonfinite", **labels, module="lm_head") > 0

    # dead neurons: a very negative bias silences every ReLU of block 0; the info alert
    # needs 3 consecutive evaluations (steps 0, 10, 20)
    model, reg = make_model(), CollectorRegistry()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.bias.fill_(-1e3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with policies.attach(model, registry=reg, rank=0):
        for i in range(21):
            train_step(model, opt, i)
            if i == 10:
                assert counter(reg, "hookpolicy_alert_firing", **labels, severity="info") == 0
        assert stat(reg, "hookpolicy_grad_output_zero_fraction", **labels, module="transformer.h.0.mlp.c_fc") == 1.0
        assert counter(reg, "hookpolicy_alert_firing", **labels, severity="info") == 1
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="info") == 1  # only c_fc of block 0


def test_activation_sparsity_matches_reference(workdir: Path) -> None:
    model = make_model()
    acts = modules_named(model, r"transformer\.h\.\d+\.mlp\.act", nn.ReLU)
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n, m in acts]
    reg = CollectorRegistry()
    labels = {"policy": "activation-sparsity", "rule": "mlp-activations"}
    try:
        with load("activation-sparsity.yaml").attach(model, registry=reg, rank=0):
            opt = torch.optim.SGD(model.parameters(), lr=1e-1)
            for step in range(11):  # every: 10 - steps 0 and 10 measured, the others keep step 0's values
                train_step(model, opt, step)
                if step % 10 == 0:
                    measured = dict(outputs)
                for name, out in measured.items():
                    assert stat(reg, "hookpolicy_output_zero_fraction", **labels, module=name) == pytest.approx(
                        (out == 0).double().mean().item()), (step, name)
                    assert stat(reg, "hookpolicy_output_mean", **labels, module=name) == pytest.approx(out.double().mean().item(), rel=1e-5)
                    assert stat(reg, "hookpolicy_output_rms", **labels, module=name) == pytest.approx(
                        out.double().pow(2).mean().sqrt().item(), rel=1e-5)
                    assert stat(reg, "hookpolicy_output_abs_max", **labels, module=name) == out.abs().max().item()
                    assert 0.2 < (out == 0).double().mean().item() < 0.8  # a ReLU at init: about half silent
                assert step % 10 == 0 or not all(torch.equal(measured[n], o) for n, o in outputs.items())

        # phase: any - the same policy measures an evaluation set, read back per batch
        model.eval()
        reg = CollectorRegistry()
        with load("activation-sparsity.yaml").attach(model, registry=reg, rank=0), torch.no_grad():
            for i in range(2):
                model(batch(50 + i)[0])
                for name, out in outputs.items():
                    assert stat(reg, "hookpolicy_output_zero_fraction", **labels, module=name) == pytest.approx(
                        (out == 0).double().mean().item())
    finally:
        for h in handles:
            h.remove()


def test_feature_extraction_writes_loadable_tensors(workdir: Path) -> None:
    model = make_model()
    names = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    outputs: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n in names]
    policy = load("feature-extraction.yaml")
    (capture,) = [a for a in policy.policies[0].rules[0].actions if getattr(a, "tensors", None)]
    assert capture.tensors is not None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with policy.attach(model, registry=CollectorRegistry(), rank=0):
            train_step(model, opt, 0)  # step 0 is evaluated (every: 100)
            at_step0 = dict(outputs)
            for i in range(1, 4):
                train_step(model, opt, i)
    finally:
        for h in handles:
            h.remove()
    files = sorted((workdir / capture.tensors.dir).glob("*.pt"))
    assert 0 < len(files) <= capture.tensors.max_files
    assert sum(f.stat().st_size for f in files) <= capture.tensors.max_bytes
    assert [f.name for f in files] == [f"step00000000-{n}-output.pt" for n in names]
    for f, name in zip(files, names):
        assert torch.equal(torch.load(f), at_step0[name])


def test_feature_extraction_stays_within_max_files(workdir: Path, tmp_path: Path) -> None:
    text = (POLICIES / "feature-extraction.yaml").read_text()
    text = text.replace("every: 100", "every: 1").replace("max_files: 200", "max_files: 4")
    policy = load_text(tmp_path, text)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with policy.attach(model, registry=CollectorRegistry(), rank=0):
        for i in range(4):  # 3 modules x 4 steps would be 12 files
            train_step(model, opt, i)
    files = list((workdir / "features").glob("*.pt"))
    assert len(files) == 4
    for f in files:
        assert torch.load(f).shape[-1] == 32


def test_feature_budget_spent_is_not_an_error(workdir: Path, tmp_path: Path) -> None:
    text = (POLICIES / "feature-extraction.yaml").read_text().replace("every: 100", "every: 1").replace("max_files: 200", "max_files: 4")
    model, reg = make_model(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with load_text(tmp_path, text).attach(model, registry=reg, rank=0):
        for i in range(5):
            train_step(model, opt, i)
        # statistics keep flowing after the file budget is spent
        assert stat(reg, "hookpolicy_output_l2_norm", "feature-extraction", "save-features", "transformer.ln_f") > 0
        assert counter(reg, "hookpolicy_hook_errors_total", policy="feature-extraction", rule="save-features") == 0


def test_explosion_guard_halts_after_three_bad_steps(workdir: Path) -> None:
    policies = load("explosion-guard.yaml")
    model, reg = make_model(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    taken = 0
    with pytest.raises(hookpolicy.Halt) as halted:
        with policies.attach(model, registry=reg, rank=0):
            for i in range(10):
                train_step(model, opt, i, loss_scale=1e6)
                taken += 1
    assert taken == 2  # the third optimizer.step() raised
    assert (halted.value.policy, halted.value.rule, halted.value.step) == ("explosion-guard", "global-grad-norm", 2)
    assert halted.value.line().startswith("hookpolicy: halted by explosion-guard/global-grad-norm at step 2: gradient norm")
    assert counter(reg, "hookpolicy_alerts_total", policy="explosion-guard", rule="global-grad-norm", severity="critical") == 1

    # single spikes between normal steps never reach 3 in a row
    model, reg = make_model(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with policies.attach(model, registry=reg, rank=0):
        for i in range(8):
            train_step(model, opt, i, loss_scale=1e6 if i % 3 != 2 else 1.0)
        assert counter(reg, "hookpolicy_alerts_total", policy="explosion-guard", rule="global-grad-norm", severity="critical") == 0


def test_explosion_guard_norm_is_the_global_grad_norm(workdir: Path) -> None:
    model = make_model()
    ref = copy.deepcopy(model)
    reg = CollectorRegistry()
    with load("explosion-guard.yaml").attach(model, registry=reg, rank=0):
        idx, targets = batch(0)
        for m in (model, ref):
            loss = m(idx, targets)[1]
            assert loss is not None
            loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
        assert stat(reg, "hookpolicy_grad_l2_norm", "explosion-guard", "global-grad-norm") == pytest.approx(expected.item(), rel=1e-5)


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
    policies = hookpolicy.load(path)
    unbound = {rule.name for policy in policies.policies for rule in policy.rules}
    for model in bundled_models().values():
        unbound -= {row["rule"] for row in policies.plan(model).rows()}
    assert unbound == set(), f"{path.name}: rules binding in no bundled example: {sorted(unbound)}"


# --------------------------------------------------------------------------- guardrails that learn the run


def _loss_spike(loss: float, applied: list[float]) -> bool:
    """loss-spike-guard.yaml's skip condition, from the losses of the steps that were applied:
    the median and the median absolute deviation (statistics.median), scaled by 1.4826."""
    if not math.isfinite(loss):
        return True
    if len(applied) < 20:  # count(loss) >= 20
        return False
    window = applied[-100:]
    median = statistics.median(window)
    mad = statistics.median([abs(x - median) for x in window])
    z = (loss - median) / (1.4826 * mad) if mad else math.copysign(math.inf, loss - median)
    return z > 4 and loss > 1.2 * median


def _zscore_spike(loss: float, applied: list[float]) -> bool:
    """The guard's old spike test (bench/policies/loss-spike-zscore.yaml): mean and std, 6 sigma."""
    if len(applied) < 20:
        return False
    window = applied[-100:]
    mean, std = statistics.fmean(window), statistics.pstdev(window)
    return std > 0 and (loss - mean) / std > 6 and loss > 1.2 * mean


@pytest.mark.slow
def test_loss_spike_guard_skips_exactly_the_spikes_of_its_reference(workdir: Path) -> None:
    """One batch learned by heart, so the loss falls, then settles; scrambled targets make
    spikes, two smaller ones while the loss still falls and three once it settled. Each step
    is skipped (parameters and AdamW state bit for bit) exactly when the policy's condition,
    computed here from the losses the script saw, says so; the old z-score test missed the
    early ones."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    half = torch.cat((scrambled[:2], targets[2:]))  # two of the four rows scrambled: a smaller spike
    early, late = {40, 41}, {120, 121, 135}
    spikes = early | late
    applied: list[float] = []
    skipped: list[int] = []
    missed_by_zscore: list[int] = []
    reg = CollectorRegistry()
    with load("loss-spike-guard.yaml").attach(model, registry=reg, rank=0):
        for step in range(140):
            _, loss = model(idx, half if step in early else scrambled if step in late else targets)
            assert loss is not None
            loss.backward()
            params, state = snapshot(model), opt_state(opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            unchanged = all(torch.equal(params[n], p) for n, p in model.named_parameters())
            spike = _loss_spike(loss.item(), applied)
            assert unchanged == spike, f"step {step}: loss {loss.item()}"
            if step in spikes and not _zscore_spike(loss.item(), applied):
                missed_by_zscore.append(step)
            if spike:
                assert same_state(state, opt_state(opt))
                skipped.append(step)
            else:
                applied.append(loss.item())
        labels = {"policy": "loss-spike-guard", "rule": "loss-spike"}
        assert stat(reg, "hookpolicy_loss_mean", **labels) == pytest.approx(applied[-1], rel=1e-6)
    assert skipped == sorted(spikes)
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == len(spikes)
    assert missed_by_zscore == [40, 41]  # while the loss fell, its std hid them


def test_loss_spike_guard_halts_when_the_loss_moved_for_good(workdir: Path) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    with load("loss-spike-guard.yaml").attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(100):
            train_loss = model(idx, targets)[1]
            assert train_loss is not None
            train_loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for spike in range(1, 21):  # from now on every batch is "a spike": 19 skipped, the 20th halts
            loss = model(idx, scrambled)[1]
            assert loss is not None
            loss.backward()
            if spike < 20:
                opt.step()
                opt.zero_grad(set_to_none=True)
                continue
            with pytest.raises(hookpolicy.Halt, match="loss-spike-guard/loss-spike"):
                opt.step()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit, NaN included (torch.equal says NaN != NaN)."""
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


@pytest.mark.parametrize("clean", [0, 5, 40], ids=["from-the-first-step", "short-history", "settled"])
def test_loss_spike_guard_halts_at_the_20th_step_of_a_loss_that_stays_nan(
        workdir: Path, clean: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The header: a NaN loss is never applied, from the first step on, and 20 steps in a row
    that are spikes or not finite halt the run at the 20th. A NaN weight makes every later
    loss NaN (a skipped step cannot repair it), after `clean` applied steps of history."""
    monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "json")  # every alert record (readable lines stop at 10)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = batch(0)
    reg = CollectorRegistry()
    with load("loss-spike-guard.yaml").attach(model, registry=reg, rank=0):
        for _ in range(clean):
            loss = model(idx, targets)[1]
            assert loss is not None
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
        for nan_step in range(1, 21):
            loss = model(idx, targets)[1]
            assert loss is not None and loss.isnan()
            loss.backward()
            params, state = snapshot(model), opt_state(opt)
            if nan_step < 20:
                opt.step()
                assert _same(params, snapshot(model)) and same_state(state, opt_state(opt)), nan_step
                opt.zero_grad(set_to_none=True)
                gauges = {k: stat(reg, f"hookpolicy_loss_{k}", "loss-spike-guard", "loss-spike")
                          for k in ("mean", "max", "nonfinite")}
                mean, largest, seen = gauges.pop("mean"), gauges.pop("max"), gauges
                continue
            with pytest.raises(hookpolicy.Halt) as halted:
                opt.step()
    assert (halted.value.policy, halted.value.rule, halted.value.step) == ("loss-spike-guard", "loss-spike", clean + 19)
    assert halted.value.message == (f"the loss was not finite or a spike for 20 steps in a row (the last: nan at step "
                                    f"{clean + 19}): it moved for good, stopping the run")
    alerts = [json.loads(line) for line in capsys.readouterr().err.splitlines()
              if line.startswith("{") and '"event": "alert"' in line]
    skipped = [a["message"] for a in alerts if a["severity"] == "warning"]
    assert skipped == [f"loss nan at step {clean + i} is not finite; step skipped" for i in range(20)]
    # "Exported: hookpolicy_loss_mean / _max / _nonfinite, hookpolicy_skipped_steps_total, hookpolicy_alerts_total"
    labels = {"policy": "loss-spike-guard", "rule": "loss-spike"}
    assert seen == {"nonfinite": 1} and math.isnan(mean) and math.isnan(largest)  # the gauges at step clean + 18
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 20  # the halting step's too
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="warning") == 20
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 1


@pytest.mark.slow
def test_recover_climbs_its_ladder_as_its_header_says(
        workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recover.yaml against its header, the spikes told by loss-spike-guard's reference
    condition (`_loss_spike`) from the losses of the applied steps: a single spike skipped (bit
    for bit); from the 3rd in a row the lr the optimizer uses (read by its own step pre-hook) is
    0.1x for 100 steps; at the 6th the state is the test's own copy taken after step 149 (the
    newest snapshot at least 10 steps older, snapshots after every 50 steps), the streaks start
    again; the 4th rewind halts, and the rewind alerts' records say so."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    model = make_model()
    lr = 1e-2
    opt, used = lr_seen(torch.optim.AdamW(model.parameters(), lr=lr))
    idx, targets = batch(0)
    scrambled = batch(1)[1]
    bad = {60, 80, 81, 82, *range(200, 206), *range(206, 212), *range(212, 218), *range(218, 224)}
    applied: list[float] = []
    streak, cool_until, rewinds, skipped = 0, 0, 0, 0
    expected_lr: list[float] = []
    copy_149: dict[str, Any] = {}
    reg = CollectorRegistry()
    with load("recover.yaml").attach(model, registry=reg, rank=0), pytest.raises(hookpolicy.Halt) as halted:
        for step in range(230):
            _, loss = model(idx, scrambled if step in bad else targets)
            assert loss is not None
            loss.backward()
            params, state = snapshot(model), opt_state(opt)
            spike = _loss_spike(loss.item(), applied)
            skipped += spike  # every spike's step is a skipped one, a rewinding or halting step included
            streak = streak + 1 if spike else 0
            rewind = streak >= 6
            if rewind and rewinds == 3:
                expected_halt = step
            if streak >= 3 and not rewind:
                cool_until = max(cool_until, step + 100)
            expected_lr.append(lr * 0.1 if step < cool_until else lr)
            opt.step()
            assert used[-1] == expected_lr[-1], step
            if step == 149:
                copy_149 = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
            if rewind:
                rewinds += 1
                streak = 0
                assert all(torch.equal(p, copy_149["model"][n]) for n, p in model.state_dict().items()), step
                assert same_state(opt_state(opt), [s for s in copy_149["opt"]["state"].values()]), step
            elif spike:
                assert all(torch.equal(params[n], p) for n, p in model.named_parameters()), step
                assert same_state(state, opt_state(opt)), step
            else:
                applied.append(loss.item())
            opt.zero_grad(set_to_none=True)
    assert (halted.value.rule, halted.value.step) == ("recover", expected_halt)
    assert rewinds == 3  # the fourth halted inside its optimizer.step()
    labels = {"policy": "recover", "rule": "recover"}
    assert counter(reg, "hookpolicy_rewinds_total", **labels, model="GPT") == 3
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels, model="GPT") == skipped
    assert 0.1 * lr in expected_lr and expected_lr.count(0.1 * lr) >= 100
    rewinding = [(a["step"], a["severity"], a["outcome"]) for a in _alert_records(tmp_path / "alerts.jsonl")
                 if a["then"] == "rewind"]
    assert [outcome for *_, outcome in rewinding] == ["rewinding"] * 3 + ["not rewound (max_rewinds: 3 reached; halting)"]
    assert rewinding[-1][:2] == (expected_halt, "critical")


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


def test_observe_logs_what_its_header_says(workdir: Path) -> None:
    """observe.yaml: the loss every step, each Linear's gradient l2 norm (weight and bias) every
    step, output rms and zero fraction every 10th step, all in runs/observe.jsonl; nothing changed."""
    import examples.charlm

    model = examples.charlm.build_model()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n, m in linears.items()]
    losses, norms, activations = [], [], {}
    data = examples.charlm.encode()
    with load("observe.yaml").attach(model, rank=0):
        for step in range(12):
            x, y = examples.charlm.batch(data, torch.arange(step, step + 64, 8), 32)
            for m, o in ((model, opt), (reference, ref_opt)):
                loss = m(x, y)[1]
                o.zero_grad(set_to_none=True)
                loss.backward()
                if m is model:
                    losses.append(loss.item())
                    norms.append({n: torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in mod.parameters(
                        recurse=False)])).item() for n, mod in linears.items()})
                    if step % 10 == 0:
                        activations[step] = {n: (o_.pow(2).mean().sqrt().item(), (o_ == 0).float().mean().item())
                                             for n, o_ in outputs.items()}
                o.step()
    for h in handles:
        h.remove()
    records = json_lines(workdir / "runs" / "observe.jsonl")
    by = collections.defaultdict(dict)
    for r in records:
        by[r["rule"]][(r["step"], r["module"])] = r["stats"]
    assert {s: v["mean"] for (s, _), v in by["loss"].items()} == pytest.approx(dict(enumerate(losses)), rel=1e-6)
    assert set(by["grad-norms"]) == {(s, n) for s in range(12) for n in linears}
    for (s, n), v in by["grad-norms"].items():
        assert v["l2_norm"] == pytest.approx(norms[s][n], rel=1e-5)
    assert {s for s, _ in by["layer-outputs"]} == {0, 10}
    for (s, n), v in by["layer-outputs"].items():
        assert (v["rms"], v["zero_fraction"]) == pytest.approx(activations[s][n], rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)  # it only watches


def _alert_records(path: Path) -> list[dict[str, Any]]:
    """The alert records of a HOOKPOLICY_ALERT_LOG file (none when nothing fired)."""
    return json_lines(path) if path.exists() else []


def test_observe_calls_a_nan_or_inf_loss_critical_and_changes_nothing(
        workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """observe.yaml: "A NaN or Inf in the loss is a critical alert. It changes nothing: no clip, no
    skipped step." The script backpropagates `loss + nan` at step 3 and `loss + inf` at step 5 (a
    constant added: the gradients stay the loss's own, finite). The alert records are exactly those
    two steps', critical, and hookpolicy_alerts_total counts them; every step is applied: the
    parameters stay bit for bit those of a twin trained on the same losses without the policy."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    model = make_model()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    poison = {3: float("nan"), 5: float("inf")}
    reg = CollectorRegistry()
    with load("observe.yaml").attach(model, registry=reg, rank=0):
        for step in range(8):
            for m, o in ((model, opt), (twin, twin_opt)):
                loss = m(*batch(step))[1]
                assert loss is not None
                (loss + poison.get(step, 0.0)).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            assert _same(snapshot(model), snapshot(twin)), step
    alerts = _alert_records(tmp_path / "alerts.jsonl")
    assert [(a["rule"], a["step"], a["severity"], a["outcome"]) for a in alerts] == [
        ("loss", 3, "critical", "logged"), ("loss", 5, "critical", "logged")]
    assert [a["message"] for a in alerts] == ["the loss is not finite at step 3", "the loss is not finite at step 5"]
    assert counter(reg, "hookpolicy_alerts_total", policy="observe", rule="loss", severity="critical") == 2
    assert counter(reg, "hookpolicy_skipped_steps_total", policy="observe", rule="loss") == 0


def test_explosion_guard_counts_a_non_finite_norm_as_beyond_the_limit(workdir: Path) -> None:
    """explosion-guard.yaml: "a critical alert when it is above 1000 or contains NaN/Inf. After 3
    consecutive such steps the run halts". Gradients of a normal size, one element poisoned by the
    test: NaN, then Inf, then NaN; the third halts. A poisoned step between clean ones never does.
    (The poisoned weight is left out of the optimizer, so lr 0 keeps every weight finite.)"""
    policies = load("explosion-guard.yaml")
    labels = {"policy": "explosion-guard", "rule": "global-grad-norm"}

    def run(model: nn.Module, poison: dict[int, float], steps: int) -> int:
        weight = model.transformer.h[0].attn.c_proj.weight
        opt = torch.optim.SGD([p for p in model.parameters() if p is not weight], lr=0.0)
        taken = 0
        for step in range(steps):
            loss = model(*batch(step))[1]
            assert loss is not None
            loss.backward()
            assert weight.grad is not None and torch.linalg.vector_norm(weight.grad) < 1000  # no explosion by itself
            if step in poison:
                weight.grad[0, 0] = poison[step]
            opt.step()
            model.zero_grad(set_to_none=True)
            taken += 1
        return taken

    model, reg = make_model(), CollectorRegistry()
    with pytest.raises(hookpolicy.Halt) as halted:
        with policies.attach(model, registry=reg, rank=0):
            run(model, {2: float("nan"), 3: float("inf"), 4: float("nan")}, 8)
    assert (halted.value.rule, halted.value.step) == ("global-grad-norm", 4)
    assert "(non-finite: 1)" in halted.value.message
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 1

    model, reg = make_model(), CollectorRegistry()
    with policies.attach(model, registry=reg, rank=0):
        assert run(model, {s: float("nan") for s in range(9) if s % 3 != 2}, 9) == 9
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 0
        assert stat(reg, "hookpolicy_grad_nonfinite", **labels) == 0  # step 8 was clean


def test_recover_takes_a_nan_loss_for_a_spike_up_its_ladder(
        workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recover.yaml: a loss that is "not finite" is a spike, from the first step on (before any
    history), and climbs the ladder like any other: the script backpropagates `loss + nan` (the
    gradients stay finite, so only the loss tells) at step 0, at step 5, and at the six steps 62-67;
    a rewind at 67 goes back to the test's own copy taken after step 49 (the newest snapshot at least
    10 steps older) and the counts in a row start again, so the NaN losses of 68 and 69 are single
    skips. Each step's alert records (rung, severity, outcome: at the rewind's step the cool-down's
    says it was not applied, the rewind took the step), the lr the optimizer's own pre-hook sees
    and the parameters and AdamW state are checked against the ladder the test climbs itself."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    model = make_model()
    lr = 1e-2
    opt, used = lr_seen(torch.optim.AdamW(model.parameters(), lr=lr))
    idx, targets = batch(0)
    nan = {0, 5, *range(62, 68), 68, 69}
    applied: list[float] = []
    streak, cool_until = 0, 0
    expected: list[tuple[int, str, str, str]] = []  # (step, then, severity, outcome) of each alert record
    copy_49: dict[str, Any] = {}
    reg = CollectorRegistry()
    with load("recover.yaml").attach(model, registry=reg, rank=0):
        for step in range(74):
            loss = model(idx, targets)[1]
            assert loss is not None
            (loss + float("nan") if step in nan else loss).backward()
            params, state = snapshot(model), opt_state(opt)
            spike = step in nan or _loss_spike(loss.item(), applied)
            assert spike == (step in nan), step  # the clean steps of a batch learned by heart hold no spike
            streak = streak + 1 if spike else 0
            rewind = streak >= 6
            if spike:
                expected.append((step, "skip_step", "warning", "step skipped"))
            if streak >= 3:
                # at a rewind's step the cool-down's alert fires too, and the rewind takes the step
                expected.append((step, "cool_down", "warning", "cooling down" if not rewind else
                                 "not cooled down (a rewind by recover/recover took the step)"))
                if not rewind:
                    cool_until = max(cool_until, step + 100)
            if rewind:
                expected.append((step, "rewind", "critical", "rewinding"))
            opt.step()
            assert used[-1] == (lr * 0.1 if step < cool_until else lr), step
            seen = {k: stat(reg, f"hookpolicy_loss_{k}", "recover", "recover") for k in ("mean", "max", "nonfinite")}
            assert seen["nonfinite"] == (step in nan), step
            assert math.isnan(seen["mean"]) if step in nan else seen["mean"] == seen["max"] == pytest.approx(loss.item())
            if step == 49:
                copy_49 = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
            if rewind:
                streak = 0
                assert all(torch.equal(p, copy_49["model"][n]) for n, p in model.state_dict().items()), step
                assert same_state(opt_state(opt), list(copy_49["opt"]["state"].values())), step
            elif spike:
                assert _same(params, snapshot(model)) and same_state(state, opt_state(opt)), step
            else:
                applied.append(loss.item())
            opt.zero_grad(set_to_none=True)
    alerts = _alert_records(tmp_path / "alerts.jsonl")
    assert [(a["step"], a["then"], a["severity"], a["outcome"]) for a in alerts] == expected
    assert all(a["stats"]["nonfinite"] == 1 for a in alerts)
    labels = {"policy": "recover", "rule": "recover"}
    for severity in ("warning", "critical"):
        assert counter(reg, "hookpolicy_alerts_total", **labels, severity=severity) == sum(
            e[2] == severity for e in expected)
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels, model="GPT") == len(nan)
    assert counter(reg, "hookpolicy_rewinds_total", **labels, model="GPT") == 1


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
                assert _same(snapshot(model), snapshot(twin)), step
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
    alerts = _alert_records(tmp_path / "alerts.jsonl")
    assert [(a["rule"], a["step"], a["severity"], a["outcome"]) for a in alerts] == [
        ("nan-guard", poisoned, "critical", "step skipped")]
    assert counter(reg, "hookpolicy_alerts_total", **labels, severity="critical") == 1
    assert counter(reg, "hookpolicy_skipped_steps_total", **labels) == 1


def test_gradient_monitor_combines_micro_batches_every_10th_step_and_only_watches(
        workdir: Path, grad_outputs: Any) -> None:
    """gradient-monitor.yaml: "every 10th step, on every backward pass, reads the gradient with
    respect to the output of each Linear (micro-batches of a step are combined)" and "It only
    watches: nothing is clipped or skipped". Two micro-batches a step: the statistics of steps 0 and
    10 are those of both micro-batches' grad_output together (the test's own tensor hooks), steps
    1-9 leave them as they were; a loss scaled by 1e4 at step 10 fires the warning alert, and the
    parameters stay bit for bit those of a twin trained without the policy."""
    model = make_model()
    twin = copy.deepcopy(model)
    seen = grad_outputs(model, nn.Linear)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    reg = CollectorRegistry()
    labels = {"policy": "gradient-monitor", "rule": "layer-grads"}
    expected: dict[str, float] = {}
    with load("gradient-monitor.yaml").attach(model, registry=reg, rank=0):
        for step in range(11):
            seen.clear()
            for micro in range(2):
                for m in (model, twin):
                    loss = m(*batch(2 * step + micro))[1]
                    assert loss is not None
                    (loss * (1e4 if step == 10 else 1.0) / 2).backward()
            for m, o in ((model, opt), (twin, twin_opt)):
                o.step()
                o.zero_grad(set_to_none=True)
            assert _same(snapshot(model), snapshot(twin)), step
            if step % 10 == 0:
                assert all(len(gs) == 2 for gs in seen.values())
                expected = {name: torch.linalg.vector_norm(torch.cat([g.flatten() for g in gs]).double()).item()
                            for name, gs in seen.items()}
                for name, gs in seen.items():
                    g = torch.cat([g.flatten() for g in gs]).double()
                    assert stat(reg, "hookpolicy_grad_output_std", **labels, module=name) == pytest.approx(g.std().item(), rel=1e-4)
                    assert stat(reg, "hookpolicy_grad_output_max", **labels, module=name) == pytest.approx(g.max().item(), rel=1e-6)
            for name, norm in expected.items():
                assert stat(reg, "hookpolicy_grad_output_l2_norm", **labels, module=name) == pytest.approx(norm, rel=1e-5), step
            fired = counter(reg, "hookpolicy_alerts_total", **labels, severity="warning")
            assert fired == (sum(norm > 10 for norm in expected.values()) if step == 10 else 0), step
    assert min(expected.values()) > 10  # the scaled step's norms: every layer's warning fired, nothing was clipped


def test_feature_extraction_summary_and_its_byte_budget(workdir: Path, tmp_path: Path) -> None:
    """feature-extraction.yaml: "Saving stops at max_files files or max_bytes bytes, whichever comes
    first. The shape-free summary (l2_norm, mean, std) of the same outputs is exported". With a
    byte budget of two and a half files (a file's size: the test's own torch.save) two files are
    written, the rest is not; the summary keeps flowing and equals torch's on the outputs the test's
    own hooks saw."""
    import io

    model = make_model()
    names = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    outputs: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach().clone()))
               for n in names]
    size = io.BytesIO()
    torch.save(torch.zeros(4, 16, 32), size)
    budget = int(2.5 * len(size.getvalue()))
    text = (POLICIES / "feature-extraction.yaml").read_text().replace("every: 100", "every: 1")
    text = text.replace("max_bytes: 2147483648", f"max_bytes: {budget}")
    reg = CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with load_text(tmp_path, text).attach(model, registry=reg, rank=0):
            for step in range(3):
                train_step(model, opt, step)
                for n, out in outputs.items():
                    got = {k: stat(reg, f"hookpolicy_output_{k}", "feature-extraction", "save-features", n)
                           for k in ("l2_norm", "mean", "std")}
                    o = out.double()
                    assert got == pytest.approx({"l2_norm": torch.linalg.vector_norm(o).item(), "mean": o.mean().item(),
                                                 "std": o.std().item()}, rel=1e-5, abs=1e-6), (step, n)  # ln_f's mean: about 0
    finally:
        for h in handles:
            h.remove()
    files = sorted((workdir / "features").glob("*.pt"))
    assert [f.name for f in files] == ["step00000000-transformer.h.0-output.pt", "step00000000-transformer.h.1-output.pt"]
    assert sum(f.stat().st_size for f in files) <= budget


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
            assert _same(snapshot(model), snapshot(twin)), step
    wpe = model.transformer.wpe.weight.detach()
    if weight_decay == 0:
        assert torch.equal(wpe, start)
    else:
        assert not torch.equal(wpe, start)
        torch.testing.assert_close(wpe, start * (1 - 1e-2 * weight_decay) ** 3)


def test_recover_says_what_its_snapshots_hold(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """recover.yaml: "Each snapshot holds the parameters and buffers plus the optimizer state (AdamW:
    3x the parameters in all), in host memory; explain and the attach line print the size." The
    sizes against the test's own sums of nbytes: explain on the charlm example, the attach line and
    the first snapshot's line (after step 49, AdamW's moments in it) on the GPT."""
    import logging

    import examples.charlm
    from click.testing import CliRunner
    from hookpolicy.cli import cli

    def size(n: int) -> str:
        return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"

    def own(model: nn.Module) -> int:  # parameters and buffers, a tied weight once
        return sum(t.nbytes for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())

    charlm = own(examples.charlm.build_model())
    explained = CliRunner().invoke(cli, ["explain", str(POLICIES / "recover.yaml"), "--model",
                                         "examples.charlm:build_model"], prog_name="hookpolicy")
    assert explained.exit_code == 0, explained.output
    assert (f"snapshots for then: rewind after every 50 steps, at most 2 in host memory, each {size(charlm)} of "
            f"parameters and buffers plus the optimizer state (Adam: 2 x {size(charlm)} more): "
            f"{size(2 * 3 * charlm)} with Adam") in explained.output

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, "hookpolicy"), load("recover.yaml").attach(model, registry=CollectorRegistry(), rank=0):
        for step in range(50):
            train_step(model, opt, step)
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    params = own(model)
    assert 3 * params <= params + state <= 3 * params + 4 * len(list(model.parameters()))  # + AdamW's step counts
    said = [r.getMessage() for r in caplog.records]
    assert f"GPT: snapshots for then: rewind after every 50 steps, at most 2 in host memory, each {size(params)} " \
           f"of parameters and buffers plus the optimizer state (Adam: 2 x {size(params)} more): " \
           f"{size(2 * 3 * params)} with Adam" in said
    assert f"GPT: first snapshot for then: rewind after step 49: {size(params + state)} (x 2 kept at most); " \
           "0 LR schedulers, 0 GradScalers with it" in said


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


def test_feature_extraction_keeps_every_forward_of_a_step(workdir: Path) -> None:
    """feature-extraction.yaml: "each evaluated forward writes one file per matched module (so gradient
    accumulation writes one per micro-batch)" and "collecting embeddings from an evaluation run
    (phase: any captures under model.eval() too)". An evaluation loop of three batches before the
    first step (an evaluation forward does not advance the step), then two micro-batches of step 0:
    every forward's output is in a file of its own, equal to what the test's own hook saw, numbered
    in order (.pt, .2.pt, ... .5.pt); none overwrites another (they all did before)."""
    model = make_model()
    seen: list[torch.Tensor] = []
    handle = model.transformer.ln_f.register_forward_hook(lambda mod, a, out: seen.append(out.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with load("feature-extraction.yaml").attach(model, registry=CollectorRegistry(), rank=0):
            model.eval()
            with torch.no_grad():
                for i in range(3):
                    model(batch(10 + i)[0])
            model.train()
            for micro in range(2):
                loss = model(*batch(micro))[1]
                assert loss is not None
                loss.backward()
            opt.step()
    finally:
        handle.remove()
    assert len(seen) == 5
    names = ["step00000000-transformer.ln_f-output.pt"] + [
        f"step00000000-transformer.ln_f-output.{n}.pt" for n in range(2, 6)]
    assert sorted(f.name for f in (workdir / "features").glob("*ln_f*")) == sorted(names)
    for name, out in zip(names, seen):
        assert torch.equal(torch.load(workdir / "features" / name), out), name


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
