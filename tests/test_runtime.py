"""The runtime against PyTorch's own references: clip_grad_norm_, vector_norm, retain_grad."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry
from torch.utils.checkpoint import checkpoint

import hookpolicy
from helpers.outputs import metric
from hookpolicy.export import sinks
from hookpolicy import Halt
from hookpolicy.engine.runtime import Attached
from hookpolicy.export.metrics import split_family

from helpers.hooks import module_hook_count, no_host_sync
from helpers.policies import load_policy


class Block(nn.Module):
    """A residual block whose caller-side `out += x` and in-place ReLU break full backward hooks."""

    def __init__(self, d: int, inplace: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU(inplace=inplace)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.inplace:
            h += x  # residual added in place to fc's output
        else:
            h = h + x
        return self.act(h)  # ReLU(inplace=True) on it


class Net(nn.Module):
    def __init__(self, d: int = 8, ckpt: bool = False, inplace: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList([Block(d, inplace) for _ in range(2)])
        self.head = nn.Linear(d, 2)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(x)


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], accum: int = 1,
          before_step: Callable[[int], None] = lambda i: None) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            before_step(i)
            opt.step()
            opt.zero_grad()
    return losses


def fresh(seed: int = 0, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(**kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return metric(reg, name, {"rank": "0", "policy": "p", **labels})


# -- statistics against references ---------------------------------------------------------

def test_captured_norms_equal_vector_norm(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: out
          match: {modules: ["head"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm, mean, std, min, max, abs_max, rms, zero_fraction, nonfinite, numel]}}]
        - name: grads
          match: {modules: ["blocks.*.fc"]}
          trigger: {at: step}
          actions: [{capture: {stats: [l2_norm], per: module}}, {capture: {stats: [abs_max], per: tensor}}]
    """)
    model, opt = fresh()
    reg = CollectorRegistry()
    seen: dict[str, torch.Tensor] = {}
    model.head.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o.detach().clone()))
    with pol.attach(model, registry=reg) as attached:
        x, y = batches(1)[0]
        nn.functional.mse_loss(model(x), y).backward()
        fc = model.blocks[0].fc
        joint = torch.linalg.vector_norm(torch.cat([fc.weight.grad.flatten(), fc.bias.grad.flatten()]))
        abs_max_w = fc.weight.grad.abs().max()
        opt.step()
    out = seen["out"].double()
    expected = {
        "l2_norm": torch.linalg.vector_norm(out), "mean": out.mean(), "std": out.std(), "min": out.min(),
        "max": out.max(), "abs_max": out.abs().max(), "rms": out.pow(2).mean().sqrt(),
        "zero_fraction": (out == 0).double().mean(), "nonfinite": torch.tensor(0.0), "numel": torch.tensor(12.0),
    }
    last = last_values(attached)
    for stat, ref in expected.items():
        assert last[("out", stat)] == pytest.approx(ref.item(), rel=1e-5, abs=1e-7), stat
    assert last[("grads", "l2_norm", "blocks.0.fc", "")] == pytest.approx(joint.item(), rel=1e-6)
    assert last[("grads", "abs_max", "blocks.0.fc", "weight")] == pytest.approx(abs_max_w.item(), rel=1e-6)


def last_values(attached: Attached) -> dict[tuple[str, ...], float]:
    """`attached.last_values()` keyed by (rule, stat, module, tensor), and by (rule, stat) for the last series."""
    last: dict[tuple[str, ...], float] = {}
    for family, series in attached.last_values().items():
        _, stat = split_family(family)
        for (_, rule, module, tensor), value in series.items():
            last[(rule, stat)] = value
            last[(rule, stat, module, tensor)] = value
    return last


def test_a_step_rule_reads_every_gradient_there_is_at_each_step(tmp_path: Path) -> None:
    """A step rule's rows follow the gradients at each step: all of them, one missing (its parameter's grad
    set to None), all, a module's two missing, then a NaN in one, which skips the step; per tensor its norm (torch's
    vector_norm), its non-finite count (torch.isfinite), what hookpolicy_actions_total counts (the modules
    with a gradient), and the parameters bit for bit against the same loop leaving that step out by hand."""
    pol = load_policy(tmp_path, """
        - name: grads
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - capture: {stats: [l2_norm, nonfinite], per: tensor}
            - alert: {if: "nonfinite > 0", per: rule, then: skip_step}
    """)
    model, opt = fresh()
    ref_model, ref_opt = fresh()
    reg = CollectorRegistry()
    missing, poisoned = {1: ["bias"], 3: ["weight", "bias"]}, 4  # step: head's parameters without a grad
    counted = 0.0
    with pol.attach(model, registry=reg) as attached:
        for i, (x, y) in enumerate(batches(6)):
            for m, o in ((model, opt), (ref_model, ref_opt)):
                nn.functional.mse_loss(m(x), y).backward()
                for name in missing.get(i, []):
                    getattr(m.head, name).grad = None
                if i == poisoned:
                    m.inp.weight.grad[0, 0] = float("nan")  # type: ignore[index]
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            if i != poisoned:
                ref_opt.step()
            ref_opt.zero_grad()
            last = last_values(attached)
            for name, grad in grads.items():
                module, _, tensor = name.rpartition(".")
                assert last[("grads", "l2_norm", module, tensor)] == pytest.approx(
                    torch.linalg.vector_norm(grad.double()).item(), rel=1e-6, nan_ok=True), (i, name)
                assert last[("grads", "nonfinite", module, tensor)] == (~torch.isfinite(grad)).sum().item(), (i, name)
            counted += len({name.rpartition(".")[0] for name in grads})
            assert sample(reg, "hookpolicy_actions_total", rule="grads", action="capture", mode="enforce") == counted
            assert sample(reg, "hookpolicy_skipped_steps_total", rule="grads") == (1.0 if i >= poisoned else 0.0)
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                assert torch.equal(p, q), (i, name)


def test_rule_clip_equals_clip_grad_norm(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: clip
          match: {modules: ["blocks.**"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: 0.05}}]
    """)
    model, opt = fresh()
    ref_model = copy.deepcopy(model)
    x, y = batches(1)[0]
    nn.functional.mse_loss(ref_model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(list(ref_model.blocks.parameters()), 0.05)
    with pol.attach(model):
        nn.functional.mse_loss(model(x), y).backward()
        captured: dict[str, torch.Tensor] = {}
        opt.register_step_pre_hook(lambda o, a, k: captured.update(
            {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    for name, p in ref_model.named_parameters():
        assert torch.allclose(captured[name], p.grad, atol=1e-6, rtol=0), name
        if name.startswith("blocks"):
            assert not torch.equal(captured[name], model.get_parameter(name).grad * 0)


@pytest.mark.parametrize("norm_type", [2, "inf"])
def test_per_module_and_tensor_clip(tmp_path: Path, norm_type: Any) -> None:
    pol = load_policy(tmp_path, f"""
        - name: clip
          match: {{modules: ["inp", "head"]}}
          trigger: {{at: step}}
          actions: [{{clip: {{max_norm: 0.01, norm_type: {norm_type}, per: module}}}}]
    """)
    model, opt = fresh()
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    expected = {}
    p = float(norm_type)
    for mod in (model.inp, model.head):
        grads = [mod.weight.grad.clone(), mod.bias.grad.clone()]
        torch.nn.utils.clip_grad_norm_(grads_as_params(grads), 0.01, norm_type=p)
        expected[mod] = [g for g in grads]
    seen: dict[nn.Module, list[torch.Tensor]] = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(
        {m: [m.weight.grad.clone(), m.bias.grad.clone()] for m in (model.inp, model.head)}))
    with pol.attach(model):
        opt.step()
    for mod, ref in expected.items():
        for got, want in zip(seen[mod], ref):
            assert torch.allclose(got, want.grad if isinstance(want, nn.Parameter) else want, atol=1e-6)


def grads_as_params(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    """Parameters whose .grad are the given tensors, so clip_grad_norm_ clips them in place."""
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    return params


# -- training is untouched when it should be ------------------------------------------------

def test_capture_only_policy_leaves_losses_bit_identical(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: fwd
          match: {types: [Linear]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm, mean, std, abs_max, nonfinite, zero_fraction]}}]
        - name: bwd
          match: {types: [Linear]}
          trigger: {at: backward}
          actions: [{capture: {stats: [l2_norm, abs_max]}}]
        - name: step
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{capture: {stats: [l2_norm, nonfinite], per: tensor}}]
    """)
    data = batches(6)
    model, opt = fresh()
    ref = train(model, opt, data)
    model2, opt2 = fresh()
    with pol.attach(model2):
        got = train(model2, opt2, data)
    assert got == ref
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_audit_mode_changes_nothing(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: clip
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - clip: {max_norm: 0.001}
            - scale: {factor: 0}
            - alert: {if: "l2_norm >= 0", then: skip_step}
        - name: clamp-out
          match: {types: [Linear]}
          trigger: {at: forward}
          actions: [{clip: {min: -0.01, max: 0.01}}, {alert: {if: "numel > 0", then: halt}}]
    """, spec="mode: audit\n")
    data = batches(4)
    model, opt = fresh()
    ref = train(model, opt, data)
    model2, opt2 = fresh()
    reg = CollectorRegistry()
    with pol.attach(model2, registry=reg):
        got = train(model2, opt2, data)
        # once per step and binding: 4 modules with parameters, 4 steps
        assert sample(reg, "hookpolicy_actions_total", rule="clip", action="clip", mode="audit") == 16
        # the alert is evaluated per module: 4 modules with parameters, 4 steps
        assert sample(reg, "hookpolicy_alerts_total", rule="clip", severity="warning") == 16
        assert sample(reg, "hookpolicy_skipped_steps_total", rule="clip") == 0
    assert got == ref


def test_a_forward_alert_skips_a_step_on_which_no_step_rule_is_active(tmp_path: Path) -> None:
    """A step rule every 3 steps and a forward alert every step: on the steps between (no step rule, no loss: the
    cycle's quiet path) the forward alert still skips its step (a NaN input at step 4), and nothing else is
    skipped; the parameters bit for bit against the same loop leaving step 4 out by hand, the step rule's norm
    against vector_norm of the gradients at its steps, hookpolicy_steps_total against the optimizer's own
    step post-hook count, and hookpolicy_last_step_timestamp_seconds within the step's own clock readings."""
    import time

    pol = load_policy(tmp_path, """
        - name: grads
          match: {modules: ["**"]}
          trigger: {at: step, every: 3}
          actions: [{capture: {stats: [l2_norm], per: rule}}]
        - name: guard
          match: {modules: ["inp"]}
          trigger: {at: forward}
          target: output
          actions: [{alert: {if: "nonfinite > 0", then: skip_step}}]
    """)
    model, opt = fresh()
    ref_model, ref_opt = fresh()
    stepped = [0]
    opt.register_step_post_hook(lambda o, a, k: stepped.__setitem__(0, stepped[0] + 1))
    reg = CollectorRegistry()
    poisoned = 4
    with pol.attach(model, registry=reg) as attached:
        for i, (x, y) in enumerate(batches(8)):
            if i == poisoned:
                x = x.clone()
                x[0, 0] = float("nan")
            nn.functional.mse_loss(model(x), y).backward()
            norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
            before = time.time()
            opt.step()
            after = time.time()
            opt.zero_grad()
            if i != poisoned:
                nn.functional.mse_loss(ref_model(x), y).backward()
                ref_opt.step()
                ref_opt.zero_grad()
            if i % 3 == 0:
                assert last_values(attached)[("grads", "l2_norm")] == pytest.approx(norm.item(), rel=1e-6), i
            labels = {"rank": "0", "model": attached.store.model}
            assert metric(reg, "hookpolicy_steps_total", labels) == stepped[0] == i + 1
            stamp = metric(reg, "hookpolicy_last_step_timestamp_seconds", labels)
            assert stamp is not None and before <= stamp <= after
            assert sample(reg, "hookpolicy_skipped_steps_total", rule="guard") == (1 if i >= poisoned else 0), i
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, ref), name


def test_audit_flag_overrides_enforce(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: freeze
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{scale: {factor: 0}}]
    """)
    data = batches(3)
    model, opt = fresh()
    ref = train(model, opt, data)
    model2, opt2 = fresh()
    with pol.attach(model2, audit=True):
        assert train(model2, opt2, data) == ref


def test_skip_step_on_nan_keeps_params_and_adamw_state(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: nan-guard
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{alert: {if: "nonfinite > 0", then: skip_step, severity: critical}}]
    """)
    model, opt = fresh()
    reg = CollectorRegistry()
    data = batches(4)
    with pol.attach(model, registry=reg) as attached:
        train(model, opt, data[:2])
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = copy.deepcopy(opt.state_dict())
        x, y = data[2]
        nn.functional.mse_loss(model(x), y).backward()
        model.head.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            assert torch.equal(p, params[n]), n
        after = opt.state_dict()
        for key, st in state["state"].items():
            for k, v in st.items():
                assert torch.equal(after["state"][key][k], v), (key, k)
        assert sample(reg, "hookpolicy_skipped_steps_total", rule="nan-guard") == 1
        assert sample(reg, "hookpolicy_alert_firing", rule="nan-guard", severity="critical") == 1
        train(model, opt, data[3:])
        assert any(not torch.equal(p, params[n]) for n, p in model.named_parameters())
        assert sample(reg, "hookpolicy_alert_firing", rule="nan-guard", severity="critical") == 0
        assert attached.step == 4


def test_halt_raises_with_policy_rule_step(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: explode
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{alert: {if: "l2_norm > 0", for: 2, per: rule, then: halt, message: "norm {l2_norm:.1f} at {step}"}}]
    """)
    model, opt = fresh()
    with pol.attach(model) as attached, pytest.raises(Halt) as info:
        train(model, opt, batches(5))
    assert (info.value.policy, info.value.rule, info.value.step) == ("p", "explode", 1)
    assert info.value.line().startswith("hookpolicy: halted by p/explode at step 1: norm ")
    assert attached.step == 1  # the halting step was not applied
    assert module_hook_count(model) == 0


# -- backward correctness ------------------------------------------------------------------

def test_backward_capture_on_inplace_model_equals_retain_grad(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: go
          match: {modules: ["blocks.*.fc", "blocks.*"]}
          trigger: {at: backward}
          actions: [{capture: {stats: [l2_norm, abs_max]}}]
    """)
    # The reference: retain_grad on the same outputs of the same model written out of place.
    model, _ = fresh(inplace=False)
    x, y = batches(1)[0]
    outs: dict[str, torch.Tensor] = {}
    for name in ("blocks.0.fc", "blocks.1.fc", "blocks.0", "blocks.1"):
        def keep(m: nn.Module, a: Any, o: torch.Tensor, name: str = name) -> None:
            o.retain_grad()
            outs[name] = o
        model.get_submodule(name).register_forward_hook(keep)
    nn.functional.mse_loss(model(x), y).backward()
    ref = {n: t.grad.clone() for n, t in outs.items()}
    model2, _ = fresh()
    with pol.attach(model2) as attached:
        nn.functional.mse_loss(model2(x), y).backward()
        with pytest.raises(RuntimeError):  # what the hand-written hook gets wrong
            h = model2.blocks[0].fc.register_full_backward_hook(lambda *a: None)
            try:
                nn.functional.mse_loss(model2(x), y).backward()
            finally:
                h.remove()
        model2.zero_grad()
    last = last_values(attached)
    for name, grad in ref.items():
        assert last[("go", "l2_norm", name, "")] == pytest.approx(torch.linalg.vector_norm(grad).item(), rel=1e-6)


def test_grad_input_equals_module_input_gradient(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: gi
          match: {modules: ["head"]}
          trigger: {at: backward}
          target: grad_input
          actions: [{capture: {stats: [l2_norm]}}]
    """)
    model, _ = fresh()
    ref = copy.deepcopy(model)
    x, y = batches(1)[0]
    feats: list[torch.Tensor] = []
    ref.head.register_forward_pre_hook(lambda m, a: feats.append(a[0]))
    (grad_in,) = torch.autograd.grad(nn.functional.mse_loss(ref(x), y), feats[0])
    with pol.attach(model) as attached:
        nn.functional.mse_loss(model(x), y).backward()
    last = last_values(attached)
    assert last[("gi", "l2_norm", "head", "")] == pytest.approx(torch.linalg.vector_norm(grad_in).item(), rel=1e-6)


def test_backward_scale_changes_gradient_flowing_down(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: half
          match: {modules: ["head"]}
          trigger: {at: backward}
          actions: [{scale: {factor: 0.5}}]
    """)
    model, _ = fresh()
    ref = copy.deepcopy(model)
    x, y = batches(1)[0]
    nn.functional.mse_loss(ref(x), y).backward()
    with pol.attach(model):
        nn.functional.mse_loss(model(x), y).backward()
    assert torch.allclose(model.inp.weight.grad, ref.inp.weight.grad * 0.5, atol=1e-7)
    assert torch.allclose(model.head.weight.grad, ref.head.weight.grad * 0.5, atol=1e-7)


# -- steps ---------------------------------------------------------------------------------

def test_grad_accumulation_is_one_step(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: g
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{capture: {stats: [l2_norm], per: rule}}]
        - name: fwd
          match: {modules: ["head"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [numel]}}]
    """)
    model, opt = fresh()
    reg = CollectorRegistry()
    norms: list[float] = []

    def record(i: int) -> None:
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.cat(grads)).item())

    with pol.attach(model, registry=reg) as attached:
        train(model, opt, batches(8), accum=4, before_step=record)
        assert attached.step == 2
        assert metric(reg, "hookpolicy_steps_total", {"rank": "0"}) == 2
        assert sample(reg, "hookpolicy_output_numel", rule="fwd", module="head", tensor="") == 4 * 12
    # root is named "" in labels; the step norm is the accumulated gradient's norm
    last = last_values(attached)
    assert last[("g", "l2_norm", "", "")] == pytest.approx(norms[-1], rel=1e-6)


def test_manual_sgd_counts_one_step_per_backward(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: g
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{capture: {stats: [l2_norm], per: rule}}, {alert: {if: "l2_norm > 0", per: rule, then: skip_step}}]
    """)
    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pol.attach(model) as attached:
        for x, y in batches(3):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
        assert attached.step == 3
    # skip_step without an optimizer zeroes the gradients, so nothing moved
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_two_optimizers_make_one_step(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: g
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{capture: {stats: [l2_norm], per: rule}}]
    """)
    torch.manual_seed(0)
    model = Net()
    opt1 = torch.optim.SGD(model.inp.parameters(), lr=0.1)
    opt2 = torch.optim.AdamW([*model.blocks.parameters(), *model.head.parameters()])
    with pol.attach(model) as attached:
        for x, y in batches(3):
            nn.functional.mse_loss(model(x), y).backward()
            opt1.step()
            opt2.step()
            opt1.zero_grad()
            opt2.zero_grad()
        assert attached.step == 3


def test_every_and_window_gate_and_remove_hooks(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: sparse
          match: {modules: ["head"]}
          trigger: {at: forward, every: 3, steps: {from: 2, until: 8}}
          actions: [{capture: {stats: [numel]}}]
    """)
    model, opt = fresh()
    reg = CollectorRegistry()
    installed = []
    with pol.attach(model, registry=reg):
        def step_hook(i: int) -> None:
            installed.append(bool(model.head._forward_hooks))
        train(model, opt, batches(10), before_step=step_hook)
        assert sample(reg, "hookpolicy_actions_total", rule="sparse", action="capture", mode="enforce") == 2
    assert installed == [s in (3, 6) for s in range(10)]


def test_phase_eval_and_train(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: train-only
          match: {modules: ["head"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [numel]}}]
        - name: eval-only
          match: {modules: ["head"]}
          trigger: {at: forward, phase: eval}
          actions: [{capture: {stats: [numel]}}]
    """)
    model, opt = fresh()
    reg = CollectorRegistry()
    with pol.attach(model, registry=reg):
        train(model, opt, batches(2))
        model.eval()
        with torch.no_grad():
            for x, _ in batches(3):
                model(x)
        model.train()
        counts = {r: sample(reg, "hookpolicy_actions_total", rule=r, action="capture", mode="enforce")
                  for r in ("train-only", "eval-only")}
    assert counts == {"train-only": 2, "eval-only": 3}


def test_checkpointed_blocks_counted_once(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: fwd
          match: {modules: ["blocks.*.fc"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm]}}]
        - name: bwd
          match: {modules: ["blocks.*.fc"]}
          trigger: {at: backward}
          actions: [{capture: {stats: [l2_norm]}}]
    """)
    model, opt = fresh(ckpt=True)
    ref_model, ref_opt = fresh(ckpt=False)
    reg = CollectorRegistry()
    data = batches(2)
    train(ref_model, ref_opt, data[:1])
    with pol.attach(model, registry=reg) as attached:
        train(model, opt, data[:1])
        for rule in ("fwd", "bwd"):
            assert sample(reg, "hookpolicy_actions_total", rule=rule, action="capture", mode="enforce") == 2
    last = last_values(attached)
    assert last[("bwd", "l2_norm", "blocks.0.fc", "")] > 0


def test_gradscaler_skipped_step_raises_no_alert(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: nan-step
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{alert: {if: "nonfinite > 0", then: halt}}]
        - name: nan-bwd
          match: {modules: ["head"]}
          trigger: {at: backward}
          actions: [{alert: {if: "nonfinite > 0", then: halt}}]
    """)
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    reg = CollectorRegistry()
    data = batches(3)
    with pol.attach(model, registry=reg) as attached:
        for i, (x, y) in enumerate(data):
            loss = nn.functional.mse_loss(model(x), y)
            if i == 0:
                loss = loss * float("inf")  # an overflow: GradScaler skips this step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert attached.step == 2
    assert sample(reg, "hookpolicy_alerts_total", rule="nan-step", severity="warning") == 0


# -- structure, select, sinks ---------------------------------------------------------------

class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.body(x)
        return {"logits": h * 2, "aux": (h, torch.ones(1, dtype=torch.long))}


def test_select_dict_and_tuple_outputs(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: logits
          match: {root: true}
          trigger: {at: forward}
          select: [logits]
          actions: [{capture: {stats: [l2_norm], per: tensor}}]
        - name: all
          match: {root: true}
          trigger: {at: forward}
          actions: [{capture: {stats: [numel], per: tensor}}]
    """)
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(3, 4)
    with pol.attach(model) as attached:
        out = model(x)  # forward statistics cover every call of a step: call once
        out["logits"].sum().backward()
    last = last_values(attached)
    assert last[("logits", "l2_norm", "", "logits")] == pytest.approx(out["logits"].norm().item(), rel=1e-6)
    assert ("logits", "l2_norm", "", "aux.0") not in last
    assert {k[3] for k in last if k[0] == "all" and len(k) == 4} == {"logits", "aux.0"}


class Tupled(nn.Module):
    """A Linear whose output is handed on in a tuple: the same tensor as `fc`'s bare output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.fc(x),)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wrap = Tupled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrap(x)[0].tanh()


def test_bare_and_tupled_outputs_measure_alike(tmp_path: Path) -> None:
    # `wrap.fc`'s bare output takes the executor's short road (Programs.measure), `wrap`'s tuple holding
    # the same tensor the general one (Programs.execute): the same bits, both against torch's own norms
    pol = load_policy(tmp_path, """
        - name: out
          match: {modules: ["wrap", "wrap.fc"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm, abs_max, nonfinite], per: tensor}}]
        - name: go
          match: {modules: ["wrap", "wrap.fc"]}
          trigger: {at: backward}
          actions: [{capture: {stats: [l2_norm, abs_max], per: tensor}}, {alert: {if: "abs_max < 0"}}]
    """)
    torch.manual_seed(0)
    model = Outer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, torch.Tensor] = {}

    def keep(m: nn.Module, a: Any, o: torch.Tensor) -> None:
        o.retain_grad()
        seen["out"] = o

    model.wrap.fc.register_forward_hook(keep)
    reg = CollectorRegistry()
    with pol.attach(model, registry=reg) as attached:
        for x, _ in batches(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        out, grad = seen["out"].detach().double(), seen["out"].grad.double()
        for rule in ("out", "go"):
            for action in ("capture", "alert") if rule == "go" else ("capture",):
                assert sample(reg, "hookpolicy_actions_total", rule=rule, action=action, mode="enforce") == 4
    last = last_values(attached)
    for rule, ref in (("out", out), ("go", grad)):
        for stat, value in (("l2_norm", torch.linalg.vector_norm(ref)), ("abs_max", ref.abs().max())):
            assert last[(rule, stat, "wrap.fc", "")] == last[(rule, stat, "wrap", "0")], (rule, stat)
            assert last[(rule, stat, "wrap.fc", "")] == pytest.approx(value.item(), rel=1e-6), (rule, stat)
    assert last[("out", "nonfinite", "wrap.fc", "")] == last[("out", "nonfinite", "wrap", "0")] == 0


def test_log_records_are_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path))
    pol = load_policy(tmp_path, """
        - name: g
          match: {modules: ["head"]}
          trigger: {at: step}
          actions: [{capture: {stats: [l2_norm, nonfinite], per: tensor, log: {path: logs/g.jsonl}}}]
    """)
    model, opt = fresh()
    writes: list[int] = []
    write = sinks.JsonLines.write
    monkeypatch.setattr(sinks.JsonLines, "write", lambda self, records: (
        writes.append(len(records)) if records and "stats" in records[0] else None, write(self, records)))
    with pol.attach(model):
        train(model, opt, batches(2))
    assert writes == [2, 2]  # a step's records of the rule go out in one write
    lines = [json.loads(line) for line in (tmp_path / "logs/g.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    assert set(lines[0]) == {"run", "time", "step", "rank", "model", "policy", "rule", "module", "target", "tensor",
                             "stats"}
    assert lines[0]["model"].partition("#")[0] == "Net"  # the default registry: other tests' Nets came first
    assert [(r["step"], r["tensor"]) for r in lines] == [(0, "weight"), (0, "bias"), (1, "weight"), (1, "bias")]
    assert lines[0]["stats"]["nonfinite"] == 0 and isinstance(lines[0]["stats"]["l2_norm"], float)


def test_an_alert_s_record_carries_every_statistic_of_its_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An alert is judged on what its condition and message read, and the record of a group it fires for
    carries every statistic of its pass with torch's values; its message reads one its condition does not."""
    monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "alerts.jsonl"))
    pol = load_policy(tmp_path, """
        - name: go
          match: {modules: ["head"]}
          trigger: {at: backward}
          target: grad_output
          actions:
            - capture: {stats: [l2_norm, abs_max, mean, nonfinite]}
            - alert: {if: "nonfinite > 0", per: tensor, then: skip_step, message: "bad at {abs_max}"}
    """)
    model, opt = fresh()
    seen: list[torch.Tensor] = []
    model.head.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].detach().clone()))
    with pol.attach(model):
        for i, (x, y) in enumerate(batches(3)):
            out = model(x)
            if i == 1:
                out = out * torch.tensor([1.0, float("inf")])
            nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
    records = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    grad = seen[1].double()
    expected = {"l2_norm": torch.linalg.vector_norm(grad).item(), "abs_max": grad.abs().max().item(),
                "mean": grad.mean().item(), "nonfinite": (~torch.isfinite(grad)).sum().item()}
    assert sorted(records[0]["stats"]) == sorted(expected)
    for stat, value in expected.items():
        assert records[0]["stats"][stat] == pytest.approx(value, rel=1e-6, nan_ok=True), stat
    assert records[0]["message"].startswith(f"bad at {records[0]['stats']['abs_max']}")


def test_tensor_files_bounded_and_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path))
    pol = load_policy(tmp_path, """
        - name: feats
          match: {modules: ["head"]}
          trigger: {at: forward}
          actions: [{capture: {tensors: {dir: feats, max_files: 3}}}]
    """)
    model, opt = fresh()
    reg = CollectorRegistry()
    outs: list[torch.Tensor] = []
    model.head.register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    with pol.attach(model, registry=reg):
        train(model, opt, batches(5))
        # a spent budget is the configured end of the capture, not an error
        assert sample(reg, "hookpolicy_hook_errors_total", rule="feats") == 0
    files = sorted((tmp_path / "feats").iterdir())
    assert [f.name for f in files] == [f"step{i:08d}-head-output.pt" for i in range(3)]
    for f, ref in zip(files, outs):
        assert torch.equal(torch.load(f), ref)


# -- errors and cleanup ---------------------------------------------------------------------

def test_failing_rule_is_contained_then_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    pol = load_policy(tmp_path, """
        - name: boom
          match: {modules: ["head"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm]}}]
    """)
    from hookpolicy.engine.execute import programs

    def explode(*a: Any, **k: Any) -> Any:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(programs, "tensor_partials", explode)
    monkeypatch.setattr(programs, "host_partials", explode)  # the CPU path (stats.host_partials)
    monkeypatch.setattr(programs, "host_row", explode)  # a hook's one CPU tensor (stats.host_row)
    model, opt = fresh()
    reg = CollectorRegistry()
    with pol.attach(model, registry=reg):
        train(model, opt, batches(5))
        assert sample(reg, "hookpolicy_hook_errors_total", rule="boom") == 3
    tracebacks = [r for r in caplog.records if "kaboom" in r.getMessage()]
    assert len(tracebacks) == 1 and "Traceback" in tracebacks[0].getMessage()
    assert module_hook_count(model) == 0


def test_on_error_halt_stops_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pol = load_policy(tmp_path, """
        - name: boom
          match: {modules: ["head"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm]}}]
    """, spec="onError: halt\n")
    from hookpolicy.engine.execute import programs

    monkeypatch.setattr(programs, "tensor_partials", lambda *a: 1 / 0)
    monkeypatch.setattr(programs, "host_partials", lambda *a: 1 / 0)  # the CPU path (stats.host_partials)
    monkeypatch.setattr(programs, "host_row", lambda *a: 1 / 0)  # a hook's one CPU tensor (stats.host_row)
    model, opt = fresh()
    with pol.attach(model), pytest.raises(Halt, match="ZeroDivisionError"):
        train(model, opt, batches(2))
    assert module_hook_count(model) == 0


def test_hooks_removed_after_exception_and_remove_twice(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: all
          match: {modules: ["**"]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm]}}]
        - name: bwd
          match: {types: [Linear]}
          trigger: {at: backward}
          target: grad_input
          actions: [{capture: {stats: [l2_norm]}}]
    """)
    model, _ = fresh()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with pol.attach(model) as attached:
            assert module_hook_count(model) > 0
            model(torch.randn(2, 3))  # wrong shape: forward raises
    assert module_hook_count(model) == 0
    attached.remove()
    assert module_hook_count(model) == 0
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks


def test_no_host_sync_inside_hooks(tmp_path: Path) -> None:
    """The CUDA rule: no hook reads a value back (`no_host_sync` has CPU tensors take CUDA's path; on CPU
    the hooks read their partials at once: `test_cpu_hooks_read_their_partials_at_once`)."""
    pol = load_policy(tmp_path, """
        - name: fwd
          match: {types: [Linear]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm, mean, std, min, max, abs_max, rms, zero_fraction, nonfinite]}},
                    {alert: {if: "nonfinite > 0", then: skip_step}}]
        - name: bwd
          match: {types: [Linear]}
          trigger: {at: backward}
          actions: [{capture: {stats: [l2_norm, abs_max]}}, {clip: {max_norm: 1.0}}]
    """)
    model, _ = fresh()
    reg = CollectorRegistry()
    with pol.attach(model, registry=reg) as attached:
        with no_host_sync():
            x, y = batches(1)[0]
            nn.functional.mse_loss(model(x), y).backward()
        assert len(attached._cycle.ledger.entries) > 0  # statistics waiting on the device for the readback
        # A sync inside a hook raises there, and onError would contain it: so also check
        # that no hook failed, or this test could not fail.
        for rule in ("fwd", "bwd"):
            assert sample(reg, "hookpolicy_hook_errors_total", rule=rule) == 0


def test_cpu_hooks_read_their_partials_at_once(tmp_path: Path) -> None:
    """The CPU rule: a hook reads its partials (no sync on CPU), so the readback has nothing to fetch."""
    pol = load_policy(tmp_path, """
        - name: fwd
          match: {types: [Linear]}
          trigger: {at: forward}
          actions: [{capture: {stats: [l2_norm, abs_max, nonfinite]}}]
    """)
    model, _ = fresh()
    with pol.attach(model) as attached:
        x, y = batches(1)[0]
        nn.functional.mse_loss(model(x), y).backward()
        entries = attached._cycle.ledger.entries
        assert entries and all(isinstance(getattr(e, "matrix", None), list) for e in entries)


def test_step_nonfinite_count_is_exact(tmp_path: Path) -> None:
    """Step rules count non-finite gradient elements at the readback: the count stays exact."""
    pol = load_policy(tmp_path, """
        - name: g
          match: {modules: ["head", "inp"]}
          trigger: {at: step}
          actions: [{capture: {stats: [nonfinite, l2_norm], per: tensor}}, {alert: {if: "nonfinite > 0", then: skip_step}}]
    """)
    model, opt = fresh()
    x, y = batches(1)[0]
    with pol.attach(model) as attached:
        nn.functional.mse_loss(model(x), y).backward()
        g = model.head.weight.grad
        g[0, 0], g[0, 1], g[1, 2] = float("nan"), float("inf"), float("-inf")
        model.inp.bias.grad[3] = float("inf")
        opt.step()
    last = last_values(attached)
    assert last[("g", "nonfinite", "head", "weight")] == 3
    assert last[("g", "nonfinite", "inp", "bias")] == 1
    assert last[("g", "nonfinite", "head", "bias")] == 0
    assert last[("g", "l2_norm", "head", "bias")] == pytest.approx(
        torch.linalg.vector_norm(model.head.bias.grad).item(), rel=1e-6)


def test_grad_input_warns_when_it_cannot_be_observed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An in-place module rewrites the identity view; a first layer's input needs no grad."""
    pol = load_policy(tmp_path, """
        - name: gi
          match: {types: [ReLU, Linear]}
          trigger: {at: backward}
          target: grad_input
          actions: [{capture: {stats: [l2_norm]}}]
    """)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    with pol.attach(model) as attached:
        for _ in range(2):  # warned once, not per call
            model(torch.randn(3, 4)).sum().backward()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings.count("p/gi: 1 modifies its input in place, so its grad_input cannot be observed; "
                          "use grad_output of the module before it") == 1
    assert warnings.count("p/gi: no input of 0 requires grad, so its grad_input never fires") == 1
    last = last_values(attached)
    assert last[("gi", "l2_norm", "2", "")] > 0  # the last Linear's grad_input is observed
