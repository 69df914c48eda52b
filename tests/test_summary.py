"""The run summary (`export/summary.py`) against what hookpolicy did not compute: the script's
own view of its steps (how many it ran, in how many its parameters did not change, bit for
bit), `torch.nn.utils.clip_grad_norm_`'s coefficient for the clips, the modules whose
gradients the script saw non-finite for the alerts, and the numbers a scrape of /metrics
shows; at a normal exit, on SIGTERM and after a halt, under `hookpolicy apply` and through
`Attached.summary()`."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from helpers import REPO
from helpers.outputs import sample
from helpers.processes import child_env

MAX_NORM = 0.5

POLICY = f"""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {{name: watch}}
spec:
  rules:
    - name: guard
      match: {{modules: ["**"]}}
      trigger: {{at: step}}
      target: grad
      actions:
        - alert: {{if: "nonfinite > 0", severity: critical, then: THEN}}
    - name: clip
      match: {{modules: ["**"]}}
      trigger: {{at: step}}
      target: grad
      actions:
        - clip: {{max_norm: {MAX_NORM}, per: rule}}
    - name: norms
      match: {{types: [Linear]}}
      trigger: {{at: step}}
      target: grad
      actions:
        - capture: {{stats: [l2_norm]}}
"""

#: Trains 3 Linear layers; a NaN loss at step NAN_AT, SIGTERM to itself before step TERM_AT.
#: After each step it prints its own view: steps run, steps whose parameters did not change
#: (bit for bit; printed again after the update), the clips `clip_grad_norm_`'s coefficient says a max_norm clip makes, and
#: the (step, module) pairs with non-finite gradients. At the end, what its /metrics shows.
SCRIPT = f"""\
import json, os, signal, sys, urllib.request
import torch
from torch import nn

steps, nan_at, term_at, port = (int(a) for a in sys.argv[1:5])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
x, y = torch.randn(64, 4), torch.randn(64, 1)
view = {{"steps": 0, "unchanged": 0, "clips": 0, "nonfinite": 0}}
for step in range(steps):
    if step == term_at:
        os.kill(os.getpid(), signal.SIGTERM)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y) * (float("nan") if step == nan_at else 1.0)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # measures; scales by 1.0
    view["clips"] += bool({MAX_NORM} / (norm + 1e-6) < 1.0)  # clip_grad_norm_'s own coefficient
    view["nonfinite"] += sum(not all(p.grad.isfinite().all() for p in m.parameters(recurse=False))
                             for m in model.modules() if list(m.parameters(recurse=False)))
    print(json.dumps(view), flush=True)  # a step that halts ends in optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    view["steps"] += 1
    view["unchanged"] += all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    print(json.dumps(view), flush=True)
if port:
    with urllib.request.urlopen(f"http://127.0.0.1:{{port}}/metrics", timeout=10) as response:
        print(response.read().decode(), flush=True)
"""


def _run(tmp_path: Path, then: str, steps: int, nan_at: int, term_at: int = -1, port: int = 0) -> Any:
    (tmp_path / "watch.yaml").write_text(POLICY.replace("THEN", then))
    (tmp_path / "train.py").write_text(SCRIPT)
    metrics = ["--metrics-port", str(port)] if port else []
    return subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", "watch.yaml", *metrics, "--", sys.executable, "train.py",
         str(steps), str(nan_at), str(term_at), str(port)],
        cwd=tmp_path, env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)


def _summary(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("hookpolicy: run summary"))
    end = start + 1
    while end < len(lines) and lines[end].startswith("hookpolicy:   "):
        end += 1
    return lines[start:end]


def _view(stdout: str) -> dict[str, int]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")][-1]  # type: ignore[no-any-return]


def _n(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _expected(view: dict[str, int], outputs: str, series: int = 0) -> list[str]:
    """What the summary should say; `series`: how many l2_norm series of the norms rule a scrape showed."""
    guard = [f"skipped {_n(view['unchanged'], 'step')}"] if view["unchanged"] else []
    if view["nonfinite"]:
        guard.append(_n(view["nonfinite"], "critical alert"))
    served = outputs.startswith("metrics ")
    return [
        f"hookpolicy: run summary (rank 0): Sequential {_n(view['steps'], 'step')}",
        f"hookpolicy:   watch/guard: {', '.join(guard) or 'no alert fired, changed nothing'}",
        f"hookpolicy:   watch/clip: clipped {_n(view['clips'], 'time')}",
        "hookpolicy:   watch/norms: " + (f"exported {series} series, " if served else "") + "changed nothing (it only captures)",
        f"hookpolicy:   outputs: {outputs}",
    ]


@pytest.mark.slow
def test_the_summary_at_exit_says_what_the_script_saw_and_what_metrics_showed(tmp_path: Path, free_port: int) -> None:
    done = _run(tmp_path, "skip_step", steps=30, nan_at=6, port=free_port)
    assert done.returncode == 0, done.stderr[-3000:]
    view = _view(done.stdout)
    assert view["steps"] == 30 and view["unchanged"] == 1 and view["nonfinite"] == 3
    assert 0 < view["clips"] < 29  # the reference is not trivial: some steps clip, others do not
    url = f"http://127.0.0.1:{free_port}/metrics"
    series = len(re.findall(r'^hookpolicy_grad_l2_norm\{[^}]*rule="norms"', done.stdout, re.M))
    assert series == 3  # one per Linear layer of the script
    assert _summary(done.stderr) == _expected(view, f"metrics {url}", series)
    scraped = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^(hookpolicy_(?:steps|skipped_steps|clipped|alerts)_total)\{[^}]*\} (\S+)$', done.stdout, re.M)
        if float(m.group(2)) > 0}
    assert scraped == {"hookpolicy_steps_total": 30, "hookpolicy_skipped_steps_total": 1,
                       "hookpolicy_clipped_total": view["clips"], "hookpolicy_alerts_total": 3}
    assert done.stderr.rstrip().endswith(_summary(done.stderr)[-1])  # the last lines of the run


@pytest.mark.slow
def test_the_summary_on_sigterm_and_after_a_halt(tmp_path: Path) -> None:
    (tmp_path / "term").mkdir()
    done = _run(tmp_path / "term", "skip_step", steps=30, nan_at=3, term_at=11)
    assert done.returncode == 143, done.stderr[-3000:]
    view = _view(done.stdout)
    assert view["steps"] == 11 and view["unchanged"] == 1
    assert _summary(done.stderr) == _expected(view, "no metrics endpoint, no file") + [
        "hookpolicy:   watch/norms: its capture goes nowhere (no log, tensorboard or tensors, and no --metrics-port)"]

    (tmp_path / "halt").mkdir()
    done = _run(tmp_path / "halt", "halt", steps=30, nan_at=9)
    assert done.returncode == 3, done.stderr[-3000:]
    view = _view(done.stdout)
    assert view["steps"] == 9 and view["unchanged"] == 0 and view["nonfinite"] == 3  # step 9 halted in step()
    summary = _summary(done.stderr)
    assert summary[0] == "hookpolicy: run summary (rank 0): Sequential 9 steps"
    assert summary[1] == f"hookpolicy:   watch/guard: {_n(view['nonfinite'], 'critical alert')}"
    assert summary[2] == f"hookpolicy:   watch/clip: clipped {_n(view['clips'], 'time')}"
    assert done.stderr.splitlines()[-1].startswith("hookpolicy: halted by watch/guard at step 9")


def test_attached_summary_counts_what_the_registry_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python API says nothing by itself; `summary()` is there, after `remove()` too."""
    import hookpolicy

    monkeypatch.chdir(tmp_path)
    (tmp_path / "watch.yaml").write_text(POLICY.replace("THEN", "skip_step"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    registry = CollectorRegistry()
    clips = 0
    with hookpolicy.load(tmp_path / "watch.yaml").attach(model, registry=registry) as handle:
        for step in range(12):
            optimizer.zero_grad()
            (torch.nn.functional.mse_loss(model(x), y) * (float("nan") if step == 4 else 1.0)).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            clips += bool(MAX_NORM / (norm + 1e-6) < 1.0)
            optimizer.step()
        series = [s for m in registry.collect() if m.name == "hookpolicy_grad_l2_norm" for s in m.samples
                  if s.labels["rule"] == "norms"]  # the scrape's (the gauges leave with the block)
    assert len(series) == 2  # one per Linear layer
    assert sample(registry, "hookpolicy_clipped_total", rule="clip") == clips
    assert handle.summary() == [
        "run summary (rank 0): Sequential 12 steps",
        "  watch/guard: skipped 1 step, 2 critical alerts",
        f"  watch/clip: clipped {clips} time{'' if clips == 1 else 's'}",
        "  watch/norms: exported 2 series, changed nothing (it only captures)",
        "  outputs: metrics in the registry given to attach",
    ]


@pytest.mark.slow
def test_the_summary_says_the_port_could_not_be_bound_not_that_none_was_given(tmp_path: Path, free_port: int) -> None:
    """The reported fault: the summary said "no --metrics-port" when the port was given but taken."""
    import socket

    (tmp_path / "watch.yaml").write_text(POLICY.replace("THEN", "skip_step"))
    (tmp_path / "train.py").write_text(SCRIPT)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port))
        taken.listen()
        done = subprocess.run(
            [sys.executable, "-m", "hookpolicy", "apply", "watch.yaml", "--metrics-port", str(free_port), "--",
             sys.executable, "train.py", "3", "-1", "-1", "0"],
            cwd=tmp_path, env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _summary(done.stderr)[-1] == (
        "hookpolicy:   watch/norms: its capture goes nowhere (no log, tensorboard or tensors, and "
        f"--metrics-port {free_port}: port {free_port} could not be bound)")


def test_a_capture_only_rule_says_what_it_wrote_where_and_that_it_changed_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not "nothing counted": the records the log file holds (read back), the series a scrape shows, and
    the parameters' update unchanged by the rule (the same training without hookpolicy, bit for bit)."""
    import hookpolicy

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HOOKPOLICY_OUTPUT_DIR", raising=False)
    (tmp_path / "p.yaml").write_text("""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: p}
spec:
  rules:
    - name: acts
      match: {types: [Linear]}
      trigger: {at: forward}
      target: output
      actions:
        - capture: {stats: [rms, mean], log: {path: logs/acts.jsonl}}
""")

    def train(governed: bool) -> tuple[list[torch.Tensor], list[str], int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        registry = CollectorRegistry()
        series = 0
        with (hookpolicy.load(tmp_path / "p.yaml").attach(model, registry=registry) if governed
              else contextlib.nullcontext()) as handle:
            for _ in range(5):
                optimizer.zero_grad()
                model(torch.randn(16, 4)).pow(2).mean().backward()
                optimizer.step()
            if handle is not None:
                series = len([s for m in registry.collect() if m.name.startswith("hookpolicy_output_")
                              for s in m.samples])
        return [p.detach().clone() for p in model.parameters()], [] if handle is None else handle.summary(), series

    plain, _, _ = train(False)
    governed, summary, series = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, governed))  # what "changed nothing" claims
    records = len((tmp_path / "logs" / "acts.jsonl").read_text().splitlines())
    assert records == 10 and series == 4  # 5 steps x 2 Linear layers; 2 layers x 2 statistics
    assert summary[1] == (f"  p/acts: wrote {records} records to {tmp_path / 'logs' / 'acts.jsonl'}, "
                          f"exported {series} series, changed nothing (it only captures)")
