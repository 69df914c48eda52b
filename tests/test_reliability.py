"""Faults in hooks, removal at awkward moments, long runs, atomic files, the exporter under load, signals.

hookpolicy runs inside week-long training jobs; none of what is tested here may be the
reason a run dies, leaks or loses data. The guarantees and the numbers these tests
measured are in docs/reliability.md.

Tests run as root in CI, where `chmod` does not stop writes: a folder that "became
read-only" or a "full disk" is simulated with a file in place of the folder, or with
`os.replace`/`open` raising `OSError(ENOSPC)`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.nn as nn
import torch.optim.optimizer as optimizer_hooks
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import hookpolicy
from hookpolicy import Halt, HookPolicyError, PolicySet
from hookpolicy.export import sinks
from hookpolicy.policy.model import LogSink
from hookpolicy.engine.runtime import MAX_ERRORS

from helpers import REPO
from helpers.hooks import global_hook_counts, module_hook_count
from helpers.models import tiny
from helpers.outputs import json_lines, metric, served
from helpers.policies import load_policy, policy_text, write_policy
from helpers.child_scripts import HOOK_REPORT


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: int = 6) -> float:
    loss = model(torch.randn(batch, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def sample(reg: CollectorRegistry, name: str, **labels: str) -> Optional[float]:
    return metric(reg, name, {**labels, "rank": "0"})


def errors_of(reg: CollectorRegistry, rule: str, policy: str = "p") -> float:
    return sample(reg, "hookpolicy_hook_errors_total", policy=policy, rule=rule) or 0.0


@pytest.fixture
def hookpolicy_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="hookpolicy")
    return caplog


def messages(caplog: pytest.LogCaptureFixture, level: int, contains: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and contains in r.getMessage()]


def disk_full(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# =========================================================================== faults in hooks

DUMP_AND_NORMS = """\
- name: dump
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], tensors: {dir: tensors}}
- name: norms
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], log: {path: logs/norms.jsonl}}
- name: outputs
  match: {types: [Linear]}
  trigger: {at: forward}
  actions:
    - capture: {stats: [rms]}
"""


def test_disk_full_on_tensor_files_is_contained_under_continue(
    tmp_path: Path, out: Path, monkeypatch: pytest.MonkeyPatch, hookpolicy_log: pytest.LogCaptureFixture,
) -> None:
    policy = load_policy(tmp_path, DUMP_AND_NORMS)
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(sinks.os, "replace", disk_full)
    steps = MAX_ERRORS + 4
    with policy.attach(model, registry=reg, rank=0):
        for _ in range(steps):
            before = model[0].weight.detach().clone()
            train_step(model, opt)
            assert not torch.equal(before, model[0].weight), "the update was not applied"

    assert sample(reg, "hookpolicy_steps_total") == steps
    # counted, and the rule switched off after MAX_ERRORS: it ran on 3 steps only
    assert errors_of(reg, "dump") == MAX_ERRORS
    # (actions count once per step and module: 2 Linears)
    assert sample(reg, "hookpolicy_actions_total", policy="p", rule="dump", action="capture", mode="enforce") == 2 * MAX_ERRORS
    # the other rules never noticed
    assert errors_of(reg, "norms") == 0 and errors_of(reg, "outputs") == 0
    assert sample(reg, "hookpolicy_actions_total", policy="p", rule="norms", action="capture", mode="enforce") == 2 * steps
    assert len(json_lines(out / "logs" / "norms.jsonl")) == 2 * steps
    # logged once, as one line (a sink fault's message says it all); the switch-off once
    raised = messages(hookpolicy_log, logging.ERROR, "p/dump raised")
    assert len(raised) == 1
    assert raised[0].startswith("hookpolicy: ") and "\n" not in raised[0] and "No space left on device" in raised[0]
    assert len(messages(hookpolicy_log, logging.ERROR, "p/dump switched off after")) == 1
    # nothing half-written is left: the temporary file of each failed write is removed
    assert list((out / "tensors").iterdir()) == []


def test_a_capture_folder_that_turns_into_a_file_mid_run_is_contained(
    tmp_path: Path, out: Path, hookpolicy_log: pytest.LogCaptureFixture,
) -> None:
    """Root ignores chmod, so "the folder became unwritable" is a file where the folder was."""
    policy = load_policy(tmp_path, DUMP_AND_NORMS)
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.attach(model, registry=reg, rank=0):
        for _ in range(2):
            train_step(model, opt)
        kept = out / "kept"
        (out / "tensors").rename(kept)
        (out / "tensors").write_text("not a folder any more")
        for _ in range(6):
            train_step(model, opt)
    assert sample(reg, "hookpolicy_steps_total") == 8
    assert errors_of(reg, "dump") == MAX_ERRORS
    assert len(messages(hookpolicy_log, logging.ERROR, "p/dump raised")) == 1
    files = sorted(kept.iterdir())
    assert len(files) == 2 * 2 * 2  # 2 steps x 2 Linear x (weight, bias)
    for file in files:
        assert isinstance(torch.load(file, weights_only=True), torch.Tensor)


def test_on_error_halt_stops_cleanly_removes_hooks_and_flushes_the_log(
    tmp_path: Path, out: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = load_policy(tmp_path, DUMP_AND_NORMS, spec="onError: halt\n")
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    baseline = global_hook_counts()
    with pytest.raises(Halt) as halted:
        with policy.attach(model, registry=reg, rank=0):
            for step in range(10):
                if step == 3:
                    monkeypatch.setattr(sinks.os, "replace", disk_full)
                before = [p.detach().clone() for p in model.parameters()]
                train_step(model, opt)
    assert (halted.value.policy, halted.value.rule, halted.value.step) == ("p", "dump", 3)
    assert "No space left on device" in halted.value.message
    # the halting step's update was not applied
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert module_hook_count(model) == 0 and global_hook_counts() == baseline
    assert errors_of(reg, "dump") == 1
    records = json_lines(out / "logs" / "norms.jsonl")
    assert sorted({r["step"] for r in records}) == [0, 1, 2, 3]
    # training after the halt runs plain PyTorch: nothing of hookpolicy is left
    train_step(model, opt)


@pytest.mark.parametrize("budget", ["max_bytes: 4000", "max_files: 2"])
def test_a_spent_budget_writes_nothing_more_warns_once_and_is_no_error(
    tmp_path: Path, out: Path, hookpolicy_log: pytest.LogCaptureFixture, budget: str,
) -> None:
    """The configured end of a capture: a warning, never a hook error (nobody gets paged)."""
    policy = load_policy(tmp_path, f"""\
        - name: dump
          match: {{modules: ["0"], params: [weight]}}
          trigger: {{at: step}}
          actions:
            - capture: {{stats: [l2_norm], tensors: {{dir: tensors, {budget}}}}}
    """)
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.attach(model, registry=reg, rank=0):
        for _ in range(8):
            train_step(model, opt)
    files = sorted((out / "tensors").iterdir())
    assert [f.name for f in files] == ["step00000000-0-grad-weight.pt", "step00000001-0-grad-weight.pt"]
    assert sum(f.stat().st_size for f in files) <= 4000
    assert errors_of(reg, "dump") == 0
    assert len(messages(hookpolicy_log, logging.WARNING, "no more tensor files")) == 1
    assert sample(reg, "hookpolicy_actions_total", policy="p", rule="dump", action="capture", mode="enforce") == 8
    assert sample(reg, "hookpolicy_steps_total") == 8


@pytest.mark.parametrize("fault", ["folder-is-a-file", "disk-full"])
def test_a_log_sink_fault_is_contained_under_continue(
    tmp_path: Path, out: Path, monkeypatch: pytest.MonkeyPatch, fault: str,
) -> None:
    policy = load_policy(tmp_path, DUMP_AND_NORMS.replace("tensors: {dir: tensors}", "tensors: {dir: t}"))
    if fault == "folder-is-a-file":
        (out / "logs").write_text("a file where the log folder should be")
    else:
        monkeypatch.setattr(sinks, "open", disk_full, raising=False)
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.attach(model, registry=reg, rank=0):
        for _ in range(6):
            train_step(model, opt)
    assert sample(reg, "hookpolicy_steps_total") == 6
    assert 1 <= errors_of(reg, "norms") <= MAX_ERRORS


LOG_EVERY_STEP = """\
- name: norms
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm, mean, std, max, min], per: tensor, log: {path: logs/norms.jsonl}}
- name: outputs
  match: {types: [Linear]}
  trigger: {at: forward}
  actions:
    - capture: {stats: [rms]}
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs as the output folder: a disk that really fills up (needs root, else skipped)."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (not root); the injected faults below cover the same path")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_disk_that_fills_up_under_a_log_ends_neither_training_nor_the_log_mid_line(
    tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch, hookpolicy_log: pytest.LogCaptureFixture,
) -> None:
    """The reported crash: a full disk's OSError escaped remove() (`with` exit, a reload, atexit)."""
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(small_disk))
    policy = load_policy(tmp_path, LOG_EVERY_STEP)
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.attach(model, registry=reg, rank=0):
        for _ in range(300):  # ~ 800 bytes a step: full after ~80
            train_step(model, opt)
    assert sample(reg, "hookpolicy_steps_total") == 300
    assert errors_of(reg, "norms") == MAX_ERRORS and errors_of(reg, "outputs") == 0
    records = json_lines(small_disk / "logs" / "norms.jsonl")  # whole lines only
    assert 0 < len(records) < 2 * 300
    assert len(messages(hookpolicy_log, logging.ERROR, "No space left on device")) == 1
    (switched_off,) = messages(hookpolicy_log, logging.ERROR, "p/norms switched off")
    assert switched_off.startswith("hookpolicy: ")


FILLING_SCRIPT = """\
import os, sys, torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
while not os.path.exists(sys.argv[1]) and step < 20000:
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    step += 1
print("trained", step, "steps", flush=True)
"""


@pytest.mark.slow
def test_a_full_disk_then_a_hot_reload_then_exit_never_reach_the_script(
    tmp_path: Path, small_disk: Path, procs: list[Proc],
) -> None:
    """The reported crash: `apply --watch`, the log's disk fills, a reload removes the old attachment."""
    policy, stop, script = tmp_path / "p.yaml", tmp_path / "stop", tmp_path / "fill.py"
    policy.write_text(policy_text(LOG_EVERY_STEP))
    script.write_text(FILLING_SCRIPT)
    run = apply(procs, tmp_path / "run", ["--watch", str(policy), "--", sys.executable, str(script), str(stop)],
                HOOKPOLICY_OUTPUT_DIR=str(small_disk), HOOKPOLICY_WATCH_INTERVAL="0.1")
    run.wait_for(lambda: "p/norms switched off" in run.stderr, what="the rule to be switched off")
    policy.write_text(policy.read_text() + "# a new revision\n")
    run.wait_for(lambda: "reloaded policies" in run.stderr, what="the reload")
    stop.touch()
    assert run.wait() == 0, run.stderr
    assert "trained" in run.stdout
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
    # each fault one line (the reloaded rule starts over, so it fails once more)
    assert all(line.startswith("hookpolicy: ") for line in run.stderr.splitlines()), run.stderr
    assert run.stderr.count("No space left on device") == 2, run.stderr
    json_lines(small_disk / "logs" / "norms.jsonl")  # whole lines only


class TornWrites:
    """A log file on a disk that fills up: one write lands half, every later write and close fail."""

    def __init__(self, file: Any) -> None:
        self._file, self._full = file, False

    def write(self, data: Any) -> int:
        if self._full:
            disk_full()
        self._full = True
        return int(self._file.write(data[: len(data) // 2]) or 0)

    def flush(self) -> None:
        if self._full:
            disk_full()

    def close(self) -> None:
        self._file.close()
        if self._full:
            disk_full()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


@pytest.mark.parametrize("fault_at", [0, 2])
def test_a_log_write_that_fails_half_way_leaves_whole_lines_and_remove_never_raises(
    tmp_path: Path, out: Path, monkeypatch: pytest.MonkeyPatch, hookpolicy_log: pytest.LogCaptureFixture,
    fault_at: int,
) -> None:
    policy = load_policy(tmp_path, LOG_EVERY_STEP)
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real_open = open
    with policy.attach(model, registry=reg, rank=0) as attached:
        for step in range(6):
            if step == fault_at:
                monkeypatch.setattr(sinks, "open", lambda *a, **k: TornWrites(real_open(*a, **k)), raising=False)
                (out / "logs" / "norms.jsonl").unlink(missing_ok=True)  # the sink opens the file anew
            train_step(model, opt)
        attached.remove()  # also the second call of the `with` exit: neither raises
    assert sample(reg, "hookpolicy_steps_total") == 6
    assert errors_of(reg, "norms") >= 1 and errors_of(reg, "outputs") == 0
    assert json_lines(out / "logs" / "norms.jsonl") == []  # the half line was cut back off
    assert len(messages(hookpolicy_log, logging.ERROR, "No space left on device")) == 1


def sink_bug(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("a bug in a sink")


@pytest.mark.parametrize("on_error", ["continue", "halt"])
@pytest.mark.parametrize("fault", [disk_full, sink_bug])
def test_nothing_a_sink_raises_escapes_remove(
    tmp_path: Path, out: Path, monkeypatch: pytest.MonkeyPatch, hookpolicy_log: pytest.LogCaptureFixture,
    on_error: str, fault: Callable[..., None],
) -> None:
    policy = load_policy(tmp_path, LOG_EVERY_STEP, spec=f"onError: {on_error}\n")
    model, reg = tiny(), CollectorRegistry()
    attached = policy.attach(model, registry=reg, rank=0)
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 4))  # buffered statistics and a pending step, flushed by remove()
    monkeypatch.setattr(sinks.JsonLines, "write", fault)
    monkeypatch.setattr(sinks.JsonLines, "close", fault)
    attached.remove()
    assert module_hook_count(model) == 0
    said = messages(hookpolicy_log, logging.ERROR, "p/norms")
    assert len(said) == 1 and said[0].startswith("hookpolicy: ") and "\n" not in said[0], said


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
                train_step(model, opt)
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
                train_step(model, opt)
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
            train_step(model, opt)
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
            train_step(model, opt)
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
                    train_step(model, opt)
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
            train_step(model, opt)
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
    train_step(model, opt)
    grad_norm = dict(policy="a", rule="g", module="0", tensor="")
    out_rms = dict(policy="b", rule="o", module="0", tensor="")
    assert sample(reg, "hookpolicy_grad_l2_norm", **grad_norm) is not None
    assert sample(reg, "hookpolicy_output_rms", **out_rms) is not None

    first.remove()  # takes off a's hooks only
    assert sample(reg, "hookpolicy_grad_l2_norm", **grad_norm) is None
    previous = sample(reg, "hookpolicy_output_rms", **out_rms)
    train_step(model, opt)
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
            train_step(model, opt)
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
        train_step(model, opt)
    assert sample(reg, "hookpolicy_steps_total") == 1
    with policy.attach(model, registry=reg, rank=0):  # once removed, it may be attached again
        train_step(model, opt)


def test_the_same_policies_on_two_models_work_independently(tmp_path: Path, out: Path) -> None:
    policy = load_policy(tmp_path, NORMS_A)
    one, two = tiny(0), tiny(1)
    reg_one, reg_two = CollectorRegistry(), CollectorRegistry()
    opt_one = torch.optim.SGD(one.parameters(), lr=0.1)
    opt_two = torch.optim.SGD(two.parameters(), lr=0.1)
    with policy.attach(one, registry=reg_one, rank=0) as a, policy.attach(two, registry=reg_two, rank=0) as b:
        for _ in range(3):
            train_step(one, opt_one)
        train_step(two, opt_two)
        assert (a.step, b.step) == (3, 1)
    assert sample(reg_one, "hookpolicy_steps_total") == 3
    assert sample(reg_two, "hookpolicy_steps_total") == 1


def rotating(root: Path, max_bytes: int, keep: int) -> "sinks.JsonLines":
    return sinks.JsonLines(root, LogSink(path="logs/x.jsonl", max_bytes=max_bytes, keep=keep))


def record(step: int) -> dict[str, Any]:
    return {"step": step, "stats": {"l2_norm": 1.0}}  # 40 bytes a line


def test_a_log_rotates_before_it_would_pass_max_bytes_and_keeps_the_newest(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=100, keep=2)
    for step in range(20):
        log.write([record(step)])
    log.close()
    names = ["x.jsonl.2", "x.jsonl.1", "x.jsonl"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(names)
    files = [tmp_path / "logs" / name for name in names]
    assert [f.stat().st_size for f in files] == [80, 80, 80]  # two 40-byte lines; a third would pass 100
    assert [r["step"] for f in files for r in json_lines(f)] == list(range(14, 20))


def test_keep_zero_starts_the_log_over(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=100, keep=0)
    for step in range(5):
        log.write([record(step)])
    log.close()
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["x.jsonl"]
    assert [r["step"] for r in json_lines(tmp_path / "logs" / "x.jsonl")] == [4]


def test_a_record_larger_than_max_bytes_is_written_whole_in_a_file_of_its_own(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=10, keep=1)
    log.write([record(0)])
    log.write([record(1)])
    log.close()
    assert [r["step"] for r in json_lines(tmp_path / "logs" / "x.jsonl.1")] == [0]
    assert [r["step"] for r in json_lines(tmp_path / "logs" / "x.jsonl")] == [1]


def test_writers_sharing_a_log_follow_each_others_rotations(tmp_path: Path) -> None:
    """Like two ranks (or two rules) appending to one path: the bound holds, nothing is written to a rotated file."""
    first, second = rotating(tmp_path, max_bytes=200, keep=1), rotating(tmp_path, max_bytes=200, keep=1)
    for step in range(0, 40, 2):
        first.write([record(step)])
        second.write([record(step + 1)])
    first.close()
    second.close()
    files = [tmp_path / "logs" / name for name in ("x.jsonl.1", "x.jsonl")]
    assert all(f.stat().st_size <= 200 for f in files)
    assert [r["step"] for f in files for r in json_lines(f)] == list(range(30, 40))


def test_a_symlink_put_in_place_of_an_open_log_is_not_written_through(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=1000, keep=1)
    log.write([record(0)])
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "logs" / "x.jsonl").unlink()
    (tmp_path / "logs" / "x.jsonl").symlink_to(victim)
    with pytest.raises(sinks.SinkError, match="symbolic link"):
        log.write([record(1)])
    log.close()
    assert victim.read_text() == "precious\n"


def test_a_log_folder_turned_into_a_symlink_is_not_followed_when_the_log_rotates(tmp_path: Path) -> None:
    root, outside = tmp_path / "out", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    log = rotating(root, max_bytes=50, keep=1)
    log.write([record(0)])
    (root / "logs").rename(root / "moved")
    (root / "logs").symlink_to(outside, target_is_directory=True)
    (outside / "x.jsonl").write_text("precious\n" * 10)  # full: it would be rotated, outside
    with pytest.raises(sinks.SinkError, match="outside the output folder"):
        log.write([record(1)])  # the file at the path is another: it would be opened anew, through the link
    log.close()
    assert [p.name for p in outside.iterdir()] == ["x.jsonl"]
    assert (outside / "x.jsonl").read_text() == "precious\n" * 10


# =========================================================================== processes


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HOOKPOLICY_POLICY_DIRS", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Proc:
    """A child process whose stdout and stderr go to files (no pipe can fill up and block it)."""

    def __init__(self, folder: Path, argv: list[str], env: dict[str, str]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = folder / "stdout", folder / "stderr"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, ready: Callable[[], bool], timeout: float = 60, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"exited ({self.proc.returncode}) before {what}; stderr:\n{self.stderr}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; stderr:\n{self.stderr}")
            time.sleep(0.05)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"did not finish in {timeout} s; stderr:\n{self.stderr}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)
            try:
                proc.proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def apply(procs: list[Proc], folder: Path, args: list[str], **env: str) -> Proc:
    proc = Proc(folder, [sys.executable, "-m", "hookpolicy", "apply", *args], child_env(**env))
    procs.append(proc)
    return proc


def scrape(port: int, timeout: float = 5) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        assert response.status == 200
        return response.read().decode("utf-8")


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float]]:
    """Every sample as (name, labels) -> (family type, value); fails on a torn or untyped family."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.type in ("counter", "gauge"), f"{family.name} has no TYPE line"
        assert family.documentation, f"{family.name} has no HELP line"
        name = re.escape(family.name) + ("(_total)?" if family.type == "counter" else "")
        assert re.search(rf"^# HELP {name} \S", text, re.M), f"{family.name} has no HELP line"
        assert re.search(rf"^# TYPE {name} {family.type}$", text, re.M), f"{family.name} has no TYPE line"
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = (family.type, s.value)
    return samples


# --------------------------------------------------------------------------- atomic writes

KILLED_SCRIPT = """\
import sys, torch, hookpolicy
torch.set_num_threads(1)
model = torch.nn.Linear(1024, 1024)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
with hookpolicy.load(sys.argv[1]).attach(model):
    step = 0
    while True:
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        print(step, flush=True)
        step += 1
"""

DUMP_WEIGHTS = """\
- name: dump
  match: {root: true, params: [weight]}
  trigger: {at: step}
  target: weight
  actions:
    - capture: {stats: [l2_norm, mean], per: tensor, tensors: {dir: tensors, max_files: 100000},
                log: {path: dump.jsonl}}
"""


@pytest.mark.slow
def test_a_run_killed_mid_write_leaves_no_partial_tensor_file(tmp_path: Path, procs: list[Proc]) -> None:
    """SIGKILL a process that writes 4 MiB tensor files back to back; only complete files have final names."""
    policy = tmp_path / "dump.yaml"
    policy.write_text(policy_text(DUMP_WEIGHTS, name="dump"))
    script = tmp_path / "writer.py"
    script.write_text(KILLED_SCRIPT)
    leftovers = partial_lines = 0
    for attempt, delay in enumerate((0.0, 0.013)):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        proc = Proc(tmp_path / f"proc{attempt}", [sys.executable, str(script), str(policy)],
                    child_env(HOOKPOLICY_OUTPUT_DIR=str(out)))
        procs.append(proc)
        folder = out / "tensors"
        proc.wait_for(lambda: folder.is_dir() and len(list(folder.glob("step*.pt"))) >= 4, what="four tensor files")
        time.sleep(delay)
        proc.proc.send_signal(signal.SIGKILL)
        assert proc.proc.wait(10) == -signal.SIGKILL
        finals = sorted(folder.glob("step*.pt"))
        others = sorted(set(folder.iterdir()) - set(finals))
        assert len(finals) >= 4
        for file in finals:  # each one complete
            loaded = torch.load(file, weights_only=True)
            assert loaded.shape == (1024, 1024), file
        for file in others:  # at most a temporary file, never with a final name or a .pt suffix
            assert file.name.startswith(sinks.TEMP_PREFIX) and not file.name.endswith(".pt"), file
        assert sorted(folder.glob("*.pt")) == finals  # a `*.pt` glob finds complete files only
        leftovers += len(others)
        # the log: whole lines, each one written with a single flush
        text = (out / "dump.jsonl").read_text()
        complete = text[: text.rfind("\n") + 1]
        records = [json.loads(line) for line in complete.splitlines()]
        assert len(records) >= len(finals)
        partial_lines += text != complete
    print(f"\nkilled mid-run twice: {leftovers} temporary file(s) left behind, no partial .pt, "
          f"{partial_lines} log(s) ending in a partial line")
    assert partial_lines == 0


# --------------------------------------------------------------------------- exporter under load

SCRAPED_SCRIPT = """\
import os, sys, time, torch
torch.set_num_threads(1)
times, stop = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 8))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, 64)
with open(times, "w", buffering=1) as out:
    while not os.path.exists(stop):
        start, wall = time.perf_counter(), time.time()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.write(f"{wall} {time.perf_counter() - start}\\n")
"""

SCRAPED_POLICY = REPO / "bench" / "policies" / "scraped.yaml"  # bench/scrape_load.py times the same

SCRAPERS = 50
SCRAPES_EACH = 30
LOAD_SECONDS = 4.0
QUIET_SECONDS = 2.0


def _scraper(port: int, deadline: float, latencies: list[float], errors: list[str]) -> None:
    """Scrape in a loop; each scrape must parse and no counter may go down between two of them."""
    last: dict[Any, float] = {}
    for _ in range(SCRAPES_EACH):
        if time.monotonic() > deadline:
            return
        start = time.perf_counter()
        try:
            text = scrape(port, timeout=30)
            latencies.append(time.perf_counter() - start)  # the HTTP request alone
            samples = parse(text)
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        for key, (kind, value) in samples.items():
            if kind == "counter" and key[0].endswith("_total"):
                if value < last.get(key, 0.0):
                    errors.append(f"counter {key} went down: {last[key]} -> {value}")
                last[key] = value
        if not any(key[0] == "hookpolicy_steps_total" for key in samples):
            errors.append("hookpolicy_steps_total missing from a scrape")
        if not any(key[0] == "hookpolicy_policy_info" and ("policy", "scraped") in key[1] for key in samples):
            errors.append("a scrape without hookpolicy_policy_info{policy='scraped'}: another process's port?")


def test_a_shutdown_before_the_exporter_thread_runs_stops_it(free_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`shutdown()` right after `serve()`, before the exporter's thread reached its loop (a busy machine).

    It used to find no stop event yet, signal nothing, wait out its 5 s join and leave the
    thread serving for the rest of the process. The thread is held back here on purpose.
    """
    from hookpolicy.export.exporter import Exporter

    run = Exporter._run

    def late(self: Exporter) -> None:
        time.sleep(0.3)
        run(self)

    monkeypatch.setattr(Exporter, "_run", late)
    with served(CollectorRegistry(), free_port) as server:
        pass
    assert not server._thread.is_alive()


def test_the_exporter_listens_with_room_for_fifty_simultaneous_connections(free_port: int) -> None:

    with served(CollectorRegistry(), free_port) as server:
        assert server.request_queue_size >= SCRAPERS


class CountingApp:
    """A WSGI app that answers with how often it was called (and the request's Accept header)."""

    def __init__(self, pause: float = 0.0) -> None:
        self.calls, self.pause = 0, pause

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        self.calls += 1
        time.sleep(self.pause)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [f"{self.calls} {environ.get('HTTP_ACCEPT', '')}".encode()]


def get(app: Callable[..., Any], **environ: str) -> tuple[str, bytes]:
    status: list[str] = []
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", **environ},
                        lambda s, headers, exc_info=None: status.append(s)))
    return status[0], body


def test_a_rendering_is_served_again_until_the_interval_is_over() -> None:
    from hookpolicy.export.exporter import RenderCache

    now = [100.0]
    app = CountingApp()
    cache = RenderCache(app, interval=1.0, clock=lambda: now[0])
    assert get(cache) == ("200 OK", b"1 ")
    now[0] += 0.9
    assert get(cache) == ("200 OK", b"1 ")
    assert get(cache, HTTP_ACCEPT="application/openmetrics-text") == ("200 OK", b"2 application/openmetrics-text")
    now[0] += 0.1
    assert get(cache) == ("200 OK", b"3 ")
    assert app.calls == 3


def test_scrapes_arriving_together_share_one_rendering() -> None:
    from hookpolicy.export.exporter import RenderCache

    app = CountingApp(pause=0.2)
    cache = RenderCache(app, interval=60.0)
    bodies: list[bytes] = []
    threads = [threading.Thread(target=lambda: bodies.append(get(cache)[1])) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert app.calls == 1 and bodies == [b"1 "] * 8


def test_clients_cannot_grow_the_rendering_cache_without_bound() -> None:
    from hookpolicy.export.exporter import RenderCache

    cache = RenderCache(CountingApp(), interval=60.0)
    for index in range(10 * RenderCache.MAX_KEYS):
        get(cache, HTTP_ACCEPT=f"text/x-{index}")
        assert len(cache._answers) <= RenderCache.MAX_KEYS


def test_the_exporter_shows_new_values_once_the_interval_is_over(free_port: int) -> None:
    from prometheus_client import Counter


    registry = CollectorRegistry()
    counter = Counter("ticks", "Ticks.", registry=registry)
    with served(registry, free_port, render_interval=0.2):
        assert ("counter", 0.0) == parse(scrape(free_port))[("ticks_total", ())]
        counter.inc()
        time.sleep(0.25)
        assert ("counter", 1.0) == parse(scrape(free_port))[("ticks_total", ())]


class BrokenCollector:
    def collect(self) -> Iterator[Any]:
        raise RuntimeError("broken collector")


def test_a_rendering_that_raises_is_a_500_and_one_line_never_a_traceback(
    free_port: int, capfd: pytest.CaptureFixture[str],
) -> None:

    registry = CollectorRegistry()
    registry.register(BrokenCollector())  # type: ignore[arg-type]
    with served(registry, free_port):
        for _ in range(2):  # not cached, reported once
            with pytest.raises(urllib.error.HTTPError) as failed:
                scrape(free_port)
            assert failed.value.code == 500
            assert failed.value.read().decode() == "cannot render metrics: RuntimeError: broken collector\n"
    assert capfd.readouterr().err == "hookpolicy: cannot render metrics: RuntimeError: broken collector\n"


def test_a_request_that_fails_in_the_server_is_one_line_on_stderr(
    free_port: int, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    from hookpolicy.export import exporter

    def broken(head: bytes) -> None:
        raise ValueError("bad request handling")

    monkeypatch.setattr(exporter, "_environ", broken)
    with served(CollectorRegistry(), free_port):
        with pytest.raises(OSError):  # the connection is closed without an answer
            scrape(free_port)
    assert capfd.readouterr().err == "hookpolicy: a metrics request from 127.0.0.1 failed: ValueError: bad request handling\n"


def test_idle_connections_do_not_keep_a_scrape_out(free_port: int, capfd: pytest.CaptureFixture[str]) -> None:
    """The reported blinding: 150 idle TCP connections kept a real scrape unanswered for 30 s."""
    with served(CollectorRegistry(), free_port):
        idle = [socket.create_connection(("127.0.0.1", free_port)) for _ in range(150)]
        try:
            assert scrape(free_port, timeout=4) is not None
        finally:
            for sock in idle:
                sock.close()
    assert capfd.readouterr().err == ""


def test_clients_dripping_a_request_are_cut_off_at_the_deadline_and_hold_no_one_back(
    free_port: int, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    """The reported stall: 3 clients sending a byte every 4 s blocked scrapes for 24 s (the timeout was per read)."""
    from hookpolicy.export import exporter

    monkeypatch.setattr(exporter, "REQUEST_DEADLINE", 1.0)
    with served(CollectorRegistry(), free_port):
        drips = [socket.create_connection(("127.0.0.1", free_port)) for _ in range(3)]
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        cut = [False] * 3
        for index in range(len(request) - 1):  # a byte every 0.1 s: each read is quick, the request never ends
            for n, drip in enumerate(drips):
                try:
                    drip.sendall(request[index:index + 1])
                except OSError:
                    cut[n] = True
            if index == 2:
                assert scrape(free_port, timeout=4) is not None  # answered while they drip
            if all(cut):
                break
            time.sleep(0.1)
        assert all(cut), "a client dripping its request outlived the per-request deadline"
        for drip in drips:
            drip.close()
    assert capfd.readouterr().err == ""


def test_connections_beyond_the_bound_close_the_oldest(free_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookpolicy.export import exporter

    monkeypatch.setattr(exporter, "MAX_CONNECTIONS", 4)
    with served(CollectorRegistry(), free_port):
        idle = [socket.create_connection(("127.0.0.1", free_port)) for _ in range(4)]
        time.sleep(0.2)  # accepted
        assert scrape(free_port, timeout=4) is not None  # the fifth: the oldest idle one made room
        idle[0].settimeout(4)
        assert idle[0].recv(1) == b""  # closed by the exporter
        for sock in idle:
            sock.close()


def test_answers_are_spaced_by_the_rate_cap(free_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tight scrape loop gets at most MAX_ANSWERS_PER_SECOND answers (here 10): 21 take at least 2 s."""
    from hookpolicy.export import exporter

    monkeypatch.setattr(exporter, "MAX_ANSWERS_PER_SECOND", 10.0)
    with served(CollectorRegistry(), free_port):
        start = time.monotonic()
        for _ in range(21):
            scrape(free_port, timeout=5)
        assert time.monotonic() - start >= 2.0  # a lower bound: sleeps guarantee it on any machine


def step_times(path: Path) -> list[tuple[float, float]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((float(parts[0]), float(parts[1])))
    return rows


@pytest.mark.slow
def test_fifty_concurrent_scrapers_get_whole_samples(
    tmp_path: Path, procs: list[Proc], free_port: int, record_property: Callable[[str, object], None],
) -> None:
    policy, script = SCRAPED_POLICY, tmp_path / "train.py"
    script.write_text(SCRAPED_SCRIPT)
    times, stop = tmp_path / "times.txt", tmp_path / "stop"
    proc = apply(procs, tmp_path / "apply", [str(policy), "--metrics-port", str(free_port), "--",
                                             sys.executable, str(script), str(times), str(stop)])

    def ready() -> bool:
        try:
            samples = parse(scrape(free_port))
        except OSError:
            return False
        assert "cannot serve metrics" not in proc.stderr, proc.stderr  # the port was taken meanwhile
        return (samples.get(("hookpolicy_steps_total", (("model", "Sequential"), ("rank", "0")))) or ("", 0))[1] > 50

    proc.wait_for(ready, timeout=90, what="metrics")
    quiet_before = (time.time(), time.time() + QUIET_SECONDS)
    time.sleep(QUIET_SECONDS)
    latencies: list[float] = []
    errors: list[str] = []
    load_start = time.time()
    deadline = time.monotonic() + LOAD_SECONDS
    threads = [threading.Thread(target=_scraper, args=(free_port, deadline, latencies, errors)) for _ in range(SCRAPERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    load = (load_start, time.time())
    quiet_after = (time.time(), time.time() + QUIET_SECONDS)
    time.sleep(QUIET_SECONDS)
    stop.touch()
    assert proc.wait(60) == 0, proc.stderr

    assert errors == []
    assert len(latencies) >= SCRAPERS  # every scraper got at least one whole scrape
    rows = step_times(times)

    def median_in(*windows: tuple[float, float]) -> float:
        inside = [dt for wall, dt in rows if any(a <= wall < b for a, b in windows)]
        assert len(inside) >= 20, f"only {len(inside)} steps in {windows}"
        return statistics.median(inside)

    quiet = median_in(quiet_before, quiet_after)
    loaded = median_in(load)
    slowdown = loaded / quiet
    latencies.sort()
    numbers = {
        "scrapes": len(latencies), "scrapes_per_s": len(latencies) / (load[1] - load[0]),
        "latency_p50_ms": 1000 * latencies[len(latencies) // 2],
        "latency_p95_ms": 1000 * latencies[int(len(latencies) * 0.95)],
        "latency_max_ms": 1000 * latencies[-1],
        "step_ms_quiet": 1000 * quiet, "step_ms_scraped": 1000 * loaded, "step_slowdown": slowdown,
    }
    for key, value in numbers.items():
        record_property(key, value)
    print(f"\nexporter under load: {numbers}")  # measured, not asserted: bench/scrape_load.py times it


# --------------------------------------------------------------------------- signals

SIGNALLED_SCRIPT = """\
import atexit, json, os, signal, sys, time

REPORT, MODE = sys.argv[1], sys.argv[2]
""" + HOOK_REPORT + """\

if MODE == "own-sigterm-handler":
    def on_term(signum, frame):
        print("script: SIGTERM handled by the script", flush=True)
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_term)

torch.manual_seed(0)
model = state["model"] = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
try:
    while True:
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        step += 1
        time.sleep(0.02)
except KeyboardInterrupt:
    print("script: KeyboardInterrupt", flush=True)
    raise
"""

LOGGED_POLICY = """\
- name: grads
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], log: {path: capture.jsonl}}
- name: outputs
  match: {types: [Linear]}
  trigger: {at: forward}
  actions:
    - capture: {stats: [rms], log: {path: outputs.jsonl}}
"""

NO_HOOKS_LEFT = {"model": 0, "global_forward_pre": 0, "global_optimizer_pre": 0, "global_optimizer_post": 0}


@pytest.mark.slow
@pytest.mark.parametrize("sig, mode, status, said", [
    (signal.SIGINT, "plain", 128 + signal.SIGINT, "script: KeyboardInterrupt"),
    (signal.SIGTERM, "own-sigterm-handler", 0, "script: SIGTERM handled by the script"),
], ids=["ctrl-c", "sigterm-to-the-scripts-handler"])
def test_a_signal_to_apply_reaches_the_script_removes_hooks_and_flushes_logs(
    tmp_path: Path, procs: list[Proc], sig: int, mode: str, status: int, said: str,
) -> None:
    policy, script, report = tmp_path / "logged.yaml", tmp_path / "forever.py", tmp_path / "report.json"
    policy.write_text(policy_text(LOGGED_POLICY, name="logged"))
    script.write_text(SIGNALLED_SCRIPT)
    proc = apply(procs, tmp_path / "apply", [str(policy), "--", sys.executable, str(script), str(report), mode],
                 HOOKPOLICY_OUTPUT_DIR=str(tmp_path))
    proc.wait_for(lambda: len(re.findall(r"^step \d+ ", proc.stdout, re.M)) >= 5, what="five steps")
    proc.proc.send_signal(sig)
    assert proc.wait(60) == status, proc.stderr
    assert said in proc.stdout
    assert json.loads(report.read_text()) == NO_HOOKS_LEFT
    steps = len(re.findall(r"^step \d+ ", proc.stdout, re.M))
    grads = json_lines(tmp_path / "capture.jsonl")
    assert len(grads) >= 2 * steps  # two Linear layers, every completed step: flushed
    outputs = json_lines(tmp_path / "outputs.jsonl")
    assert len(outputs) >= 2 * steps
    assert "Traceback" not in proc.stderr or mode == "plain"


@pytest.mark.slow
def test_sighup_with_a_broken_policy_keeps_the_old_one(tmp_path: Path, procs: list[Proc], free_port: int) -> None:
    policy, stop = tmp_path / "watched.yaml", tmp_path / "stop"
    policy.write_text(policy_text(LOGGED_POLICY, name="watched"))
    proc = apply(procs, tmp_path / "apply", [
        str(policy), "--metrics-port", str(free_port), "--", sys.executable, str(REPO / "examples" / "train_mlp.py"),
        "--steps", "100000", "--sleep", "0.02", "--stop-file", str(stop),
    ], HOOKPOLICY_OUTPUT_DIR=str(tmp_path), HOOKPOLICY_WATCH_INTERVAL="0.1")

    def metrics() -> dict[Any, tuple[str, float]]:
        try:
            return parse(scrape(free_port))
        except OSError:
            return {}

    def info(samples: dict[Any, tuple[str, float]]) -> set[str]:
        return {dict(labels)["revision"] for (name, labels) in samples if name == "hookpolicy_policy_info"}

    def steps(samples: dict[Any, tuple[str, float]]) -> float:
        return samples.get(("hookpolicy_steps_total", (("model", "Sequential"), ("rank", "0"))), ("", 0.0))[1]

    def reload_ok(samples: dict[Any, tuple[str, float]]) -> Optional[float]:
        found = samples.get(("hookpolicy_config_last_reload_successful", (("rank", "0"),)))
        return None if found is None else found[1]

    proc.wait_for(lambda: steps(metrics()) > 3, timeout=90, what="metrics")
    old = info(metrics())
    assert len(old) == 1 and reload_ok(metrics()) == 1

    policy.write_text(policy.read_text().replace("at: step", "at: stepp"))
    proc.proc.send_signal(signal.SIGHUP)
    proc.wait_for(lambda: reload_ok(metrics()) == 0, timeout=30, what="the failed reload")
    at_failure = steps(metrics())
    proc.wait_for(lambda: steps(metrics()) > at_failure + 10, timeout=30, what="ten more steps")
    later = metrics()
    assert info(later) == old  # the old policy stays, and keeps working
    assert reload_ok(later) == 0
    norms = [v for (name, labels), (_, v) in later.items()
             if name == "hookpolicy_grad_l2_norm" and dict(labels)["rule"] == "grads"]
    assert len(norms) == 3  # the three Linear layers of train_mlp.py
    stop.touch()
    assert proc.wait(60) == 0, proc.stderr
    assert "reload failed; keeping the current policies" in proc.stderr
    assert re.search(rf"^{re.escape(str(policy))}:\d+:\d+: \$\.spec\.rules\[0\]\.trigger\.at: ", proc.stderr, re.M)


# --------------------------------------------------------------------------- reloads: bounded, off the training thread


def test_the_watcher_never_reads_a_file_beyond_the_size_limit_nor_an_unchanged_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reported fault: a 2 GiB file moved over the policy was read whole every interval (RSS 0.3 -> 2.4 GB)."""
    import tracemalloc

    from hookpolicy.apply import reload
    from hookpolicy.policy.loader import MAX_BYTES

    folder = tmp_path / "policies"
    folder.mkdir()
    write_policy(folder, LOG_EVERY_STEP)
    with open(folder / "huge.yaml", "wb") as f:  # sparse: 64 MiB that take no disk
        f.truncate(64 << 20)
    tracemalloc.start()
    try:
        first = reload.fingerprint([str(folder)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_BYTES  # the small policy is read (at most MAX_BYTES + 1), the sparse file is not
    assert {f for f, _ in first} == {str(folder / "huge.yaml"), str(folder / "p.yaml")}

    settled = time.time() - 10
    os.utime(folder / "p.yaml", (settled, settled))
    reload.fingerprint([str(folder)])  # remembers the checksum of the settled file
    opened: list[str] = []
    real_open = open
    monkeypatch.setattr(reload, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k),
                        raising=False)
    again = reload.fingerprint([str(folder)])
    assert opened == []  # nothing changed: nothing read
    (folder / "p.yaml").write_text(policy_text(LOG_EVERY_STEP) + "# changed\n")
    assert reload.fingerprint([str(folder)]) != again and opened == [str(folder / "p.yaml")]


def test_a_reload_is_validated_in_another_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported fault: validating a 1 MB reload held the GIL, training fell from ~136 to 0-3 steps/s for 8 s."""
    from hookpolicy.apply.reload import Reloader, Swaps
    from hookpolicy.environment import ChildConfig
    from hookpolicy.policy import sources

    path = write_policy(tmp_path, LOG_EVERY_STEP)
    swaps = Swaps(hookpolicy.load(path), rank=0)
    reloader = Reloader(ChildConfig(sources=(str(path),)), swaps, registry=CollectorRegistry())

    def not_here(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("policies were parsed in the training process")

    from hookpolicy.apply import reload

    for module in (sources, reload, hookpolicy.api):
        monkeypatch.setattr(module, "load_sources", not_here, raising=False)
    path.write_text(policy_text(LOG_EVERY_STEP.replace("l2_norm, mean", "l2_norm")))
    reloader.reload()
    assert swaps.next is not None
    (loaded,) = swaps.next[1].policies
    assert loaded.rules[0].actions[0].stats == ("l2_norm", "std", "max", "min")  # type: ignore[union-attr]


def test_a_reload_that_cannot_be_validated_keeps_the_policies_and_says_why(
    tmp_path: Path, capfd: pytest.CaptureFixture[str],
) -> None:
    from hookpolicy.apply.validate import load_elsewhere

    path = write_policy(tmp_path, LOG_EVERY_STEP)
    path.write_text(path.read_text().replace("rules:", "rules: 3\n  x:"))
    with pytest.raises(hookpolicy.PolicyError) as caught:
        load_elsewhere([str(path)])
    assert caught.value.problems == hookpolicy_problems(path)
    with pytest.raises(hookpolicy.PolicyError, match="validation took longer than 0.001 s"):
        load_elsewhere([str(path)], timeout=0.001)


def hookpolicy_problems(path: Path) -> tuple[hookpolicy.Problem, ...]:
    with pytest.raises(hookpolicy.PolicyError) as caught:
        hookpolicy.load(path)
    return caught.value.problems


def test_policy_info_is_in_every_scrape_across_a_swap(tmp_path: Path, out: Path) -> None:
    """The reported fault: one scrape right after a swap had no hookpolicy_policy_info."""
    from hookpolicy.apply.reload import Governed, Swaps

    path = write_policy(tmp_path, LOG_EVERY_STEP)
    registry, model = CollectorRegistry(), tiny()
    old = hookpolicy.load(path).attach(model, registry=registry, rank=0)
    swaps = Swaps(hookpolicy.load(path), rank=0)
    path.write_text(policy_text(LOG_EVERY_STEP) + "# revision 2\n")
    new = hookpolicy.load(path)
    swaps.request(new)
    governed = Governed(model, old, generation=0)
    in_swap, release = threading.Event(), threading.Event()

    def attach(policies: PolicySet, module: nn.Module, step: int) -> Any:
        in_swap.set()  # the old attachment is removed, the new not attached yet
        release.wait(10)
        return policies.attach(module, registry=registry, rank=0, start_step=step)

    swapper = threading.Thread(target=swaps._swap, args=(governed, [governed], attach))
    swapper.start()
    assert in_swap.wait(10)
    seen: list[set[str]] = []
    scraper = threading.Thread(target=lambda: seen.append(
        {m.samples[0].labels["revision"] for m in registry.collect() if m.name == "hookpolicy_policy_info"}))
    scraper.start()
    scraper.join(0.5)  # a scrape now waits for the swap (before: it saw no policy at all)
    release.set()
    swapper.join(10)
    scraper.join(10)
    assert seen == [{new.policies[0].revision}]
    governed.attached.remove()
