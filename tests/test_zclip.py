"""policies/zclip.yaml against ZClip's own implementation, step by step.

The reference is the authors' package (`zclip` 1.0.0 on PyPI, `zclip/zclip.py`), called as
its README shows: `ZClip()` at its defaults (mode="zscore", clip_option="adaptive_scaling",
alpha 0.97, z_thresh 2.5, eps 1e-6, warmup_steps 25, max_grad_norm 1.0), `zclip.step(model)`
between backward and the optimizer's step, on a twin of the governed model fed the same
batches. The gradients the optimizer uses must match after every step: during the warm-up
(only the max_grad_norm cap, clip_grad_norm_), on ordinary steps (the cap where the norm is
above 1), and on spikes (the adaptive threshold, whose EMA is updated with it, not with the cap).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn
from zclip import ZClip

import hookpolicy
from helpers import REPO
from helpers.hooks import no_host_sync
from helpers.outputs import metric
from helpers.policies import load_policy

ZCLIP_YAML = REPO / "policies" / "zclip.yaml"
STEPS = 100
#: the first steps' gradient norms are about 1 (ZClip's max_grad_norm cap acts on some, in
#: the warm-up and after), from this step on about 0.2 (under the cap)
CALM = 46
#: step -> loss multiplier: gradient spikes. Before CALM their adaptive threshold is above the
#: cap, which decides the gradient, while the EMA learns the threshold (not the cap); after
#: CALM the threshold is below the cap and decides it.
SPIKES = {30: 15.0, 41: 40.0, 42: 6.0, 85: 25.0, 91: 15.0}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _backward(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    scale = (1.0 if step < CALM else 0.2) * (1.0 + 0.3 * torch.randn((), generator=g).item())
    (nn.functional.mse_loss(model(x), y) * scale * SPIKES.get(step, 1.0)).backward()


def _clipped(reg: CollectorRegistry) -> float:
    return metric(reg, "hookpolicy_clipped_total", {"rule": "zclip", "module": "", "mode": "enforce"}) or 0.0


def _run(policies: hookpolicy.PolicySet, reference: ZClip, steps: int = STEPS) -> dict[str, list[int]]:
    """Train a model under `policies` and its twin under `reference`; compare the gradients each
    step. Returns the steps on which ZClip clipped adaptively, capped, or left the norm alone."""
    model = _model()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    used: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append([p.grad.clone() for p in model.parameters()]))
    seen: dict[str, list[int]] = {"adaptive": [], "capped": [], "alone": []}
    reg = CollectorRegistry()
    with policies.attach(model, registry=reg, rank=0):
        for step in range(steps):
            for m in (model, twin):
                _backward(m, step)
            norm = reference._compute_grad_norm(twin)
            adaptive: Optional[float] = reference._compute_clip_val(norm) if reference.initialized else None
            reference.step(twin)
            limit = min(adaptive if adaptive is not None else norm, reference.max_grad_norm or norm)
            seen["adaptive" if adaptive is not None else "capped" if norm > limit else "alone"].append(step)
            before = _clipped(reg)
            opt.step()
            for got, want in zip(used[-1], [p.grad for p in twin.parameters()]):
                torch.testing.assert_close(got, want, msg=lambda m: f"step {step}: {m}")
            # a count per clip that acted: the adaptive one, then the cap on what it left
            cap = reference.max_grad_norm
            want = int(adaptive is not None) + int(cap is not None and min(adaptive or norm, norm) > cap)
            assert _clipped(reg) - before == want, step
            twin_opt.step()
            opt.zero_grad()
            twin_opt.zero_grad()
    return seen


def test_zclip_yaml_equals_the_authors_zclip_at_its_defaults() -> None:
    seen = _run(hookpolicy.load(ZCLIP_YAML), ZClip())
    assert set(SPIKES) <= set(seen["adaptive"]) and min(seen["adaptive"]) >= 25  # the spikes, after the warm-up
    assert {s for s in seen["capped"] if s < 25} and {s for s in seen["capped"] if s >= 25}  # the cap, in and after it
    assert seen["alone"]  # and steps neither clipped


def test_the_percentile_variant_equals_zclips_percentile_mode_without_a_cap(tmp_path: Path) -> None:
    """The documented variant: max_norm mean + 2.5 std of the EMA, no `when`, no cap."""
    policies = load_policy(tmp_path, """
        - name: zclip
          match: {modules: ["**"]}
          trigger: {at: step}
          actions:
            - clip: {max_norm: "ema(norm, 0.97) + 2.5 * ema_std(norm, 0.97)", warmup: 25, per: rule}
    """)
    seen = _run(policies, ZClip(mode="percentile", max_grad_norm=None))
    assert set(SPIKES) <= set(seen["adaptive"])  # percentile mode reports its threshold on every step
    assert not seen["capped"]


class _Ema:
    """A history whose ema and ema_std are ZClip's mean and sqrt(var)."""

    def __init__(self, mean: float, var: float) -> None:
        self.mean, self.var = mean, var

    def aggregate(self, func: str, series: str, param: float) -> float:
        return {"ema": self.mean, "ema_std": self.var ** 0.5}[func]


@pytest.mark.parametrize("mean, var", [(1.0, 0.01), (0.3, 0.04), (2.0, 1e-6)])
def test_the_threshold_on_the_device_equals_zclips_clip_value(mean: float, var: float) -> None:
    """For norms below, around and far above the mean: the policy's first clip, evaluated on the
    device from a norm tensor, clips exactly where ZClip's `_compute_clip_val` returns a value,
    to that value (mean + z_t * std / (z / z_t): lower the larger the spike); elsewhere not at all."""
    from hookpolicy.engine.execute.programs import device_limit
    from hookpolicy.policy.model import Clip

    clip = hookpolicy.load(ZCLIP_YAML).policies[0].rules[0].actions[0]
    assert isinstance(clip, Clip) and clip.on_device
    reference = ZClip()
    reference.mean, reference.var, reference.initialized = mean, var, True
    std = var ** 0.5
    limit = device_limit(clip, _Ema(mean, var))
    thresholds = []
    for k in (-5.0, -2.6, -1.0, -0.3, 0.0, 0.5, 2.4, 2.6, 3.0, 15.0, 100.0):
        norm = mean + k * std
        want = reference._compute_clip_val(norm)
        got = limit(torch.tensor(norm, dtype=torch.float32))
        assert got.dtype == torch.float64 and got.dim() == 0
        if want is None:
            assert got.item() == float("inf"), (k, got)
        else:
            assert got.item() == pytest.approx(want, rel=1e-6), k  # the norm was float32
            thresholds.append(got.item())
    assert len(thresholds) == 4 and thresholds == sorted(thresholds, reverse=True)


def test_zclip_reads_no_value_back_inside_its_step_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adaptive threshold reads the current norm: it is computed on the device, and the step
    rules run under no_host_sync() (a .item() there would raise, and count a hook error)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reg = CollectorRegistry()
    with hookpolicy.load(ZCLIP_YAML).attach(model, registry=reg, rank=0) as attached:
        programs = attached._cycle.programs
        run_step_rules = programs.run_step_rules

        def guarded(*args: Any, **kwargs: Any) -> Any:
            with no_host_sync():
                return run_step_rules(*args, **kwargs)

        monkeypatch.setattr(programs, "run_step_rules", guarded)
        for step in range(32):  # past the warm-up, through the spike at 30
            _backward(model, step)
            opt.step()
            opt.zero_grad()
        assert _clipped(reg) > 0
    assert metric(reg, "hookpolicy_hook_errors_total", {"rule": "zclip"}) == 0


@pytest.mark.parametrize("text", [
    "norm > 1 and norm < 3 or norm > 10",
    "(norm - ema(norm, 0.9)) / ema_std(norm, 0.9) > 2 and other < 1",
])
def test_conditions_and_values_on_a_tensor_equal_their_float_evaluation(text: str) -> None:
    """`when` and a norm-reading max_norm run on a 0-dim tensor: the same answers as on floats
    (IEEE division by zero included), computed with nothing read back."""
    from hookpolicy.policy.expr import parse, parse_value

    names = {"norm": "norm", "other": "norm"}  # an alias of the same series
    condition = parse(text, names)
    value = parse_value("ema(norm, 0.9) + 2 * ema_std(norm, 0.9) / ((norm - ema(norm, 0.9)) / ema_std(norm, 0.9))",
                        names)
    for std in (0.5, 0.0):
        past = _Ema(1.0, std * std)
        for norm in (0.5, 1.0, 2.0, 5.0, 20.0):
            with no_host_sync():
                on_device = condition.evaluate({"norm": torch.tensor(norm, dtype=torch.float64)}, past)
                threshold = value.evaluate({"norm": torch.tensor(norm, dtype=torch.float64)}, past)
            assert isinstance(on_device, torch.Tensor) and isinstance(threshold, torch.Tensor)
            assert bool(on_device) == condition.evaluate({"norm": norm}, past), (norm, std)
            want = value.evaluate({"norm": norm}, past)
            assert threshold.item() == pytest.approx(want, nan_ok=True, rel=1e-12), (norm, std)


def test_a_threshold_on_the_device_that_is_not_positive_clips_nothing_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """`max_norm` read on the device (it reads the current norm) that comes out negative from step 3 on:
    nothing is clipped (the gradients the optimizer applies are a plain twin's, bit for bit) and one
    `hookpolicy:` line names the rule, the step and the value's cause."""
    policies = load_policy(tmp_path, """
        - name: odd
          match: {modules: ["**"]}
          trigger: {at: step}
          target: grad
          actions:
            - clip: {max_norm: "ema(norm, 0.5) - 3 * norm", warmup: 3, per: rule}
    """)
    model, twin = _model(), _model()
    seen: list[list[torch.Tensor]] = []
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.clone() for p in model.parameters()
                                                              if p.grad is not None]))
    reg = CollectorRegistry()
    with caplog.at_level("WARNING", logger="hookpolicy"), policies.attach(model, registry=reg, rank=0):
        for step in range(8):
            for m, o in ((model, opt), (twin, twin_opt)):
                o.zero_grad()
                _backward(m, step)
            opt.step()  # hookpolicy's clip runs in a global step pre-hook, before the test's own hook
            for applied, q in zip(seen[-1], twin.parameters()):
                assert q.grad is not None and torch.equal(applied, q.grad)
            twin_opt.step()
    assert len(seen) == 8
    lines = [r.getMessage() for r in caplog.records if "was NaN or not positive" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("p/odd: max_norm ema(norm, 0.5) - 3 * norm was NaN or not "
                                                   "positive at step 3 for <root>"), lines
    assert (metric(reg, "hookpolicy_clipped_total", {"rule": "odd", "module": "", "mode": "enforce"}) or 0.0) == 0.0
