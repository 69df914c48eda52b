"""AGC (`clip: {unitwise_ratio, eps}`) against a reference written here from the NFNets equations.

Brock et al. 2021, "High-Performance Large-Scale Image Recognition Without Normalization",
section 4.1: for each unit i of a parameter (a row of a weight matrix, an output channel
of a conv kernel; a bias is one unit), with G_i its gradient and W_i its weights,

    G_i <- lambda * max(||W_i||, eps) / ||G_i|| * G_i   if ||G_i|| / max(||W_i||, eps) > lambda

(the paper's reference code divides by max(||G_i||, 1e-6)). The reference below applies
that to a copy of the model, and the test compares the gradients the optimizer used.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from click.testing import CliRunner
from helpers import REPO
from helpers.hooks import no_host_sync
from helpers.outputs import metric
from helpers.policies import load_policy
from helpers.references import agc_reference
from hookpolicy.cli import cli
from stacks.timm_like import BUILDERS, CLASSIFIER


class ConvNet(nn.Module):
    """A conv (4-d weight, bias), a linear head (2-d weight, zero bias: eps decides its bound),
    a scale vector, a frozen parameter and one the forward never uses (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.head = nn.Linear(6 * 4 * 4, 5)
        nn.init.zeros_(self.head.bias)
        self.gain = nn.Parameter(torch.ones(6))
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)) * self.gain[:, None, None]
        return self.head(h.flatten(1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randn(8, 5, generator=g)) for _ in range(n)]


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss scaled so that AGC at ratio 0.01-0.05 clips some units and not others."""
    return 0.05 * nn.functional.mse_loss(model(x), y)


RULE = """
- name: agc
  match: {modules: [%s]}
  trigger: {at: step}
  actions: [{clip: {unitwise_ratio: %s, eps: %s}}]
"""


def run(tmp_path: Path, modules: str, ratio: float, eps: float, steps: int = 4, spec: str = "",
        ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], list[dict[str, int]], nn.Module, nn.Module,
                   CollectorRegistry]:
    """Train a model under the policy and a copy under the reference, side by side.

    Returns per step the gradients the optimizer used with hookpolicy and with the
    reference, the reference's count of clipped units, both models and the registry.
    """
    pol = load_policy(tmp_path, RULE % (modules, ratio, eps), spec=spec)
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    got: list[dict[str, torch.Tensor]] = []
    want: list[dict[str, torch.Tensor]] = []
    counts: list[dict[str, int]] = []
    opt.register_step_pre_hook(lambda o, a, k: got.append(
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    reg = CollectorRegistry()
    selected = [(n, p) for n, p in ref.named_parameters() if modules == '"**"' or f'"{n.split(".")[0]}"' == modules]
    with pol.attach(model, registry=reg):
        for x, y in batches(steps):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                loss(m, x, y).backward()
            counts.append(agc_reference(selected, ratio, eps) if not spec else {})
            want.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
            opt.step()
            ref_opt.step()
    return got, want, counts, model, ref, reg


def clipped(reg: CollectorRegistry, module: str, mode: str = "enforce") -> float | None:
    """hookpolicy_clipped_total of the rule `agc` on `module`."""
    return metric(reg, "hookpolicy_clipped_total", {"rank": "0", "policy": "p", "rule": "agc", "module": module,
                                                     "mode": mode})


def test_agc_equals_the_nfnets_equations(tmp_path: Path) -> None:
    got, want, counts, model, ref, reg = run(tmp_path, '"**"', 0.02, 1e-3)
    assert all(0 < sum(c.values()) < 7 + 6 + 1 for c in counts), counts  # some units clipped, not all
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w) == ["conv.bias", "conv.weight", "gain", "head.bias", "head.weight"]
        for name in g:
            torch.testing.assert_close(g[name], w[name], rtol=1e-6, atol=1e-9, msg=lambda m: f"step {step} {name}: {m}")
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")
    assert model.unused.weight.grad is None and model.frozen.grad is None
    for module in ("conv", "head", ""):  # the units clipped, per module, over the 4 steps
        assert clipped(reg, module) == sum(c.get(module, 0) for c in counts), module
    assert clipped(reg, "unused") is None


def test_agc_clips_only_the_matched_modules(tmp_path: Path) -> None:
    """`match` decides which parameters AGC sees: the head's gradients stay as backward left them."""
    got, want, counts, _, _, reg = run(tmp_path, '"conv"', 0.01, 1e-3, steps=2)
    assert all(c["conv"] > 0 for c in counts)
    assert clipped(reg, "conv") == sum(c["conv"] for c in counts) and clipped(reg, "head") is None
    for g, w in zip(got, want):
        for name in g:
            torch.testing.assert_close(g[name], w[name], rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")
    # the reference left the head alone too; and the conv was really clipped by both
    torch.manual_seed(0)
    plain = ConvNet()
    x, y = batches(1)[0]
    loss(plain, x, y).backward()
    assert torch.equal(got[0]["head.weight"], plain.head.weight.grad)
    assert not torch.allclose(got[0]["conv.weight"], plain.conv.weight.grad)


def test_eps_bounds_units_with_zero_weights(tmp_path: Path) -> None:
    """A zero-initialised bias (||w|| = 0) may still move: its bound is ratio * eps, not 0."""
    got, want, _, _, _, _ = run(tmp_path, '"head"', 0.5, 0.01, steps=1)
    bias = got[0]["head.bias"]
    torch.testing.assert_close(bias, want[0]["head.bias"], rtol=1e-6, atol=1e-9)
    assert float(torch.linalg.vector_norm(bias)) == pytest.approx(0.5 * 0.01, rel=1e-5)


def test_audit_leaves_gradients_bit_for_bit(tmp_path: Path) -> None:
    got, _, _, model, _, reg = run(tmp_path, '"**"', 0.02, 1e-3, steps=3, spec="mode: audit\n")
    torch.manual_seed(0)
    plain = ConvNet()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    would: dict[str, int] = {}
    for step, (x, y) in enumerate(batches(3)):
        opt.zero_grad()
        loss(plain, x, y).backward()
        for module, count in agc_reference(list(plain.named_parameters()), 0.02, 1e-3, apply=False).items():
            would[module] = would.get(module, 0) + count
        for name, p in plain.named_parameters():
            if p.grad is not None:
                assert torch.equal(got[step][name], p.grad), (step, name)
        opt.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    # once per step and module with gradients: conv, head and the root (gain); not `unused`
    actions = metric(reg, "hookpolicy_actions_total", {"rank": "0", "policy": "p", "rule": "agc", "action": "clip",
                                                       "mode": "audit"})
    assert actions == 3 * 3
    assert sum(would.values()) > 0  # the audit had something to report
    for module in ("conv", "head", ""):  # what it would have clipped
        assert clipped(reg, module, "audit") == would[module], module
        assert clipped(reg, module, "enforce") is None


def test_no_host_sync_inside_the_step_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AGC runs inside the optimizer step pre-hook: no .item(), .tolist(), bool(tensor)... there."""
    pol = load_policy(tmp_path, RULE % ('"**"', 0.02, 1e-3))
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    reg = CollectorRegistry()
    x, y = batches(1)[0]
    for m in (model, ref):
        loss(m, x, y).backward()
    agc_reference(list(ref.named_parameters()), 0.02, 1e-3)
    with pol.attach(model, registry=reg) as attached:
        programs = attached._cycle.programs
        run_step_rules = programs.run_step_rules

        def guarded(rules: Any, *loss: Any, **kwargs: Any) -> None:
            with no_host_sync():
                run_step_rules(rules, *loss, **kwargs)

        monkeypatch.setattr(programs, "run_step_rules", guarded)
        opt.step()
    # a sync would have raised inside the hook, where onError contains it: so check both
    assert metric(reg, "hookpolicy_hook_errors_total", {"rule": "agc"}) == 0
    torch.testing.assert_close(model.conv.weight, ref.conv.weight - 0.5 * ref.conv.weight.grad)


def test_parameters_flattened_by_fsdp1_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """FSDP1 makes each parameter a 1-D view of a flat shard and marks it `_fsdp_flattened`: AGC
    would take a weight matrix for one unit, so it raises (onError: continue) and changes nothing."""
    pol = load_policy(tmp_path, RULE % ('"head"', 0.01, 1e-3))
    torch.manual_seed(0)
    model = ConvNet()
    setattr(model.head.weight, "_fsdp_flattened", True)  # what torch.distributed.fsdp._flat_param does
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    reg = CollectorRegistry()
    x, y = batches(1)[0]
    with pol.attach(model, registry=reg):
        loss(model, x, y).backward()
        before = model.head.weight.grad.clone()
        opt.register_step_pre_hook(lambda o, a, k: torch.testing.assert_close(model.head.weight.grad, before,
                                                                             rtol=0, atol=0))
        opt.step()
    assert metric(reg, "hookpolicy_hook_errors_total", {"rule": "agc"}) == 1
    assert "head.weight is flattened by FSDP1 (FullyShardedDataParallel)" in caplog.text


def test_a_capture_after_agc_sees_the_clipped_gradients(tmp_path: Path) -> None:
    """Actions run in list order: statistics captured after the clip are those of the clipped gradients."""
    pol = load_policy(tmp_path, """
        - name: agc
          match: {modules: [conv]}
          trigger: {at: step}
          actions:
            - clip: {unitwise_ratio: 0.01}
            - capture: {stats: [l2_norm, nonfinite], per: tensor}
    """)
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batches(1)[0]
    seen: dict[str, torch.Tensor] = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(weight=model.conv.weight.grad.clone()))
    with pol.attach(model) as attached:
        loss(model, x, y).backward()
        before = float(torch.linalg.vector_norm(model.conv.weight.grad))
        opt.step()
        published = [v for family, series in attached.last_values().items() if family.endswith("l2_norm")
                     for (_, _, module, tensor), v in series.items() if (module, tensor) == ("conv", "weight")]
    after = float(torch.linalg.vector_norm(seen["weight"]))
    assert after < before
    assert published == [pytest.approx(after, rel=1e-6)]


# --------------------------------------------------------------------------- the shipped policy on timm-style models

AGC_YAML = REPO / "policies" / "agc.yaml"
TIMM_LIKE = REPO / "tests" / "stacks" / "timm_like.py"


def image_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_the_shipped_policy_clips_all_but_the_classifier_of_timm_style_models(arch: str, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """policies/agc.yaml against the NFNets equations on every parameter but the final linear
    layer's (timm's `head.fc`, ResNet's `fc`, ViT's `head`, Hugging Face's `classifier`), whose
    gradients the optimizer must use exactly as backward left them."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = BUILDERS[arch]()
    twin = copy.deepcopy(model)
    head = CLASSIFIER[arch] + "."
    selected = [(n, p) for n, p in twin.named_parameters() if not n.startswith(head)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    used: list[dict[str, torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append({n: p.grad.clone() for n, p in model.named_parameters()}))
    reg = CollectorRegistry()
    total, head_would = 0, 0
    with hookpolicy.load(AGC_YAML).attach(model, registry=reg, rank=0):
        for step, (x, y) in enumerate(image_batches(3)):
            for m, o in ((model, opt), (twin, twin_opt)):
                o.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
            unclipped = {n: p.grad.clone() for n, p in twin.named_parameters() if n.startswith(head)}
            head_would += sum(agc_reference([(n, p) for n, p in twin.named_parameters() if n.startswith(head)],
                                            0.01, 1e-3, apply=False).values())
            total += sum(agc_reference(selected, ratio=0.01, eps=1e-3).values())
            opt.step()
            for name, p in twin.named_parameters():
                if name in unclipped:  # bit for bit what backward wrote
                    assert torch.equal(used[-1][name], unclipped[name]), (step, name)
                else:
                    torch.testing.assert_close(used[-1][name], p.grad, rtol=1e-6, atol=1e-9,
                                               msg=lambda m: f"step {step} {name}: {m}")
            twin_opt.step()
    assert head_would > 0  # AGC would have clipped the classifier: leaving it alone is a choice
    assert total > 0
    assert sum(s.value for m in reg.collect() for s in m.samples if s.name == "hookpolicy_clipped_total") == total


def test_an_exclude_glob_naming_a_container_warns_at_plan_attach_and_explain(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The old agc.yaml (`exclude: [head]`) on an NF-RegNet: `head` has no parameters, its `fc` stays clipped."""
    old = AGC_YAML.read_text().replace('"head", "head.fc", ', '"head", ')
    assert old != AGC_YAML.read_text()
    path = tmp_path / "agc.yaml"
    path.write_text(old)
    wanted = ("agc/agc: exclude glob 'head' names head, which has no parameters of its own; globs match whole "
              "names, so the parameters of head.fc stay selected: did you mean 'head.**'?")
    policies = hookpolicy.load(path)
    assert wanted in policies.plan(BUILDERS["nf_regnet"]()).warnings
    with policies.attach(BUILDERS["nf_regnet"](), registry=CollectorRegistry(), rank=0):
        assert wanted in caplog.text
    shown = CliRunner().invoke(cli, ["explain", str(path), "--model", f"{TIMM_LIKE}:build_nf_regnet"])
    assert f"warning: {wanted}" in shown.output
    # ConvNeXt's head.norm stays clipped by design: head.fc being excluded, `head` did what it could
    for arch, build in BUILDERS.items():
        warnings = hookpolicy.load(AGC_YAML).plan(build()).warnings
        assert not [w for w in warnings if "no parameters of its own" in w], (arch, warnings)


def test_a_modules_glob_naming_a_container_warns(tmp_path: Path) -> None:
    policies = load_policy(tmp_path, """
        - {name: grads, match: {modules: [head, stages]}, trigger: {at: step}, actions: [{capture: {stats: [l2_norm]}}]}
        - {name: outputs, match: {modules: [head]}, trigger: {at: forward}, actions: [{capture: {stats: [l2_norm]}}]}
        - {name: fine, match: {modules: ["head.**"]}, trigger: {at: step}, actions: [{capture: {stats: [l2_norm]}}]}
    """)
    warnings = [w for w in policies.plan(BUILDERS["nf_regnet"]()).warnings if "no parameters of" in w]
    assert warnings == [
        "p/grads: modules glob 'head' names head, which has no parameters of its own; globs match whole names, "
        "so the parameters of head.fc are not selected: did you mean 'head.**'?",
        "p/grads: modules glob 'stages' names stages, which has no parameters of its own; globs match whole names, "
        "so the parameters of stages.0.0, stages.0.0.conv1, stages.0.0.conv2, ... are not selected: "
        "did you mean 'stages.**'?",
    ]  # a forward rule on `head` reads its output: nothing to say
