"""Signals and reloads under `apply`: a signal reaches the script, removes the hooks and flushes
the logs; SIGHUP with a broken policy keeps the old one; the watcher reads nothing beyond
the size limit nor an unchanged file again; a reload is validated in another process, off
the training thread; policy_info is in every scrape across a swap. The guarantees are in
docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch.nn as nn
from prometheus_client import CollectorRegistry

import hookpolicy
from helpers import REPO
from helpers.child_scripts import HOOK_REPORT
from helpers.models import tiny
from helpers.outputs import json_lines, parse_exposition
from helpers.policies import LOG_EVERY_STEP, policy_text, write_policy
from helpers.processes import Proc, scrape_text, start_apply
from hookpolicy import PolicySet


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
    proc = start_apply(procs, tmp_path / "apply", [str(policy), "--", sys.executable, str(script), str(report), mode],
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
    proc = start_apply(procs, tmp_path / "apply", [
        str(policy), "--metrics-port", str(free_port), "--", sys.executable, str(REPO / "examples" / "train_mlp.py"),
        "--steps", "100000", "--sleep", "0.02", "--stop-file", str(stop),
    ], HOOKPOLICY_OUTPUT_DIR=str(tmp_path), HOOKPOLICY_WATCH_INTERVAL="0.1")

    def metrics() -> dict[Any, tuple[str, float]]:
        try:
            return parse_exposition(scrape_text(free_port))
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
    assert re.search(rf"^hookpolicy: {re.escape(str(policy))}:\d+:\d+: \$\.spec\.rules\[0\]\.trigger\.at: ", proc.stderr, re.M)


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

    def attach(policies: PolicySet, module: nn.Module, step: int, generation: int) -> Any:
        in_swap.set()  # the old attachment is removed, the new not attached yet
        release.wait(10)
        return policies.attach(module, registry=registry, rank=0, start_step=step)

    assert swaps.next is not None
    swapper = threading.Thread(target=swaps._swap, args=(governed, [governed], attach, *swaps.next))
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
