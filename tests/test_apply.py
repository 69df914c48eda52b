"""`hookpolicy apply` end to end: the real CLI runs real training scripts in subprocesses.

Metrics are scraped from the real `/metrics` endpoint while the script runs: the scripts
hold at the end of training (`--hold-file`) until the test has read what it needs, or
stop when told (`--stop-file`). The discovery rules themselves are also checked in
process, at the end, where a model's shape is easy to vary.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import hookpolicy
from helpers import REPO
from helpers.hooks import global_hook_counts
from helpers.models import tiny
from helpers.outputs import metric
from helpers.processes import (
    Run, Samples, child_env, labels_of, losses, scrape, steps_are, torchrun, value, wait_metrics,
)
from hookpolicy.apply.discovery import Discovery
from hookpolicy.engine.hooks import heap
from hookpolicy.apply.reload import Reloader
from hookpolicy.environment import ChildConfig
from hookpolicy.export.metrics import RELOAD_SUCCESSFUL
from hookpolicy.export.exporter import RENDER_INTERVAL
from hookpolicy.apply.launch import BOOTSTRAP_DIR
from helpers.child_scripts import HOOK_REPORT

MONITOR = str(REPO / "policies" / "example-monitor.yaml")
TRAIN = str(REPO / "examples" / "train_mlp.py")
DDP = str(REPO / "examples" / "train_ddp.py")

HALT_POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: guard
spec:
  rules:
    - name: nan-halt
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert:
            if: "nonfinite > 0"
            per: rule
            severity: critical
            then: halt
            message: "non-finite gradients"
"""

WATCHED_POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: watched
spec:
  rules:
    - name: grads
      match: {types: [Linear]}
      trigger: {at: step, every: EVERY}
      target: grad
      actions:
        - capture: {stats: [l2_norm]}
"""

BROKEN_POLICY = WATCHED_POLICY.replace("EVERY", "0")  # every: 0 is out of range


# -- the command forms -------------------------------------------------------------------


@pytest.mark.slow
def test_plain_script_serves_metrics_while_it_runs(apply: Callable[..., Run], tmp_path: Path, free_port: int) -> None:
    hold = tmp_path / "hold"
    run = apply(MONITOR, "--metrics-port", str(free_port), "--",
                sys.executable, TRAIN, "--steps", "6", "--hold-file", str(hold))
    samples = wait_metrics(run, free_port, steps_are(6))
    for module in ("0", "2", "4"):
        norm = value(samples, "hookpolicy_grad_l2_norm", policy="example-monitor", rule="grad-norms",
                     module=module, tensor="", rank="0")
        assert norm is not None and norm > 0
    info = labels_of(samples, "hookpolicy_policy_info")
    assert [(i["policy"], i["mode"], i["rank"]) for i in info] == [("example-monitor", "enforce", "0")]
    assert value(samples, "hookpolicy_config_last_reload_successful", rank="0") == 1
    hold.touch()
    assert run.wait() == 0
    assert f"hookpolicy: rank 0: metrics on http://127.0.0.1:{free_port}/metrics" in run.stderr
    assert len(losses(run.stdout)) == 6


def _python_word() -> str:
    """`python` as a user types it when that is this interpreter (PATH lookup), else this one."""
    found = shutil.which("python")
    if found is None:
        return sys.executable
    same = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    return "python" if os.path.realpath(same.stdout.strip()) == os.path.realpath(sys.executable) else sys.executable


@pytest.mark.slow
def test_module_form(apply: Callable[..., Run], tmp_path: Path, free_port: int) -> None:
    hold = tmp_path / "hold"
    run = apply(MONITOR, "--metrics-port", str(free_port), "--",
                _python_word(), "-m", "examples.charlm", "--steps", "3", "--hold-file", str(hold))
    samples = wait_metrics(run, free_port, steps_are(3))
    modules = {lab["module"] for lab in labels_of(samples, "hookpolicy_grad_l2_norm")}
    assert {"lm_head", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj"} <= modules
    hold.touch()
    assert run.wait() == 0
    assert len(losses(run.stdout)) == 3


@pytest.mark.slow
def test_bare_script_form_runs_with_this_python_and_leaves_losses_identical(
    apply: Callable[..., Run], tmp_path: Path,
) -> None:
    args = ["--steps", "12", "--seed", "3"]
    plain = subprocess.run([sys.executable, TRAIN, *args], env=child_env(), capture_output=True, text=True, check=True)
    run = apply(MONITOR, "--", os.path.relpath(TRAIN, REPO), *args)
    assert run.wait() == 0, run.stderr
    assert losses(run.stdout) == losses(plain.stdout)
    assert len(losses(plain.stdout)) == 12
    assert "governing Sequential" in run.stderr


# -- what a step is ----------------------------------------------------------------------


@pytest.mark.slow
def test_manual_sgd_counts_one_step_per_backward_pass(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    hold = tmp_path / "hold"
    run = apply(MONITOR, "--metrics-port", str(free_port), "--", sys.executable, TRAIN,
                "--manual-sgd", "--steps", "3", "--accum", "2", "--hold-file", str(hold))
    samples = wait_metrics(run, free_port, steps_are(6))  # 3 updates x 2 backward passes
    assert value(samples, "hookpolicy_grad_l2_norm", rule="grad-norms", module="4") is not None
    hold.touch()
    assert run.wait() == 0


@pytest.mark.slow
def test_gradient_accumulation_counts_optimizer_steps(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    hold = tmp_path / "hold"
    run = apply(MONITOR, "--metrics-port", str(free_port), "--", sys.executable, TRAIN,
                "--steps", "3", "--accum", "4", "--hold-file", str(hold))
    samples = wait_metrics(run, free_port, steps_are(3))
    time.sleep(0.3 + RENDER_INTERVAL)  # a scrape after a fresh rendering
    assert value(scrape(free_port) or [], "hookpolicy_steps_total", rank="0") == 3  # not 12
    assert not value(samples, "hookpolicy_alerts_total", rule="nan-guard")
    hold.touch()
    assert run.wait() == 0


@pytest.mark.slow
def test_amp_bfloat16_autocast(apply: Callable[..., Run], tmp_path: Path, free_port: int) -> None:
    hold = tmp_path / "hold"
    run = apply(MONITOR, "--metrics-port", str(free_port), "--", sys.executable, TRAIN,
                "--amp", "--steps", "4", "--hold-file", str(hold))
    samples = wait_metrics(run, free_port, steps_are(4))
    for module in ("0", "2", "4"):
        assert value(samples, "hookpolicy_output_nonfinite", rule="layer-outputs", module=module) == 0
        norm = value(samples, "hookpolicy_grad_l2_norm", rule="grad-norms", module=module)
        assert norm is not None and 0 < norm < float("inf")
    assert not value(samples, "hookpolicy_skipped_steps_total", rule="nan-guard")
    hold.touch()
    assert run.wait() == 0


@pytest.mark.slow
def test_torchrun_ddp_ranks_serve_on_port_and_port_plus_one(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    hold = tmp_path / "hold"
    run = apply(MONITOR, "--metrics-port", str(free_port), "--", *torchrun(), "--standalone",
                "--nproc_per_node", "2", DDP, "--steps", "4", "--hold-file", str(hold))
    rank0 = wait_metrics(run, free_port, steps_are(4, "0"), timeout=120)
    rank1 = wait_metrics(run, free_port + 1, steps_are(4, "1"), timeout=60)
    for module in ("0", "2", "4"):
        norm0 = value(rank0, "hookpolicy_grad_l2_norm", rule="grad-norms", module=module, rank="0")
        assert norm0 is not None and norm0 > 0
    # read after DDP's all-reduce, the same on both ranks: the job's series, exported by rank 0 alone
    assert labels_of(rank1, "hookpolicy_grad_l2_norm") == []
    assert {lab["rank"] for lab in labels_of(rank1, "hookpolicy_output_rms")} == {"1"}  # activations: per rank
    hold.touch()
    assert run.wait(180) == 0, run.stderr
    out = losses(run.stdout)
    by_rank = [[line.split(" loss ")[1] for line in out if line.startswith(f"rank {r} ")] for r in (0, 1)]
    assert len(by_rank[0]) == len(by_rank[1]) == 4
    assert by_rank[0][0] != by_rank[1][0]  # different data on each rank: only the gradients agree


# -- exit statuses -----------------------------------------------------------------------


@pytest.mark.slow
def test_halt_exits_3_with_the_one_line(apply: Callable[..., Run], tmp_path: Path) -> None:
    policy = tmp_path / "guard.yaml"
    policy.write_text(HALT_POLICY)
    run = apply(str(policy), "--", sys.executable, TRAIN, "--steps", "10", "--nan-at", "4")
    assert run.wait() == 3
    line = "hookpolicy: halted by guard/nan-halt at step 4: non-finite gradients"
    assert run.stderr.splitlines().count(line) == 1
    assert "Traceback" not in run.stderr
    assert [x.split(" loss")[0] for x in losses(run.stdout)] == [f"step {i}" for i in range(4)]


#: A script that catches the Halt `optimizer.step()` raises and exits 0 (to save a checkpoint
#: first, say): the halt reaches no excepthook.
CATCHING_SCRIPT = """\
import sys
import torch
from hookpolicy import Halt

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(8, 4)).pow(2).mean() * (float("nan") if step == 2 else 1.0)
    loss.backward()
    try:
        opt.step()
    except Halt as halt:
        print(f"caught {type(halt).__name__} at step {step}", flush=True)
        sys.exit(0)
    opt.zero_grad()
print("trained", flush=True)
"""


@pytest.mark.slow
def test_a_halt_the_script_catches_still_exits_3(apply: Callable[..., Run], tmp_path: Path) -> None:
    """The script swallows the Halt and exits 0: `apply` learnt of it from its halt handler
    (before the Halt propagated), so it still exits 3 with the one line."""
    policy, script = tmp_path / "guard.yaml", tmp_path / "catching.py"
    policy.write_text(HALT_POLICY)
    script.write_text(CATCHING_SCRIPT)
    run = apply(str(policy), "--", sys.executable, str(script))
    assert run.wait() == 3, run.stderr
    assert run.stdout.splitlines() == ["caught Halt at step 2"]
    line = "hookpolicy: halted by guard/nan-halt at step 2: non-finite gradients"
    assert run.stderr.splitlines().count(line) == 1, run.stderr


@pytest.mark.slow
def test_halt_under_torchrun_is_one_line_too(apply: Callable[..., Run], tmp_path: Path) -> None:
    policy = tmp_path / "guard.yaml"
    policy.write_text(HALT_POLICY)
    run = apply(str(policy), "--", *torchrun(), "--standalone", "--nproc_per_node", "2", DDP,
                "--steps", "6", "--nan-at", "2")
    assert run.wait(180) == 3
    line = "hookpolicy: halted by guard/nan-halt at step 2: non-finite gradients"
    assert run.stderr.splitlines()[-1] == line  # both ranks halted; the line is printed once
    assert run.stderr.count(line) == 1
    assert not [x for x in losses(run.stdout) if " step 2 " in x]


@pytest.mark.slow
def test_audit_never_halts(apply: Callable[..., Run], tmp_path: Path) -> None:
    policy = tmp_path / "guard.yaml"
    policy.write_text(HALT_POLICY)
    run = apply(str(policy), "--audit", "--log-format", "json", "--", sys.executable, TRAIN, "--steps", "6",
                "--nan-at", "2")
    assert run.wait() == 0
    assert "hookpolicy: halted by" not in run.stderr
    assert len(losses(run.stdout)) == 6
    alert = json.loads(next(line for line in run.stderr.splitlines() if line.startswith("{")))
    assert (alert["event"], alert["mode"], alert["step"]) == ("alert", "audit", 2)
    assert alert["outcome"] == "not halted (audit mode)" and alert["message"].endswith("[not halted (audit mode)]")


@pytest.mark.slow
def test_invalid_policy_runs_nothing(apply: Callable[..., Run], tmp_path: Path) -> None:
    marker = tmp_path / "started"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN_POLICY)
    run = apply(MONITOR, str(bad), "--", sys.executable, str(script))
    assert run.wait() == 1
    assert re.search(rf"^hookpolicy: {re.escape(str(bad))}:9:\d+: \$\.spec\.rules\[0\]\.trigger\.every: ", run.stderr, re.M)
    assert "Traceback" not in run.stderr
    assert not marker.exists()
    # an invalid file in an ops-managed folder stops the run just the same
    ops = tmp_path / "ops"
    ops.mkdir()
    shutil.copy(bad, ops / "guard.yaml")
    run = apply(MONITOR, "--", sys.executable, str(script), env=child_env(HOOKPOLICY_POLICY_DIRS=str(ops)))
    assert run.wait() == 1
    assert str(ops / "guard.yaml") in run.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_script_status_passes_through(apply: Callable[..., Run], tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('out', flush=True)\nprint('err', file=sys.stderr)\nsys.exit(7)\n")
    run = apply(MONITOR, "--", sys.executable, str(script))
    assert run.wait() == 7
    assert run.stdout == "out\n"
    assert "err\n" in run.stderr
    run = apply(MONITOR, "--", "no-such-command-hookpolicy")
    assert run.wait() == 127
    assert "command not found: no-such-command-hookpolicy" in run.stderr


@pytest.mark.slow
def test_port_in_use_is_one_line_and_training_goes_on(apply: Callable[..., Run], free_port: int) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port))
        busy.listen()
        run = apply(MONITOR, "--metrics-port", str(free_port), "--", sys.executable, TRAIN, "--steps", "5")
        assert run.wait() == 0
    errors = [line for line in run.stderr.splitlines() if "cannot serve metrics" in line]
    assert len(errors) == 1
    assert f"rank 0: cannot serve metrics on 127.0.0.1:{free_port}" in errors[0]
    assert "metrics on http" not in run.stderr  # no promise of a port that was never bound
    assert "Traceback" not in run.stderr
    assert len(losses(run.stdout)) == 5


# -- signals -----------------------------------------------------------------------------

SIGTERM_SCRIPT = """\
import atexit, json, sys, time

REPORT = sys.argv[1]
""" + HOOK_REPORT + """\

torch.manual_seed(0)
model = state["model"] = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    step = 0
    while True:
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        step += 1
        time.sleep(0.05)
finally:
    print("script finally", flush=True)
"""

LOGGED_POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: logged
spec:
  rules:
    - name: grads
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [l2_norm], log: {path: capture.jsonl}}
"""


@pytest.mark.slow
def test_sigterm_reaches_the_script_and_hooks_come_off(apply: Callable[..., Run], tmp_path: Path) -> None:
    script, report, policy = tmp_path / "forever.py", tmp_path / "report.json", tmp_path / "logged.yaml"
    script.write_text(SIGTERM_SCRIPT)
    policy.write_text(LOGGED_POLICY)
    log = tmp_path / "capture.jsonl"
    run = apply(str(policy), "--", sys.executable, str(script), str(report),
                env=child_env(HOOKPOLICY_OUTPUT_DIR=str(tmp_path)))
    deadline = time.monotonic() + 90
    while len(losses(run.stdout)) < 3:
        assert run.proc.poll() is None, run.stderr
        assert time.monotonic() < deadline, run.stderr
        time.sleep(0.1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM
    assert "script finally" in run.stdout
    assert json.loads(report.read_text()) == {
        "model": 0, "global_forward_pre": 0, "global_optimizer_pre": 0, "global_optimizer_post": 0,
    }
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) >= 2 * 3  # two Linear layers, every step so far
    assert {r["module"] for r in records} == {"0", "2"}


# -- reload ------------------------------------------------------------------------------


def _revisions(samples: Samples) -> set[str]:
    return {lab["revision"] for lab in labels_of(samples, "hookpolicy_policy_info")}


@pytest.mark.slow
def test_watch_swaps_a_valid_version_and_keeps_the_old_on_an_invalid_one(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    policy, stop = tmp_path / "watched.yaml", tmp_path / "stop"
    policy.write_text(WATCHED_POLICY.replace("EVERY", "1"))
    run = apply(str(policy), "--watch", "--metrics-port", str(free_port), "--", sys.executable, TRAIN,
                "--steps", "100000", "--sleep", "0.03", "--stop-file", str(stop),
                env=child_env(HOOKPOLICY_WATCH_INTERVAL="0.2"))
    first = _revisions(wait_metrics(run, free_port, lambda s: bool(_revisions(s))))
    assert len(first) == 1

    policy.write_text(WATCHED_POLICY.replace("EVERY", "2"))
    swapped = wait_metrics(run, free_port, lambda s: bool(_revisions(s)) and _revisions(s) != first)
    second = _revisions(swapped)
    assert len(second) == 1
    assert value(swapped, "hookpolicy_config_last_reload_successful", rank="0") == 1
    steps_before = value(swapped, "hookpolicy_steps_total", rank="0") or 0

    policy.write_text(BROKEN_POLICY)
    broken = wait_metrics(run, free_port, lambda s: value(s, "hookpolicy_config_last_reload_successful") == 0)
    assert _revisions(broken) == second  # the old version stays
    later = wait_metrics(run, free_port, lambda s: (value(s, "hookpolicy_steps_total") or 0) > steps_before + 5)
    assert _revisions(later) == second
    assert value(later, "hookpolicy_grad_l2_norm", rule="grads", module="4") is not None

    stop.touch()
    assert run.wait() == 0
    assert "reloaded policies" in run.stderr
    assert re.search(rf"^hookpolicy: {re.escape(str(policy))}:9:\d+: \$\.spec\.rules\[0\]\.trigger\.every: ", run.stderr, re.M)


@pytest.mark.slow
def test_sighup_reloads_without_watch(apply: Callable[..., Run], tmp_path: Path, free_port: int) -> None:
    policy, stop = tmp_path / "watched.yaml", tmp_path / "stop"
    policy.write_text(WATCHED_POLICY.replace("EVERY", "1"))
    run = apply(str(policy), "--metrics-port", str(free_port), "--", sys.executable, TRAIN,
                "--steps", "100000", "--sleep", "0.03", "--stop-file", str(stop),
                env=child_env(HOOKPOLICY_WATCH_INTERVAL="0.2"))
    first = _revisions(wait_metrics(run, free_port, lambda s: bool(_revisions(s))))
    policy.write_text(WATCHED_POLICY.replace("EVERY", "3"))
    time.sleep(0.8 + RENDER_INTERVAL)  # without --watch, a change alone does nothing
    assert _revisions(scrape(free_port) or []) == first
    run.proc.send_signal(signal.SIGHUP)
    wait_metrics(run, free_port, lambda s: bool(_revisions(s)) and _revisions(s) != first)
    stop.touch()
    assert run.wait() == 0


# -- the bootstrap -----------------------------------------------------------------------

BOOT_ENV = {"HOOKPOLICY_BOOTSTRAP": "1", "HOOKPOLICY_POLICIES": MONITOR}


def _python(code: str, python_path: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    env = child_env(PYTHONPATH=os.pathsep.join([BOOTSTRAP_DIR, *python_path]), **extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_bootstrap_imports_nothing_heavy_at_start_up() -> None:
    done = _python("import sys; print('torch' in sys.modules, 'hookpolicy' in sys.modules)", [], **BOOT_ENV)
    assert (done.returncode, done.stdout, done.stderr) == (0, "False False\n", "")


def test_bootstrap_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    code = "import os; print(os.environ.get('THEIRS_RAN'))"
    for extra in (BOOT_ENV, {}):  # with the bootstrap on, and off
        done = _python(code, [str(theirs)], **extra)
        assert (done.returncode, done.stdout) == (0, "yes\n"), done.stderr


@pytest.mark.slow
def test_bootstrap_is_inert_without_its_variable() -> None:
    code = ("import torch, sys, torch.nn.modules.module as m, torch.optim.optimizer as o; "
            "print('hookpolicy' in sys.modules, len(m._global_forward_pre_hooks), len(o._global_optimizer_pre_hooks))")
    assert _python(code, []).stdout == "False 0 0\n"
    assert _python(code, [], **BOOT_ENV).stdout == "True 1 1\n"


# -- discovery, in process ---------------------------------------------------------------

@pytest.fixture
def discovery() -> Iterator[Discovery]:
    before = global_hook_counts()
    d = Discovery(hookpolicy.load(MONITOR), registry=CollectorRegistry(), rank=0)
    d.install()
    try:
        yield d
    finally:
        d.remove()
        d.remove()  # idempotent
    assert global_hook_counts() == before


def _train_step(model: nn.Module, opt: Optional[torch.optim.Optimizer], call: Optional[Callable[..., torch.Tensor]] = None,
                micro: int = 1) -> None:
    for _ in range(micro):
        out = (call or model)(torch.randn(5, 4))
        out.pow(2).mean().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()


def test_discovery_governs_the_outermost_trained_model(discovery: Discovery) -> None:
    model = tiny(out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model(torch.randn(2, 4))  # evaluation: nothing is governed
    assert discovery.governed == []
    _train_step(model, opt)
    [governed] = discovery.governed
    assert governed.model is model and governed.attached.step == 1
    assert not discovery.watching_calls  # every stepped parameter is governed: the hook is gone
    _train_step(model, opt)
    assert [g.model for g in discovery.governed] == [model] and governed.attached.step == 2


def test_discovery_leaves_a_target_network_alone(discovery: Discovery) -> None:
    online, target = tiny(0, out=1), tiny(1, out=1)
    opt = torch.optim.SGD(online.parameters(), lr=0.1)
    for _ in range(2):
        loss = (online(torch.randn(5, 4)) - target(torch.randn(5, 4))).pow(2).mean()  # target not in no_grad
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert [g.model for g in discovery.governed] == [online]
    assert discovery.governed[0].attached.step == 2


def test_discovery_replaces_a_part_by_the_model_that_contains_it(discovery: Discovery) -> None:
    model = tiny(out=1)
    _train_step(model, torch.optim.SGD(model[0].parameters(), lr=0.1), call=model[0])  # a part trained alone first
    [part] = discovery.governed
    assert part.model is model[0]
    attached = part.attached  # held here: discovery keeps it weakly, and the garbage collector may run at any time
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt)  # its first step finds the rest of the model, governed at the next call
    _train_step(model, opt)
    [governed] = discovery.governed
    assert governed.model is model
    assert attached.removed  # the part's own attachment is gone
    assert governed.attached.step == 3  # the count goes on


@pytest.mark.parametrize("call", ["part", "forward"])
def test_discovery_governs_the_model_its_optimizer_trains_whatever_is_called(discovery: Discovery, call: str) -> None:
    """Lightning calls a LightningModule's `training_step`, never the module: its parts are called."""
    model = tiny(out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt, call=model[0] if call == "part" else model.forward)
    [governed] = discovery.governed
    assert governed.model is model and governed.attached.step == 1


@pytest.mark.parametrize("garbage", [False, True], ids=["no-optimizer", "an-optimizer-in-a-dead-cycle"])
def test_discovery_under_manual_sgd_keeps_watching(discovery: Discovery, garbage: bool) -> None:
    """A model trained without an optimizer is governed, one step per update, whatever garbage the heap holds.

    An optimizer nothing reaches any more, in a reference cycle, stays on the heap until
    the cyclic collector runs; when that is depends on what was allocated since (it was
    whatever earlier tests left, and made this test fail about once in six runs). It
    steps nothing: discovery collects it before leaving a model alone for its sake. The
    collector is off here, so the garbage is certainly there.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if garbage:
            earlier = torch.optim.SGD(tiny(seed=1).parameters(), lr=0.1)
            earlier.cycle = earlier  # type: ignore[attr-defined]
            del earlier
            assert heap.live_optimizers()  # this one, and whatever earlier tests left
        model = tiny(out=1)
        for _ in range(3):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p.sub_(0.1 * p.grad)
                    p.grad = None
    finally:
        if was_enabled:
            gc.enable()
    [governed] = discovery.governed
    assert governed.model is model and governed.attached.step == 3
    assert discovery.watching_calls


def test_discovery_after_a_detached_run_governs_manual_sgd() -> None:
    """A model attached, trained and detached earlier in the process leaves no optimizer behind.

    Discovery governs a model trained without an optimizer only when no optimizer exists;
    one that survived the earlier run in a reference cycle (detaching once kept its
    caller's frames, and their optimizer, until a full garbage collection) made it leave
    the manual-SGD model alone. The collector is off: the earlier run is gone by
    reference counting, as in a process where no full collection happened yet.
    """
    def earlier_run() -> None:
        model = tiny(out=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hookpolicy.load(MONITOR).attach(model, registry=CollectorRegistry()):
            _train_step(model, opt)

    torch.optim.SGD([nn.Parameter(torch.zeros(1))])  # the process's first optimizer imports torch._dynamo,
    gc.collect()  # whose import frames hold it in a cycle; collected here with what other tests left
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        earlier_run()
        assert not heap.live_optimizers()  # gone by reference counting (discovery would collect it now)
        d = Discovery(hookpolicy.load(MONITOR), registry=CollectorRegistry(), rank=0)
        d.install()
        try:
            model = tiny(out=1)
            model(torch.randn(5, 4)).pow(2).mean().backward()
            assert [g.model for g in d.governed] == [model]
        finally:
            d.remove()
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("watching", [False, True], ids=["hook-retired", "hook-installed"])
def test_discovery_swaps_a_reload_between_steps_never_between_micro_batches(
    discovery: Discovery, tmp_path: Path, watching: bool,
) -> None:
    model = tiny(out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt)
    first = discovery.governed[0].attached
    if watching:  # as while discovery is still looking: every module call is seen mid-step
        discovery._install_forward()
    changed = tmp_path / "monitor.yaml"
    changed.write_text(Path(MONITOR).read_text().replace("every: 10", "every: 5"))
    model(torch.randn(5, 4)).pow(2).mean().backward()  # micro-batch 1 of step 1
    discovery.swaps.request(hookpolicy.load(changed))
    for _ in range(3):  # micro-batches 2..4: same step, no swap
        model(torch.randn(5, 4)).pow(2).mean().backward()
        assert discovery.governed[0].attached is first
    opt.step()
    opt.zero_grad()
    assert first.step == 2 and not first.removed
    _train_step(model, opt)  # the first call of step 2 swaps
    second = discovery.governed[0].attached
    assert second is not first and first.removed
    assert second.policies[0].revision != first.policies[0].revision
    assert second.step == 3
    assert not discovery.watching_calls  # and the forward hook is retired again


def test_a_failed_reload_reads_0_until_a_valid_one_even_across_attaches(
    discovery: Discovery, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    policy = tmp_path / "watched.yaml"
    policy.write_text(WATCHED_POLICY.replace("EVERY", "1"))
    reloader = Reloader(ChildConfig(sources=(str(policy),)), discovery.swaps, registry=discovery.registry)

    def gauge() -> Optional[float]:
        return metric(discovery.registry, RELOAD_SUCCESSFUL.name, {"rank": "0"})

    model = tiny(out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt)
    assert gauge() == 1
    policy.write_text(BROKEN_POLICY)
    reloader.reload()
    assert gauge() == 0 and "reload failed; keeping the current policies" in capsys.readouterr().err
    assert discovery.govern(tiny(out=1)) is not None  # a new attach does not hide the failure
    assert gauge() == 0 and discovery.swaps.next is None
    policy.write_text(WATCHED_POLICY.replace("EVERY", "1"))
    reloader.reload()
    assert gauge() == 1 and discovery.swaps.next is not None
    _train_step(model, opt)
    _train_step(model, opt)
    assert [p.name for p in discovery.governed[0].attached.policies] == ["watched"]


def test_only_the_metrics_store_spells_the_reload_gauge() -> None:
    import ast

    for path in sorted((REPO / "hookpolicy").rglob("*.py")):
        if path.name == "metrics.py":
            continue
        strings = {n.value for n in ast.walk(ast.parse(path.read_text("utf-8"))) if isinstance(n, ast.Constant)}
        assert RELOAD_SUCCESSFUL.name not in strings, path


GLOB_NOTHING = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: glob-nothing
spec:
  rules:
    - name: attn-grads
      match: {modules: ["**.attn.*"]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [l2_norm]}
"""


@pytest.mark.slow
def test_a_rule_that_selects_nothing_is_a_positioned_warning_and_an_error_under_strict(
    apply: Callable[..., Run], tmp_path: Path,
) -> None:
    policy = tmp_path / "glob-nothing.yaml"
    policy.write_text(GLOB_NOTHING)
    where = f"hookpolicy: {policy}:8:7: $.spec.rules[0].match: glob-nothing/attn-grads: matches no module of Sequential"
    run = apply(str(policy), "--", sys.executable, TRAIN, "--steps", "3")
    assert run.wait() == 0
    assert where in run.stderr.splitlines()
    assert len(losses(run.stdout)) == 3
    strict = apply("--strict", str(policy), "--", sys.executable, TRAIN, "--steps", "3")
    assert strict.wait() == 1
    assert f"{where} (--strict: stopping before the first step)" in strict.stderr.splitlines()
    assert losses(strict.stdout) == []  # no step trained ungoverned
    assert "Traceback" not in strict.stderr
