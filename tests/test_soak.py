"""Long runs: memory, live tensors, logs and tensor files stay bounded over thousands of steps.

    python -m pytest -m soak tests/test_soak.py -s      # the 10,000-step soak (~30-60 s on one core)

CI runs the same checks over 1,000 steps; the 10,000-step soak is deselected unless a `-m`
expression names `soak` (tests/conftest.py). The numbers of both are in docs/reliability.md.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from pathlib import Path
from typing import Callable

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from helpers.hooks import global_hook_counts, module_hook_count
from helpers.outputs import json_lines, metric
from helpers.policies import load_policy

LONG_RUN_POLICY = """\
- name: grads
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm, abs_max, nonfinite]}
    - alert: {if: "nonfinite > 0", per: rule, severity: critical, then: skip_step}
- name: outputs
  match: {types: [Linear]}
  trigger: {at: forward, every: 10}
  actions:
    - capture: {stats: [rms, zero_fraction], log: {path: logs/outputs.jsonl}}
- name: grad-outputs
  match: {modules: ["2"]}
  trigger: {at: backward, every: 5}
  actions:
    - capture: {stats: [l2_norm], per: tensor, log: {path: logs/grad-outputs.jsonl, max_bytes: 8000, keep: 2}}
- name: dump-files
  match: {modules: ["0"], params: [weight]}
  trigger: {at: step, every: 10}
  target: weight
  actions:
    - capture: {tensors: {dir: tensors/files, max_files: 30}}
- name: dump-bytes
  match: {modules: ["4"], params: [weight]}
  trigger: {at: step, every: 7}
  target: weight
  actions:
    - capture: {tensors: {dir: tensors/bytes, max_bytes: 40000}}
"""


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def long_run(folder: Path, out: Path, steps: int, warmup: int = 100) -> dict[str, float]:
    """Train a small MLP for `warmup + steps` steps under LONG_RUN_POLICY and check what it left.

    Returns the measured numbers (for docs/reliability.md).
    """
    policy = load_policy(folder, LONG_RUN_POLICY, name="long")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    reg = CollectorRegistry()
    seen: list[weakref.ref[torch.Tensor]] = []
    spy = model[2].register_forward_hook(lambda m, a, o: seen.append(weakref.ref(o)))
    baseline = global_hook_counts()
    total = warmup + steps
    started = time.perf_counter()
    try:
        with policy.attach(model, registry=reg, rank=0):
            for step in range(total):
                if step == warmup:
                    tensors_before, rss_before = live_tensors(), resident_bytes()
                    started = time.perf_counter()
                if step == warmup + steps // 2:  # both tensor budgets are spent by now
                    tensors_middle = live_tensors()
                x = torch.randn(32, 16)
                out_ = model(x)
                loss = out_.pow(2).mean()
                loss.backward()
                grad = model[0].weight.grad
                assert grad is not None
                step_tensors = [weakref.ref(t) for t in (x, out_, loss, grad)]
                opt.step()
                opt.zero_grad()
                del x, out_, loss, grad
                if step % 97 == 0:  # every so often: nothing of this step outlives it
                    gc.collect()
                    alive = [r for r in step_tensors + seen if r() is not None]
                    assert alive == [], f"step {step}: {len(alive)} tensors outlived their step"
                    seen.clear()
                seen = [r for r in seen if r() is not None]
            elapsed = time.perf_counter() - started
            rss_after, tensors_after = resident_bytes(), live_tensors()
            assert metric(reg, "hookpolicy_steps_total", {"rank": "0"}) == total
            labels = {"policy": "long", "rule": "grads", "module": "4", "tensor": "", "rank": "0"}
            assert metric(reg, "hookpolicy_grad_l2_norm", labels) is not None
    finally:
        spy.remove()
    assert module_hook_count(model) == 0 and global_hook_counts() == baseline
    growth = rss_after - rss_before
    assert growth < 50 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB over {steps} steps"
    # No growth with the steps. (The first half may pin a few: a log handler that keeps records,
    # as pytest's does, keeps the BudgetSpent exception logged once per writer, with its frames.)
    assert tensors_after - tensors_middle <= 2, (tensors_before, tensors_middle, tensors_after)

    # logs: exactly one record per evaluation, every line complete
    outputs = json_lines(out / "logs" / "outputs.jsonl")
    assert len(outputs) == 3 * len(range(0, total, 10))
    # a rotated log: at most keep + 1 files within max_bytes, holding the latest records, no gap
    rotated = [out / "logs" / name for name in ("grad-outputs.jsonl.2", "grad-outputs.jsonl.1", "grad-outputs.jsonl")]
    # beside each capture log its run's alert file (`*.alerts.jsonl`), bounded by the capture's max_bytes and keep
    alerts = [out / "logs" / "outputs.alerts.jsonl", out / "logs" / "grad-outputs.alerts.jsonl"]
    assert sorted(p.name for p in (out / "logs").iterdir()) == sorted(
        ["outputs.jsonl", *(p.name for p in rotated), *(p.name for p in alerts)])
    assert all(p.stat().st_size <= 8000 for p in alerts[1:])
    assert all(0 < p.stat().st_size <= 8000 for p in rotated)
    kept = [r["step"] for p in rotated for r in json_lines(p)]
    assert kept == list(range(0, total, 5))[-len(kept):] and len(kept) > 8000 // 300
    # tensor files: within their budgets, complete, nothing temporary left over
    files = sorted((out / "tensors" / "files").iterdir())
    assert len(files) == min(30, len(range(0, total, 10)))
    by_bytes = sorted((out / "tensors" / "bytes").iterdir())
    assert 0 < sum(f.stat().st_size for f in by_bytes) <= 40000
    for file in files + by_bytes:
        assert file.name.startswith("step") and file.suffix == ".pt", file
        assert torch.load(file, weights_only=True).shape in ((32, 16), (4, 32))
    return {
        "steps": steps, "rss_growth_mib": growth / 2**20, "live_tensor_growth": tensors_after - tensors_middle,
        "ms_per_step": 1000 * elapsed / steps,
        "log_bytes": sum(p.stat().st_size for p in (out / "logs").iterdir()),
        "tensor_files": len(files) + len(by_bytes),
    }


@pytest.mark.parametrize("steps", [1000, pytest.param(10_000, marks=pytest.mark.soak)])
def test_a_long_run_keeps_memory_tensors_and_files_bounded(
    tmp_path: Path, out: Path, one_thread: None, record_property: Callable[[str, object], None], steps: int,
) -> None:
    """1,000 steps in CI; 10,000 with `pytest -m soak`."""
    numbers = long_run(tmp_path, out, steps=steps)
    for key, value in numbers.items():
        record_property(key, value)
    print(f"\nlong run: {numbers}")
