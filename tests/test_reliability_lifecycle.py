"""Attach and remove at awkward moments: no hooks left behind by a forward that raised, remove
from inside a step, from a global optimizer hook or from another thread, attach and remove
many times, two attachments on one model and one policy set on two models. The guarantees
are in docs/reliability.md.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.optim.optimizer as optimizer_hooks
from prometheus_client import CollectorRegistry

from helpers.hooks import global_hook_counts, module_hook_count
from helpers.models import tiny, tiny_step
from helpers.outputs import errors_of, json_lines, sample
from helpers.policies import load_policy
from hookpolicy import HookPolicyError


# =========================================================================== no hooks left behind


class Flaky(nn.Module):
    """Raises from its forward on chosen calls, from inside a child's forward."""

    def __init__(self, fail_on: set[int]) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(8, 2)
        self.calls = 0
        self.fail_on = fail_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.inp(x))
        if self.calls in self.fail_on:
            raise ValueError(f"forward failed on call {self.calls}")
        return self.out(h)


EVERY_HOOK_POINT = """\
- name: pre
  match: {types: [Linear]}
  trigger: {at: forward_pre}
  actions: [{capture: {stats: [mean]}}]
- name: fwd
  match: {types: [Linear]}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms]}}, {clip: {min: -100, max: 100}}]
- name: bwd-out
  match: {types: [Linear]}
  trigger: {at: backward}
  target: grad_output
  actions: [{capture: {stats: [l2_norm]}}]
- name: bwd-in
  match: {modules: [out]}
  trigger: {at: backward}
  target: grad_input
  actions: [{capture: {stats: [l2_norm]}}]
- name: grads
  match: {modules: ["**"]}
  trigger: {at: step}
  actions: [{capture: {stats: [l2_norm], log: {path: grads.jsonl}}}, {clip: {max_norm: 10}}]
"""


def test_a_forward_that_raises_leaves_no_hooks_behind(tmp_path: Path, out: Path) -> None:
    policy = load_policy(tmp_path, EVERY_HOOK_POINT)
    model = Flaky(fail_on={3})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    baseline = global_hook_counts()
    with pytest.raises(ValueError, match="forward failed on call 3"):
        with policy.attach(model, registry=CollectorRegistry(), rank=0):
            for _ in range(5):
                tiny_step(model, opt)
    assert module_hook_count(model) == 0
    assert global_hook_counts() == baseline
    assert len(json_lines(out / "grads.jsonl")) == 2 * 2  # steps 0 and 1, both Linear layers, complete


def test_training_goes_on_after_a_forward_that_raised(tmp_path: Path, out: Path) -> None:
    """A caught exception mid-forward must not leave the runtime thinking it is still inside one."""
    policy = load_policy(tmp_path, EVERY_HOOK_POINT)
    model, reg = Flaky(fail_on={2, 3}), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.attach(model, registry=reg, rank=0) as attached:
        done = 0
        while done < 5:
            try:
                tiny_step(model, opt)
                done += 1
            except ValueError:
                opt.zero_grad()
        assert attached.step == 5
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))  # an evaluation forward: the phase must be right again
        model.train()
    assert sample(reg, "hookpolicy_steps_total") == 5
    for rule in ("pre", "fwd", "bwd-out", "bwd-in", "grads"):
        assert errors_of(reg, rule) == 0
        assert (sample(reg, "hookpolicy_actions_total", policy="p", rule=rule, action="capture", mode="enforce") or 0) >= 5
    assert module_hook_count(model) == 0


# =========================================================================== remove while running

LOGGED = """\
- name: grads
  match: {types: [Linear]}
  trigger: {at: step}
  actions: [{capture: {stats: [l2_norm], log: {path: grads.jsonl}}}]
- name: outs
  match: {types: [Linear]}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms], log: {path: outs.jsonl}}}]
- name: backs
  match: {types: [Linear]}
  trigger: {at: backward}
  actions: [{capture: {stats: [l2_norm]}}]
"""


class Remover(nn.Module):
    """Calls `remove` of its own attachment from its forward or from a backward hook."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.where = where
        self.calls = 0
        self.remove: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x)
        if self.calls == 3 and self.where == "forward":
            self.remove()
        if self.calls == 3 and self.where == "backward":
            h.register_hook(lambda grad: self.remove())
        return self.b(h)


@pytest.mark.parametrize("where", [
    "forward", "backward", "optimizer-pre-hook", "optimizer-post-hook",
    "global-optimizer-pre-hook-after", "global-optimizer-post-hook",
])
def test_remove_from_inside_a_step_is_safe(tmp_path: Path, out: Path, where: str) -> None:
    policy = load_policy(tmp_path, LOGGED)
    model = Remover(where)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    baseline = global_hook_counts()
    calls = {"n": 0}

    def remove_on_third(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            attached.remove()

    attached = policy.attach(model, registry=CollectorRegistry(), rank=0)
    model.remove = attached.remove
    extra = {
        "optimizer-pre-hook": lambda: opt.register_step_pre_hook(remove_on_third),
        "optimizer-post-hook": lambda: opt.register_step_post_hook(remove_on_third),
        "global-optimizer-pre-hook-after": lambda: optimizer_hooks.register_optimizer_step_pre_hook(remove_on_third),
        "global-optimizer-post-hook": lambda: optimizer_hooks.register_optimizer_step_post_hook(remove_on_third),
    }.get(where)
    handle = extra() if extra else None
    try:
        for _ in range(6):
            tiny_step(model, opt)
    finally:
        if handle is not None:
            handle.remove()
        attached.remove()
    assert attached.removed
    assert module_hook_count(model) == 0
    # Removed inside a step, the global optimizer hooks cannot leave the dict PyTorch is
    # iterating: they stay, inert, until the next attach or remove outside a step.
    policy.attach(tiny(), registry=CollectorRegistry(), rank=0).remove()
    assert global_hook_counts() == baseline
    for name in ("grads.jsonl", "outs.jsonl"):
        records = json_lines(out / name)
        assert records and max(r["step"] for r in records) <= 3


def test_remove_from_a_global_optimizer_hook_registered_before_attach_is_safe(tmp_path: Path, out: Path) -> None:
    policy = load_policy(tmp_path, LOGGED)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    holder: dict[str, Any] = {}
    handle = optimizer_hooks.register_optimizer_step_pre_hook(lambda *a: holder["attached"].remove())
    try:
        holder["attached"] = policy.attach(model, registry=CollectorRegistry(), rank=0)
        for _ in range(3):
            tiny_step(model, opt)
    finally:
        handle.remove()
        holder["attached"].remove()
    assert holder["attached"].removed and module_hook_count(model) == 0
    policy.attach(tiny(), registry=CollectorRegistry(), rank=0).remove()  # settles the inert global hooks


def test_remove_from_another_thread_while_training_is_safe(tmp_path: Path, out: Path) -> None:
    policy = load_policy(tmp_path, LOGGED)
    baseline = global_hook_counts()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so removal lands inside hooks
    rng = random.Random(0)
    failures: list[BaseException] = []
    try:
        for trial in range(12):
            model = tiny(trial)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            attached = policy.attach(model, registry=CollectorRegistry(), rank=0)
            delay = rng.uniform(0, 0.02)
            remover = threading.Thread(target=lambda: (time.sleep(delay), attached.remove()))
            remover.start()
            try:
                for _ in range(40):
                    tiny_step(model, opt)
            except BaseException as exc:  # noqa: BLE001 - collected and reported below
                failures.append(exc)
            remover.join()
            attached.remove()
            assert module_hook_count(model) == 0
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    policy.attach(tiny(), registry=CollectorRegistry(), rank=0).remove()  # settles hooks left inert mid-step
    assert global_hook_counts() == baseline
    for name in ("grads.jsonl", "outs.jsonl"):
        if (out / name).exists():  # (a removal before the first step writes nothing)
            json_lines(out / name)  # every line complete and parseable


def test_attach_and_remove_many_times_leaks_no_hooks(tmp_path: Path, out: Path) -> None:
    policy = load_policy(tmp_path, EVERY_HOOK_POINT)
    model = Flaky(fail_on=set())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    baseline = global_hook_counts()
    for _ in range(50):
        with policy.attach(model, registry=CollectorRegistry(), rank=0):
            tiny_step(model, opt)
        assert module_hook_count(model) == 0
        assert global_hook_counts() == baseline


# =========================================================================== attach twice

NORMS_A = """\
- name: g
  match: {types: [Linear]}
  trigger: {at: step}
  actions: [{capture: {stats: [l2_norm]}}]
"""
OUTS_B = """\
- name: o
  match: {types: [Linear]}
  trigger: {at: forward}
  actions: [{capture: {stats: [rms]}}]
"""


def test_two_policies_attached_separately_to_one_model_work_independently(tmp_path: Path, out: Path) -> None:
    """Decided: different policies may be attached one by one; each removal takes off its own hooks only."""
    a, b = load_policy(tmp_path, NORMS_A, name="a"), load_policy(tmp_path, OUTS_B, name="b")
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    baseline = global_hook_counts()
    first = a.attach(model, registry=reg, rank=0)
    second = b.attach(model, registry=reg, rank=0)
    tiny_step(model, opt)
    grad_norm = dict(policy="a", rule="g", module="0", tensor="")
    out_rms = dict(policy="b", rule="o", module="0", tensor="")
    assert sample(reg, "hookpolicy_grad_l2_norm", **grad_norm) is not None
    assert sample(reg, "hookpolicy_output_rms", **out_rms) is not None

    first.remove()  # takes off a's hooks only
    assert sample(reg, "hookpolicy_grad_l2_norm", **grad_norm) is None
    previous = sample(reg, "hookpolicy_output_rms", **out_rms)
    tiny_step(model, opt)
    assert sample(reg, "hookpolicy_output_rms", **out_rms) != previous  # b still runs
    assert sample(reg, "hookpolicy_grad_l2_norm", **grad_norm) is None  # a does not
    infos = [s.labels["policy"] for m in reg.collect() for s in m.samples if s.name == "hookpolicy_policy_info"]
    assert infos == ["b"]
    assert second.step == 2
    second.remove()
    assert module_hook_count(model) == 0 and global_hook_counts() == baseline


def test_two_attachments_on_one_model_count_each_step_once(tmp_path: Path, out: Path) -> None:
    a, b = load_policy(tmp_path, NORMS_A, name="a"), load_policy(tmp_path, OUTS_B, name="b")
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with a.attach(model, registry=reg, rank=0), b.attach(model, registry=reg, rank=0):
        for _ in range(3):
            tiny_step(model, opt)
    assert sample(reg, "hookpolicy_steps_total") == 3


def test_the_same_policies_attached_twice_to_one_model_are_refused(tmp_path: Path, out: Path) -> None:
    """Decided: refused with a clear error. Run twice, a policy would scale or clip twice and two
    attachments would share (and on removal drop) one set of metric series."""
    policy = load_policy(tmp_path, NORMS_A)
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.attach(model, registry=reg, rank=0):
        installed = (module_hook_count(model), global_hook_counts())
        with pytest.raises(HookPolicyError, match="already attached"):
            policy.attach(model, registry=reg, rank=0).remove()
        assert (module_hook_count(model), global_hook_counts()) == installed  # nothing half-installed
        tiny_step(model, opt)
    assert sample(reg, "hookpolicy_steps_total") == 1
    with policy.attach(model, registry=reg, rank=0):  # once removed, it may be attached again
        tiny_step(model, opt)


def test_the_same_policies_on_two_models_work_independently(tmp_path: Path, out: Path) -> None:
    policy = load_policy(tmp_path, NORMS_A)
    one, two = tiny(0), tiny(1)
    reg_one, reg_two = CollectorRegistry(), CollectorRegistry()
    opt_one = torch.optim.SGD(one.parameters(), lr=0.1)
    opt_two = torch.optim.SGD(two.parameters(), lr=0.1)
    with policy.attach(one, registry=reg_one, rank=0) as a, policy.attach(two, registry=reg_two, rank=0) as b:
        for _ in range(3):
            tiny_step(one, opt_one)
        tiny_step(two, opt_two)
        assert (a.step, b.step) == (3, 1)
    assert sample(reg_one, "hookpolicy_steps_total") == 3
    assert sample(reg_two, "hookpolicy_steps_total") == 1
