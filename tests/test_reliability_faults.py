"""Faults in hooks and in what they write: a full disk (a 64 KiB tmpfs, or injected), a capture
folder that turns into a file, a log write failing half way, a sink that raises, a spent
budget; contained under `onError: continue`, stopped cleanly under `halt`, never the reason a
run dies. The guarantees are in docs/reliability.md.

Tests run as root in CI, where `chmod` does not stop writes: a folder that "became
read-only" or a "full disk" is simulated with a file in place of the folder, or with
`os.replace`/`open` raising `OSError(ENOSPC)`.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers.hooks import global_hook_counts, module_hook_count
from helpers.models import tiny, tiny_step
from helpers.outputs import errors_of, json_lines, sample
from helpers.policies import LOG_EVERY_STEP, load_policy, policy_text
from helpers.processes import Proc, start_apply
from hookpolicy import Halt
from hookpolicy.engine.runtime import MAX_ERRORS
from hookpolicy.export import sinks


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
            tiny_step(model, opt)
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
            tiny_step(model, opt)
        kept = out / "kept"
        (out / "tensors").rename(kept)
        (out / "tensors").write_text("not a folder any more")
        for _ in range(6):
            tiny_step(model, opt)
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
                tiny_step(model, opt)
    assert (halted.value.policy, halted.value.rule, halted.value.step) == ("p", "dump", 3)
    assert "No space left on device" in halted.value.message
    # the halting step's update was not applied
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert module_hook_count(model) == 0 and global_hook_counts() == baseline
    assert errors_of(reg, "dump") == 1
    records = json_lines(out / "logs" / "norms.jsonl")
    assert sorted({r["step"] for r in records}) == [0, 1, 2, 3]
    # training after the halt runs plain PyTorch: nothing of hookpolicy is left
    tiny_step(model, opt)


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
            tiny_step(model, opt)
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
            tiny_step(model, opt)
    assert sample(reg, "hookpolicy_steps_total") == 6
    assert 1 <= errors_of(reg, "norms") <= MAX_ERRORS


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
            tiny_step(model, opt)
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
    run = start_apply(procs, tmp_path / "run", ["--watch", str(policy), "--", sys.executable, str(script), str(stop)],
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
            tiny_step(model, opt)
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
    tiny_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 4))  # buffered statistics and a pending step, flushed by remove()
    monkeypatch.setattr(sinks.JsonLines, "write", fault)
    monkeypatch.setattr(sinks.JsonLines, "close", fault)
    attached.remove()
    assert module_hook_count(model) == 0
    said = messages(hookpolicy_log, logging.ERROR, "p/norms")
    assert len(said) == 1 and said[0].startswith("hookpolicy: ") and "\n" not in said[0], said
