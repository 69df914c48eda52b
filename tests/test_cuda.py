"""The CUDA path on a real GPU: the statistics, the syncs, a clip and a skipped step with an enabled GradScaler.

Skipped where torch sees no CUDA device (CI has none); run where a GPU is lent
(`docs/benchmarks.md` says where and when it last ran). What only a GPU can check:

- a hook's statistics stay on the device until the step's one read-back, and are still
  the float64 references the test computes itself from the tensors it captures;
- no hook synchronises the host with the device: `torch.cuda.set_sync_debug_mode("warn")`
  warns at every synchronising call, and a step under a policy makes exactly the plain
  loop's synchronising calls plus the read-back's one;
- a clip equals `clip_grad_norm_` on the same gradients, bit for bit;
- with float16 autocast and an enabled `GradScaler` (nanoGPT's default on a GPU without
  bfloat16), a guard judges the unscaled gradients `scaler.step` hands the optimizer,
  and a skipped step leaves the parameters and the scaler where the same loop leaves them
  when it skips that step by hand (`scaler.unscale_`, no `optimizer.step()`, `scaler.update()`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from helpers.outputs import metric, sample
from helpers.policies import load_policy
from hookpolicy.export.metrics import split_family

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
STATS = ["l2_norm", "mean", "std", "min", "max", "abs_max", "rms", "zero_fraction", "nonfinite"]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)).to(CUDA)


def data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=g).to(CUDA), torch.randn(32, 8, generator=g).to(CUDA)) for _ in range(n)]


def reference(t: torch.Tensor) -> dict[str, float]:
    """The statistics of `t`, computed in float64 on the host (the test's own, not hookpolicy's)."""
    x = t.detach().double().cpu()
    finite = torch.isfinite(x)
    return {"l2_norm": torch.linalg.vector_norm(x).item(), "mean": x.mean().item(), "std": x.std().item(),
            "min": x.min().item(), "max": x.max().item(), "abs_max": x.abs().max().item(),
            "rms": math.sqrt((x * x).mean().item()), "zero_fraction": (x == 0).double().mean().item(),
            "nonfinite": float((~finite).sum().item())}


def last(attached: object) -> dict[tuple[str, str, str, str], float]:
    """The last published value of each series, keyed by (rule, stat, module, tensor)."""
    out: dict[tuple[str, str, str, str], float] = {}
    for family, series in attached.last_values().items():  # type: ignore[attr-defined]
        _, stat = split_family(family)
        for (_, rule, module, tensor), value in series.items():
            out[(rule, stat, module, tensor)] = value
    return out


@contextlib.contextmanager
def syncs() -> Iterator[list[int]]:
    """Counts the synchronising CUDA calls made inside (`set_sync_debug_mode("warn")` warns at each)."""
    counted = [0]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counted[0] = sum("synchroniz" in str(w.message) for w in caught)


def rules(stats: list[str]) -> str:
    listed = ", ".join(stats)
    return f"""
        - name: out
          match: {{types: [Linear]}}
          trigger: {{at: forward}}
          target: output
          actions: [{{capture: {{stats: [{listed}]}}}}]
        - name: gout
          match: {{types: [Linear]}}
          trigger: {{at: backward}}
          target: grad_output
          actions: [{{capture: {{stats: [{listed}]}}}}]
        - name: grads
          match: {{modules: ["**"]}}
          trigger: {{at: step}}
          target: grad
          actions: [{{capture: {{stats: [{listed}], per: tensor}}}}]
    """


def same(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or got == want


def test_statistics_on_the_device_are_the_float64_references(tmp_path: Path) -> None:
    """Every statistic of every target, kept on the GPU until the read-back, against the test's float64 ones.

    The second step poisons one gradient with a NaN: its count waits for the read-back (the CUDA
    rule), and its norm, moments and extrema are NaN as torch's are."""
    pol = load_policy(tmp_path, rules(STATS))
    model, reg = mlp(), CollectorRegistry()
    seen: dict[tuple[str, ...], torch.Tensor] = {}
    names = {m: n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for m, name in names.items():
        def keep(mod: nn.Module, args: object, out: torch.Tensor, name: str = name) -> None:
            seen[("out", name)] = out.detach().clone()
            out.register_hook(lambda g: seen.__setitem__(("gout", name), g.detach().clone()))
        m.register_forward_hook(keep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pol.attach(model, registry=reg) as attached:
        for i, (x, y) in enumerate(data(2)):
            nn.functional.mse_loss(model(x), y).backward()
            if i == 1:
                model[4].bias.grad[3] = float("nan")  # type: ignore[index,operator]
            for pname, p in model.named_parameters():
                module, _, tensor = pname.rpartition(".")
                seen[("grads", module, tensor)] = p.grad.detach().clone()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            got = last(attached)
            checked = 0
            for key, t in seen.items():
                rule, module, tensor = (key[0], key[1], "") if len(key) == 2 else key
                want = reference(t)
                scale = want["rms"] if math.isfinite(want["rms"]) else 1.0  # what a mean's rounding is relative to
                for stat in STATS:
                    value = got[(rule, stat, module, tensor)]
                    if stat in ("min", "max", "abs_max", "zero_fraction", "nonfinite"):
                        assert same(value, want[stat]), (i, key, stat, value, want[stat])
                    elif stat in ("l2_norm", "rms"):
                        assert value == pytest.approx(want[stat], rel=2e-6, nan_ok=True), (i, key, stat)
                    else:
                        assert value == pytest.approx(want[stat], rel=1e-5, abs=1e-6 * scale, nan_ok=True), (i, key, stat)
                    checked += 1
            assert checked == len(STATS) * (2 * len(names) + len(list(model.parameters())))  # out, gout; grads
            assert got[("grads", "nonfinite", "4", "bias")] == (1.0 if i == 1 else 0.0)
    for rule in ("out", "gout", "grads"):
        assert (sample(reg, "hookpolicy_hook_errors_total", rule=rule) or 0.0) == 0


GUARDS = """
        - name: guard
          match: {modules: ["**"]}
          trigger: {at: step}
          target: grad
          actions: [{alert: {if: "nonfinite > 0", per: rule, then: skip_step}}]
        - name: clip
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: 1.0}}]
"""


def test_no_hook_synchronises_and_a_step_reads_back_once(tmp_path: Path) -> None:
    """Forward and backward under every statistic, a guard and a clip make the plain loop's synchronising
    calls (none); the optimizer step makes the plain step's plus one: the read-back's single transfer."""
    pol = load_policy(tmp_path, rules(STATS) + GUARDS)
    counts: dict[str, tuple[int, int]] = {}
    for label in ("plain", "governed"):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        reg = CollectorRegistry()
        with contextlib.ExitStack() as stack:
            if label == "governed":
                stack.enter_context(pol.attach(model, registry=reg))
            for i, (x, y) in enumerate(data(4)):
                with syncs() as hooks:
                    nn.functional.mse_loss(model(x), y).backward()
                with syncs() as step:
                    opt.step()
                opt.zero_grad()
                if i >= 2:  # after the first steps' lazy state (AdamW's, hookpolicy's plans)
                    assert counts.setdefault(label, (hooks[0], step[0])) == (hooks[0], step[0]), (label, i)
            if label == "governed":
                for rule in ("out", "gout", "grads", "guard", "clip"):
                    assert (sample(reg, "hookpolicy_hook_errors_total", rule=rule) or 0.0) == 0
    print("synchronising calls (forward+backward, step):", counts)
    assert counts["governed"][0] == counts["plain"][0] == 0
    assert counts["governed"][1] == counts["plain"][1] + 1


def test_a_clip_is_clip_grad_norm_bit_for_bit(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: clip
          match: {modules: ["**"]}
          trigger: {at: step}
          actions: [{clip: {max_norm: 0.05}}]
    """)
    model = mlp()
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin))
    clipped: dict[str, torch.Tensor] = {}
    opt.register_step_pre_hook(lambda o, a, k: clipped.update(
        {n: p.grad.clone() for n, p in model.named_parameters()}))  # type: ignore[union-attr]
    with pol.attach(model):
        for x, y in data(3):
            for m, o in ((model, opt), (twin, twin_opt)):
                nn.functional.mse_loss(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
            opt.step()
            twin_opt.step()
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                assert torch.equal(clipped[name], q.grad), name  # type: ignore[arg-type]
                assert torch.equal(p, q), name
            opt.zero_grad()
            twin_opt.zero_grad()


SPIKE, OVERFLOW = 4, 2


def amp_loop(model: nn.Sequential, steps: int, skip_by_hand: bool = False,
             each: Callable[[int, torch.amp.GradScaler], None] = lambda i, s: None, taken: Optional[list[int]] = None,
             ) -> None:
    """torch's AMP recipe in float16 with an enabled GradScaler; the loss is multiplied by 1e6 at OVERFLOW (the
    scaled gradients overflow: the scaler skips that step) and by 300 at SPIKE (a spike the guard must see in
    the unscaled gradients). With `skip_by_hand` the loop skips SPIKE itself, as `scaler.step` would up to the
    optimizer: `scaler.unscale_`, no `optimizer.step()`, then `scaler.update()`. `taken` counts the optimizer's
    steps with a post-hook of the test's own."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if taken is not None:
        opt.register_step_post_hook(lambda o, a, k: taken.__setitem__(0, taken[0] + 1))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 8, growth_interval=3)
    for i, (x, y) in enumerate(data(steps)):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        factor = {OVERFLOW: 1e6, SPIKE: 300.0}.get(i, 1.0)
        scaler.scale(loss * factor).backward()
        if skip_by_hand and i == SPIKE:
            scaler.unscale_(opt)
        else:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        each(i, scaler)


def test_a_guard_with_an_enabled_grad_scaler_judges_the_unscaled_gradients(tmp_path: Path) -> None:
    pol = load_policy(tmp_path, """
        - name: spike
          match: {modules: ["**"]}
          trigger: {at: step}
          target: grad
          actions: [{capture: {stats: [l2_norm]}}, {alert: {if: "l2_norm > 100", per: rule, then: skip_step}}]
    """)
    steps = 7
    reference = mlp()
    kept: list[tuple[dict[str, torch.Tensor], float]] = []
    amp_loop(reference, steps, skip_by_hand=True,
             each=lambda i, s: kept.append(({n: p.clone() for n, p in reference.named_parameters()}, s.get_scale())))
    model, taken = mlp(), [0]
    reg = CollectorRegistry()

    def check(i: int, scaler: torch.amp.GradScaler) -> None:
        params, scale = kept[i]
        for name, p in model.named_parameters():
            assert torch.equal(p, params[name]), (i, name)
        assert scaler.get_scale() == scale, i
        assert sample(reg, "hookpolicy_skipped_steps_total", rule="spike") == (1.0 if i >= SPIKE else 0.0), i
        assert metric(reg, "hookpolicy_steps_total", {"rank": "0", "model": attached.store.model}) == taken[0], i

    with pol.attach(model, registry=reg) as attached:
        amp_loop(model, steps, each=check, taken=taken)
    assert taken[0] == steps - 1  # every step but the overflowed one, which the scaler skipped
    assert kept[OVERFLOW][1] == kept[OVERFLOW - 1][1] / 2  # the scaler did skip the overflowed step itself
